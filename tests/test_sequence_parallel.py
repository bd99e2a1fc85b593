"""What sequence-parallel TP buys one rank, by advise's own measurement of it (fakerank:
the layout's rank on fake tensors, its FLOPs by the op counter, its saved activations
by torch's MemTracker), against amounts derived from the model's sizes here.

Equivalence with `single` and the bytes per mesh dimension are test_layouts' (real
gloo ranks); the report's TP narrative says the same in words."""

from __future__ import annotations

import functools

import pytest

from parabench.layout import Layout
from parabench.predict import fakerank
from parabench.spec import ModelSpec

# A large vocabulary beside narrow blocks: the head is most of the work, as in a 3B
# Llama with 128k tokens, so a head computed whole on every rank cannot hide.
VOCAB, SEQ, WIDTH, LAYERS = 32768, 128, 128, 2
GPT = ModelSpec.of("gpt", vocab=VOCAB, seq_len=SEQ, n_layer=LAYERS, n_head=8, d_model=WIDTH)
MICRO = 2  # sequences per step
FP32 = {"precision": "fp32", "optimizer": "adamw"}


@functools.cache  # each shape measured once: both tests read tp 2 and 4, with and without
def _rank(tp: int, sequence: bool = True) -> fakerank.Measured:
    layout = Layout(tp=tp, sequence_parallel=sequence)
    return fakerank.measure(GPT, fakerank.Probe(layout, micro=MICRO, **FP32))


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_a_tp_ranks_flops_are_one_tp_th_of_the_models_head_included(tp):
    """Every matmul of the step is split over tp, the embedding's and the head's too
    (and the loss runs on the split logits): a rank's FLOPs are 1/tp of the whole
    model's within 5%. Without sequence parallelism the head is whole on every rank, and
    it is most of this model's work: the rank does far more than 1/tp."""
    split = _rank(tp).work.flops()
    whole = _rank(1).work.flops()
    assert split * tp == pytest.approx(whole, rel=0.05)
    copied = _rank(tp, sequence=False).work.flops()
    assert copied * tp > 1.5 * whole


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_saves_the_norms_inputs_over_tp(tp):
    """What the blocks' forwards save for backward, by MemTracker, falls by what the
    sequence split takes off each LayerNorm (its input, B x T x d, and its mean and
    reciprocal deviation, B x T each, fp32): 1 - 1/tp of it, for the two norms of each
    block. Everything else a block saves is split over tp either way (the column-wise
    layers' gathered input is whole in both)."""
    with_sp, without = _rank(tp), _rank(tp, sequence=False)
    tokens = MICRO * SEQ
    per_norm = (tokens * WIDTH + 2 * tokens) * 4
    derived = LAYERS * 2 * per_norm * (1 - 1 / tp)
    drop = without.block_saved_bytes - with_sp.block_saved_bytes
    assert drop == pytest.approx(derived, rel=0.01), (drop, derived)
