"""`parabench advise`: which layout to run for a model on N GPUs, whether it fits, and
how fast it would go, answered on a laptop.

For each model and each N, every layout that applies is a candidate (`candidates`):

- the factorisations of N into pp x dp_replicate x dp_shard x tp (layout.MESH_DIMS,
  torchtitan's order), with tp within a node and splitting the model's widths, pp no
  more than its repeated blocks (and at most MAX_PP), and data parallelism as FSDP
  (dp_shard), HSDP (a node's worth of shards, replicated across nodes) or DDP;
- for a pipeline, its schedule (1F1B, Interleaved 1F1B or GPipe); for FSDP, ZeRO-3 (reshard after
  forward) or ZeRO-2 (keep the gathered parameters to backward; a pipeline always);
- activation checkpointing none, selective or full;
- the micro-batch and the accumulation (or a pipeline's micro-batches) that reach the
  global batch.

Each is then, and says which:

- **measured, memory**: one rank of it under fake tensors (predict/fakerank.py): its peak by
  torch's memory tracker, in its dtypes, at a few depths extended to its stage's
  blocks, each part of the step on its own line. A pipeline's first stage holds the
  activations of its micro-batches in flight (1F1B: up to pp; GPipe: all; Interleaved
  1F1B: where torch's own order holds most), one micro-batch's measured, the rest
  added;
- **counted**: its ops' FLOPs and bytes, its collectives' bytes per mesh dimension;
- **predicted, time**: compute, each op at the GPU's roofline (hardware/gpus.py), eager or
  as torch.compile fuses it, with BF16 or Float8 linears (`advise.compile`,
  `advise.float8`); communication
  per mesh dimension at the fabric's time at its span (hardware/fabric.py, scaling.layout_comm),
  less what data parallelism's run under compute (FSDP's prefetched gathers, the
  gradient reductions under the backward: predict/overlap.py's timeline; tensor
  parallelism's and a pipeline's exposed); a pipeline's bubble, (pp - 1) of its m
  micro-batches' slots (each its compute and tp's collectives; Interleaved 1F1B's
  stages fill and drain in half the time), and its transfers between stages, each
  on the link its ranks use. Then tokens per second per GPU and MFU (a pipeline's
  GPU, its share of the model's FLOPs).

The search (`search`) measures what decides and infers the rest, each inferred row
naming the measurement that decided it. A rank shape (its tp, stage, micro-batch,
checkpointing and kind of data parallelism) is measured once, with FSDP's chunks over
2 ranks (`reference`), and every other dp_shard, at every N, and HSDP's rank, derived
from it (fakerank.at_shard: exact, tests/test_advise.py). Layouts are searched in
worker processes side by side, those of one shape in one worker.

Whether it fits: on a GPU, what the card would hold (the caching allocator's reserved
peak, the CUDA context, NCCL's buffers per process group: gpus.fits); a pipeline's
FSDP stage also holds its gradients whole over its micro-batches, where its schedule
holds most (held).

results/advise.csv holds every candidate (columns: docs/results.md), the recommended
one ranked 1: the fastest that fits.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import TYPE_CHECKING

from parabench.hardware import gpus
from parabench.hardware.fabric import Fabric
from parabench.hardware.gpus import GPU
from parabench.layout import Layout
from parabench.predict.scaling import layout_comm
from parabench.records import ADVISE_COLUMNS, atomic_write_bytes, csv_text, write_rows
from parabench.spec import ModelSpec

if TYPE_CHECKING:  # fakerank imports torch: imported where a search runs
    from parabench.predict.fakerank import Work

LAYOUT_CSV = "advise-layout.csv"  # `--layout`'s rows
ADVISE_CSV = "advise.csv"  # a search's
# DistributedDataParallel's buckets: bucket_cap_mb's default, and its first bucket's
# (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES = 25 * 2**20, 2**20
MAX_PP = 16  # deeper pipelines need global batches beyond what training runs use
MICRO_CAP = 16  # samples per micro-batch tried, at most
AC_ORDER = ("none", "selective", "full")
SCHEDULES = ("1f1b", "interleaved", "gpipe")
# Interleaved 1F1B's stages a rank: torchtitan's for a looped schedule when the split
# is not given (generate_split_points: num_stages_per_rank = 2)
VIRTUAL_STAGES = 2
# this-machine as a CPU: a model's ranks are timed here when its whole step, priced, is
# shorter (a larger model's ranks would take minutes each to time)
TIMED_UP_TO_S = 1.0


def stages_per_rank(schedule: str) -> int:
    """The pipeline stages each rank runs under `schedule`."""
    return VIRTUAL_STAGES if schedule == "interleaved" else 1


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run model `model` on `gpus` GPUs: a layout, and the micro-batch and
    accumulation that make up each data-parallel rank's share of the global batch."""

    model: str
    gpus: int
    layout: Layout
    micro: int  # samples per micro-batch
    accumulation: int  # micro-batches per step on a data-parallel rank

    def replace(self, **changes) -> Candidate:
        return dataclasses.replace(self, **changes)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(n: int) -> list[int]:
    return [d for d in _divisors(n) if d & (d - 1) == 0]


