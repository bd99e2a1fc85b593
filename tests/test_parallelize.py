"""One layout, both ways: a benchmark cell's rank and advise's rank are the same rank.

Both call strategies.parallelize with the same Layout: the cell's (RunSpec.layout) on
real tensors, alone in its process over the no-communication group (ranks.rank_of,
what `parabench ranks` and `plan` measure), and advise's (fakerank) on fake tensors
over torch's fake process group. So each mesh dimension carries the same calls and
bytes, counted by different code on each side (the group's own counter; a dispatch
mode), and the peak memory agrees within what the two ways of counting it differ by.
"""

from __future__ import annotations

import pytest

from conftest import tiny_spec
from parabench.predict import advise, fakerank
from parabench.predict.rank_alone import rank_of
from parabench.spec import ModelSpec

# The gpt preset's shape, small: sequence-parallel TP with the head split on the
# vocabulary and the loss parallel (gpt declares how), FSDP's units per block.
GPT = ModelSpec.of("gpt", vocab=512, seq_len=32, n_layer=3, n_head=4, d_model=64)
BATCH = 8
# The peaks are counted two ways: the cell's rank by the allocator's events (what it
# holds between steps, plus the step's own allocations: profiling.peak_memory), and
# advise's by torch's MemTracker on fake tensors, which tests/test_advise.py holds
# within 1% of the allocator on the same rank (here: FSDP 2 x TP 2 equal to the byte,
# HSDP 2x2 0.02% apart).
MEMORY_REL = 0.01


@pytest.mark.parametrize(
    "strategy, options",
    [("fsdp_tp", {"tp": 2}), ("hsdp", {"dp_replicate": 2})],
    ids=["fsdp2xtp2-sp", "hsdp2x2"],
)
def test_a_cells_rank_and_advises_rank_of_one_layout_agree(strategy, options):
    spec = tiny_spec(
        strategy, 4, model=GPT, batch_size=BATCH, optimizer="adamw", steps=3, **options
    )
    layout = spec.layout
    assert layout.world == 4 and (layout.tp == 1 or layout.sequence_parallel)
    cell = rank_of(spec, threads=1)
    assert cell["status"] == "ok", cell["reason"]
    probe = fakerank.Probe(
        layout, micro=BATCH // layout.dp, precision=spec.precision, optimizer=spec.optimizer
    )
    fake = fakerank.measure(GPT, probe)

    counted = {
        (dim, op): (v["count"], v["bytes"])
        for dim, ops in fake.work.comm_by_dim.items()
        for op, v in ops.items()
    }
    measured = {
        (dim, op): (v["count"], v["bytes"])
        for dim, ops in cell["comm_by_dim"].items()
        for op, v in ops.items()
        if v["count"]
    }
    assert counted == measured
    assert {d for d, _ in measured} == set(layout.declared()) - {"pp"}
    assert fake.peak_bytes == pytest.approx(cell["peak_memory_bytes"], rel=MEMORY_REL)


@pytest.mark.parametrize("strategy", ["fsdp_pp", "ddp_pp"])
def test_a_pipelines_first_stage_holds_what_advise_prices_for_each_micro_batch(strategy):
    """The cells' own pipeline (PipelineStage under GPipe, rank 0: the embedding and the
    first half of the blocks, on real tensors alone over the no-communication group)
    holds, for each more micro-batch in flight, what advise prices one at
    (`advise.Held.activations`: what the stage's forward made and still holds,
    parameters aside, its blocks' and its input), measured on fake tensors: the peaks
    at 4 and 8 micro-batches of the same size differ by 4 of them (GPipe holds every
    forward before any backward)."""
    model = ModelSpec.of("gpt", vocab=512, seq_len=32, n_layer=8, n_head=4, d_model=256)
    peaks = []
    for m in (4, 8):
        spec = tiny_spec(
            strategy,
            4,
            model=model,
            batch_size=4 * m,  # 2 samples a micro-batch over 2 data-parallel ranks
            optimizer="adamw",
            pp=2,
            microbatches=m,
            schedule="gpipe",
        )
        cell = rank_of(spec, threads=1)
        assert cell["status"] == "ok", cell["reason"]
        peaks.append(cell["peak_memory_bytes"])
    probe = fakerank.Probe(spec.layout, micro=2, precision=spec.precision, blocks=4)
    priced = advise.Held(1, 0, 1).activations(fakerank.measure(model, probe))
    assert (peaks[1] - peaks[0]) / 4 == pytest.approx(priced, rel=0.01), (peaks, priced)
