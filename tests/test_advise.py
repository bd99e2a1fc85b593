"""`parabench advise`: one rank of a layout on fake tensors, checked against the real
thing where the real thing runs here; the search and its table.

- The memory tracker under fake tensors against a real allocation on this CPU (the
  profiler's allocator events over the same step on real tensors), for a small model
  under two layouts.
- A deep stage measured at a few depths and extended, against the same stage measured
  whole: memory, ops, FLOPs, collectives.
- The bytes each mesh dimension sends, counted under fake tensors, against the bytes
  derived from the model (test_layouts.derived, which real gloo ranks also meet).
- The command: every column, every candidate accounted for, the recommendation fits.
- torchtitan's published runs: structure, signs, orders of magnitude (the errors
  themselves are the report's to state, not a test's to bound).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Callable

import pandas as pd
import pytest
import torch
import torch.distributed as dist
from test_layouts import GPT, derived

import conftest
from conftest import REPO
from parabench.hardware import gpus
from parabench.hardware.fabric import PROFILES, BusbwTable, Fabric
from parabench.layout import Layout
from parabench.predict import advise, fakerank
from parabench.records import ADVISE_COLUMNS, TORCHTITAN_COLUMNS
from parabench.spec import ModelSpec

HF = pytest.importorskip("transformers", reason="the Llama-shaped checks build transformers' llama")

# A small Llama: every part of the real ones (GQA, SwiGLU, RMSNorm, untied head).
LLAMA = ModelSpec.of(
    "hf",
    model_type="llama",
    seq_len=64,
    config={
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 4,
        "vocab_size": 512,
        "tie_word_embeddings": False,
    },
)
FP32 = {"precision": "fp32", "optimizer": "adamw"}


def _real_peak(spec: ModelSpec, shape: fakerank.Probe) -> int:
    """The same rank's step on real tensors: what it holds before the step (its
    parameters and optimizer state, from the tensors) plus the peak of the blocks the
    step allocates, from the profiler's allocator events (profiling.cpu_alloc_peak)."""
    from torch.profiler import ProfilerActivity, profile

    from parabench.run.profiling import _chrome_events, cpu_alloc_peak

    with fakerank.rank(spec, shape, fake=False) as r:
        held = sum(fakerank.local_bytes(t) for t in (*r.module.parameters(), *_states(r.optimizer)))
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fakerank.step(r)
        return held + cpu_alloc_peak(_chrome_events(prof.export_chrome_trace))


