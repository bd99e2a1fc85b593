"""One real rank of a world of N, alone in this process: what the scaling model and the
plan predict from.

The rank joins a process group whose collectives return at once (process/nocomm.py: its own
data stands in for its peers'), so the strategy is the real one, built as a cell
builds it: FSDP shards the model N ways, ZeRO-1 keeps 1/N of the optimizer state, a
tensor-parallel rank multiplies its slices of the matrices, a pipeline stage runs its
own blocks over every micro-batch, gradient accumulation runs its micro-batches. For
that rank, measured:

- its compute step (the median of timed steps after a warm-up, synchronized), with
  nothing to wait for;
- the bytes of parameters, gradients and optimizer state it holds between steps, and
  its peak in a step;
- the collectives it issues per step and their bytes, counted by the group itself in
  the anatomy's units (nocomm.counting).

`parabench ranks` measures, one after another, one rank of every multi-process cell of
a sweep with the cores that rank gets there (every stage of a pipeline: the slowest
sets its pace): ranks.csv, what scaling.predict reads. It runs them in a child process
(launch.launch_ranks), so a crash or a hang still ends in a row per rank that says
why. `parabench plan` measures ranks at world sizes no one here has (predict/plan.py).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from parabench import envinfo, strategies
from parabench.config import rank_key, ranks_of
from parabench.models import build
from parabench.process import nocomm, runtime
from parabench.process.data import Shard, SyntheticBatches
from parabench.records import RANK_COLUMNS, RANK_KEY, read_rows, write_rows
from parabench.run import faults, profiling
from parabench.run.loop import ALONE_STEPS, ALONE_WARMUP, run_step, synchronizer
from parabench.spec import RunSpec
from parabench.strategies import checkpointing


def device_memory(device: torch.device) -> int | None:
    """What one device holds: the GPU's memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return envinfo.available_memory()


def rank_of(spec: RunSpec, threads: int, rank: int = 0) -> dict:
    """Rank `rank` of a world of spec.devices, in this process, with `threads` intra-op
    threads: what it holds, its peak, its compute step and the collectives it issues
    (see the module's docstring)."""
    world = spec.devices
    device = torch.device(runtime.resolve_device_type(spec.device))
    if device.type == "cuda":
        # The rank drives the first device it sees (the job asks for one), made current
        # before any device mesh is built: a mesh otherwise picks cuda:<rank % count>.
        device = torch.device("cuda", 0)
    # One process measures every rank: the last one's leftovers, freed inside this one's
    # counted step, would lower its peak (CPU) or raise it (CUDA's high-water mark).
    profiling.release([device])
    if device.type == "cuda" and torch.cuda.is_available():  # else skipped: none visible
        torch.cuda.set_device(device)
        profiling.reset_high_water([device])
    torch.set_num_threads(threads)
    # Alone on its host: local rank 0 of 1, so it needs the one device it drives.
    with _threads_restored(), runtime.alone(spec, rank, device, threads) as ctx:
        if reason := strategies.get(spec.strategy).skip_reason(spec, ctx):
            return {"status": "skipped", "reason": reason}
        # after the skip: a mesh on a device that is not there fails
        ctx = runtime.with_meshes(ctx, spec)
        model = build(spec.model, spec.seed)
        strategy = strategies.build(model, spec, ctx)
        # Only this rank's samples are drawn: at weak scaling the global batch of a
        # world of 1,024 would not fit in memory, and no other rank needs it.
        per_rank = spec.global_batch // strategy.shard.count
        batches = SyntheticBatches(model, per_rank, spec.seed, Shard(0, 1), strategy.data_device)
        sync = synchronizer(strategy.devices())
        fault = faults.for_cell(spec.model_name, spec.strategy, world, 0, rank)
        times = []
        for step in range(ALONE_STEPS + ALONE_WARMUP):
            if fault and step == fault.step:
                fault.fire()
            times.append(run_step(strategy, batches, step, sync)[0])
        held = strategy.held_bytes()
        # The group counts the collectives (c10d calls it past the profiler), so the
        # profiler records memory only: shapes cost a third of the time.
        # Each mesh dimension's group counts its own (a 1-D strategy's one dimension is
        # the world): the bytes per dimension, and their sum per op.
        groups = ctx.named_mesh().groups() if ctx.meshes else {_one_dim(spec): ctx.group}
        # the rank's peak is its counted step's, as a cell's (run/cell.py): not its
        # build's, which moved the whole model onto its device before sharding it, nor
        # its warm-up's (FSDP's lazy init, compile's workspaces)
        profiling.reset_high_water(strategy.devices())
        with nocomm.counting_each(groups) as by_dim:
            counted = profiling.StepProfiler(ctx).count(
                lambda: run_step(strategy, batches, ALONE_STEPS + ALONE_WARMUP, sync), shapes=False
            )
        comm = nocomm.merged(by_dim)
        peak = profiling.peak_memory(strategy.devices(), held, counted)  # before the tracker's step
        saved = saved_activations(
            lambda: run_step(strategy, batches, ALONE_STEPS + ALONE_WARMUP + 1, sync)
        )
        return {
            "status": "ok",
            "reason": "",
            "samples_per_rank": per_rank,
            "tokens_per_sample": model.tokens_per_sample,
            "params_bytes_per_rank": held["params"],
            "grads_bytes_per_rank": held["grads"],
            "optimizer_bytes_per_rank": held["optimizer"],
            "peak_memory_bytes": peak,
            "device_memory_bytes": device_memory(device),
            "compute_s": statistics.median(times[ALONE_WARMUP:]),
            "compute_steps_s": times[ALONE_WARMUP:],
            "comm_by_op": comm,
            "comm_by_dim": by_dim,
            "saved_activation_bytes": saved,
            "checkpointed_blocks": checkpointing.count(model.blocks()),
            "comm_bytes_per_step": sum(v["bytes"] for v in comm.values()),
            "collectives_per_step": sum(v["count"] for v in comm.values()),
        }


