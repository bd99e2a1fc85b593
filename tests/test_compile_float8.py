"""advise prices a run compiled or with Float8 from the same fake step as eager
(predict/fakerank.py: FUSED, LINEAR, AMAX, CAST): what a fused run reads and writes,
which GEMMs Float8 converts, and the config's keys for both. torchtitan's published
runs with and without them are test_advise.py's."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from conftest import REPO
from parabench.hardware import gpus
from parabench.layout import Layout
from parabench.predict import advise, fakerank
from parabench.predict.fakerank import (
    AMAX,
    BACKWARD,
    CAST,
    FORWARD,
    FUSED,
    LINEAR,
    MATMUL,
    MEMORY,
    OPTIMIZER,
    RECOMPUTE,
    Counting,
)
from parabench.spec import ModelSpec

KIB = 4096  # 1,024 fp32 elements


def _ops(counting: Counting, kind: str) -> list[tuple[int, float]]:
    return sorted((b, n) for (_, k, _, b), n in counting.work.ops.items() if k == kind)


def test_a_fused_run_reads_what_comes_in_and_writes_what_leaves():
    """Three pointwise ops between two matmuls: eager, three kernels each reading and
    writing 4 KiB; fused, one kernel reading y and writing its last output, and what is
    still held when it ends (sin saves its input for the backward). The first
    intermediate is freed before the last is made, which may take its address: a
    storage is told by identity, not address."""
    x, w = torch.randn(32, 32), torch.randn(32, 32)
    counting = Counting({})
    with torch.no_grad(), counting:
        y = x @ w
        z = (y * 2 + 1).exp()
        _ = z @ w
    assert _ops(counting, MEMORY) == [(2 * KIB, 3)]
    assert _ops(counting, FUSED) == [(2 * KIB, 1)]  # y in, z out

    x = torch.randn(32, 32, requires_grad=True)
    counting = Counting({})
    with counting:
        y = x @ w
        z = (y * 2 + 1).sin()  # saves y * 2 + 1
        _ = z @ w
    assert _ops(counting, FUSED) == [(3 * KIB, 1)]


@pytest.mark.parametrize(
    "seq, layout",
    [
        (1024, Layout(dp_shard=2, tp=2, ac="selective", sequence_parallel=True)),
        # 128 tokens of width 128: the hidden states have a square weight's shape
        (128, Layout(dp_shard=2, ac="none")),
    ],
)
def test_compile_and_float8_price_a_real_rank_as_they_run_it(seq, layout):
    """A small Llama's rank on fake tensors: Float8 converts each block's seven linears,
    three GEMMs each (and those selective checkpointing recomputes), never the output
    head's, even where a block's weight has the hidden states' shape; its operands are
    scaled, but a weight FSDP gathers in Float8; fusing never costs more than eager in
    any phase, and the optimizer is never fused."""
    llama = pytest.importorskip("test_advise").LLAMA
    spec = ModelSpec.of("hf", **{**llama.size_dict(), "seq_len": seq})
    probe = fakerank.Probe(layout, micro=1, precision="bf16", optimizer="adamw", blocks=2)
    m = fakerank.measure(spec, probe)
    count = collections.Counter()
    for (phase, kind, _, _), n in m.work.ops.items():
        count[phase, kind] += n
    assert count[FORWARD, LINEAR] == 2 * 7 and count[BACKWARD, LINEAR] == 2 * 14
    assert count[FORWARD, MATMUL] == 1 and count[BACKWARD, MATMUL] == 2  # the head
    # forward: the input only (FSDP gathers the weight in Float8); backward: the
    # output's gradient for the input's, both operands for the weight's
    assert count[FORWARD, AMAX] == count[FORWARD, CAST] == 2 * 7
    assert count[BACKWARD, AMAX] == 2 * 7 * 3
    assert count[RECOMPUTE, MATMUL] == 0 and count[OPTIMIZER, FUSED] == 0
    assert (count[RECOMPUTE, LINEAR] > 0) == (layout.ac == "selective")
    assert 0.3 < m.linear_share < 1
    h100 = gpus.PROFILES["h100"]
    for phase in (FORWARD, BACKWARD, OPTIMIZER):
        eager = m.work.seconds(h100, phase)
        assert 0 < m.work.seconds(h100, phase, compiled=True) <= eager
    assert m.work.seconds(h100, OPTIMIZER, compiled=True) == m.work.seconds(h100, OPTIMIZER)
    # the linears at the FP8 rate, less time; their scaling, more kernels: at this toy
    # width the kernels win, as torchao says of small shapes (at Llama's, Float8 is
    # faster: test_advise's torchtitan rows)
    linears = fakerank.Work(
        collections.Counter({k: n for k, n in m.work.ops.items() if k[1] == LINEAR})
    )
    assert linears.seconds(h100, float8=True) == linears.seconds(h100)  # floor-bound here
    compute_bound = dataclasses.replace(h100, op_floor_s=0, bandwidth=1e18)
    assert linears.seconds(compute_bound, float8=True) == pytest.approx(
        linears.seconds(compute_bound) * h100.achievable_flops / h100.fp8_flops
    )
    scaling = m.work.seconds(h100, float8=True) - m.work.seconds(h100)
    assert scaling > linears.seconds(h100, float8=True) - linears.seconds(h100)
    # FSDP's gather of the linears' weights at a byte each: less, by half their share
    lay = probe.layout
    bf16 = advise.collectives(m, lay)["dp_shard"]["all_gather"]["bytes"]
    fp8 = advise.collectives(m, lay, float8=True)["dp_shard"]["all_gather"]["bytes"]
    assert fp8 == pytest.approx(bf16 * (1 - m.linear_share / 2))


def test_under_autocast_a_recomputed_linear_is_converted_as_its_forward_was():
    """Without FSDP's mixed precision (DDP, TP alone, one device), autocast casts each
    weight to BF16 as a linear runs, and a checkpoint's recompute casts it again, to a
    new copy no forward hook sees: the recompute's GEMMs and the input gradients taken
    with that copy are the block's linears still (80 tokens: no activation has a
    weight's shape to match by chance)."""
    llama = pytest.importorskip("test_advise").LLAMA
    spec = ModelSpec.of("hf", **{**llama.size_dict(), "seq_len": 80})
    count = {}
    for ac in ("none", "full"):
        probe = fakerank.Probe(Layout(dp_replicate=2, ac=ac), micro=2, blocks=2)
        count[ac] = collections.Counter()
        for (phase, kind, _, _), n in fakerank.measure(spec, probe).work.ops.items():
            count[ac][phase, kind] += n
    for ac in ("none", "full"):
        assert count[ac][BACKWARD, LINEAR] == 2 * 14 and count[ac][BACKWARD, MATMUL] == 2
    assert count["full"][RECOMPUTE, MATMUL] == 0 and count["full"][RECOMPUTE, LINEAR] > 0