def _states(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize(
    "shape",
    [
        fakerank.Probe(Layout(dp_shard=4), micro=4, **FP32),
        fakerank.Probe(Layout(dp_shard=2, tp=2), micro=4, **FP32),
    ],
    ids=["fsdp4", "fsdp2xtp2"],
)
def test_the_tracker_on_fake_tensors_sees_what_a_real_step_allocates(shape):
    """Within 1% of the allocator's own count on real tensors: the fake step is the
    real step's memory (measured +0.001% and +0.02%; +5.5% and +2.3% while DTensor's
    shadow tensors counted, fakerank._shadows)."""
    fake = fakerank.measure(LLAMA, shape).peak_bytes
    real = _real_peak(LLAMA, shape)
    assert fake == pytest.approx(real, rel=0.01), (fake, real)
    # and not a trivially small model: the step's own allocations matter
    assert real > 2 * fakerank.measure(LLAMA, shape).by_category.get("opt", 0)


def _flat(comm: dict) -> dict:
    return {(d, op, k): v for d, ops in comm.items() for op, e in ops.items() for k, v in e.items()}


# gpt: a sequential model, whose children (the embedding and head among them) are its
# blocks (models/base.py)
GPT_SPEC = ModelSpec.of("gpt", vocab=512, seq_len=32, n_layer=2, n_head=4, d_model=64)


@pytest.mark.parametrize(
    "spec, shape",
    [
        (LLAMA, fakerank.Probe(Layout(dp_shard=4, ac="full"), micro=2)),
        (LLAMA, fakerank.Probe(Layout(dp_shard=2, tp=2, ac="selective", zero=2), micro=4)),
        (LLAMA, fakerank.Probe(Layout(dp_replicate=2, dp_shard=2), micro=2)),
        (GPT_SPEC, fakerank.Probe(Layout(dp_shard=2, ac="full"), micro=2)),
    ],
    ids=["fsdp-full", "fsdp-tp-selective-zero2", "hsdp", "gpt-fsdp-full"],
)
def test_a_deep_stage_measured_at_a_few_depths_is_the_stage_measured_whole(spec, shape):
    """Identical blocks hold and do the same: extended from a few depths to 9 blocks,
    every figure is the one measured at 9 (the peak to 0.5%, the rest exactly); then
    another micro-batch and checkpointing of the same shape, measured at the depth the
    first settled at. A rank's depth is its repeated blocks (a sequential model's
    embedding and head aside), and what leaves its last block is a block's output."""
    fakerank._SETTLED.clear()
    other = {"none": "full", "full": "selective", "selective": "none"}[shape.layout.ac]
    for micro, ac in ((shape.micro, shape.layout.ac), (shape.micro * 2, other)):
        at = shape.replace(micro=micro, layout=shape.layout.replace(ac=ac))
        ext = fakerank.at_blocks(spec, at, 9)
        whole = fakerank.measure(spec, at.replace(blocks=9))
        assert ext.peak_bytes == pytest.approx(whole.peak_bytes, rel=0.005)
        assert ext.saved_bytes == pytest.approx(whole.saved_bytes, rel=0.005)
        assert ext.work.flops() == pytest.approx(whole.work.flops(), rel=1e-9)
        assert ext.work.op_count() == pytest.approx(whole.work.op_count())
        assert ext.work.recompute_flops == pytest.approx(whole.work.recompute_flops)
        assert _flat(ext.work.comm_by_dim) == pytest.approx(_flat(whole.work.comm_by_dim))
        assert (ext.blocks, whole.blocks) == (9, 9)
        assert 0 < ext.work.block_flops == pytest.approx(whole.work.block_flops, rel=1e-9)
        assert ext.work.block_flops < ext.work.flops(fakerank.STEP)  # the head's are not
        width = spec.size_dict().get("d_model") or spec.size_dict()["config"]["hidden_size"]
        seq = spec.size_dict()["seq_len"]
        assert whole.boundary_bytes == micro * seq * width * 2 // shape.layout.tp  # bf16
    assert fakerank._SETTLED, "the first option's depth was kept for the second"


def test_an_op_between_two_running_blocks_is_the_part_of_the_one_entered_last():
    """As one block's backward hands its input's gradient to the next, both are
    running; the op is the part of the block entered last (the forward's deeper, the
    backward's shallower), whatever order the set of running names iterates in: that
    order follows the names' hashes, and with it each part's line zigzagged with the
    depth and never settled (Llama 3.1 70B under FSDP 2 took 24 depths, not 3)."""
    from types import SimpleNamespace

    def parts(n: int, phase_of: Callable[[], tuple[str, str]]) -> list[tuple[str, str]]:
        seen = []
        for model in range(30):  # 30 sets of names: a lucky order cannot pass them all
            blocks = [torch.nn.Identity() for _ in range(n)]
            names = {b: f"m{model}.layers.{i}" for i, b in enumerate(blocks)}
            mods = SimpleNamespace(parents=set(), get_known_fqn=names.get)
            where = fakerank._parts(
                SimpleNamespace(_mod_tracker=mods), blocks, SimpleNamespace(phase="")
            )
            for pair in ((0, 1), (n - 2, n - 1)):
                mods.parents = {names[blocks[i]] for i in pair}
                seen.append(phase_of(where))
        return seen

    forward = parts(6, lambda where: where())
    assert forward == [("forward", "inner"), ("forward", "last")] * 30

    backward = []

    class InBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            backward.extend(parts(6, lambda where: where()))
            return grad

    InBackward.apply(torch.zeros(1, requires_grad=True)).sum().backward()
    assert backward == [("backward", "first"), ("backward", "inner")] * 30


def _second_forward_adds(probe: fakerank.Probe) -> int:
    """What a rank holds more after a second micro-batch's forward than after the first,
    both held for their backward, as a pipeline's stage holds its micro-batches in
    flight: the step's whole memory, by torch's tracker, no category read."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    def total(tracker) -> int:
        return sum(s[_TOTAL_KEY] for s in tracker.get_tracker_snapshot().values())

    with fakerank.rank(LLAMA, probe) as r:
        tracker = fakerank.total_tracker_class()()
        tracker.track_external(r.module, r.optimizer)
        with tracker:
            # autocast entered for each, as a pipeline's stage does (its bf16 copies of
            # the weights made and saved by each micro-batch: strategies/pipeline.py)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=r.par.autocast):
                first = r.par.root(r.batch[0])
            one = total(tracker)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=r.par.autocast):
                second = r.par.root(r.batch[0])
            two = total(tracker)
        del first, second
    return two - one


@pytest.mark.parametrize(
    "layout",
    [
        Layout(dp_shard=2, ac="full"),
        Layout(dp_shard=2, zero=2),
        Layout(dp_shard=2, tp=2, ac="selective"),
        Layout(dp_replicate=2, ac="selective"),
        Layout(dp_replicate=2),
        Layout(tp=2),
    ],
    ids=["fsdp-full", "fsdp-zero2", "fsdp-tp-selective", "ddp-selective", "ddp", "tp"],
)
def test_a_micro_batch_in_flight_holds_what_a_second_forward_adds(layout):
    """What each block adds to a micro-batch in flight (`block_saved_bytes`, which a
    pipeline's stage holds for each: advise.held) is what one more block adds to the
    memory a second forward holds beside the first, to the byte. Read before from the
    tracker's activations, it was negative under FSDP with full checkpointing: the
    tracker moves a storage to the parameters when a module first uses it, so the
    blocks' gathers and frees of each other's parameters counted. Autocast's bf16
    copies of the weights count, as each micro-batch of a stage makes its own; and the
    first stage also holds, for each, what its forward made before the blocks."""
    probes = [fakerank.Probe(layout, micro=2, blocks=b) for b in (3, 4)]
    measured = [fakerank.measure(LLAMA, p).block_saved_bytes for p in probes]
    truth = [_second_forward_adds(p) for p in probes]
    assert measured[1] - measured[0] == truth[1] - truth[0] > 0, (measured, truth)
    if layout.ac == "full":  # the first block keeps its input: the embedding's output
        embedded = 2 * LLAMA.size_dict()["seq_len"] * LLAMA.size_dict()["config"]["hidden_size"]
        assert fakerank.measure(LLAMA, probes[0]).input_saved_bytes >= 2 * embedded


def test_ranks_in_one_kept_world_measure_as_each_in_its_own():
    """A search keeps one world and its meshes from rank to rank (fakerank.kept_worlds),
    so that DTensor's plans made for one rank serve the next: every figure is the one
    the rank measures in a world of its own, its collectives on its own mesh's
    dimensions, through a mesh made once and used again, two meshes in one world whose
    tp submeshes hold the same ranks (alike if named alike), and changes of world size
    and kind (a timed rank's world is parabench's own group); the world ends with the
    search."""
    fsdp_tp = fakerank.Probe(Layout(dp_shard=2, tp=2, sequence_parallel=True), micro=2)
    sp_full = {"sequence_parallel": True, "ac": "full"}
    probes = [
        fsdp_tp,
        fsdp_tp.replace(micro=4),  # the same mesh, made once
        fakerank.Probe(Layout(dp_replicate=8, tp=2, **sp_full)),
        fakerank.Probe(Layout(dp_replicate=4, dp_shard=2, tp=2, **sp_full)),
        fakerank.Probe(Layout(dp_replicate=2, dp_shard=2, ac="full"), micro=2),
        fakerank.Probe(Layout(dp_replicate=2), micro=2),
    ]

    def figures(m: fakerank.Measured) -> tuple:
        return (
            m.peak_bytes,
            m.reserved_bytes,
            m.by_category,
            m.work.flops(),
            dict(m.work.ops),
            _flat(m.work.comm_by_dim),
        )

    fakerank._MEASURED.clear()
    alone = [figures(fakerank.measure(LLAMA, p)) for p in probes]
    fakerank._MEASURED.clear()
    kept, meshes = [], []
    with fakerank.kept_worlds():
        for p in probes:
            kept.append(figures(fakerank.measure(LLAMA, p)))
            assert dist.is_initialized() and dist.get_world_size() == p.world
            meshes.append(len(fakerank._KEPT.meshes))
        phases = fakerank.timed(LLAMA, fsdp_tp.replace(micro=1), ranks=2)  # another kind
        assert all(0 < s < 60 for s in phases.values())
        kept.append(figures(fakerank.measure(LLAMA, fsdp_tp.replace(micro=1))))
    assert not dist.is_initialized()
    assert meshes == [1, 1, 1, 2, 1, 1]
    fakerank._MEASURED.clear()
    assert kept == [*alone, figures(fakerank.measure(LLAMA, fsdp_tp.replace(micro=1)))]


@pytest.mark.parametrize(
    "layout", [Layout(dp_shard=2, tp=2, sequence_parallel=True), Layout(dp_replicate=2)]
)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_optimizer_state_made_directly_is_the_state_a_step_makes(layout, optimizer):
    """A rank's optimizer state, made without a step (fakerank.initial_state), is the
    state torch's first step makes: the same keys, and tensors of the same kind (DTensor
    with the same placements, or not), shape, dtype and device, for every parameter."""

    def described(state) -> dict:
        return {
            k: (
                type(t).__name__,
                tuple(t.shape),
                t.dtype,
                t.device.type,
                getattr(t, "placements", None),
            )
            for k, t in state.items()
        }

    probe = fakerank.Probe(layout, micro=1, optimizer=optimizer)
    with fakerank.rank(LLAMA, probe) as r:
        stepped = fakerank._optimizer(r.module, probe)
        for p in r.module.parameters():
            p.grad = torch.zeros_like(p)
        stepped.step()
        stepped.zero_grad(set_to_none=True)
        params = list(r.module.parameters())
        made = [described(r.optimizer.state[p]) for p in params]
        want = [described(stepped.state[p]) for p in params]
    assert made == want
    assert all(made) == (optimizer == "adamw")  # AdamW's has state; SGD's none


# A vocabulary large beside its blocks, and gradients held whole (DDP, TP alone): at a
# few blocks the step's peak is the loss's buffers at the forward's end; by 16 it is
# the gradients at the backward's end, which grow faster with depth (as Llama 3.1 8B's
# do between 8 and 16 blocks under DDP or TP 2 with full checkpointing).
WIDE_VOCAB = ModelSpec.of(
    "hf",
    **{
        **LLAMA.size_dict(),
        "seq_len": 512,
        "config": {
            **LLAMA.size_dict()["config"],
            "hidden_size": 256,
            "intermediate_size": 512,
            "vocab_size": 4096,
        },
    },
)


@pytest.mark.parametrize(
    "layout", [Layout(dp_replicate=2, ac="full"), Layout(tp=2, ac="full")], ids=["ddp", "tp"]
)
def test_a_peak_that_moves_to_another_part_of_the_step_is_extended_part_by_part(layout):
    """Extended from 3 and 4 blocks to 16, each part of the step (forward or backward,
    first, inner or last block, before or after them, the optimizer) on its own line:
    the peak and its split are the ones measured at 16 blocks, to the byte. One line
    through the step's peaks at 3 and 4 blocks would follow the loss's part, and fall
    short by over 3%."""
    probe = fakerank.Probe(layout, micro=1)
    low, high, whole = (fakerank.measure(WIDE_VOCAB, probe.replace(blocks=b)) for b in (3, 4, 16))
    ext = fakerank.extended(low, high, 16)
    assert ext.peak_bytes == whole.peak_bytes
    assert ext.by_category == whole.by_category
    one_line = low.peak_bytes + (high.peak_bytes - low.peak_bytes) * 13
    assert one_line < 0.97 * whole.peak_bytes
    # the peak moved: from the forward's end (activations, no gradients) to the gradients
    assert not low.by_category.get("grad") and whole.by_category["grad"]


@pytest.mark.parametrize(
    "strategy, shape",
    [
        ("fsdp_tp", fakerank.Probe(Layout(dp_shard=2, tp=2), micro=4, **FP32)),
        ("hsdp", fakerank.Probe(Layout(dp_replicate=2, dp_shard=2), micro=4, **FP32)),
    ],
)
def test_bytes_per_mesh_dimension_on_fake_tensors_are_the_models(strategy, shape):
    """No collective reaches a process group under fake tensors: the op counter counts
    them, and gets what the model's shapes say each dimension sends (test_layouts'
    derivation, which the real gloo ranks of those layouts also meet)."""
    from parabench.models import build

    spec = ModelSpec.of(**GPT)
    counted = fakerank.measure(spec, shape).work.comm_by_dim
    want = derived(build(spec, 0), strategy, shape.layout.degrees, {"rank": 0})
    assert set(counted) == set(want)
    for dim, ops in want.items():
        for op, v in ops.items():
            assert counted[dim][op]["bytes"] == v["bytes"], (dim, op)
            if "count" in v:
                assert counted[dim][op]["count"] == v["count"], (dim, op)


def test_recompute_is_counted_apart_and_checkpointing_trades_memory_for_it():
    none = fakerank.measure(LLAMA, fakerank.Probe(Layout(dp_shard=2), micro=4))
    full = fakerank.measure(LLAMA, fakerank.Probe(Layout(dp_shard=2, ac="full"), micro=4))
    assert none.work.recompute_flops == 0 < full.work.recompute_flops
    assert full.work.flops() == pytest.approx(none.work.flops() + full.work.recompute_flops)
    assert full.saved_bytes < none.saved_bytes / 2


CONFIG = {
    "results": "results",
    "device": "cpu",
    "models": {
        "llama": {
            "arch": "hf",
            "model_type": "llama",
            "seq_len": 64,
            "batch_size": 16,
            "config": {**LLAMA.size_dict()["config"], "num_hidden_layers": 2},
        }
    },
    "devices": [1],
    "advise": {"enabled": True, "gpus": [4, 8], "gpus_per_node": 4, "gpu": "h100"},
}


@pytest.fixture(scope="module")
def advised(tmp_path_factory):
    work = tmp_path_factory.mktemp("advise")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "parabench",
            "advise",
            "--config-json",
            json.dumps(CONFIG),
            "--workers",
            "1",
            "--out",
            str(work),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return pd.read_csv(work / "advise.csv"), proc.stdout


def test_advise_writes_every_column_and_accounts_for_every_candidate(advised):
    table, out = advised
    assert tuple(table.columns) == ADVISE_COLUMNS
    assert set(table["status"]) <= {"ok", "inferred", "skipped"}, table[table["status"] == "failed"]
    for n in (4, 8):
        mine = table[table["gpus"] == n]
        ok = mine[mine["status"].isin(["ok", "inferred"])]
        # every layout of the mesh that applies: tp within a node and splitting the heads
        # (4 heads, 2 key/value heads: tp 1 or 2), pp up to the 2 blocks
        layouts = {(r.pp, r.dp_replicate * r.dp_shard, r.tp) for r in ok.itertuples()}
        want = {(pp, n // (pp * tp), tp) for tp in (1, 2) for pp in (1, 2)}
        assert layouts == want, layouts ^ want
        assert (
            mine["micro_batch"] * mine["accumulation"] * mine["dp_replicate"] * mine["dp_shard"]
            == 16
        )[ok.index].all()
        assert set(ok["ac"]) == {"none", "selective", "full"}
        assert ok[ok["status"] == "inferred"]["reason"].str.len().gt(0).all()
        best = mine[mine["rank"] == 1]
        assert len(best) == 1 and bool(best["fits"].iloc[0])
        fits = mine[(mine["status"] == "ok") & (mine["fits"].astype(str) == "True")]
        assert best["step_s"].iloc[0] == fits["step_s"].min()
        measured = mine[mine["status"] == "ok"]
        assert (measured["step_s"] >= measured["compute_s"]).all()
        assert (measured["mfu"] > 0).all() and (measured["mfu"] < 1).all()
        assert (measured["memory_bytes"] > measured["param_bytes"]).all()
        # the categories make up the peak (a pipeline's other micro-batches in flight
        # among the activations, its gradients accumulated among the gradients)
        kinds = measured[["param_bytes", "grad_bytes", "opt_bytes", "act_bytes", "temp_bytes"]]
        gap = (kinds.sum(axis=1) - measured["memory_bytes"]).abs()
        assert (gap <= 0.01 * measured["memory_bytes"]).all(), measured[gap > 0]
        # a GPU runs its share of the model's FLOPs, whatever the layout: a pipeline's
        # stage, measured with the embedding and the head, runs them once between stages
        for _, alike in measured.groupby("ac"):
            flops = alike["flops_per_gpu"]
            assert flops.max() < 1.01 * flops.min(), alike[["layout", "flops_per_gpu"]]
        # data parallelism: FSDP, DDP, and HSDP within the node of 4
        assert {
            (r.dp_replicate, r.dp_shard) for r in ok[(ok.tp == 1) & (ok.pp == 1)].itertuples()
        } >= {
            (1, n),
            (n, 1),
        }
    assert "advise llama N=8" in out


def test_a_search_that_failed_partway_is_reported_as_failed_not_answered(advised):
    """A (model, N) whose search failed partway keeps the rows it decided, unranked,
    and a row of no layout saying why (advise._advise_model): the report says it was
    not advised, and why, rather than call an unranked row the fastest that fits."""
    from parabench.report.advice import _sections

    table, _ = advised
    mine = table[table["gpus"] == 4].copy()
    mine["rank"] = float("nan")
    cut = pd.DataFrame([{"model": "llama", "gpus": 4, "status": "failed", "reason": "boom"}])
    sections = _sections(pd.concat([mine, cut]))
    assert len(sections) == 1 and [f["reason"] for f in sections[0]["failed"]] == ["boom"]
    assert not sections[0].get("best")


def test_a_search_killed_halfway_leaves_the_rows_it_decided(advised, tmp_path):
    """advise.csv is written as each layout's rows are decided: killed (SIGKILL, no
    handler runs) once some are in, the table holds them, each as the full search
    decided it, and the log said how far the search was."""
    import signal
    import time

    cmd = [sys.executable, "-m", "parabench", "advise", "--config-json", json.dumps(CONFIG)]
    proc = subprocess.Popen(
        [*cmd, "--workers", "1", "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
    )
    path, deadline = tmp_path / "advise.csv", time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if path.exists() and (pd.read_csv(path)["status"] == "ok").sum() >= 3:
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the search ended before it could be cut off"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        log = proc.communicate()[0]
    partial, full = pd.read_csv(path), advised[0]
    assert tuple(partial.columns) == ADVISE_COLUMNS
    assert (partial["status"] == "ok").sum() >= 3 and len(partial) < len(full)
    assert partial["rank"].isna().all()  # ranks come when the whole N is in
    key = ["gpus", "layout", "micro_batch", "ac", "zero", "schedule"]
    same = partial.merge(full, on=key, suffixes=("", "_full"), validate="one_to_one")
    assert len(same) == len(partial)
    for col in ("status", "step_s", "memory_bytes", "fits", "reason"):
        assert same[col].astype(str).tolist() == same[col + "_full"].astype(str).tolist(), col
    assert re.search(r"advise llama N=4: \d+/\d+ layouts, \d+ measured, \d+ s, about", log)


def test_the_table_written_as_rows_are_decided_is_the_table_written_whole(tmp_path):
    """As each layout's rows are decided, advise.csv is what `write` writes of every row
    so far, the earlier models' and N's first, though each row is encoded only once."""
    import types

    before = [{"model": "m", "gpus": 2, "layout": "DDP 2", "status": "ok", "step_s": 0.5}]
    got = [
        [{"model": "m", "gpus": 4, "layout": "FSDP 4", "status": "ok", "reason": 'a "b", c'}],
        [{"model": "m", "gpus": 4, "layout": "TP 4", "status": "failed", "fits": False}],
    ]
    searched = types.SimpleNamespace(measurements=0)
    progress = advise._Progress("advise m N=4", searched, 7, before, tmp_path, lambda s: None)
    whole = tmp_path / "whole"
    whole.mkdir()
    for i, rows in enumerate(got):
        progress.decided(rows, i, len(got))
        so_far = [{**r, "params": 7} for batch in got[: i + 1] for r in batch]
        advise.write(before + so_far, whole)
        assert (tmp_path / "advise.csv").read_bytes() == (whole / "advise.csv").read_bytes()


def _advise_cli(tmp_path, *extra: str, config: dict = CONFIG) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "parabench", "advise", "--config-json", json.dumps(config)]
    return subprocess.run(
        [*cmd, *extra, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )


def test_one_given_layout_is_priced_as_the_search_prices_it(advised, tmp_path):
    """`--layout` prices what a user runs today (or a published run) without a search:
    the same row the search gives that layout, on the GPUs its degrees make."""
    proc = _advise_cli(tmp_path, "--layout", "fsdp 2 x tp 2, selective ac, micro 2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (tmp_path / "advise.csv").exists(), "the search's table is not overwritten"
    (row,) = pd.read_csv(tmp_path / "advise-layout.csv").to_dict("records")
    assert (row["gpus"], row["layout"], row["micro_batch"], row["accumulation"]) == (
        4,
        "FSDP 2 × TP 2, SP, selective AC",
        2,
        4,  # 16 samples over 2 data-parallel ranks, 2 at a time
    )
    table = advised[0]
    found = table[(table["layout"] == row["layout"]) & (table["micro_batch"] == 2)]
    if len(found) and found["status"].iloc[0] == "ok":  # the search measured it too
        assert row["step_s"] == pytest.approx(found["step_s"].iloc[0])
        assert row["memory_bytes"] == found["memory_bytes"].iloc[0]
    assert row["status"] == "ok" and row["step_s"] > 0 and "fits" in proc.stdout
    bad = _advise_cli(tmp_path / "bad", "--layout", "FSDP 2 x TP 2, micro 3")
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1
    assert bad.stderr.startswith("parabench advise: --layout: the global batch of 16")
    # what the search would not run is refused as it says, before anything is measured
    for extra, said in [
        (("--layout", "PP 4"), "llama: PP 4: at most 2 stages (2 blocks)"),
        (("--layout", "TP 8"), "llama: TP 8 is not within a node of 4 GPUs"),
        (("--gpus", "8", "--layout", "FSDP 2 x TP 2"), "runs on 4 GPUs, not --gpus [8]"),
    ]:
        bad = _advise_cli(tmp_path / "refused", *extra)
        assert bad.returncode == 2 and said in bad.stderr, bad.stderr
        assert not (tmp_path / "refused" / "advise-layout.csv").exists()


def test_a_given_layout_whose_rank_fails_says_why_in_its_row_and_its_line(tmp_path, monkeypatch):
    """A `--layout` whose fake step fails prices nothing: its row is `failed` with the
    error, and its line says so, not a step of nan seconds that "does not fit"."""

    def fails(spec, probe):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(fakerank, "measure", fails)
    said: list[str] = []
    from parabench.config import checked

    config = checked(json.loads(json.dumps(CONFIG)))
    (row,) = advise.price(
        config,
        "FSDP 2, micro 2",
        gpus.PROFILES["h100"],
        PROFILES["h100-nvlink-ndr400"],
        tmp_path,
        log=said.append,
    )
    assert row["status"] == "failed" and "RuntimeError: no such kernel" in row["reason"]
    assert said[-1].startswith("advise llama: FSDP 2, micro 2 x 4 on 2 GPUs: failed: ")
    assert said[-1].endswith("RuntimeError: no such kernel") and "nan" not in said[-1]
    assert pd.read_csv(tmp_path / advise.LAYOUT_CSV)["status"].tolist() == ["failed"]


def test_a_layout_is_priced_alike_to_the_bit_in_every_process(tmp_path):
    """A rank extended from two depths sums its ops in one order whatever the process:
    Python seeds string hashes afresh in each, and sums taken in a set's order differed
    in their last bits from one process to the next (and so from a cached step's)."""
    import os

    tables = []
    for seed in ("1", "2"):
        out = tmp_path / seed
        proc = subprocess.run(
            [
                *(sys.executable, "-m", "parabench", "advise", REPO / "config/advise.yaml"),
                *("--models", "llama3_8b", "--gpus", "16", "--out", out),
                *("--layout", "FSDP 8 x TP 2, SP, full AC, micro 2"),
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        tables.append((out / "advise-layout.csv").read_bytes())
    assert tables[0] == tables[1]


@pytest.mark.parametrize(
    "change, extra, said",
    [
        ({"gpu": "h1000"}, (), "advise.gpu: 'h1000'"),
        # Float8 on a card with no FP8 tensor cores, asked for on the command line
        ({}, ("--gpu", "a100", "--float8"), "advise.float8: gpu 'a100'"),
        # the command line's options are the file's keys, held to the same bounds
        ({}, ("--gpus", "0"), "advise.gpus.0: 0 is less than the minimum of 1"),
        ({}, ("--gpus", "8", "8"), "advise.gpus: [8, 8] has non-unique elements"),
        ({}, ("--global-batch", "0"), "advise.global_batch: 0 is less than the minimum"),
    ],
)
def test_a_config_advise_cannot_use_is_refused_naming_its_key(tmp_path, change, extra, said):
    """One line naming the key, and no advise.csv."""
    bad = {**CONFIG, "advise": {**CONFIG["advise"], **change}}
    proc = _advise_cli(tmp_path, *extra, config=bad)
    assert proc.returncode == 2, proc.stderr
    assert said in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert not (tmp_path / "advise.csv").exists()


@pytest.fixture(scope="module")
def torchtitan_rows() -> list[dict]:
    return conftest.torchtitan_rows()


def test_torchtitans_runs_are_predicted_as_stated(torchtitan_rows):
    """Llama 3.1 8B, 70B and 405B ranks on fake tensors at 8 to 512 GPUs, each
    published run priced as it ran (eager, compiled, Float8) against what it reported:
    - Tables 1 and 3 (8B, FSDP), each eager, compiled, and compiled with Float8: within
      25% on allocated memory (measured -15%, -11%: memory is priced as eager's) and
      15% on reserved, as torchtitan reports it (measured -9% to +4%); within 60% on
      tokens/s (measured +41% to +57%: advise's compute is too fast; the +11% and +14%
      before #45 came partly from pricing a causal mask that transformers built on fake
      tensors only), so a prediction 2x off either way fails here;
    - what compile and Float8 buy, each against the table's published runs: compile's
      seconds saved a step within 10% (measured 0.377 s against 0.386 s and 0.408 s:
      the memory-bound work it removes is priced at the card's bandwidth), Float8's gain
      as a ratio within 5% (1.290x and 1.297x against 1.280x and 1.286x; its seconds saved
      are a third short, 0.37 s against 0.54 and 0.56, as the matmuls it halves are
      priced too fast);
    - Tables 4 and 5 (70B FSDP x TP, 405B with PP, compiled with Float8: TP sequence
      parallel with a parallel loss, as they ran it) within 50% on tokens/s (measured
      +18%, +33%); within 25% on memory and 15% reserved: Table 4 measured -15%,
      reserved -5% (+445% before TP was sequence parallel and DTensor's shadow tensors
      left the tracker); Table 5 -10%, reserved +0.2% (-43% and -33% before its stage's
      gradients, accumulated unsharded over its micro-batches, were added)."""
    rows = torchtitan_rows
    assert [(r["table"], r["compile"], r["float8"]) for r in rows] == [
        *(
            (t, c, f)
            for t in ("Table 1", "Table 3")
            for c, f in ((False, False), (True, False), (True, True))
        ),
        ("Table 4", True, True),
        ("Table 5", True, True),
        ("Table 5", True, True),
    ]
    assert set(TORCHTITAN_COLUMNS) >= set(rows[0])
    for r in rows:
        assert r["status"] == "ok", r
        tps, memory = r["tps_error"], r["memory_error"]
        assert abs(tps) < 0.6, (r["table"], r["run"], tps)
        assert abs(memory) < 0.25, (r["table"], r["run"], memory)
        assert abs(r["reserved_error"]) < 0.15, (r["table"], r["run"], r["reserved_error"])
        # the allocator's reserve: more than allocated, less than twice
        assert r["memory_bytes"] <= r["reserved_bytes"] < 2 * r["memory_bytes"], r["table"]
        assert ("Float8 matmuls" in r["leaves_out"]) != r["float8"]
    for t in ("Table 1", "Table 3"):
        eager, compiled, float8 = (r for r in rows if r["table"] == t)
        assert eager["memory_bytes"] == compiled["memory_bytes"] == float8["memory_bytes"]

        def step(r: dict, tps: str) -> float:
            return r["tokens_per_sample"] * r["micro_batch"] * r["accumulation"] / r[tps]

        def saved(a: dict, b: dict, tps: str) -> float:
            return step(a, tps) - step(b, tps)

        pub = "published_tokens_per_s_per_gpu"
        assert saved(eager, compiled, "tokens_per_s_per_gpu") == pytest.approx(
            saved(eager, compiled, pub), rel=0.1
        ), t
        predicted = float8["tokens_per_s_per_gpu"] / compiled["tokens_per_s_per_gpu"]
        assert predicted == pytest.approx(float8[pub] / compiled[pub], rel=0.05), t
    # Table 5's two schedules, one measurement: Interleaved 1F1B's bubble is half
    # 1F1B's, its throughput 1.26x against 1.28x published; it holds less at its peak,
    # as published (72.7 against 82.5 GiB): one of its stages' gradients is reduced
    # before the other's first backward
    one, two = (r for r in rows if r["table"] == "Table 5")
    assert (one["schedule"], two["schedule"]) == ("1f1b", "interleaved")
    assert two["bubble_s"] == pytest.approx(one["bubble_s"] / advise.VIRTUAL_STAGES)
    ratio = two["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"]
    pub = "published_tokens_per_s_per_gpu"
    assert ratio == pytest.approx(two[pub] / one[pub], rel=0.05)
    assert two["reserved_bytes"] < one["reserved_bytes"]
    t1, t3 = rows[0], rows[3]
    # weak scaling from 8 to 128 GPUs: the same rank's work, more communication
    assert t3["comm_s"] > t1["comm_s"] and t3["compute_s"] == pytest.approx(
        t1["compute_s"], rel=0.05
    )


def test_every_published_run_fits_its_gpus(torchtitan_rows):
    """Each of torchtitan's runs ran on its 96 GB H100s: advise must say it fits (Table
    4 did not before TP was sequence parallel: 392 GiB predicted), deciding on what the
    GPU would hold: the reserved peak, the CUDA context and NCCL's buffers."""
    for r in torchtitan_rows:
        groups = [r[d] for d in ("pp", "dp_replicate", "dp_shard", "tp") if r[d] > 1]
        assert r["overhead_bytes"] == gpus.overhead(groups), r["table"]
    assert all(r["fits"] for r in torchtitan_rows), [
        (r["table"], r["predicted_memory_gib"]) for r in torchtitan_rows if not r["fits"]
    ]


def test_the_ranking_check_sets_each_measured_layout_beside_its_prediction():
    """The report's on-machine check: each layout the run measured at N, matched to the
    advise row of the same degrees (no accumulation, no checkpointing), its error, and
    how the two rank them (Spearman's rho by hand: 1 - 6 * sum(d^2) / (n (n^2 - 1)))."""
    from parabench.report.advice import ranking

    measured = {"ddp": 0.020, "fsdp": 0.060, "fsdp_tp": 0.070, "hsdp": 0.050}
    # communication, and what the slowest rank waited for: ddp's wait holds more than its
    # communication (the straggler's), so it hid at least nothing, not -20%
    comm = {"ddp": (0.010, 0.012), "fsdp": (0.020, 0.015), "fsdp_tp": (0.03, 0.03)}
    summary = pd.DataFrame(
        [
            {
                "model": "gpt",
                "devices": 4,
                "strategy": s,
                "ac": "none",
                "precision": "fp32",
                "optimizer": "sgd",
                "global_batch": 8,
                "status": "ok",
                "step_time_s": t,
                "options": "{}",
                "comm_s": comm.get(s, (0.010, 0.005))[0],
                "comm_exposed_s": comm.get(s, (0.010, 0.005))[1],
            }
            for s, t in measured.items()
        ]
    )
    layouts = {  # (dp_replicate, dp_shard, tp, zero) -> predicted step
        (4, 1, 1, 0): 0.015,
        (1, 4, 1, 3): 0.070,
        (1, 2, 2, 3): 0.050,
        (2, 2, 1, 3): 0.060,
        (1, 4, 1, 2): 0.001,  # ZeRO-2: not what the fsdp cell ran
    }
    adv = pd.DataFrame(
        [
            {
                "model": "gpt",
                "gpus": 4,
                "gpu": "this-machine",
                "precision": "fp32",
                "optimizer": "sgd",
                "global_batch": 8,
                "status": "ok",
                "ac": "none",
                "accumulation": 1,
                "pp": 1,
                "dp_replicate": r,
                "dp_shard": d,
                "tp": t,
                "zero": z,
                "layout": f"{r}x{d}x{t}",
                "step_s": step,
                "compute_s": step / 2,
                "roofline_compute_s": step / 4,
                "compute_source": "timed here: ..." if z == 3 else "priced: ...",
                "comm_s": step / 2,
                "comm_hidden_s": 0.0,
            }
            for (r, d, t, z), step in layouts.items()
        ]
    )
    (check,) = ranking(adv, summary)
    got = {r["strategy"]: r for r in check["rows"]}
    assert got["fsdp"]["predicted_s"] == 0.070 and got["fsdp_tp"]["predicted_s"] == 0.050
    # its compute beside the roofline's (timed here, or priced); timed only if all are
    assert got["fsdp"]["compute_s"] == pytest.approx(0.035)
    assert got["fsdp"]["roofline_compute_s"] == pytest.approx(0.0175)
    assert got["fsdp"]["timed"] and not got["ddp"]["timed"] and not check["timed"]
    for s, t in measured.items():
        assert got[s]["error"] == pytest.approx(got[s]["predicted_s"] / t - 1)
    assert check["top1"] and check["predicted_best"] == check["measured_best"] == "ddp"
    # predicted ranks ddp 1, fsdp 4, fsdp_tp 2, hsdp 3; measured 1, 3, 4, 2: sum d^2 = 6
    assert check["spearman"] == pytest.approx(1 - 6 * 6 / (4 * 15))
    hidden = {s: got[s]["measured_hidden"] for s in measured}
    assert hidden == pytest.approx({"ddp": 0.0, "fsdp": 0.25, "fsdp_tp": 0.0, "hsdp": 0.5})
    assert all(got[s]["predicted_hidden"] == 0 for s in measured)
    assert check["hidden_gap"] == pytest.approx((0.25 + 0.5) / 4)
    # of two layouts no rank correlation: they rank alike or opposite, whatever the figures
    (two,) = ranking(adv, summary[summary["strategy"].isin(["ddp", "fsdp"])])
    assert len(two["rows"]) == 2 and two["spearman"] is None and two["top1"]


def test_the_shipped_advise_config_loads_and_its_models_plan_without_building():
    from parabench import models
    from parabench.config import advise_problems, load_config, model_spec

    config = load_config(REPO / "config/advise.yaml")
    assert advise_problems(config, REPO) == []
    for entry in config["models"].values():
        facts = models.facts(model_spec(entry))
        assert not facts.problems and facts.has_tp_plan and facts.n_blocks >= 32


def test_a_second_search_reads_its_ranks_from_the_cache_and_decides_alike(tmp_path, monkeypatch):
    """With a cache (`advise --cache`), each fake step a search takes is kept; the same
    search again, in a process that holds none of them, takes no fake step and writes
    every row as the first did. A change of code (or torch, transformers, Python) reads
    none of them: its steps are taken again."""
    from parabench import models

    monkeypatch.setenv(fakerank.CACHE_ENV, str(tmp_path))

    def searched() -> tuple[list[dict], int, int]:
        fakerank._MEASURED.clear()
        fakerank._SETTLED.clear()
        logged = []
        search = advise.Search(
            {"llama": LLAMA},
            gpus.PROFILES["h100"],
            PROFILES["h100-nvlink-ndr400"],
            "bf16",
            "adamw",
            log=logged.append,
        )
        ran = fakerank.steps_run()
        with fakerank.kept_worlds():
            rows = advise.search(
                search,
                "llama",
                models.facts(LLAMA),
                2,
                2,
                16,
                advise.tokens_per_sample(LLAMA),
                fakerank.depth(LLAMA),
            )
        read = sum(int(line.split(": ")[1].split()[0]) for line in logged if "  read " in line)
        return rows, fakerank.steps_run() - ran, read

    first, ran, read = searched()
    assert ran > 0 and read == 0
    again, ran_again, read_again = searched()
    assert ran_again == 0 and read_again == ran
    assert again == first
    monkeypatch.setattr(fakerank, "_code_stamp", lambda: "another code")
    _, ran_changed, read_changed = searched()
    assert ran_changed == ran and read_changed == 0


def test_a_failed_measurement_decides_nothing():
    """A layout whose lightest measurement fails is not 'does not fit': its rows say
    it failed, and the search does not prune the heavier layouts of its degrees."""
    from parabench import models

    class Failing(_Ruled):
        def row(self, c, facts, global_batch, tokens):
            return {**self.base(c, global_batch, tokens), "status": "failed", "reason": "boom"}

    search = Failing(lambda c: False)
    facts = models.facts(LLAMA)
    family = [
        c
        for c in advise.candidates("llama", facts, 4, 4, 16, 4)
        if isinstance(c, advise.Candidate)
        and c.layout.replace(ac="none") == Layout(dp_shard=4, zero=3)
    ]
    rows, lightest = advise._search_family(search, family, facts, 16, 0)
    assert lightest is None
    assert {r["status"] for r in rows} == {"failed"} and not any(
        r.get("fits") is False for r in rows
    )
    assert all("boom" in r["reason"] for r in rows)


class _Ruled(advise.Search):
    """A search whose every measurement is a rule of the candidate's (whether it
    fits), its step shorter with a larger micro-batch: the search's logic alone, no
    model built."""

    def __init__(self, rule: Callable[[advise.Candidate], bool]) -> None:
        super().__init__(
            {"llama": LLAMA},
            gpus.PROFILES["h100"],
            PROFILES["h100-nvlink-ndr400"],
            "bf16",
            "adamw",
            log=lambda _: None,
        )
        self.rule, self.measured_rows = rule, []

    def row(self, c, facts, global_batch, tokens):
        self.measured_rows.append(c)
        fits = self.rule(c)
        return {
            **self.base(c, global_batch, tokens),
            "status": "ok",
            "fits": fits,
            "step_s": 1 / c.micro,
        }


def _ruled_search(rule: Callable[[advise.Candidate], bool]) -> tuple[list[dict], _Ruled]:
    """The search at 4 GPUs, a node of 4, a global batch of 16, of the small Llama's 4
    blocks (pipelines of 2 and 4 stages), each measurement `rule`."""
    from parabench import models

    search = _Ruled(rule)
    rows = advise.search(search, "llama", models.facts(LLAMA), 4, 4, 16, 0, 4)
    return rows, search


def _candidate_of(r: dict) -> advise.Candidate:
    """A row's candidate."""
    lay = Layout(
        r["pp"],
        r["dp_replicate"],
        r["dp_shard"],
        r["tp"],
        zero=r["zero"],
        ac=r["ac"],
        schedule=r["schedule"],
    )
    return advise.Candidate("llama", 4, lay, r["micro_batch"], r["accumulation"])


def test_a_layout_is_decided_by_the_fit_of_its_own_schedule_only():
    """GPipe runs only where 1F1B cannot (fewer micro-batches than stages: its
    smallest micro-batch is the largest), so its lightest option holds far more than
    1F1B's at micro-batch 1: a GPipe that does not fit decides nothing of a 1F1B."""
    rows, search = _ruled_search(lambda c: c.layout.schedule != "gpipe")
    piped = [r for r in rows if r["pp"] > 1 and r["status"] in ("ok", "inferred")]
    assert {r["schedule"] for r in piped} == {"1f1b", "interleaved", "gpipe"}
    for r in piped:
        if r.get("fits") is not None:
            assert bool(r["fits"]) == search.rule(_candidate_of(r)), r
    # every 1F1B layout's lightest option measured itself
    lightest = {
        (c.layout.replace(ac="none"), c.micro, c.layout.ac)
        for c in search.measured_rows
        if c.layout.schedule == "1f1b"
    }
    families = {
        Layout(r["pp"], r["dp_replicate"], r["dp_shard"], r["tp"], zero=r["zero"], schedule="1f1b")
        for r in piped
        if r["schedule"] == "1f1b"
    }
    assert families and all((f, 1, "full") in lightest for f in families)


def test_a_worker_that_dies_costs_its_search_a_second_try_here_not_its_rows(tmp_path):
    """A worker killed (for memory, say) breaks its pool for good: the search of that N
    runs again in this process, and the next ones there too, rather than each becoming
    a failed row."""
    from concurrent.futures.process import BrokenProcessPool

    class Broken:
        _broken = False

        def submit(self, *args, **kwargs):
            self._broken = True
            raise BrokenProcessPool("a child process terminated abruptly")

    search = _Ruled(lambda c: True)
    config = {
        "advise": {"gpus": [4, 8], "gpus_per_node": 4, "global_batch": 16},
        "models": {"llama": {"batch_size": 16}},
    }
    said: list[str] = []
    rows = advise._advise_model(search, config, "llama", Broken(), tmp_path, [], said.append)
    assert sum("searched again here" in line for line in said) == 1, said
    assert {r["gpus"] for r in rows} == {4, 8} and not any(r["status"] == "failed" for r in rows)
    assert any(r.get("rank") == 1 for r in rows)


def test_interleaved_1f1b_at_as_many_micro_batches_as_stages_is_measured_on_its_own():
    """At as many micro-batches as stages, Interleaved 1F1B's rank reduces one stage's
    gradients before its other stage's first backward, and holds fewer micro-batches in
    flight (`_held_points`): its largest micro-batch can fit where smaller ones do not.
    It is measured, and decided by no smaller one's fit, nor decides them."""

    def rule(c: advise.Candidate) -> bool:
        lay = c.layout
        return lay.schedule != "interleaved" or c.accumulation == lay.pp

    rows, _ = _ruled_search(rule)
    island = [
        r
        for r in rows
        if r["schedule"] == "interleaved"
        and r["status"] != "skipped"
        and r["accumulation"] == r["pp"]
    ]
    assert island and all(bool(r.get("fits")) for r in island), island
    assert any(r["status"] == "ok" for r in island)
    for r in rows:
        if r["status"] in ("ok", "inferred") and r["pp"] > 1 and r.get("fits") is not None:
            assert bool(r["fits"]) == rule(_candidate_of(r)), r
    assert not any(
        r["schedule"] == "interleaved" and r.get("fits") and r["accumulation"] > r["pp"]
        for r in rows
    )
    # and the other way: the island alone does not fit, the smaller micro-batches do

    def other(c: advise.Candidate) -> bool:
        return c.layout.schedule != "interleaved" or c.accumulation > c.layout.pp

    rows, _ = _ruled_search(other)
    for r in rows:
        if r["status"] in ("ok", "inferred") and r["pp"] > 1 and r.get("fits") is not None:
            assert bool(r["fits"]) == other(_candidate_of(r)), r
    assert any(
        r["schedule"] == "interleaved" and r["accumulation"] == r["pp"] and r.get("fits") is False
        for r in rows
    )


# advise's pricing on a rank's work given by hand, in round figures: the arithmetic of
# `predict` and what it calls, without a model built (the tests above build models).
# The device: 1e12 FLOP/s, memory never the bound, no floor, a 2e12 peak.
UNIT_GPU = gpus.GPU("unit", 2e12, 1e12, 80 * 2**30, 1e30, "by hand", op_floor_s=0.0)
# 1 GB/s within a node of 4 GPUs, 1 GB/s of a node's NICs across nodes: a call's seconds
# are its bytes times nccl-tests' bus factor over the busbw, no latency.
UNIT_FABRIC = Fabric(
    "unit",
    "by hand",
    {"intra": BusbwTable((1.0,), (4e9,), 0.0), "inter": BusbwTable((1.0,), (1e9,), 0.0)},
    gpus_per_node=4,
)


def _work(step: float, optimizer: float, recompute: float = 0.0, comm=None) -> fakerank.Work:
    """A rank's work of these seconds on UNIT_GPU (one matmul each) and collectives."""
    ops = {(fakerank.STEP, fakerank.MATMUL, step * 1e12, 0.0): 1}
    ops[(fakerank.OPTIMIZER, fakerank.MATMUL, optimizer * 1e12, 0.0)] = 1
    if recompute:
        ops[(fakerank.RECOMPUTE, fakerank.MATMUL, recompute * 1e12, 0.0)] = 1
    return fakerank.Work(collections.Counter(ops), comm or {})


def _measured(work: fakerank.Work, boundary_bytes: int = 0) -> fakerank.Measured:
    return fakerank.Measured(0, {}, work, boundary_bytes, blocks=4)


def _candidate(micro: int = 1, accumulation: int = 1, **kw) -> advise.Candidate:
    layout = Layout(**kw)
    return advise.Candidate("unit", layout.world, layout, micro, accumulation)


def test_a_step_is_priced_from_its_ranks_work_and_the_fabric():
    """FSDP on 2 GPUs of a node, 3 micro-batches of 4 samples with checkpointing: each
    micro-batch computes 2 s and recomputes 0.5 s and reduce-scatters 1 GB (0.5 GB on
    the bus at n=2: 0.125 s at 4 GB/s); the optimizer step 1 s."""
    c = _candidate(dp_shard=2, micro=4, accumulation=3, zero=3)
    comm = {"dp_shard": {"reduce_scatter": {"count": 1, "bytes": 1e9}}}
    m = _measured(_work(2.0, 1.0, recompute=0.5, comm=comm))
    got = advise.predict(c, m, UNIT_GPU, UNIT_FABRIC, tokens_per_sample=10)
    assert got["compute_s"] == pytest.approx(3 * (2 + 0.5) + 1)
    assert got["recompute_s"] == pytest.approx(3 * 0.5)
    assert got["comm_s"] == pytest.approx(3 * 0.125)  # every micro-batch's, no pipeline
    assert json.loads(got["comm_by_dim"]) == {
        "dp_shard": {"reduce_scatter": {"count": 3, "bytes": 3e9}}
    }
    assert got["bubble_s"] == 0
    step = 8.5 + 0.375
    assert got["step_s"] == pytest.approx(step)
    samples = 4 * 3 * 2  # micro x accumulation x dp
    assert got["samples_per_s_per_gpu"] == pytest.approx(samples / step / 2)
    assert got["tokens_per_s_per_gpu"] == pytest.approx(10 * samples / step / 2)
    # the FLOPs a GPU runs count the recompute; the model FLOPs utilisation does not
    assert got["flops_per_gpu"] == pytest.approx((3 * (2 + 0.5) + 1) * 1e12)
    assert got["mfu"] == pytest.approx((3 * 2 + 1) * 1e12 / step / 2e12)
    # a model without tokens has no token rate
    assert math.isnan(advise.predict(c, m, UNIT_GPU, UNIT_FABRIC, 0)["tokens_per_s_per_gpu"])


def test_a_layouts_tp_is_priced_on_the_curve_of_its_own_groups():
    """predict hands each dimension's collectives to the fabric with where its group
    sits in the layout (layout_comm: span and world), so a tp pair inside a world of 4
    is priced on the curve the benchmark measured for pairs placed so (here 4 ms a
    call), not the 2-rank world's (1 ms); tp on its own is that world."""
    from test_fabric import curve_rows

    from parabench.hardware import fabric

    curves = fabric.from_curves(
        pd.DataFrame(
            curve_rows(1e-3, 2, 2, 1) + curve_rows(4e-3, 2, 4, 1) + curve_rows(2e-3, 2, 4, 2)
        )
    )
    comm = {"tp": {"all_reduce": {"count": 3, "bytes": 65536}}}
    m = _measured(_work(2.0, 1.0, comm=comm))
    inside = advise.predict(_candidate(dp_shard=2, tp=2), m, UNIT_GPU, curves, 0)
    assert inside["comm_s"] == pytest.approx(3 * 4e-3)
    alone = advise.predict(_candidate(tp=2), m, UNIT_GPU, curves, 0)
    assert alone["comm_s"] == pytest.approx(3 * 1e-3)


def test_data_parallel_communication_runs_under_compute_as_torch_schedules_it():
    """FSDP ZeRO-3 over 2 GPUs of a node, 4 units: forward 4 s, backward 8 s; each
    gather and each reduce-scatter 4 GB (2 GB on the bus at n=2: 0.5 s at 4 GB/s), 8
    gathers and 4 reductions. On the timeline (predict/overlap.py) the first gather and
    the last reduction wait (1 s); the timeline's 7 gathers stand for the 8 measured, the
    8th exposed: 6 s of communication, 4.5 s of it under compute. DDP's one all-reduce
    of 76 MiB of gradients (the fake rank's) is torch DDP's 4 buckets (1 MiB, then 25
    MiB each), taken as alike, 19 MiB each: all hidden under the backward but the
    last. In a pipeline, none hides."""
    fwd_bwd = {
        (fakerank.FORWARD, fakerank.MATMUL, 4e12, 0.0): 1,
        (fakerank.BACKWARD, fakerank.MATMUL, 8e12, 0.0): 1,
        (fakerank.OPTIMIZER, fakerank.MATMUL, 1e12, 0.0): 1,
    }
    fsdp = {
        "dp_shard": {
            "all_gather": {"count": 8, "bytes": 8 * 4e9},
            "reduce_scatter": {"count": 4, "bytes": 4 * 4e9},
        }
    }
    m = _measured(fakerank.Work(collections.Counter(fwd_bwd), fsdp))
    got = advise.predict(_candidate(dp_shard=2, zero=3), m, UNIT_GPU, UNIT_FABRIC, 0)
    assert got["comm_hidden_s"] == pytest.approx(4.5)
    assert got["comm_s"] == pytest.approx(6 - 4.5)
    assert got["step_s"] == pytest.approx(12 + 1 + 1.5)
    grads = advise.DDP_FIRST_BUCKET_BYTES + 3 * advise.DDP_BUCKET_BYTES
    ddp = {"dp_replicate": {"all_reduce": {"count": 1, "bytes": grads}}}
    m = _measured(fakerank.Work(collections.Counter(fwd_bwd), ddp))
    got = advise.predict(_candidate(dp_replicate=2), m, UNIT_GPU, UNIT_FABRIC, 0)
    assert got["comm_hidden_s"] == pytest.approx(3 / 4 * grads / 4e9)
    assert got["comm_s"] == pytest.approx(1 / 4 * grads / 4e9)
    piped = _candidate(pp=2, dp_replicate=2, accumulation=2, schedule="1f1b")
    assert advise.predict(piped, m, UNIT_GPU, UNIT_FABRIC, 0)["comm_hidden_s"] == 0


@pytest.mark.parametrize("n", [8, 16, 64, 1024])
@pytest.mark.parametrize("grads", [5e8, 4e9, 1.6e10])
def test_what_hides_is_never_more_than_what_is_charged(n, grads):
    """On a real fabric (latency, bandwidth by size), DDP's buckets and FSDP's units are
    charged as the timeline prices them: the exposed communication is never negative,
    and the step never shorter than its compute."""
    fabric = PROFILES["h100-nvlink-ndr400"]
    fwd_bwd = {
        (fakerank.FORWARD, fakerank.MATMUL, 1e11, 0.0): 1,
        (fakerank.BACKWARD, fakerank.MATMUL, 2e11, 0.0): 1,
    }
    cases = {
        _candidate(dp_replicate=n): {"dp_replicate": {"all_reduce": {"count": 1, "bytes": grads}}},
        _candidate(dp_shard=n, zero=3): {
            "dp_shard": {
                "all_gather": {"count": 66, "bytes": grads},
                "reduce_scatter": {"count": 33, "bytes": 2 * grads},
            }
        },
    }
    for c, comm in cases.items():
        m = _measured(fakerank.Work(collections.Counter(fwd_bwd), comm))
        got = advise.predict(c, m, UNIT_GPU, fabric, 0)
        assert got["comm_s"] >= 0 and got["comm_hidden_s"] >= 0, c.layout.label
        assert got["step_s"] >= got["compute_s"], c.layout.label


def test_a_cpu_hides_ddps_buckets_only_and_only_with_a_core_each():
    """On a CPU profile: torch DDP's reducer all-reduces its buckets asynchronously,
    beside the backward, where each rank has a core of its own; FSDP2 issues every
    gather and reduction synchronously there (its streams do nothing on a CPU): FSDP's
    and HSDP's hide nothing, whatever the cores. The same measured ranks on a GPU hide
    them all. DDP over TP is FSDP2's `replicate` of the whole model (parallelize.py),
    one all-reduce once the backward is done: it hides nowhere."""
    fwd_bwd = {
        (fakerank.FORWARD, fakerank.MATMUL, 4e12, 0.0): 1,
        (fakerank.BACKWARD, fakerank.MATMUL, 8e12, 0.0): 1,
    }
    grads = advise.DDP_FIRST_BUCKET_BYTES + 3 * advise.DDP_BUCKET_BYTES
    ddp = {"dp_replicate": {"all_reduce": {"count": 1, "bytes": grads}}}
    fsdp = {
        "dp_shard": {
            "all_gather": {"count": 8, "bytes": 8 * 4e9},
            "reduce_scatter": {"count": 4, "bytes": 4 * 4e9},
        }
    }
    hsdp = {**fsdp, "dp_replicate": {"all_reduce": {"count": 4, "bytes": 4 * 2e9}}}
    cases = [  # (layout, its communication, hides on a GPU, on a CPU with a core each)
        (_candidate(dp_replicate=2), ddp, True, True),
        (_candidate(dp_replicate=2, tp=2), ddp, False, False),
        (_candidate(dp_shard=2, zero=3), fsdp, True, False),
        (_candidate(dp_shard=2, zero=2), fsdp, True, False),
        (_candidate(dp_replicate=2, dp_shard=2, zero=3), hsdp, True, False),
    ]
    for c, comm, on_a_gpu, on_a_cpu in cases:
        m = _measured(fakerank.Work(collections.Counter(fwd_bwd), comm))
        on_gpu = advise.predict(c, m, UNIT_GPU, UNIT_FABRIC, 0)
        # hidden: more than the timeline's rounding (seconds here)
        assert (on_gpu["comm_hidden_s"] > 1e-9) is on_a_gpu, c.layout.label
        for cores in (c.gpus, 2 * c.gpus, c.gpus // 2):
            cpu = dataclasses.replace(UNIT_GPU, cores=cores)
            got = advise.predict(c, m, cpu, UNIT_FABRIC, 0)
            hides = on_a_cpu and cores >= c.gpus
            assert (got["comm_hidden_s"] > 1e-9) is hides, (c.layout.label, cores)
            # what does not hide is charged: the same communication either way
            total = got["comm_s"] + got["comm_hidden_s"]
            assert total == pytest.approx(on_gpu["comm_s"] + on_gpu["comm_hidden_s"])


def test_ranks_sharing_cores_compute_in_turn():
    """A CPU profile's ranks share its cores: 2 ranks on 1 core take twice the compute
    (the optimizer and the recompute too); on 4 cores, each its own."""
    c = _candidate(dp_shard=2, accumulation=2)
    m = _measured(_work(2.0, 1.0, recompute=0.5))
    for cores, slicing in [(1, 2.0), (2, 1.0), (4, 1.0)]:
        cpu = dataclasses.replace(UNIT_GPU, cores=cores)
        got = advise.predict(c, m, cpu, UNIT_FABRIC, 0)
        assert got["compute_s"] == pytest.approx(slicing * (2 * (2 + 0.5) + 1)), cores
        assert got["recompute_s"] == pytest.approx(slicing * 2 * 0.5), cores


def test_a_rank_timed_on_this_host_takes_the_rooflines_place():
    """Timed (fakerank.timed): forward 2 s, backward 3 s, optimizer 1 s. The backward
    is split as the eager roofline splits it (backward 2 s, recompute 0.5 s: a fifth is
    recompute, whether the run is priced compiled or with Float8); the turns 2 ranks
    take on 1 core are in the timed seconds (priced, they double them). Compiled or
    with Float8, each phase is scaled by what the roofline says they save: compile the
    memory-bound ops (forward 8 s to 7, backward 2 to 1, recompute 0.5 to 0.4), Float8
    the linears (backward 2 s to 1.5, recompute 0.5 to 0.3, at twice the rate)."""
    work = fakerank.Work(
        collections.Counter(
            {
                (fakerank.FORWARD, fakerank.MATMUL, 7e12, 0.0): 1,
                (fakerank.FORWARD, fakerank.MEMORY, 0.0, 1e12): 1,
                (fakerank.BACKWARD, fakerank.LINEAR, 1e12, 0.0): 1,
                (fakerank.BACKWARD, fakerank.MEMORY, 0.0, 1e12): 1,
                (fakerank.RECOMPUTE, fakerank.LINEAR, 0.4e12, 0.0): 1,
                (fakerank.RECOMPUTE, fakerank.MEMORY, 0.0, 0.1e12): 1,
                (fakerank.OPTIMIZER, fakerank.MATMUL, 9e12, 0.0): 1,
            }
        )
    )
    timed = {fakerank.FORWARD: 2.0, fakerank.BACKWARD: 3.0, fakerank.OPTIMIZER: 1.0}
    cpu = dataclasses.replace(UNIT_GPU, bandwidth=1e12, cores=1, fp8_flops=2e12)
    c = _candidate(dp_shard=2, accumulation=2)
    m = _measured(work)

    def compute(forward: float, backward: float, recompute: float) -> float:
        """2 micro-batches and the optimizer's 1 s: the turns the rank took on its core
        are in its timed seconds already."""
        return 2 * (forward + backward + recompute) + 1

    got = advise.predict(c, m, cpu, UNIT_FABRIC, 0, timed=timed)
    assert got["compute_s"] == pytest.approx(compute(2, 2.4, 0.6))
    assert got["recompute_s"] == pytest.approx(2 * 0.6)
    assert got["roofline_compute_s"] == pytest.approx(2 * (2 * 10.5 + 9))  # 2 ranks a core
    compiled = advise.predict(c, m, cpu, UNIT_FABRIC, 0, compiled=True, timed=timed)
    assert compiled["compute_s"] == pytest.approx(compute(2 * 7 / 8, 2.4 / 2, 0.6 * 0.8))
    assert compiled["recompute_s"] == pytest.approx(2 * 0.6 * 0.8)
    float8 = advise.predict(c, m, cpu, UNIT_FABRIC, 0, float8=True, timed=timed)
    assert float8["compute_s"] == pytest.approx(compute(2, 2.4 * 0.75, 0.6 * 0.6))
    assert float8["recompute_s"] == pytest.approx(2 * 0.6 * 0.6)
    # priced, the same step is the roofline's: 8 + 2 + 0.5 s a micro-batch, 9 s optimizer
    assert advise.predict(c, m, cpu, UNIT_FABRIC, 0)["compute_s"] == pytest.approx(
        2 * (2 * 10.5 + 9)
    )
    # a step the roofline has no backward for: the timed backward is all backward
    bare = _measured(fakerank.Work(collections.Counter(), {}))
    for compiled in (False, True):  # nor anything compile would save
        got = advise.predict(c, bare, cpu, UNIT_FABRIC, 0, compiled=compiled, timed=timed)
        assert got["recompute_s"] == 0 and got["compute_s"] == pytest.approx(compute(2, 3, 0))


# Where this process's forks cannot run a backward (torch before 2.13, after a fake
# step), `timed` runs in a fresh process: neither its copies' CPU time nor a patch of
# this process reaches them there (test_a_rank_is_timed_in_a_fresh_process_...).
DIRECT = pytest.mark.skipif(
    "not __import__('parabench.predict.fakerank').predict.fakerank._forks_run_autograd()",
    reason="this torch runs no backward in a fork of this process (fakerank.timed)",
)


@DIRECT
def test_a_rank_is_timed_taking_turns_with_the_ranks_beside_it():
    """fakerank.timed runs a rank as a cell's ranks run on this host: with two ranks to
    one core, the rank forked beside the timed one steps all the while it is timed, on
    the same core, the two taking turns (each about half the core's time); the copy is
    gone when `timed` returns, and this process's cores and threads are as they were.

    Asserted on CPU time, which a neighbour's load (another test worker) takes from both
    ranks alike, not on the step's wall time, which it slows as it likes: how much the
    turns cost a step is a benchmark's figure (docs/design/advise.md), not a test's."""
    import multiprocessing
    import os
    import resource
    import time

    def cpu_beside() -> float:
        used = resource.getrusage(resource.RUSAGE_CHILDREN)  # those reaped, here all
        return used.ru_utime + used.ru_stime

    spec = ModelSpec.of(**GPT)
    probe = fakerank.Probe(Layout(dp_replicate=2), micro=64, precision="fp32", optimizer="sgd")
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    one = {min(cores)}
    os.sched_setaffinity(0, one)
    try:
        fakerank.timed(spec, probe, ranks=1)  # this process's first steps, not counted
        before = time.perf_counter(), time.process_time(), cpu_beside()
        phases = fakerank.timed(spec, probe, ranks=2)
        wall = time.perf_counter() - before[0]
        mine, beside = time.process_time() - before[1], cpu_beside() - before[2]
        assert os.sched_getaffinity(0) == one
    finally:
        fakerank._bind(sorted(cores))  # every thread's: `timed` bound them all to the one
    assert all(v > 0 for v in phases.values())
    # The copy, forked after the timed rank's first step, steps until the timed steps
    # end: most of the timed rank's CPU time. The two share the one core: together no
    # more of it than the call's wall time.
    assert 0.5 * mine < beside, (beside, mine)
    assert mine + beside < 1.1 * wall, (mine, beside, wall)
    assert not multiprocessing.active_children()
    assert torch.get_num_threads() == threads


@DIRECT
def test_a_rank_beside_the_timed_one_that_dies_fails_the_timing(monkeypatch):
    """A copy stepping beside the timed rank that dies (here at its second step) makes
    `timed` fail, at once and saying so, rather than time the rank beside fewer ranks
    than its row says; nothing is left running."""
    import multiprocessing
    import os

    parent, step = os.getpid(), fakerank.step
    count = [0]

    def dying(r, *args, **kwargs):
        if os.getpid() != parent:  # in the forked copy only
            count[0] += 1
            if count[0] == 2:
                os._exit(3)
        return step(r, *args, **kwargs)

    monkeypatch.setattr(fakerank, "step", dying)
    spec = ModelSpec.of(**GPT)
    probe = fakerank.Probe(Layout(dp_replicate=2), micro=64, precision="fp32", optimizer="sgd")
    cores, t0 = os.sched_getaffinity(0), time.monotonic()
    with pytest.raises(RuntimeError, match=r"beside it (died|ended).*\b3\b"):
        fakerank.timed(spec, probe, ranks=2)
    assert time.monotonic() - t0 < 30  # not the minute a copy may take to start
    assert not multiprocessing.active_children()
    assert os.sched_getaffinity(0) == cores


def test_a_rank_is_timed_in_a_fresh_process_where_forks_cannot_run_autograd(monkeypatch):
    """Before torch 2.13 a fork of a process that ran a fake rank's backward refuses to
    run one: `timed` then runs in a process forked from a new Python (multiprocessing's
    forkserver), bound to this process's cores, which forks its copies in turn, and
    returns its phases, or says why it failed; neither that process nor a copy is left
    running."""
    import multiprocessing

    monkeypatch.setattr(fakerank, "_forks_run_autograd", lambda: False)
    spec = ModelSpec.of(**GPT)
    probe = fakerank.Probe(Layout(dp_replicate=2), micro=8, precision="fp32", optimizer="sgd")
    phases = fakerank.timed(spec, probe, ranks=2)
    assert set(phases) == {fakerank.FORWARD, fakerank.BACKWARD, fakerank.OPTIMIZER}
    assert all(0 < s < 10 for s in phases.values())
    # a rank whose step fails (TP 3 over 6 heads): its error, named, from that process
    with pytest.raises(RuntimeError, match=r"fresh process: RuntimeError: shape .* is invalid"):
        fakerank.timed(spec, probe.replace(layout=Layout(tp=3)), ranks=2)
    assert not multiprocessing.active_children()


def test_this_machine_times_each_rank_that_fits_and_says_so():
    """On this host's CPU as the device, a small model's rank that fits is run here on
    real tensors (finite values: the model's own initial ones, its collectives filled
    from its own data, a step moving them) and timed, and the row says so; one that
    does not fit, a model too large to time here, or any GPU profile's, is priced."""
    spec = ModelSpec.of(**GPT)
    host = gpus.GPU(gpus.THIS_MACHINE, 1e11, 1e11, 2**34, 1e10, "by hand", cores=2)
    c = advise.Candidate("gpt", 4, Layout(dp_shard=2, tp=2), 2, 1)
    probe = advise._probe(c, "fp32", "sgd")
    with fakerank.rank(spec, probe, fake=False, local=True) as r:
        before = [fakerank._local(p).clone() for p in r.module.parameters()]
        fakerank.step(r)
        shards = [fakerank._local(p) for p in r.module.parameters()]
        assert all(torch.isfinite(t).all() for t in shards)
        assert all(t.std() > 0 for t in shards if t.dim() > 1)  # the model's own values
        assert (
            sum(not torch.equal(a, b) for a, b in zip(shards, before, strict=True))
            > len(shards) / 2
        )
    search = advise.Search({"gpt": spec}, host, UNIT_FABRIC, "fp32", "sgd", log=lambda _: None)
    row = search.row(c, None, 4, 16)
    assert row["status"] == "ok" and row["fits"], row
    assert row["compute_source"].startswith("timed here"), row["compute_source"]
    ((key, phases),) = search.times.items()
    assert key[-1] == 4  # timed beside its 3 other ranks, 2 a core, taking turns
    assert all(v > 0 for v in phases.values())
    assert row["compute_s"] == pytest.approx(sum(phases.values()))
    assert 0 < row["roofline_compute_s"] != row["compute_s"]
    assert "its 4 ranks together in this host's memory" in row["memory_source"]
    # the host holds the layout's 4 ranks, not one: room for 2 of them does not fit it,
    # and nothing is timed
    tight = dataclasses.replace(host, memory_bytes=2 * row["memory_bytes"])
    search = advise.Search({"gpt": spec}, tight, UNIT_FABRIC, "fp32", "sgd", log=lambda _: None)
    row = search.row(c, None, 4, 16)
    assert row["fits"] is False and row["binding"] == "memory" and not search.times, row
    # each rank is a process of its own: with a quarter of the host each, 4 do not fit
    heavy = dataclasses.replace(host, process_bytes=host.memory_bytes / 4)
    search = advise.Search({"gpt": spec}, heavy, UNIT_FABRIC, "fp32", "sgd", log=lambda _: None)
    row = search.row(c, None, 4, 16)
    assert row["fits"] is False and not search.times, row
    small = dataclasses.replace(host, memory_bytes=2**10)
    priced = advise.Search({"gpt": spec}, small, UNIT_FABRIC, "fp32", "sgd", log=lambda _: None)
    row = priced.row(c, None, 4, 16)
    assert not row["fits"] and row["compute_source"].startswith("priced") and not priced.times
    assert row["roofline_compute_s"] == row["compute_s"]
    gpu = advise.Search({"gpt": spec}, UNIT_GPU, UNIT_FABRIC, "fp32", "sgd", log=lambda _: None)
    assert gpu.row(c, None, 4, 16)["compute_source"].startswith("priced") and not gpu.times
    # a model whose whole step this host would take seconds over: none of its ranks timed
    slow = dataclasses.replace(host, peak_flops=1e6, achievable_flops=1e6)
    large = advise.Search({"gpt": spec}, slow, UNIT_FABRIC, "fp32", "sgd", log=lambda _: None)
    row = large.row(c, None, 4, 16)
    assert row["fits"] and row["compute_source"].startswith("priced") and not large.times


def test_a_pipelines_step_adds_its_fill_and_drain():
    """PP 2 x FSDP 2 x TP 2 on two nodes of 4, 4 micro-batches of 0.1 s: tp's all-reduce
    (0.1 GB: 0.025 s within the node) recurs with every micro-batch, FSDP's
    reduce-scatter (0.4 GB, 0.2 GB on the bus: 0.05 s) runs once per step. Stage 0's
    first rank sends to stage 1's, dp x tp = 4 ranks on, on the next node: 0.1 GB over
    one of the node's 4 NICs (0.25 GB/s), 0.4 s each way of the fill and the drain; the
    bubble, (pp - 1) micro-batches' slots: each its compute and tp's all-reduce, in the
    compute's stream."""
    c = _candidate(pp=2, dp_shard=2, tp=2, accumulation=4, zero=3, schedule="1f1b")
    comm = {
        "tp": {"all_reduce": {"count": 1, "bytes": 1e8}},
        "dp_shard": {"reduce_scatter": {"count": 1, "bytes": 4e8}},
    }
    m = _measured(_work(0.1, 0.05, comm=comm), boundary_bytes=10**8)
    got = advise.predict(c, m, UNIT_GPU, UNIT_FABRIC, 0)
    assert got["compute_s"] == pytest.approx(4 * 0.1 + 0.05)
    assert json.loads(got["comm_by_dim"]) == {
        "tp": {"all_reduce": {"count": 4, "bytes": 4e8}},
        "dp_shard": {"reduce_scatter": {"count": 1, "bytes": 4e8}},
    }
    assert got["comm_s"] == pytest.approx(4 * 0.025 + 0.05 + 2 * 0.4)
    assert got["bubble_s"] == pytest.approx(0.1 + 0.025)
    assert got["step_s"] == pytest.approx(0.45 + 0.95 + 0.125)
    assert got["samples_per_s_per_gpu"] == pytest.approx(1 * 4 * 2 / 1.525 / 8)


def test_a_pipelines_gpu_runs_its_share_of_the_blocks_and_of_the_embedding_and_head():
    """A stage is measured with the model's embedding and head (the heaviest stage's
    bound, for its step); a GPU of 2 stages over the model's 4 blocks runs its 2 blocks
    (6 of the stage's 10 TFLOP a micro-batch, 2 of recompute) and half of the rest."""
    work = _work(10.0, 0.0, recompute=2.0)
    work.block_flops = 6e12
    m = dataclasses.replace(_measured(work), blocks=2)
    c = _candidate(pp=2, accumulation=4, schedule="1f1b")
    got = advise.predict(c, m, UNIT_GPU, UNIT_FABRIC, 0, blocks=4)
    assert got["flops_per_gpu"] == pytest.approx(4 * (6e12 + 4e12 / 2 + 2e12))
    assert got["mfu"] == pytest.approx(4 * 8e12 / got["step_s"] / UNIT_GPU.peak_flops)
    # the step itself is the measured stage's, the heaviest
    assert got["compute_s"] == pytest.approx(4 * (10 + 2))
    # were the model 8 blocks deep, a GPU's 4 would be twice the measured stage's 2
    deeper = advise.predict(c, m, UNIT_GPU, UNIT_FABRIC, 0, blocks=8)
    assert deeper["flops_per_gpu"] == pytest.approx(4 * (2 * 6e12 + 4e12 / 2 + 2 * 2e12))


def test_a_pipelines_transfers_are_priced_on_the_link_between_its_stages():
    """PP 2 x TP 2 on a node of 4: the stages' ranks are 2 apart, within the node
    (0.1 GB at 4 GB/s: 0.025 s each way); PP 3 on a flat 1 GB/s fabric: two boundaries,
    each filled and drained (4 x 0.1 s); a boundary whose stages sit on two nodes, over
    the network."""
    m = _measured(_work(0.1, 0.05), boundary_bytes=10**8)
    c = _candidate(pp=2, tp=2, accumulation=4, schedule="1f1b")
    assert advise.predict(c, m, UNIT_GPU, UNIT_FABRIC, 0)["comm_s"] == pytest.approx(2 * 0.025)
    flat = Fabric("flat", "by hand", {"any": BusbwTable((1.0,), (1e9,), 0.0)})
    c = _candidate(pp=3, accumulation=4, schedule="1f1b")
    assert advise.predict(c, m, UNIT_GPU, flat, 0)["comm_s"] == pytest.approx(4 * 0.1)
    # PP 4 x TP 2 on two nodes of 4: stages 1 and 2 meet across the nodes, one rank of
    # each pair on each (one NIC: 0.25 GB/s, 0.4 s), the others within one (0.025 s)
    c = _candidate(pp=4, tp=2, accumulation=4, schedule="1f1b")
    got = advise.predict(c, m, UNIT_GPU, UNIT_FABRIC, 0)["comm_s"]
    assert got == pytest.approx(2 * (0.025 + 0.4 + 0.025))
    # Interleaved 1F1B: twice through the stages, and back from the last to the first
    # between, across the nodes
    c = _candidate(pp=4, tp=2, accumulation=8, schedule="interleaved")
    got = advise.predict(c, m, UNIT_GPU, UNIT_FABRIC, 0)["comm_s"]
    assert got == pytest.approx(2 * (2 * (0.025 + 0.4 + 0.025) + 0.4))


def test_a_peak_of_exactly_the_usable_memory_fits():
    card = 80 * 2**30
    assert gpus.fits(gpus.usable(card), card) is True
    assert gpus.fits(gpus.usable(card) + 1, card) is False
    assert gpus.fits(1, None) is None
    # where what the GPU holds is known (reserved, context, NCCL), the whole card
    assert gpus.fits(card, card, held_bytes=card) is True
    assert gpus.fits(1, card, held_bytes=card + 1) is False


def test_a_gpu_holds_its_context_and_a_nccl_set_per_group():
    """781 MiB of CUDA context, then per mesh dimension over more than one rank: 544
    MiB for a pair, 688 for more (NVIDIA/nccl#964); FSDP 32 x TP 8 has two groups."""
    mib = 2**20
    assert gpus.overhead([]) == 781 * mib
    assert gpus.overhead([2, 1]) == (781 + 544) * mib
    assert gpus.overhead([32, 8]) == (781 + 2 * 688) * mib


def test_a_pipelines_fsdp_stage_holds_its_gradients_whole_over_its_micro_batches():
    """torch's PipelineStage turns FSDP's gradient sync off for every backward and
    reduces at the schedule's REDUCE_GRAD, and FSDP2 accumulates each gradient
    unsharded in fp32 meanwhile: a stage of 1,000 x 10 and 10 x 10 parameters holds
    4 x 1,010 x 10 bytes, less what the measured step's peak held, with one
    micro-batch too (torch 2.13's stage.backward_maybe_with_nosync); nothing without a
    pipeline or without FSDP."""
    shards = {fakerank.Shard(1000, 10, 4, 8): 1, fakerank.Shard(10, 10, 4, 8): 1}
    m = dataclasses.replace(_measured(_work(1, 1)), shards=shards, by_category={"grad": 400})
    pp = {"pp": 2, "dp_shard": 2, "zero": 2, "schedule": "1f1b"}
    assert advise.held(_candidate(accumulation=4, **pp), m).grads == 4 * 10100 - 400
    gpipe = {**pp, "schedule": "gpipe"}
    assert advise.held(_candidate(accumulation=1, **gpipe), m).grads == 4 * 10100 - 400
    assert advise.held(_candidate(accumulation=4, dp_shard=2), m).grads == 0
    ddp = {"pp": 2, "dp_replicate": 2, "schedule": "1f1b"}
    assert advise.held(_candidate(accumulation=4, **ddp), m).grads == 0


def test_a_pipelines_first_stage_holds_the_schedules_micro_batches():
    """Other micro-batches' activations the first rank holds at its peak: 1F1B up to
    pp, GPipe all; Interleaved 1F1B as torch's own schedule orders its rank 0 (its two
    stages a rank warm up with 2 x (pp - 1) more chunks: 8 stages and 16 micro-batches
    hold 11.5 of them, against 1F1B's 8)."""
    m = _measured(_work(1, 1))
    m = dataclasses.replace(m, block_saved_bytes=100)

    def extra(**kw) -> float:
        return advise.held(_candidate(**kw), m).micro_batches

    assert extra(accumulation=8) == 0  # no pipeline: one at a time
    assert extra(pp=4, accumulation=8, schedule="1f1b") == 3
    assert extra(pp=4, accumulation=2, schedule="gpipe") == 1
    assert extra(pp=4, accumulation=8, schedule="gpipe") == 7
    assert extra(pp=8, accumulation=8, schedule="interleaved") == 7
    assert extra(pp=8, accumulation=16, schedule="interleaved") == 10.5
    # each of its 23 forwards in flight then holds its stage's input, though two of
    # them make one micro-batch's pass through the rank's blocks
    m = dataclasses.replace(m, input_saved_bytes=10)
    kept = advise.held(_candidate(pp=8, accumulation=16, schedule="interleaved"), m)
    assert kept.inputs == 22 and kept.activations(m) == 10.5 * 100 + 22 * 10
    kept = advise.held(_candidate(pp=4, accumulation=8, schedule="1f1b"), m)
    assert kept.inputs == 3 and kept.activations(m) == 3 * (100 + 10)
    assert [advise.stage_blocks(10, pp) for pp in (1, 2, 3, 4)] == [10, 5, 4, 3]


def test_interleaved_1f1b_holds_one_stages_gradients_at_its_peak_where_torch_reduces_them():
    """torch schedules each stage's gradient reduction just after its last backward
    (`_add_reduce_grad`). At 8 stages and 8 micro-batches, Interleaved 1F1B runs all
    16 forwards of rank 0's two stages, then the later stage's 8 backwards, reduced, then
    the earlier's: it never holds both stages' gradients whole, where 1F1B and GPipe
    hold the stage's with every micro-batch's activations. With 16 micro-batches its
    steady state holds both."""
    order = advise.rank0_order("interleaved", 8, 8)
    assert [k for k, _ in order] == ["F"] * 16 + ["B"] * 16
    assert [s for k, s in order if k == "B"] == [8] * 8 + [0] * 8
    assert max(share for _, share, _ in advise._held_points("interleaved", 8, 8)) == 0.5
    assert max(advise._held_points("1f1b", 8, 8)) == (8.0, 1.0, 8)
    assert max(advise._held_points("gpipe", 4, 8)) == (8.0, 1.0, 8)
    assert max(share for _, share, _ in advise._held_points("interleaved", 8, 16)) == 1.0
    shards = {fakerank.Shard(1000, 10, 4, 8): 1}
    m = dataclasses.replace(_measured(_work(1, 1)), shards=shards, block_saved_bytes=10**6)
    pp = {"pp": 8, "dp_shard": 2, "zero": 2, "accumulation": 8}
    one = advise.held(_candidate(schedule="1f1b", **pp), m)
    two = advise.held(_candidate(schedule="interleaved", **pp), m)
    assert one.micro_batches == two.micro_batches == 7
    assert two.grads == one.grads / 2 == 4 * 10000 / 2


def test_interleaved_1f1b_is_searched_only_where_torch_runs_it_and_its_bubble_is_priced():
    """Skipped, saying why: fewer blocks than pp x 2 stages; fewer micro-batches than
    stages (its rank would idle between its stages, which the bubble does not price);
    micro-batches not a multiple of its rounds (torch refuses: 5 for 2 stages)."""
    assert advise.interleaved_refusal(8, 8, 16) == ""
    assert "block for each of 8 x 2" in advise.interleaved_refusal(8, 8, 12)
    assert "fewer micro-batches than stages" in advise.interleaved_refusal(8, 4, 32)
    assert "multiple of its rounds" in advise.interleaved_refusal(2, 5, 32)
    assert advise.interleaved_refusal(8, 16, None) == ""


@pytest.mark.parametrize(
    "row, expected",
    [
        ({"fits": False, "comm_s": 0.0, "bubble_s": 0.0, "step_s": 2.0}, "memory"),
        ({"fits": None, "comm_s": 0.19, "bubble_s": 0.1, "step_s": 2.0}, "compute"),
        ({"fits": True, "comm_s": 0.2, "bubble_s": 0.1, "step_s": 2.0}, "exposed communication"),
        ({"fits": True, "comm_s": 0.1, "bubble_s": 0.2, "step_s": 2.0}, "bubble"),
        ({"comm_s": 0.6, "bubble_s": 0.6, "step_s": 2.0}, "exposed communication"),
        ({"comm_s": 0.6, "step_s": 2.0}, "exposed communication"),
        ({"bubble_s": 0.6, "step_s": 2.0}, "bubble"),
    ],
)
def test_the_binding_term_is_the_larger_of_a_tenth_of_the_step(row, expected):
    assert advise.binding(row) == expected


def test_the_largest_fit_is_found_by_bisection():
    micros = [1, 2, 4, 8, 16, 32, 64]
    for largest in [None, *micros]:
        probed = []

        def fits(micro: int, largest=largest, probed=probed) -> bool:
            probed.append(micro)
            return largest is not None and micro <= largest

        assert advise._largest_fit(micros, fits) == largest
        assert len(probed) <= 3, (largest, probed)  # log2(8): not one probe per size
    assert advise._largest_fit([], lambda _: True) is None


def test_an_op_costs_its_roofline_bound_and_at_least_the_floor():
    gpu = gpus.GPU("unit", 2e12, 1e12, 1.0, 1e9, "by hand", attention_flops=0.5e12)
    assert gpu.op_time(2e12, 1e8) == pytest.approx(2.0)  # compute-bound
    assert gpu.op_time(1e8, 3e9) == pytest.approx(3.0)  # memory-bound
    assert gpu.op_time(1.0, 1.0) == pytest.approx(3e-6)  # the floor
    assert gpu.op_time(1e12, 0.0, attention=True) == pytest.approx(2.0)  # its own rate
    # a profile without an attention rate prices attention at the matmul rate
    plain = dataclasses.replace(gpu, attention_flops=0.0)
    assert plain.op_time(1e12, 0.0, attention=True) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "kernel", ["_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention"]
)
def test_grouped_query_attention_counts_its_key_value_heads_broadcast(kernel):
    """Llama 3's attention (32 query heads over 8 key-value heads, passed unexpanded with
    enable_gqa) counts as the kernel runs it, every query head over the whole sequence:
    torch 2.10's formulas refused it, which failed every candidate of a GQA model."""
    b, s, d = 2, 128, 64
    q = torch.empty(b, 32, s, d, device="meta")
    kv, whole = torch.empty(b, 8, s, d, device="meta"), torch.empty(b, 32, s, d, device="meta")
    forward = getattr(torch.ops.aten, kernel).default
    backward = getattr(torch.ops.aten, f"{kernel}_backward").default
    count = fakerank._op(forward)[2]
    assert count(q, kv, kv) == count(q, whole, whole) == 2 * (2 * b * 32 * s * s * d)
    count = fakerank._op(backward)[2]  # the scores again, then four products
    grad = torch.empty_like(q)
    assert count(grad, q, kv, kv) == count(grad, q, whole, whole) == 5 * (2 * b * 32 * s * s * d)


# --- a rank derived at another data-parallel degree ------------------------------------

# The small Llama at a sequence of 1,024: its activations, not its states, make its
# peak, as in the models advise is for (at 64 the peak comes at the optimizer's step,
# holding the gradients, which advise.Search then measures rather than derives).
LONG = ModelSpec.of("hf", **{**LLAMA.size_dict(), "seq_len": 1024})


def test_fsdps_copies_around_its_collectives_are_counted_and_never_fused():
    """FSDP2 copies each all-gather's buffer into the parameters (read and written:
    fsdp::split_with_sizes_copy) and the gradients into each reduce-scatter's input
    (fsdp::chunk_cat): custom ops that return nothing, their outputs `out` arguments;
    and it casts its chunks in place before each gather (mixed precision).
    Each is counted as what it moves, the gathered and reduced buffers' bytes exactly
    those of the collectives, the gradients read beside; in FSDP's hooks, they run as
    their own kernels whether the blocks are compiled or not."""
    with fakerank.kept_worlds():
        m = fakerank.measure(LONG, fakerank.Probe(Layout(dp_shard=2), micro=2))
    ops = m.work.ops

    def moved(kind: str) -> float:
        return sum(b * n for (_, k, _, b), n in ops.items() if k == kind)

    dp = m.work.comm_by_dim["dp_shard"]
    assert moved(fakerank.BUFFER) == 2 * dp["all_gather"]["bytes"] + dp["reduce_scatter"]["bytes"]
    # bf16 gradients read into the reduction's fp32 buffer (FSDP2's mixed precision)
    assert moved(fakerank.GRADS) == dp["reduce_scatter"]["bytes"] / 2
    copies = fakerank.Work(
        collections.Counter({k: n for k, n in ops.items() if k[1] in ("buffer", "grads")})
    )
    gpu = gpus.PROFILES["h100"]
    eager = copies.seconds(gpu)
    assert eager > 0 and copies.seconds(gpu, compiled=True) == eager
    assert copies.op_count() == dp["all_gather"]["count"] + dp["reduce_scatter"]["count"]
    # before each gather, its chunks cast to bf16 in place (fp32 read, bf16 written:
    # aten::_foreach_copy_, returning nothing) and copied into its buffer (bf16 both ways)
    chunk = sum(k.row_elements * -(-k.rows // 2) * n for k, n in m.shards.items())
    into = sum(b * n for (p, k, _, b), n in ops.items() if k == fakerank.CHUNK and p == "forward")
    assert into == (4 + 2 + 2 + 2) * chunk


@pytest.mark.parametrize(
    "layout, precision",
    [
        (Layout(dp_shard=2, tp=2, ac="selective", sequence_parallel=True), "bf16"),
        (Layout(dp_shard=2, zero=2, ac="full"), "bf16"),
        (Layout(dp_shard=2), "fp32"),
    ],
    ids=["fsdp-tp-sp", "zero2", "fsdp-fp32"],
)
@pytest.mark.parametrize("replicas", [1, 2], ids=["fsdp", "hsdp"])
def test_a_rank_derived_at_another_dp_shard_is_the_rank_measured_there(layout, precision, replicas):
    """What advise derives of a rank at dp_shard 8 and 128 from its measurement at 2
    (fakerank.at_shard), HSDP's from FSDP's, is what a measurement there finds: the
    peak and its split to the byte, every phase's FLOPs, its time (every op's bytes,
    no floor) to 0.1%, every collective's bytes. At 128 FSDP pads (the key/value
    projections' 64 rows split 128 ways)."""
    # no floor: every op's bytes count, however small (the small Llama's are all below it)
    gpu = dataclasses.replace(gpus.PROFILES["h100"], op_floor_s=0.0)
    probe = fakerank.Probe(layout, micro=2, precision=precision)
    ref = fakerank.measure(LONG, probe)
    assert fakerank.derivable(ref) and ref.shards
    for shard in (8, 128):
        at = layout.replace(dp_shard=shard, dp_replicate=replicas)
        derived = fakerank.at_shard(ref, shard, replicas)
        measured = fakerank.measure(LONG, probe.replace(layout=at))
        assert derived.peak_bytes == measured.peak_bytes, shard
        assert derived.by_category == measured.by_category
        for phase in (fakerank.STEP, fakerank.RECOMPUTE, fakerank.OPTIMIZER):
            assert derived.work.flops(phase) == pytest.approx(measured.work.flops(phase))
            # per op, a model-wide chunk ratio: at 128, where only some parameters pad,
            # the optimizer's time is 6e-5 off (the memory and the bytes sent exact)
            assert derived.work.seconds(gpu, phase) == pytest.approx(
                measured.work.seconds(gpu, phase), rel=1e-3
            )
        assert _flat(derived.work.comm_by_dim) == pytest.approx(_flat(measured.work.comm_by_dim))
    # the derivation moves what dp_shard splits, so the test can fail: from 2 to 128
    # the optimizer's state shrinks 64-fold, less padding
    assert derived.by_category["opt"] < ref.by_category["opt"] / 32


@pytest.mark.parametrize(
    "layout",
    [
        Layout(dp_shard=2, ac="full"),
        Layout(dp_shard=2, tp=2, ac="full", sequence_parallel=True),
        Layout(dp_shard=2, zero=2, ac="full"),
    ],
    ids=["fsdp", "fsdp-tp-sp", "zero2"],
)
def test_a_deep_rank_whose_peak_holds_gradients_is_derived_at_another_dp_shard(layout):
    """A rank extended to 9 blocks whose peak holds gradients: their chunks appear
    block by block over the backward and shrink with dp_shard, so at another dp_shard
    the peak can fall at another moment. Derived depth by depth (fakerank.derived: each
    measured depth's parts at whichever moment of their frontier holds most there, then
    extended), it is the rank measured at dp_shard 8 and 16 and extended alike, and the
    rank measured whole at 9 blocks: the peak, its split and every part to the byte."""
    probe = fakerank.Probe(layout, micro=2)
    m = fakerank.at_blocks(LLAMA, probe, 9)
    assert m.extended_from and not fakerank.derivable(m)
    with pytest.raises(ValueError, match="depth by depth"):
        fakerank.at_shard(m, 8)
    for shard in (8, 16):
        at = probe.replace(layout=layout.replace(dp_shard=shard))
        derived = fakerank.derived(LLAMA, probe, m, shard)
        measured = fakerank.at_blocks(LLAMA, at, 9)
        whole = fakerank.measure(LLAMA, at.replace(blocks=9))
        assert derived.peak_bytes == measured.peak_bytes == whole.peak_bytes, shard
        assert derived.by_category == measured.by_category == whole.by_category
        assert derived.parts == measured.parts
        assert (derived.derived_from, derived.sharded_at) == (2, shard)
        # the peak moved as no single moment of the reference's would: what moving its
        # peak by the chunks and their state alone (at_shard of a peak without
        # gradients) says is not it
        alone = dataclasses.replace(m, by_category={**m.by_category, "grad": 0})
        assert fakerank.at_shard(alone, shard).peak_bytes != derived.peak_bytes


def test_the_search_derived_from_reference_ranks_is_the_full_search():
    """advise measures each rank shape once, at dp_shard 2 (advise.reference), and
    derives every other data-parallel degree; a search that measures every candidate's
    own rank decides the same: every row's status, fit, reason and rank, and its
    figures. On a card small enough that memory decides."""
    from parabench import models

    facts = models.facts(LONG)
    # the card FSDP 8 at micro-batch 2 would just fill with TP's NCCL buffers too
    # (gpus.fits: what it would hold), so that activations decide for FSDP x TP
    m = fakerank.measure(LONG, fakerank.Probe(Layout(dp_shard=8), micro=2))
    card = m.reserved_bytes + gpus.overhead([8, 2])
    gpu = dataclasses.replace(gpus.PROFILES["h100"], memory_bytes=card)
    fabric = PROFILES["h100-nvlink-ndr400"]
    tables = {}
    for derive in (True, False):
        fakerank._MEASURED.clear()  # each search takes its own fake steps
        search = advise.Search({"llama": LONG}, gpu, fabric, "bf16", "adamw", print, derive)
        rows = advise.search(search, "llama", facts, 16, 4, 16, 1024, 4)
        tables[derive] = pd.DataFrame(rows).set_index(
            ["gpus", "layout", "micro_batch", "ac", "zero", "schedule"]
        )
        tables[derive, "steps"] = search.measurements
    derived, full = tables[True], tables[False].loc[tables[True].index]
    assert len(derived) == len(tables[False])
    for col in ("status", "fits", "reason", "rank", "binding"):
        assert derived[col].astype(str).tolist() == full[col].astype(str).tolist(), col
    assert derived["rank"].eq(1).sum() == 1 and (derived["status"] == "inferred").any()
    assert {False, True} <= set(derived["fits"].dropna())
    # among the derived: ranks whose peak holds gradients (fakerank.derived's frontiers)
    from_ref = derived["memory_source"].astype(str).str.contains("derived from its rank")
    alone = ~derived.index.get_level_values("layout").str.contains("PP")
    assert (from_ref & alone & derived["grad_bytes"].gt(0)).any()
    for col in ("step_s", "memory_bytes", "comm_s", "comm_hidden_s", "compute_s", "mfu"):
        pd.testing.assert_series_equal(derived[col], full[col], rtol=1e-6, check_names=False)
    assert tables[True, "steps"] < tables[False, "steps"]


@pytest.mark.slow  # spawns worker processes
def test_a_search_in_worker_processes_is_the_search_in_one():
    """A search on a GPU profile at 4 GPUs or more runs its layouts in worker processes
    (advise.pool: each gets a copy of the search with what its shapes need, and sends
    back what it measured, merged into the searching process's): the same rows, the
    same figures, the same recommendation and the same fake steps as one process
    alone. On the card of the derivation test above, where memory decides."""
    from parabench import models

    facts = models.facts(LONG)
    m = fakerank.measure(LONG, fakerank.Probe(Layout(dp_shard=8), micro=2))
    card = m.reserved_bytes + gpus.overhead([8, 2])
    gpu = dataclasses.replace(gpus.PROFILES["h100"], memory_bytes=card)
    fabric = PROFILES["h100-nvlink-ndr400"]
    tables, steps = {}, {}
    kept = dict(fakerank._MEASURED), dict(fakerank._SETTLED)
    for workers in (1, 2):
        fakerank._MEASURED.clear()  # each search takes its own fake steps
        fakerank._SETTLED.clear()
        # print: what a worker's copy logs with must pickle, as the command's does
        search = advise.Search({"llama": LONG}, gpu, fabric, "bf16", "adamw", print)
        with advise.pool(workers) as pool:
            rows = advise.search(search, "llama", facts, 16, 4, 16, 1024, 4, pool)
        index = ["gpus", "layout", "micro_batch", "ac", "zero", "schedule"]
        tables[workers] = pd.DataFrame(rows).set_index(index).sort_index()
        steps[workers] = search.measurements
    one, two = tables[1], tables[2]
    assert one.index.equals(two.index) and one.index.is_unique
    assert one["rank"].eq(1).sum() == 1 and {False, True} <= set(one["fits"].dropna())
    pd.testing.assert_frame_equal(one, two, rtol=1e-9)
    assert steps[1] == steps[2] > 0
    fakerank._MEASURED.update(kept[0])  # the other tests' measurements, as they were
    fakerank._SETTLED.update(kept[1])