def candidates(
    name: str, facts, n: int, gpus_per_node: int, global_batch: int, depth: int | None
) -> Iterator[Candidate | tuple[Candidate | Layout, str, str]]:
    """Every candidate layout at n GPUs; one that cannot run, or need not be measured,
    as (it, or its Layout alone; why; its status) instead. A pipeline's stages each hold at
    least one of the model's `depth` repeated blocks (None: a model whose stage advise
    cannot build, so no pipeline)."""
    for tp in _divisors(min(n, gpus_per_node)):
        if n % tp:
            continue
        if tp > 1 and (facts.tp_skip or not facts.has_tp_plan or facts.tp_problem(tp)):
            continue  # the model cannot split that way: not a layout of it
        for pp in _divisors(n // tp):
            if pp > 1 and (not depth or facts.cut_skip or pp > depth or pp > MAX_PP):
                continue
            dp = n // (tp * pp)
            if global_batch % dp:
                yield (
                    Layout(pp=pp, dp_shard=dp, tp=tp),
                    f"the global batch of {global_batch} does not split over {dp} "
                    "data-parallel ranks",
                    "skipped",
                )
                continue
            local = global_batch // dp
            in_node = max(1, gpus_per_node // tp)
            modes = [(1, dp)] if dp > 1 else [(1, 1)]
            if dp > 1:
                modes.append((dp, 1))  # DDP
                # HSDP: a node's worth of shards, replicated across nodes (torchtitan's
                # use); within one node, half the ranks' worth
                k = in_node if dp > in_node else dp // 2
                if 1 < k < dp and dp % k == 0:
                    modes.append((dp // k, k))
            for rep, shard in modes:
                zeros = [3, 2] if shard > 1 and pp == 1 else [2] if shard > 1 else [0]
                for zero in zeros:
                    for micro in reversed(_powers_of_two(local)):
                        if micro > MICRO_CAP:
                            continue
                        for ac in AC_ORDER:
                            for schedule in SCHEDULES if pp > 1 else ("",):
                                layout = Layout(
                                    pp, rep, shard, tp, zero=zero, ac=ac, schedule=schedule
                                )
                                c = Candidate(name, n, layout, micro, local // micro)
                                if schedule == "1f1b" and c.accumulation < pp:
                                    yield (
                                        c,
                                        f"1F1B needs a micro-batch per stage: {c.accumulation} "
                                        f"for {pp} stages (torch's Schedule1F1B refuses it)",
                                        "skipped",
                                    )
                                elif schedule == "interleaved" and (
                                    why := interleaved_refusal(pp, c.accumulation, depth)
                                ):
                                    yield (c, why, "skipped")
                                elif schedule == "gpipe" and c.accumulation >= pp:
                                    yield (
                                        c,
                                        "not measured: 1F1B runs this step with the same "
                                        "bubble, holding fewer micro-batches' activations",
                                        "inferred",
                                    )
                                else:
                                    yield c


def _probe(c: Candidate, precision: str, optimizer: str):
    """What measuring `c`'s rank depends on (its stage's layout: fakerank.Probe)."""
    from parabench.predict.fakerank import Probe

    return Probe(c.layout, micro=c.micro, precision=precision, optimizer=optimizer)


def reference(probe):
    """The probe whose measurement `probe`'s rank is derived from: with FSDP, the same
    rank with its chunks over 2 ranks (fakerank.at_shard derives any larger dp_shard,
    and HSDP from FSDP); with DDP, over 2 replicas (a replica holds and does the same
    whatever their number, and all-reduces the whole gradient). So a rank shape is
    measured once for every N and every data-parallel degree."""
    lay = probe.layout
    if lay.dp_shard > 1:
        changes = {"dp_shard": 2, "dp_replicate": 1}
    else:
        changes = {"dp_replicate": min(lay.dp_replicate, 2)}
    return probe.replace(layout=lay.replace(**changes))


def stage_blocks(blocks: int, pp: int) -> int:
    """The blocks of a pipeline's largest stage."""
    return math.ceil(blocks / pp)


def interleaved_refusal(pp: int, micro_batches: int, depth: int | None) -> str:
    """Why Interleaved 1F1B cannot run (or be priced) at pp stages of `micro_batches`
    on a model of `depth` repeated blocks; "" where it can. torch refuses micro-batches
    that are not a multiple of its rounds; with fewer micro-batches than stages its
    rank idles between its own stages, which the bubble here does not price."""
    if depth is not None and depth < pp * VIRTUAL_STAGES:
        return (
            f"Interleaved 1F1B needs a block for each of {pp} x {VIRTUAL_STAGES} stages: "
            f"the model has {depth}"
        )
    if micro_batches < pp:
        return (
            f"Interleaved 1F1B with fewer micro-batches than stages ({micro_batches} for "
            f"{pp}) idles between a rank's stages: not priced"
        )
    rounds = micro_batches // pp
    if micro_batches % rounds:
        return (
            f"Interleaved 1F1B needs micro-batches a multiple of its rounds ({rounds}), "
            f"got {micro_batches} (torch's ScheduleInterleaved1F1B refuses it)"
        )
    return ""


def rank0_order(schedule: str, pp: int, micro_batches: int) -> tuple[tuple[str, int], ...]:
    """A pipeline's first rank's compute, in order, as torch's schedule runs it: each
    ("F" or "B", the stage it runs). 1F1B runs min(m, pp) forwards, then alternates a
    backward and a forward, then drains its backwards (Schedule1F1B, for m >= pp: the
    same sequence as written here); GPipe runs every forward first;
    Interleaved 1F1B's order is torch's own (ScheduleInterleaved1F1B, VIRTUAL_STAGES
    stages a rank, from torch's schedule visualizer)."""
    m = micro_batches
    if schedule == "gpipe":
        return (("F", 0),) * m + (("B", 0),) * m
    if schedule == "1f1b":
        w = min(pp - 1, m)
        return (("F", 0),) * w + (("F", 0), ("B", 0)) * (m - w) + (("B", 0),) * w
    return _interleaved_order(pp, m)


@functools.cache
def _interleaved_order(pp: int, micro_batches: int) -> tuple[tuple[str, int], ...]:
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    kind = schedules._ComputationType
    names = {kind.FORWARD: "F", kind.FULL_BACKWARD: "B", kind.BACKWARD_INPUT: "B"}
    ops = get_schedule_ops(
        schedules.ScheduleInterleaved1F1B, pp, micro_batches, num_stages_per_rank=VIRTUAL_STAGES
    )[0]
    return tuple(
        (names[a.computation_type], a.stage_index)
        for a in ops
        if a is not None and a.computation_type in names
    )


@functools.cache
def _held_points(
    schedule: str, pp: int, micro_batches: int
) -> tuple[tuple[float, float, int], ...]:
    """Each moment of the first rank's schedule where what it holds can peak: during a
    forward (its activations just saved) and during a backward (the stage's gradients
    there, its activations not yet freed). Each as (micro-batches of the whole stage's
    saved activations, share of the stage's parameters whose gradients are held
    unsharded, forwards in flight): a stage of a rank's v stages holds from its first
    backward to its last, when torch reduces them (`_add_reduce_grad`: "reduce_grad
    frees memory"); each forward in flight holds its stage's input (the embedding's
    output, or what the stage before sent), whatever share of the blocks it ran."""
    v = stages_per_rank(schedule)
    order = rank0_order(schedule, pp, micro_batches)
    backwards = collections.Counter(stage for kind, stage in order if kind == "B")
    seen: collections.Counter = collections.Counter()
    acts, grads, points = 0, 0, []
    for kind, stage in order:
        if kind == "F":
            acts += 1
            points.append((acts / v, grads / v, acts))
            continue
        if not seen[stage]:
            grads += 1
        seen[stage] += 1
        points.append((acts / v, grads / v, acts))
        acts -= 1
        if seen[stage] == backwards[stage]:
            grads -= 1  # reduced: its sharded gradient stays, as in the measured step
    return tuple(points)


@dataclasses.dataclass(frozen=True)
class Held:
    """What a pipeline's first stage holds beyond the one micro-batch's step measured,
    where its schedule holds most (`held`)."""

    micro_batches: float = 0.0  # other micro-batches' saved activations, in flight
    grads: int = 0  # bytes of gradients held unsharded, beyond the measured peak's
    inputs: int = 0  # other forwards' stage inputs held (Interleaved: more than the above)

    def activations(self, m) -> int:
        """Their bytes, as the measured micro-batch's step `m` holds one
        (PeakTracker.in_flight): what its blocks saved for each, and its stage's input
        (the embedding's output, which the first block saves under full AC) for each
        forward."""
        return int(self.micro_batches * m.block_saved_bytes + self.inputs * m.input_saved_bytes)


def held(c: Candidate, m) -> Held:
    """The moment of `c`'s pipeline schedule where its first rank holds most (`_held_points`),
    as the measured micro-batch's step `m` prices each: a micro-batch in flight holds
    what the stage's blocks saved for one, and each forward in flight its stage's input
    (`Held.activations`); with FSDP, each stage's gradients are held whole between its
    first backward and its last. torch's PipelineStage turns FSDP's gradient sync and
    resharding off for every backward (set_requires_gradient_sync(False),
    set_reshard_after_backward(False): stage.py's backward_maybe_with_nosync) and
    reduces at the schedule's REDUCE_GRAD, and FSDP2 keeps each gradient unsharded in
    the reduce dtype meanwhile (`unsharded_accumulated_grad`: fp32 under bf16 mixed
    precision): 4 bytes an element of the stage's tp-local parameters, less the
    gradients the measured step held at its peak; a rank's stages taken as holding equal
    shares. 1F1B and GPipe hold all of both at once; Interleaved 1F1B reduces one
    stage's before its other's first backward."""
    lay = c.layout
    if lay.pp == 1:
        return Held()
    whole = 0
    if lay.dp_shard > 1:
        whole = int(4 * sum(n * k.rows * k.row_elements for k, n in m.shards.items()))
    measured_grads = m.by_category.get("grad", 0)
    points = [
        Held(acts - 1, max(int(share * whole) - measured_grads, 0) if share else 0, forwards - 1)
        for acts, share, forwards in _held_points(lay.schedule, lay.pp, c.accumulation)
    ]
    return max(points, key=lambda h: h.activations(m) + h.grads)


def collectives(m, lay: Layout, float8: bool = False) -> dict:
    """A micro-batch's collectives by mesh dimension, as the run issues them: the fake
    rank's, but DDP's gradients (FSDP2's `replicate` of the whole model there: one
    all-reduce) in torch DistributedDataParallel's buckets, which it all-reduces as the
    backward fills them: the first of 1 MiB, the rest of bucket_cap_mb (25 MiB, its
    default), taken as alike. DDP over TP runs as the fake rank does (FSDP2's
    `replicate`: strategies/parallelize.py), one all-reduce once the backward is done.
    With Float8, FSDP gathers the blocks' linear weights at a byte each (torchtitan's
    enable_fsdp_float8_all_gather), half their BF16 bytes."""
    comm = m.work.comm_by_dim
    gathered = comm.get("dp_shard", {}).get("all_gather")
    if float8 and gathered:
        fp8 = {**gathered, "bytes": gathered["bytes"] * (1 - m.linear_share / 2)}
        comm = {**comm, "dp_shard": {**comm["dp_shard"], "all_gather": fp8}}
    ddp = comm.get("dp_replicate", {}).get("all_reduce")
    if lay.dp_shard > 1 or lay.tp > 1 or not ddp or not ddp.get("count"):
        return comm
    rest = max(ddp["bytes"] - DDP_FIRST_BUCKET_BYTES, 0)
    buckets = max(ddp["count"], 1 + math.ceil(rest / DDP_BUCKET_BYTES))
    replicate = {**comm["dp_replicate"], "all_reduce": {"count": buckets, "bytes": ddp["bytes"]}}
    return {**comm, "dp_replicate": replicate}


def data_parallel(comm: dict, lay: Layout, fabric: Fabric, forward_s: float, backward_s: float):
    """What of one micro-batch's data-parallel collectives (`comm`: `collectives`) runs
    under its compute (predict/overlap.py), each call priced as layout_comm prices it,
    so never more than it charges; None where the rank has none, or runs them once a
    step in a pipeline's schedule (its own timeline: not modelled)."""
    from parabench.predict import overlap
    from parabench.predict.scaling import spans

    if lay.pp > 1 or not (comm.get("dp_shard") or comm.get("dp_replicate")):
        return None
    deg, span = lay.degrees, spans(lay.degrees)

    def call(dim: str, op: str) -> tuple[float, float]:
        """(calls, seconds of one) of `op` over `dim` a micro-batch."""
        e = comm.get(dim, {}).get(op, {})
        if not e.get("count"):
            return 0.0, 0.0
        return e["count"], fabric.time(op, deg[dim], e["bytes"] / e["count"], span[dim], lay.world)

    gathers, gather = call("dp_shard", "all_gather")
    reduces, reduce = call("dp_shard", "reduce_scatter")
    replicas, all_reduce = call("dp_replicate", "all_reduce")
    units = reduces or replicas  # FSDP's units, or DDP's buckets: one reduction each
    charged = gathers * gather + reduces * reduce + replicas * all_reduce
    t = overlap.micro_batch(
        forward_s, backward_s, units, gather, reduce + all_reduce, gathers > units + 1
    )
    # the timeline's units stand for the calls charged: what it hides, of what was charged
    return min(t.hidden_s, charged)


def predict(
    c: Candidate,
    m,
    gpu: GPU,
    fabric: Fabric,
    tokens_per_sample: int,
    compiled: bool = False,
    float8: bool = False,
    timed: dict[str, float] | None = None,
    blocks: int | None = None,
) -> dict:
    """The step of candidate `c` from its rank's measurement `m` (fakerank.Measured),
    run eager or compiled, with BF16 or Float8 linears (fakerank.Work.seconds); its
    compute timed on this host where `timed` (fakerank.timed, beside its other ranks:
    `_timed_phases`). `blocks`: the model's repeated blocks, a pipeline's share of
    whose FLOPs a GPU runs (its FLOPs and MFU)."""
    from parabench.predict.fakerank import BACKWARD, FORWARD, OPTIMIZER, RECOMPUTE, STEP

    phases = _timed_phases(m.work, gpu, compiled, float8, timed) if timed else {}

    def priced(phase: str) -> float:
        return m.work.seconds(gpu, phase, compiled, float8)

    def seconds(phase: str) -> float:
        if not phases:
            return priced(phase)
        return phases[FORWARD] + phases[BACKWARD] if phase == STEP else phases[phase]

    a, lay = c.accumulation, c.layout
    slicing = max(1.0, c.gpus / gpu.cores) if gpu.cores else 1.0  # ranks sharing cores

    def compute_of(seconds: Callable[[str], float], turns: float) -> tuple[float, float, float]:
        """A step's recompute, a micro-batch's compute and the step's compute, each
        phase `turns` times its own (ranks taking turns on a core)."""
        recompute = seconds(RECOMPUTE) * turns
        micro_s = seconds(STEP) * turns + recompute
        return recompute, micro_s, a * micro_s + seconds(OPTIMIZER) * turns

    # a rank timed beside the others took its turns (fakerank.timed)
    turns = 1.0 if phases else slicing
    recompute, micro_s, compute = compute_of(seconds, turns)
    forward = seconds(FORWARD) * turns
    issued = collectives(m, lay, float8)
    hidden = a * (data_parallel(issued, lay, fabric, forward, micro_s - forward) or 0.0)
    if gpu.cores and (slicing > 1 or lay.dp_shard > 1):
        # A CPU hides nothing where no core is free for gloo's threads while the ranks
        # compute; nor FSDP2's collectives (FSDP's, HSDP's) on any number of cores: its
        # streams do nothing there and it issues each call synchronously, the rank
        # waiting in it (its cells' traces: every gloo span inside the call). Torch
        # DDP's reducer runs its buckets asynchronously, under the backward.
        hidden = 0.0
    # Per micro-batch, as the rank measured, but a pipeline's schedule runs data
    # parallelism's gather and gradient sync once per step (layout.py): only tp's
    # collectives recur with every micro-batch there. Per step from here on.
    comm_dims = {
        d: {
            op: {k: v * (a if lay.pp == 1 or d == "tp" else 1) for k, v in e.items()}
            for op, e in ops.items()
        }
        for d, ops in issued.items()
    }
    comm = layout_comm([comm_dims], fabric.time, lay.degrees, a) - hidden
    # fill and drain wait on one transfer per boundary, each way
    p2p = 2 * sum(_hop_s(fabric, lay, k, m.boundary_bytes) for k in _hops(lay))
    # (pp - 1)/m of m micro-batches' slots, each its compute and tp's collectives (in
    # the compute's stream, exposed: `comm` holds them for every micro-batch);
    # interleaved, its stages a rank each fill and drain in 1/v of the time (Narayanan
    # et al. 2021, torch's Interleaved1F1B)
    tp_s = 0.0
    if lay.pp > 1 and issued.get("tp"):
        tp_s = layout_comm([{"tp": issued["tp"]}], fabric.time, lay.degrees, 1)
    bubble = (lay.pp - 1) * (micro_s + tp_s) / stages_per_rank(lay.schedule)
    step = compute + comm + p2p + bubble
    # A pipeline's stage is measured with the embedding and the head (the heaviest
    # stage's bound, for its step), which the model runs once between its pp stages:
    # a GPU's FLOPs are its share of the blocks' and of theirs
    # (the recompute is the blocks'; the optimizer's, a few FLOPs a parameter, is left
    # as the stage's)
    per_gpu, recomputed = m.work.flops(STEP), m.work.recompute_flops
    if lay.pp > 1 and blocks and m.work.block_flops:
        share = blocks / lay.pp / m.blocks  # a GPU's blocks, of the stage's measured
        per_gpu = m.work.block_flops * share + (per_gpu - m.work.block_flops) / lay.pp
        recomputed *= share
    model_flops = a * per_gpu + m.work.flops(OPTIMIZER)
    samples = c.micro * a * lay.dp
    return {
        "compute_s": compute,
        # the roofline's figure beside a timed one: how far pricing is from this host
        "roofline_compute_s": compute_of(priced, slicing)[2] if phases else compute,
        "recompute_s": a * recompute,
        "comm_s": comm + p2p,
        "comm_hidden_s": hidden,
        "comm_by_dim": json.dumps(comm_dims, sort_keys=True),
        "bubble_s": bubble,
        "step_s": step,
        "samples_per_s_per_gpu": samples / step / c.gpus,
        "tokens_per_s_per_gpu": samples * tokens_per_sample / step / c.gpus
        if tokens_per_sample
        else math.nan,
        "flops_per_gpu": a * (per_gpu + recomputed) + m.work.flops(OPTIMIZER),
        "mfu": model_flops / step / gpu.peak_flops,
    }


def _hops(lay: Layout) -> list[int]:
    """The stage boundaries a micro-batch crosses, in order: k, from stage k to k + 1,
    and pp - 1 from the last stage back to the first (Interleaved 1F1B: a rank's next
    stage)."""
    if lay.pp == 1:
        return []
    once = list(range(lay.pp - 1))
    around = [*once, lay.pp - 1]  # to a rank's next stage, back at the first
    return [*(around * (stages_per_rank(lay.schedule) - 1)), *once]


def _hop_s(fabric: Fabric, lay: Layout, k: int, nbytes: float) -> float:
    """One transfer across boundary k (`_hops`): each rank of a stage sends to its
    peer in the next, a stage's dp x tp ranks on (pp the mesh's outer dimension), all
    at once, so over the network where any pair sits on two nodes (every boundary
    that starts a node, and the way back to the first stage across them)."""
    stride = lay.dp * lay.tp
    span = 2 * stride  # the curves' placement, where the fabric has no nodes
    if g := fabric.gpus_per_node:
        a, b = k * stride, (k + 1) % lay.pp * stride
        apart = any((a + j) // g != (b + j) // g for j in range(stride))
        span = g + 1 if apart else 2  # on two nodes, one rank on each: one NIC
    return fabric.time("send", 2, nbytes, span, lay.world)


def _timed_phases(
    work: Work, gpu: GPU, compiled: bool, float8: bool, timed: dict[str, float]
) -> dict[str, float]:
    """Each phase's seconds on one rank (FORWARD, BACKWARD, RECOMPUTE, OPTIMIZER) from
    its step timed on this host (fakerank.timed): its backward split from its recompute
    as the roofline splits them (fakerank.Work.seconds), each scaled by what compile or
    Float8 save on the roofline (the timed step is eager)."""
    from parabench.predict.fakerank import BACKWARD, FORWARD, OPTIMIZER, RECOMPUTE

    def priced(phase: str, compiled: bool = compiled, float8: bool = float8) -> float:
        return work.seconds(gpu, phase, compiled, float8)

    names = (FORWARD, BACKWARD, RECOMPUTE, OPTIMIZER)
    backward = priced(BACKWARD, False, False) + priced(RECOMPUTE, False, False)
    share = priced(RECOMPUTE, False, False) / backward if backward else 0.0
    got = {
        FORWARD: timed[FORWARD],
        BACKWARD: timed[BACKWARD] * (1 - share),
        RECOMPUTE: timed[BACKWARD] * share,
        OPTIMIZER: timed[OPTIMIZER],
    }
    if compiled or float8:
        for p in names:
            eager = priced(p, False, False)
            got[p] *= priced(p) / eager if eager else 1.0
    return got


def leaves_out(layout: Layout, compiled: bool = False, float8: bool = False) -> str:
    """What the prediction of `layout` leaves out, which a run of it may use (#46): said
    on its row, so no figure is read as more than it is."""
    out = []
    if layout.pp > 1:
        out.append("overlap in the pipeline's schedule (data parallelism's priced exposed)")
    out.append(
        "compile's smaller activations (its memory is eager's)"
        if compiled
        else "torch.compile's fusion"
    )
    if not float8:
        out.append("Float8 matmuls")
    if layout.tp > 1:
        out.append("async TP")
        if float8:
            out.append("Float8 in TP's collectives")
    if layout.schedule == "interleaved":
        out.append("the split of a rank's blocks between its stages (taken as even)")
    return "; ".join(out)


def binding(row: dict) -> str:
    """What limits the candidate: memory (it does not fit), else the larger of exposed
    communication and the bubble where it is a tenth of the step or more, else compute."""
    if row.get("fits") is False:
        return "memory"
    comm, bubble, step = row.get("comm_s", 0), row.get("bubble_s", 0), row.get("step_s", 0)
    if max(comm, bubble) < 0.1 * step:
        return "compute"
    return "exposed communication" if comm >= bubble else "bubble"


class Search:
    """Measures candidates (once per rank shape and depth, shared across N) and
    predicts them."""

    def __init__(
        self,
        specs: dict[str, ModelSpec],
        gpu: GPU,
        fabric: Fabric,
        precision: str,
        optimizer: str,
        log: Callable[[str], None] = print,
        derive: bool = True,
        compiled: bool = False,
        float8: bool = False,
    ) -> None:
        self.specs, self.gpu, self.fabric = specs, gpu, fabric
        self.precision, self.optimizer, self.log = precision, optimizer, log
        # how the runs are priced, not measured: one fake step prices every way
        self.compiled, self.float8 = compiled, float8
        if float8 and not gpu.fp8_flops:
            raise ValueError(f"advise.float8: gpu {gpu.name!r} has no FP8 rate (fp8_flops)")
        self.derive = derive  # False: every rank measured itself (the test of deriving)
        self.cache: dict = {}
        self.times: dict = {}  # (model, probe at its blocks, ranks) -> fakerank.timed's
        self.small: dict[str, bool] = {}  # model -> whether its ranks are timed
        self.measurements = 0  # fake steps taken (fakerank.measure; not read from its cache)
        self.memo: list = []  # what a worker's copy takes in first (for_family)

    def for_family(self, cands: list[Candidate]) -> Search:
        """A copy to send to a worker: the measurements of these candidates' shapes
        only (a copy, so that sending it never meets the cache growing)."""
        from parabench.predict import fakerank

        probes = [(c.model, _probe(c, self.precision, self.optimizer)) for c in cands]
        shapes = {*probes, *((m, reference(p)) for m, p in probes)}
        copy = self.priced(self.compiled, self.float8)
        copy.cache = {k: v for k, v in self.cache.items() if k[:2] in shapes}
        models = {m for m, _ in shapes}
        copy.memo = [fakerank.memo(self.specs[m], [p for n, p in shapes if n == m]) for m in models]
        return copy

    def priced(self, compiled: bool, float8: bool) -> Search:
        """A search pricing runs compiled or with Float8, with nothing measured yet."""
        return Search(
            self.specs,
            self.gpu,
            self.fabric,
            self.precision,
            self.optimizer,
            self.log,
            self.derive,
            compiled,
            float8,
        )

    def measured(self, c: Candidate, blocks: int | None):
        """The rank of `c` (its stage): derived from its reference's (`reference`),
        measured once (fakerank.derived); an exception's text where it failed."""
        from parabench.predict import fakerank

        probe = _probe(c, self.precision, self.optimizer)
        ref = reference(probe) if self.derive else probe
        m = self._measured(c, ref, blocks)
        if isinstance(m, str) or ref == probe:
            return m
        lay = probe.layout
        if lay.dp_shard == 1:  # DDP: its replicas are alike
            return m
        try:
            return fakerank.derived(self.specs[c.model], ref, m, lay.dp_shard, lay.dp_replicate)
        except ValueError as e:  # a row that says why
            return _why(e)

    def _measured(self, c: Candidate, probe, blocks: int | None):
        from parabench.predict import fakerank

        key = (c.model, probe, blocks)
        if key not in self.cache:
            t0, before, ran = time.perf_counter(), fakerank.measurements(), fakerank.steps_run()
            try:
                spec = self.specs[c.model]
                self.cache[key] = (
                    fakerank.at_blocks(spec, probe, blocks)
                    if blocks
                    else fakerank.measure(spec, probe)
                )
            except Exception as e:  # a row that says why, never a lost search
                self.cache[key] = _why(e)
            made = fakerank.steps_run() - ran
            if read := fakerank.measurements() - before - made:  # from the cache
                self.log(f"  read {probe.layout.label}, micro {c.micro}: {read} fake steps")
            if made:
                self.measurements += made
                self.log(
                    f"  measured {probe.layout.label}, micro {c.micro}: {made} fake steps, "
                    f"{time.perf_counter() - t0:.1f} s"
                )
        return self.cache[key]

    def row(self, c: Candidate, facts, global_batch: int, tokens: int) -> dict:
        """One candidate's row: measured, predicted, whether it fits."""
        from parabench.predict import fakerank

        blocks = fakerank.depth(self.specs[c.model])
        stage = stage_blocks(blocks, c.layout.pp) if blocks else None
        row = self.base(c, global_batch, tokens)
        m = self.measured(c, stage)
        if isinstance(m, str):
            return {**row, "status": "failed", "reason": m}
        # the first stage's other micro-batches in flight, and its gradients held whole
        kept = held(c, m)
        extra, accumulated = kept.activations(m), kept.grads
        peak = m.peak_bytes + extra + accumulated
        how = f"measured at {m.blocks} blocks"
        if m.extended_from:
            lo, hi = m.extended_from
            how = f"measured at {lo} and {hi} blocks, extended to {m.blocks}"
        if m.derived_from:
            how += f"; derived from its rank with FSDP over {m.derived_from} (fakerank.at_shard)"
        if extra:
            how += f"; {kept.micro_batches:g} more micro-batches' saved activations in flight"
            if kept.inputs != kept.micro_batches:  # Interleaved: a forward a stage
                how += f", and {kept.inputs:g} more forwards' stage inputs,"
            how += " added"
        if accumulated:
            how += (
                "; the stage's unsharded fp32 gradients, accumulated over its micro-batches, added"
            )
        # the allocator's reserve over the peak, as its model replays the step
        reserved = peak + max(m.reserved_bytes - m.peak_bytes, 0)
        # a GPU also holds its CUDA context and NCCL's buffers (a CPU profile: none)
        groups = [d for d in c.layout.degrees.values() if d > 1]
        overhead = 0 if self.gpu.cores else gpus.overhead(groups)
        # A CPU profile is one host, and every rank of the layout runs on it, as its
        # cells' do and as its ranks are timed and their turns priced: its memory holds
        # all of them, each in a process of its own (a GPU's, one rank). A pipeline's
        # ranks are each counted at its first stage's peak.
        ranks = c.gpus if self.gpu.cores else 1
        process = self.gpu.process_bytes if self.gpu.cores else 0.0
        fits = gpus.fits(
            ranks * (peak + process),
            self.gpu.memory_bytes,
            None if self.gpu.cores else reserved + overhead,
        )
        if self.gpu.cores:
            how += (
                f"; fits: its {ranks} ranks together in this host's memory, each in a "
                f"process of {process / 2**30:.2f} GiB besides"
            )
        timed = self.timed(c, stage, c.gpus) if fits and self.times_model(c.model) else None
        source = f"priced: each op at {self.gpu.name}'s roofline (fakerank.Work.seconds)"
        if isinstance(timed, str):  # priced, as it was measured: the row says why
            source, timed = f"{source}; timing its rank here failed: {timed}", None
        elif timed:
            source = (
                f"timed here: the rank's step on real tensors beside its {c.gpus - 1} "
                f"other ranks on {self.gpu.cores} cores, as a cell's run, collectives "
                "returning at once (fakerank.timed)"
            )
        row.update(
            status="ok",
            memory_bytes=peak,
            reserved_bytes=reserved,
            overhead_bytes=overhead,
            memory_source=how,
            # the categories sum to the peak: other micro-batches in flight hold
            # activations, a pipeline's stage its gradients accumulated
            **{
                f"{k}_bytes": m.by_category.get(k, 0)
                + {"grad": accumulated, "act": extra}.get(k, 0)
                for k in ("param", "grad", "opt", "act", "temp")
            },
            fits=fits,
            compute_source=source,
            **predict(
                c, m, self.gpu, self.fabric, tokens, self.compiled, self.float8, timed, blocks
            ),
        )
        row["binding"] = binding(row)
        return row

    def times_model(self, model: str) -> bool:
        """Whether `model`'s ranks are timed here, every one that fits (so that a search
        never ranks timed rows against priced ones): on this-machine as a CPU, where a
        step of the model whole at micro-batch 1, priced at this host's GEMM rate (6
        FLOPs a parameter a token), is shorter than TIMED_UP_TO_S."""
        from parabench.predict import fakerank

        if self.gpu.name != gpus.THIS_MACHINE or not self.gpu.cores:  # not this host's CPU
            return False
        if model not in self.small:
            spec = self.specs[model]
            flops = 6 * fakerank.parameters(spec) * max(1, tokens_per_sample(spec))
            self.small[model] = flops / self.gpu.achievable_flops < TIMED_UP_TO_S
        return self.small[model]

    def timed(self, c: Candidate, blocks: int | None, ranks: int) -> dict[str, float] | str:
        """The rank of `c` timed on this host as one of `ranks` (fakerank.timed), once
        per rank shape; an exception's text where it failed."""
        from parabench.predict import fakerank

        # a pipeline's stage: its blocks
        probe = _probe(c, self.precision, self.optimizer).replace(blocks=blocks or 0)
        key = (c.model, probe, ranks)
        if key not in self.times:
            t0 = time.perf_counter()
            try:
                self.times[key] = fakerank.timed(self.specs[c.model], probe, ranks)
            except Exception as e:  # a row that says why, never a lost search
                self.times[key] = _why(e)
            self.log(
                f"  timed {probe.layout.label}, micro {c.micro}: {time.perf_counter() - t0:.1f} s"
            )
        return self.times[key]

    def base(self, c: Candidate, global_batch: int, tokens: int) -> dict:
        return {
            "model": c.model,
            "gpus": c.gpus,
            "gpu": self.gpu.name,
            "fabric": self.fabric.name,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "compile": self.compiled,
            "float8": self.float8,
            "global_batch": global_batch,
            "tokens_per_sample": tokens,
            "layout": c.layout.label,
            **c.layout.degrees,
            "schedule": c.layout.schedule,
            "ac": c.layout.ac,
            "zero": c.layout.zero,
            "micro_batch": c.micro,
            "accumulation": c.accumulation,
            "device_memory_bytes": self.gpu.memory_bytes,
            "leaves_out": leaves_out(c.layout, self.compiled, self.float8),
        }


def _family(c: Candidate) -> Candidate:
    """A layout with its ZeRO stage and schedule, whatever its checkpointing and
    micro-batch: what the micro-batch and checkpointing search runs within."""
    return c.replace(layout=c.layout.replace(ac="none"), micro=0, accumulation=0)


def _largest_fit(micros: list[int], fits: Callable[[int], bool]) -> int | None:
    """The largest of the ascending `micros` that fits, by bisection: memory grows with
    the micro-batch, so each probe halves what is left."""
    lo, hi, best = 0, len(micros) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(micros[mid]):
            best, lo = micros[mid], mid + 1
        else:
            hi = mid - 1
    return best


def _search_family(
    search: Search, cands: list[Candidate], facts, global_batch: int, tokens: int
) -> tuple[list[dict], bool | None]:
    """One layout's rows (see `search`), and whether its lightest option fits (None:
    its measurement failed, which decides nothing)."""
    rows = []
    by = {(c.layout.ac, c.micro): c for c in cands}
    micros = sorted({c.micro for c in cands})
    # Interleaved 1F1B at as many micro-batches as stages holds half the gradients it
    # holds at twice as many (its rank runs each stage's backwards before the other's,
    # and reduces that stage's gradients early: `_held_points`), though more of each
    # micro-batch's activations, so its largest micro-batch can fit where a smaller one
    # does not: measured on its own, neither deciding nor decided by the smaller ones
    island = next(
        (
            c.micro
            for c in cands
            if c.layout.schedule == "interleaved" and c.accumulation == c.layout.pp
        ),
        None,
    )
    steady = [m for m in micros if m != island]  # memory grows with the micro-batch
    first = steady[0] if steady else island  # the lightest option: full AC there
    done: dict[tuple[str, int], dict] = {}

    def fits(ac: str, micro: int) -> bool:
        """Measured: a failure counts as not fitting for the search, and its row says
        it failed; rows decided by it say so too."""
        if (ac, micro) not in done:
            done[(ac, micro)] = search.row(by[(ac, micro)], facts, global_batch, tokens)
        return bool(done[(ac, micro)].get("fits"))

    def slower(ac: str, micro: int) -> bool:
        """Whether this fitting option's step is longer than a smaller micro-batch's
        that fits (at any level): past it, a pipeline's bubble grows faster than its
        passes shrink."""
        smaller = [r["step_s"] for (_, m), r in done.items() if m < micro and r.get("fits")]
        return bool(smaller) and done[(ac, micro)]["step_s"] > min(smaller)

    def failed(ac: str, micro: int) -> str:
        got = done.get((ac, micro), {})
        return got.get("reason", "") if got.get("status") == "failed" else ""

    best: dict[str, int | None] = {}  # each level's largest fit, of the steady micro-batches
    stopped: dict[str, int] = {}  # a pipeline's level: the micro-batch its scan stopped at
    at_island: dict[str, bool] = {}  # each level measured at the island: whether it fits
    steady_fits = bool(steady) and fits("full", first)
    lightest = steady_fits or (island is not None and fits("full", island))
    if lightest:
        floor = 0  # a lighter level's largest fit: below it, that level is faster
        pipelined = cands[0].layout.pp > 1
        for ac in AC_ORDER:
            above = [m for m in steady if m > floor] if steady_fits else []
            ended = True  # not stopped by a step longer than a smaller micro-batch's
            if pipelined:  # from the smallest micro-batch up, while steps shorten
                best[ac] = None
                for m in above:
                    if not fits(ac, m):
                        break
                    best[ac] = m
                    if slower(ac, m):
                        stopped[ac] = m  # a larger one only grows the bubble further
                        ended = False
                        break
            else:
                best[ac] = _largest_fit(above, lambda m, ac=ac: fits(ac, m)) if above else None
            floor = max(floor, best[ac] or 0)
            # the island, unless a lighter level fits there (the same passes, less
            # recompute: faster)
            if island is not None and ended and not any(at_island.values()):
                at_island[ac] = fits(ac, island)
    lightest_text = f"micro-batch {first} with full checkpointing" + (
        f", nor micro-batch {island}, as many micro-batches as stages"
        if island is not None and island != first
        else ""
    )
    for c in cands:
        ac = c.layout.ac
        key = (ac, c.micro)
        if key in done:
            rows.append(done[key])
            continue
        row = {**search.base(c, global_batch, tokens), "status": "inferred"}
        smaller = [m for m in steady if m < c.micro and (ac, m) in done]
        if (why := failed("full", first)) and not (c.micro == island and at_island):
            row.update(status="failed", reason=f"not measured: its lightest option failed ({why})")
        elif not lightest:
            row.update(
                fits=False,
                binding="memory",
                reason=f"does not fit: nor does {lightest_text} (measured)",
            )
        elif c.micro != island and not steady_fits:
            row.update(
                fits=False,
                binding="memory",
                reason=f"does not fit: nor does micro-batch {first} with full checkpointing "
                "(measured)",
            )
        elif ac in stopped and c.micro > stopped[ac]:
            row.update(
                reason=f"not measured: at ac {ac}, micro-batch {stopped[ac]}'s step is "
                "already longer than a smaller one's, and a larger one only grows the bubble"
            )
        elif lighter := [
            a
            for a in AC_ORDER[: AC_ORDER.index(ac)]
            if (at_island.get(a) if c.micro == island else (best.get(a) or 0) >= c.micro)
        ]:
            row.update(
                fits=True,
                reason=f"fits: ac {lighter[0]} fits at this micro-batch, with less recompute",
            )
        elif c.micro != island and best.get(ac) is not None and c.micro < best[ac]:
            row.update(
                fits=True, reason=f"fits, and micro-batch {best[ac]} fits too, with fewer passes"
            )
        elif smaller and (why := failed(ac, smaller[-1])):
            row.update(
                status="failed",
                reason=f"not measured: micro-batch {smaller[-1]} at ac {ac} failed ({why})",
            )
        else:
            row.update(
                fits=False,
                binding="memory",
                reason=f"does not fit: a smaller micro-batch at ac {ac} does not (measured)",
            )
        rows.append(row)
    return rows, (None if failed("full", first) else lightest)


def _families_job(
    search: Search, fams: list[list[Candidate]], facts, global_batch: int, tokens: int
):
    """_search_family of each of `fams` in a worker, one after another: their rows and
    whether their lightest options fit, what it measured (for the cache), and the fake
    steps it took (fakerank.memo, for the searching process to remember)."""
    from parabench.predict import fakerank

    for got in search.memo:
        fakerank.remember(got)
    before = set(search.cache)
    steps = fakerank.steps_run()
    known = fakerank.steps_known()  # what was shipped in, or measured here before
    with fakerank.kept_worlds():
        found = [_search_family(search, cands, facts, global_batch, tokens) for cands in fams]
    new = {k: v for k, v in search.cache.items() if k not in before}
    probes = {(k[0], k[1]) for k in new}
    memo = [  # only the steps taken for these families: the searching process has the rest
        fakerank.memo(search.specs[m], [p for n, p in probes if n == m], known)
        for m in {m for m, _ in probes}
    ]
    return found, new, memo, fakerank.steps_run() - steps


def _shape(fam: Candidate) -> tuple:
    """What a family's ranks are measured as, whatever its pipeline and data-parallel
    degrees (`reference`): families alike are searched in one worker, one after
    another, so that each shape is measured once, not in two workers at once."""
    lay = fam.layout
    sharded = lay.dp_shard > 1  # FSDP and HSDP: one reference
    return (fam.model, lay.tp, lay.zero, sharded, not sharded and lay.dp_replicate > 1)


def search(
    search: Search,
    name: str,
    facts,
    n: int,
    gpus_per_node: int,
    global_batch: int,
    tokens: int,
    depth: int | None,
    pool=None,
    decided: Callable[[list[dict], int, int], None] | None = None,
) -> list[dict]:
    """Every candidate of model `name` at n GPUs, as rows, ranked (module docstring).

    Within a layout (a family: its degrees, ZeRO stage and schedule), memory grows with
    the micro-batch and shrinks with heavier checkpointing (none, selective, full). So:
    its lightest option (its smallest micro-batch, full) is measured first, and where it
    does not fit, nothing of the layout does; else, for each level, the largest
    micro-batch that fits is found by bisection (a pipeline's: those that fit, from the
    smallest, whose bubble is the least, until a step is longer than a smaller one's;
    Interleaved 1F1B's at as many micro-batches as stages on its own, as it can hold
    less), above the largest a lighter level fits at (below it the lighter level is
    faster: the same passes, less recompute). And across layouts of the same degrees
    and schedule: ZeRO-3 FSDP holds no more than ZeRO-2, HSDP or DDP, so where its
    lightest option does not fit, theirs are not measured. What is not measured is a
    row that says which measurement decided it. `pool`: a process pool the layouts are
    searched in, side by side (not where the model's ranks are timed here:
    Search.times_model). `decided(rows, families done, families)` is called with
    every row as soon as it is decided (unranked: ranks are given once all are in)."""
    from parabench.predict import fakerank

    if search.times_model(name):  # its ranks are timed: one at a time, or they share cores
        pool = None
    rows: list[dict] = []
    families: dict[Candidate, list[Candidate]] = {}
    for c in candidates(name, facts, n, gpus_per_node, global_batch, depth):
        if isinstance(c, tuple):
            what, why, status = c
            if isinstance(what, Candidate):
                rows.append(
                    {**search.base(what, global_batch, tokens), "status": status, "reason": why}
                )
                continue
            rows.append(
                {
                    "model": name,
                    "gpus": n,
                    "layout": what.parallelism,  # its settings were never chosen
                    **what.degrees,
                    "status": status,
                    "reason": why,
                }
            )
        else:
            families.setdefault(_family(c), []).append(c)
    # (pp, tp, dp, schedule) -> families, lightest first: FSDP before DDP, ZeRO-3 before
    # ZeRO-2. A schedule decides what a stage holds (GPipe every micro-batch's
    # activations, 1F1B a stage's worth, Interleaved 1F1B a stage's gradients reduced
    # early), and its own micro-batches (GPipe's only where 1F1B cannot run: its
    # smallest can be 16): a layout is never decided by another schedule's fit
    groups: dict[tuple, list[Candidate]] = {}
    for fam in sorted(families, key=lambda f: (f.layout.dp_replicate > 1, -f.layout.zero)):
        lay = fam.layout
        groups.setdefault((lay.pp, lay.tp, lay.dp, lay.schedule), []).append(fam)

    def tell(got: list[dict], families_done: int) -> None:
        if decided is not None:
            decided(got, families_done, len(families))

    tell(rows, 0)  # the layouts that cannot run

    def run(fams: list[Candidate]) -> dict[Candidate, tuple[list[dict], bool]]:
        args = (facts, global_batch, tokens)
        out = {}
        if pool is None:
            with fakerank.kept_worlds():
                for f in fams:
                    out[f] = _search_family(search, families[f], *args)
                    tell(out[f][0], len(done) + len(out))
            return out
        from concurrent.futures import as_completed

        alike: dict[tuple, list[Candidate]] = {}
        for f in fams:
            alike.setdefault(_shape(f), []).append(f)
        known = {k[:2] for k in search.cache}

        def work(batch: list[Candidate]) -> tuple[int, int]:
            """What a batch has left to measure: its rank shapes not yet measured, then
            its layouts."""
            probes = {
                (c.model, reference(_probe(c, search.precision, search.optimizer)))
                for f in batch
                for c in families[f]
            }
            return len(probes - known), len(batch)

        # The longest first, as each worker takes the next as it frees: a long batch
        # taken last left the other worker idle for up to 11 s of a phase (Llama-3-8B)
        futures = {
            pool.submit(
                _families_job,
                search.for_family([c for f in batch for c in families[f]]),
                [families[f] for f in batch],
                *args,
            ): batch
            for batch in sorted(alike.values(), key=work, reverse=True)
        }
        for fut in as_completed(futures):
            found, new, memo, steps = fut.result()
            search.cache.update(new)
            for m in memo:
                fakerank.remember(m)
            search.measurements += steps
            batch = futures[fut]
            out.update(zip(batch, found, strict=True))
            tell([r for rows, _ in found for r in rows], len(done) + len(out))
        return out

    done: dict[Candidate, tuple[list[dict], bool]] = {}
    lightest = run([fams[0] for fams in groups.values()])
    done.update(lightest)
    # the rest of a group, unless its lightest layout does not fit (None: it failed, so
    # nothing is known, and they are measured)
    rest = [f for fams in groups.values() if lightest[fams[0]][1] is not False for f in fams[1:]]
    done.update(run(rest))
    skipped = 0  # families not measured: a lighter one of theirs does not fit
    for fams in groups.values():
        first = fams[0]
        for fam in fams:
            if fam in done:
                rows += done[fam][0]
                continue
            c0 = families[first][0]
            tried = sorted(  # its smallest micro-batch, and Interleaved 1F1B's island
                {min(c.micro for c in families[first])}
                | {c.micro for c in families[first] if c.layout.pp == c.accumulation}
                & {c.micro for c in families[first] if c.layout.schedule == "interleaved"}
            )
            lightest_micro = " nor at ".join(str(m) for m in tried)
            zero = {3: "ZeRO-3", 2: "ZeRO-2"}.get(c0.layout.zero, "")
            got = [
                {
                    **search.base(c, global_batch, tokens),
                    "status": "inferred",
                    "fits": False,
                    "binding": "memory",
                    "reason": (
                        f"does not fit: holds at least what {c0.layout.parallelism} "
                        f"{zero} holds, which does not fit at micro-batch {lightest_micro} "
                        "with full checkpointing (measured)"
                    ),
                }
                for c in families[fam]
            ]
            rows += got
            skipped += 1
            tell(got, len(done) + skipped)
    ranked = sorted(
        (r for r in rows if r.get("status") == "ok" and r.get("fits")), key=lambda r: r["step_s"]
    )
    for i, r in enumerate(ranked):
        r["rank"] = i + 1
    return rows


def write(rows: list[dict], out: Path) -> Path:
    path = out / ADVISE_CSV
    write_rows(path, ADVISE_COLUMNS, rows)
    return path


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"[:500]


def tokens_per_sample(spec: ModelSpec) -> int:
    """A language model's sequence length (0: a model that reads no tokens)."""
    return int(spec.size_dict().get("seq_len") or 0)


def global_batch_of(adv: dict, entry: dict, tokens: int) -> tuple[int, str]:
    """The global batch in samples, and why not where it cannot be had."""
    if adv.get("global_tokens"):
        if not tokens:
            return 0, "advise.global_tokens: the model reads no tokens (give global_batch)"
        if adv["global_tokens"] % tokens:
            return (
                0,
                f"advise.global_tokens: {adv['global_tokens']} is not a whole number of "
                f"{tokens}-token samples",
            )
        return adv["global_tokens"] // tokens, ""
    return int(adv.get("global_batch") or entry["batch_size"]), ""


def run(
    config: dict,
    gpu: GPU,
    fabric: Fabric,
    out: Path,
    log: Callable[[str], None] = print,
    pool=None,
) -> list[dict]:
    """Advise on every model of the config's `advise` section at each of its GPU counts:
    out/advise.csv, rewritten as each layout's rows are decided, so a search cut off
    keeps every row it decided (unranked until its N is done).
    `pool`: processes the layouts are searched in (`pool`), None for this one alone
    (and unused for a model whose ranks are timed here: `search`)."""
    from parabench.config import model_spec

    adv = config["advise"]
    names = adv.get("models") or list(config["models"])
    specs = {n: model_spec(config["models"][n]) for n in names}
    searcher = searching(specs, gpu, fabric, adv, log)
    rows: list[dict] = []
    for name in names:
        rows += _advise_model(searcher, config, name, pool, out, rows, log)
    write(rows, out)
    return rows


def searching(specs: dict, gpu: GPU, fabric: Fabric, adv: dict, log: Callable) -> Search:
    """The search the config's `advise` section asks for: its precision and optimizer
    measured, its runs priced compiled or with Float8 where it says so."""
    return Search(
        specs,
        gpu,
        fabric,
        adv.get("precision", "bf16"),
        adv.get("optimizer", "adamw"),
        log,
        compiled=bool(adv.get("compile")),
        float8=bool(adv.get("float8")),
    )


def candidate(text: str, model: str, global_batch: int, key: str = "--layout") -> Candidate:
    """A candidate as a person writes it: a layout (layout.Layout.parse) and its
    micro-batch ("FSDP 32 x TP 8, full AC, micro 2"; 1 when not said); the
    accumulation is what the global batch leaves. A ValueError naming `key`."""
    parts = [p.strip() for p in text.split(",")]
    micro = [p for p in parts if re.fullmatch(r"micro(-batch)? \d+", p.lower())]
    lay = Layout.parse(", ".join(p for p in parts if p not in micro), key)
    m = int(micro[-1].split()[-1]) if micro else 1
    if m < 1 or global_batch % (lay.dp * m):
        raise ValueError(
            f"{key}: the global batch of {global_batch} does not split into micro-batches "
            f"of {m} over {lay.dp} data-parallel ranks"
        )
    c = Candidate(model, lay.world, lay, m, global_batch // (lay.dp * m))
    if lay.pp > 1 and lay.schedule == "1f1b" and c.accumulation < lay.pp:
        raise ValueError(
            f"{key}: 1F1B needs a micro-batch per stage: {c.accumulation} for {lay.pp} "
            "stages (torch's Schedule1F1B refuses it)"
        )
    return c


def applies(c: Candidate, facts, depth: int | None, gpus_per_node: int) -> str:
    """Why a given layout is not one the search would run for this model (its
    `candidates`' rules), or "": tp within a node and splitting the model's widths, a
    pipeline's stages cut between its blocks, one at least each, the model sound."""
    lay = c.layout
    if facts.problems:
        return "; ".join(facts.problems)
    if lay.tp > 1:
        if gpus_per_node % lay.tp:
            return f"TP {lay.tp} is not within a node of {gpus_per_node} GPUs"
        if why := facts.tp_skip or (not facts.has_tp_plan and "no tensor-parallel plan"):
            return f"TP {lay.tp}: {why}"
        if why := facts.tp_problem(lay.tp):
            return f"TP {lay.tp}: {why}"
    if lay.pp > 1:
        if not depth or facts.cut_skip:
            return f"PP {lay.pp}: {facts.cut_skip or 'its repeated blocks are not known'}"
        if lay.pp > min(depth, MAX_PP):
            return f"PP {lay.pp}: at most {min(depth, MAX_PP)} stages ({depth} blocks)"
    if lay.schedule == "interleaved" and (
        why := interleaved_refusal(lay.pp, c.accumulation, depth)
    ):
        return why
    return ""


def price(
    config: dict,
    text: str,
    gpu: GPU,
    fabric: Fabric,
    out: Path,
    log: Callable = print,
    gpus: list[int] | None = None,
) -> list[dict]:
    """One given layout (`text`: a run's own, or a published one) priced for each model
    of the config's `advise` section as the search prices a candidate: a row per model,
    in out/advise-layout.csv (advise.csv stays the search's). Its GPUs are its degrees'
    product: `gpus` (the command line's), where given, must hold it."""
    from parabench import models
    from parabench.config import model_spec
    from parabench.predict import fakerank

    adv = config["advise"]
    # every model's candidate first: a refusal before anything is measured or written
    given = []
    for name in adv.get("models") or list(config["models"]):
        entry = config["models"][name]
        spec = model_spec(entry)
        tokens = tokens_per_sample(spec)
        batch, why = global_batch_of(adv, entry, tokens)
        if why:
            raise ValueError(why)
        c = candidate(text, name, batch)
        if gpus and c.gpus not in gpus:
            raise ValueError(f"--layout: {c.layout.label} runs on {c.gpus} GPUs, not --gpus {gpus}")
        facts = models.facts(spec)
        if why := applies(c, facts, fakerank.depth(spec), adv.get("gpus_per_node", 8)):
            raise ValueError(f"--layout: {name}: {why}")
        given.append((name, spec, tokens, batch, c, facts))
    rows = []
    for name, spec, tokens, batch, c, facts in given:
        search_ = searching({name: spec}, gpu, fabric, adv, log)
        row = {**search_.row(c, facts, batch, tokens)}
        rows.append({**row, "params": fakerank.parameters(spec)})
        write_rows(out / LAYOUT_CSV, ADVISE_COLUMNS, rows)
        said = (
            f"advise {name}: {c.layout.label}, micro {c.micro} x {c.accumulation} on "
            f"{c.gpus} GPUs: "
        )
        if row.get("status") != "ok":  # a measurement that failed prices nothing
            log(said + f"{row.get('status')}: {row.get('reason', '')}")
            continue
        log(
            said + f"{row['step_s']:.3g} s/step, {row['tokens_per_s_per_gpu']:,.0f} "
            f"tokens/s/GPU, {row['memory_bytes'] / 2**30:.1f} GiB, "
            + ("fits" if row.get("fits") else f"does not fit ({row.get('reason', '')})")
        )
    return rows


@contextlib.contextmanager
def pool(workers: int):
    """Processes the layouts are searched in (spawned: each measures on fake tensors
    under its own fake process group), or None for this process alone."""
    if workers < 2:
        yield None
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_exits_fast) as pool:
        yield pool


def _exits_fast() -> None:
    """A worker's exit skips the interpreter's teardown once its exit handlers have
    run (torch's among them, registered later, so run first): seconds with torch
    loaded, which the search waited on as its pool shut down (3.5 s of Llama-3-8B's).
    Every result is sent by then (the results' queue writes as it is called)."""
    import atexit

    def exit_now() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    atexit.register(exit_now)


class _Progress:
    """One (model, N)'s search as it goes: every row written out as soon as it is
    decided (after the `before` rows), so a search cut off keeps them; a log line per
    layout with the count done and an estimate of the time left."""

    def __init__(self, what: str, search_: Search, params: int, before, out: Path, log):
        self.what, self.search, self.params = what, search_, params
        self.out, self.log = out, log
        self.rows: list[dict] = []
        self.t0, self.measured = time.perf_counter(), search_.measurements
        # advise.csv as `write` writes it, in pieces: each row encoded once (written
        # whole after each layout, the table's thousands of rows took the searching
        # process 9 s of Llama-3-8B's search, on a core its workers need)
        self.text = [csv_text(ADVISE_COLUMNS, before)]

    def decided(self, got: list[dict], families_done: int, families: int) -> None:
        new = [{**r, "params": self.params} for r in got]
        self.rows += new
        self.text.append(csv_text(ADVISE_COLUMNS, new, header=False))
        atomic_write_bytes(self.out / ADVISE_CSV, "".join(self.text).encode())
        if families_done:
            spent = time.perf_counter() - self.t0
            left = spent / families_done * (families - families_done)
            self.log(
                f"{self.what}: {families_done}/{families} layouts, "
                f"{self.search.measurements - self.measured} measured, {spent:.0f} s, "
                f"about {left:.0f} s to go"
            )


def _advise_model(
    search_: Search, config: dict, name: str, pool, out: Path, done: list[dict], log
) -> list[dict]:
    """Model `name`'s rows at each N (advise.csv rewritten as each layout's are
    decided); what fails, a row that says why, and the next N goes on."""
    from parabench import models
    from parabench.predict import fakerank

    adv = config["advise"]
    spec, entry = search_.specs[name], config["models"][name]
    rows: list[dict] = []
    for n in adv["gpus"]:
        t0, before = time.perf_counter(), search_.measurements
        progress = None
        if pool is not None and getattr(pool, "_broken", False):
            pool = None  # a worker died in an earlier search: the rest here
        try:
            facts = models.facts(spec)
            tokens = tokens_per_sample(spec)
            batch, why = global_batch_of(adv, entry, tokens)
            if why or facts.problems:
                raise ValueError(why or "; ".join(facts.problems))
            depth = fakerank.depth(spec)
            params = fakerank.parameters(spec)
            while True:
                what = f"advise {name} N={n}"
                progress = _Progress(what, search_, params, done + rows, out, log)
                try:
                    found = search(
                        search_,
                        name,
                        facts,
                        n,
                        adv.get("gpus_per_node", 8),
                        batch,
                        tokens,
                        depth,
                        pool,
                        progress.decided,
                    )
                    break
                except BrokenProcessPool as e:
                    if pool is None:
                        raise
                    # a worker died (killed for memory, say): what it measured before
                    # is kept (search_.cache); this N again in this process
                    log(f"{what}: a worker process died ({_why(e)}); searched again here")
                    pool = None
        except Exception as e:  # this (model, N) fails; the table keeps the rest
            rows += progress.rows if progress else []  # what it decided before it failed
            rows.append({"model": name, "gpus": n, "status": "failed", "reason": _why(e)})
            write(done + rows, out)
            log(f"advise {name} N={n}: failed: {_why(e)}")
            continue
        rows += [{**r, "params": params} for r in found]
        write(done + rows, out)
        best = [r for r in found if r.get("rank") == 1]
        log(
            f"advise {name} N={n}: {search_.measurements - before} measured "
            f"[{time.perf_counter() - t0:.1f} s]; "
            + (
                f"best {best[0]['layout']}, micro {best[0]['micro_batch']}: "
                f"{best[0]['step_s']:.3g} s/step"
                if best
                else "nothing fits"
            )
        )
    return rows


def check_torchtitan(
    gpu: GPU, fabric: Fabric, log: Callable[[str], None] = print, pool=None
) -> list[dict]:
    """Each of torchtitan's published runs (published.TORCHTITAN_TABLES), its layout
    measured and predicted as advise does any candidate, compiled or with Float8 as
    that run was, beside what it reported; a table's runs priced from one measurement,
    the tables side by side in `pool`'s processes where given."""
    from parabench.config import model_spec
    from parabench.predict.published import TORCHTITAN_SOURCE, TORCHTITAN_TABLES, llama3_model

    specs = {t["model"]: model_spec(llama3_model(t["model"])) for t in TORCHTITAN_TABLES}
    searcher = Search(specs, gpu, fabric, "bf16", "adamw", log)
    tables: dict[str, list[dict]] = {}
    for t in TORCHTITAN_TABLES:
        tables.setdefault(t["table"], []).append(t)
    futures = {}
    for name, runs in tables.items() if pool else ():
        try:
            futures[name] = pool.submit(_torchtitan_rows, searcher, specs[runs[0]["model"]], runs)
        except BrokenProcessPool:  # a worker died before: the rest here
            break
    rows = []
    for name, runs in tables.items():
        try:
            try:
                got = futures[name].result() if name in futures else None
            except BrokenProcessPool as e:  # its worker died: once more, here
                log(f"torchtitan {name}: a worker process died ({_why(e)}); priced here")
                got = None
            if got is None:
                got = _torchtitan_rows(searcher, specs[runs[0]["model"]], runs)
        except Exception as e:  # transformers missing, say: rows that say so
            got = [{"status": "failed", "reason": _why(e)}] * len(runs)
            log(f"torchtitan {name}: failed: {e}")
        rows += [
            _torchtitan_row(row, t, TORCHTITAN_SOURCE, log)
            for row, t in zip(got, runs, strict=True)
        ]
    return rows


def _torchtitan_row(row: dict, t: dict, source: str, log: Callable) -> dict:
    """A published run's prediction beside what it reported."""
    published = {
        "table": t["table"],
        "run": t["run"],
        "source": source,
        "model": t["model"],
        "gpus": t["gpus"],
        "published_tokens_per_s_per_gpu": t["tokens_per_s_per_gpu"],
        "published_memory_gib": t["memory_gib"],
        "not_modelled": t["not_modelled"],
    }
    if row.get("status") != "ok":
        return {**row, **published}
    predicted_gib = row["memory_bytes"] / 2**30
    reserved_gib = row["reserved_bytes"] / 2**30
    log(
        f"torchtitan {t['table']}, {t['run']}: {row['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU "
        f"against {t['tokens_per_s_per_gpu']:,.0f}; {reserved_gib:.1f} GiB reserved against "
        f"{t['memory_gib']}"
    )
    return {
        **row,
        **published,
        "tps_error": row["tokens_per_s_per_gpu"] / t["tokens_per_s_per_gpu"] - 1,
        "predicted_memory_gib": predicted_gib,
        "memory_error": predicted_gib / t["memory_gib"] - 1,
        # torchtitan reports the reserved peak: like against like
        "predicted_reserved_gib": reserved_gib,
        "reserved_error": reserved_gib / t["memory_gib"] - 1,
    }


def _torchtitan_rows(searcher: Search, spec: ModelSpec, runs: list[dict]) -> list[dict]:
    """One published layout, measured once, priced as each of its runs ran (eager,
    compiled, Float8) as any candidate is."""
    from parabench import models
    from parabench.predict import fakerank

    facts, params = models.facts(spec), fakerank.parameters(spec)
    rows = []
    for r in runs:  # the schedule is not measured (fakerank.Probe): one measurement
        layout = Layout(
            pp=r["pp"],
            dp_shard=r["dp_shard"],
            tp=r["tp"],
            zero=r["zero"],
            ac=r["ac"],
            schedule=r["schedule"] or "1f1b",
        )
        c = Candidate(r["model"], r["gpus"], layout, r["micro"], r["accumulation"])
        batch = c.micro * c.accumulation * c.layout.dp
        row = searcher.priced(r["compile"], r["float8"]).row(
            c, facts, batch, tokens_per_sample(spec)
        )
        rows.append({**row, "params": params})
    return rows