def test_the_cells_refuse_float8_naming_the_key():
    """precision: float8 passes the schema and is refused before any job, with the
    reason on this device (advise prices it)."""
    from conftest import tiny_config
    from parabench import config as cfg

    config = cfg.checked(tiny_config(precision=["bf16", "float8"]))
    found = cfg.problems(config)
    assert any(p.startswith("precision: float8: a CPU has no FP8 matmul") for p in found), found
    assert "advise.float8" in cfg.float8_refusal("cpu")
    assert "torchao" in cfg.float8_refusal("cuda")


def test_advise_float8_needs_bf16_and_an_fp8_rate(tmp_path):
    """Each refusal names advise.float8: FP32 training, this-machine (no FP8 rate
    measured), a profile file without fp8_flops; an H100 with BF16 passes."""
    from parabench import config as cfg

    config = cfg.load_config(REPO / "config" / "advise.yaml")
    adv = config["advise"]
    adv.update(float8=True)
    assert cfg.advise_problems(config, REPO) == []
    adv.update(precision="fp32")
    assert any("advise.float8: prices BF16" in p for p in cfg.advise_problems(config, REPO))
    adv.update(precision="bf16", gpu="this-machine")
    assert any("advise.float8: this-machine" in p for p in cfg.advise_problems(config, REPO))
    (tmp_path / "mine.yaml").write_text(
        "{name: mine, peak_flops: 1e15, achievable_flops: 8e14, memory_bytes: 8e10, "
        "bandwidth: 3e12, source: by hand}"
    )
    adv.update(gpu="mine.yaml")
    assert cfg.advise_problems(config, tmp_path) == [
        "advise.float8: gpu 'mine.yaml' has no FP8 rate (fp8_flops)"
    ]