@contextlib.contextmanager
def _threads_restored() -> Iterator[None]:
    """The process's intra-op threads as they were before a rank set its own."""
    try:
        yield
    finally:
        torch.set_num_threads(envinfo.usable_cores())


def saved_activations(step) -> int | None:
    """Bytes of activations saved for backward when the forward ends, by torch's own
    memory tracker (MemTracker: every tensor by category, on one more step): the
    largest over the modules whose forward it saw end, which is the outermost one's.
    None where the tracker cannot follow the step (it reads torch internals)."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState

    try:
        tracker = MemTracker()
        with tracker:
            step()
        saved = [
            snap.get(_MemRefType.ACT, 0)
            for state in tracker.memory_tracking.values()
            if hasattr(state, "snapshots")
            for taken in state.snapshots.get(_ModState.POST_FW, [])
            for snap in taken.values()
        ]
    except Exception:  # a missing figure, not a failed rank
        return None
    return max(saved, default=None)


def _one_dim(spec: RunSpec) -> str:
    """The mesh dimension a 1-D strategy's world is (ddp: dp_replicate), or "world"
    for a strategy with none."""
    return next(iter(spec.record.layout.declared()), "world")


def measured(spec: RunSpec, threads: int, rank: int = 0) -> dict:
    """rank_of, with a failure recorded as a row that says why (an allocation failure:
    it does not fit), never a lost table."""
    try:
        return rank_of(spec, threads, rank)
    except Exception as e:
        got = {"status": "failed", "reason": f"{type(e).__name__}: {e}"[:500]}
        if isinstance(e, torch.OutOfMemoryError | MemoryError):
            got["fits"] = False
        return got


def threads_of(spec: RunSpec, rank: int, cores: int) -> int:
    """The intra-op threads rank `rank` of the cell runs with: its share of its host's
    cores, as runtime.bind gives it."""
    local = spec.devices // spec.nodes
    return len(runtime.share(rank % local, local, list(range(cores))))


def run_ranks(config: dict, out: Path, part: tuple[int, int] | None = None) -> None:
    """Measure every rank of config.alone_ranks(config) (with `part`, this job's share:
    config.ranks_of), one after another, each with the threads its rank of the cell
    gets; out/ranks.csv is rewritten after each, so a crash loses none measured before
    it. Rows already in out/ranks.csv are kept, not measured again: launch.launch_ranks,
    which runs this in a child, starts it again after a rank that killed it or ran past
    its time, having recorded that rank as failed."""
    cores = envinfo.usable_cores()
    path = out / "ranks.csv"
    wanted = ranks_of(config, part)
    keys = {_key(rank_key(spec, rank)) for spec, rank in wanted}
    rows = [row for row in read_rows(path) if _key(row) in keys]
    done = {_key(row) for row in rows}
    for spec, rank in wanted:
        if _key(rank_key(spec, rank)) in done:
            continue
        threads = threads_of(spec, rank, cores)
        t0 = time.perf_counter()
        got = measured(spec, threads, rank)
        for key in ("comm_by_op", "comm_by_dim", "compute_steps_s"):
            if key in got:
                got[key] = json.dumps(got[key], sort_keys=True)
        rows.append({**rank_key(spec, rank), "threads": threads, **got})
        write_rows(path, RANK_COLUMNS, rows)
        print(
            f"ranks {spec.model_name} {spec.strategy} x{spec.devices} rank {rank}: "
            f"{got['status']} {got.get('reason') or ''}[{time.perf_counter() - t0:.1f} s]",
            flush=True,
        )


def _key(row: dict) -> tuple[str, ...]:
    return tuple(str(row[k]) for k in RANK_KEY)
