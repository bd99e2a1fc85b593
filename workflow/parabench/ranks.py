"""One real rank of a world of N, alone in this process: what the scaling model and the
plan predict from.

The rank joins a process group whose collectives return at once (nocomm.py: its own
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
a sweep at the cores that rank gets there (every stage of a pipeline: the slowest
sets its pace): ranks.csv, what scaling.predict reads. `parabench plan` measures ranks
at world sizes no one here has (plan.py).
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist

from parabench import envinfo, nocomm, profiling, runtime, strategies
from parabench.config import alone_ranks
from parabench.data import Shard, SyntheticBatches
from parabench.loop import run_step, synchronizer
from parabench.models import build
from parabench.records import VARIANT_KEYS, atomic_write_bytes
from parabench.spec import RunSpec

STEPS, WARMUP = 6, 2  # the rank's timed steps (median) after its warm-up

# ranks.csv: one row per rank measured
COLUMNS = (
    *VARIANT_KEYS,
    "strategy",
    "devices",
    "rank",
    "status",
    "reason",
    "threads",
    "samples_per_rank",
    "compute_s",
    "compute_steps_s",
    "comm_by_op",
    "comm_bytes_per_step",
    "collectives_per_step",
    "params_bytes_per_rank",
    "grads_bytes_per_rank",
    "optimizer_bytes_per_rank",
    "peak_memory_bytes",
)


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
    # One process measures every rank: the last one's leftovers, freed inside this one's
    # counted step, would lower its peak (CPU) or raise it (CUDA's high-water mark).
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    dist.init_process_group(nocomm.BACKEND, store=dist.HashStore(), rank=rank, world_size=world)
    torch.set_num_threads(threads)
    try:
        group = dist.group.WORLD
        group.alone = True  # no peer will ever send (nocomm.py)
        cores = envinfo.usable_cores()
        ctx = runtime.Context(rank, world, rank, device, threads, True, 1, (), cores, group, group)
        if reason := strategies.get(spec.strategy).skip_reason(spec, ctx):
            return {"status": "skipped", "reason": reason}
        model = build(spec.model, spec.seed)
        strategy = strategies.build(model, spec, ctx)
        # Only this rank's samples are drawn: at weak scaling the global batch of a
        # world of 1,024 would not fit in memory, and no other rank needs it.
        per_rank = spec.global_batch // strategy.shard.count
        batches = SyntheticBatches(model, per_rank, spec.seed, Shard(0, 1), strategy.data_device)
        sync = synchronizer(strategy.devices())
        times = [run_step(strategy, batches, s, sync)[0] for s in range(STEPS + WARMUP)]
        held = strategy.held_bytes()
        # The group counts the collectives (c10d calls it past the profiler), so the
        # profiler records memory only: shapes cost a third of the time.
        with nocomm.counting(group) as comm:
            counted = profiling.StepProfiler(ctx).count(
                lambda: run_step(strategy, batches, STEPS + WARMUP, sync), shapes=False
            )
        return {
            "status": "ok",
            "reason": "",
            "samples_per_rank": per_rank,
            "tokens_per_sample": model.tokens_per_sample,
            "params_bytes_per_rank": held["params"],
            "grads_bytes_per_rank": held["grads"],
            "optimizer_bytes_per_rank": held["optimizer"],
            "peak_memory_bytes": profiling.peak_memory(strategy.devices(), held, counted),
            "device_memory_bytes": device_memory(device),
            "compute_s": statistics.median(times[WARMUP:]),
            "compute_steps_s": times[WARMUP:],
            "comm_by_op": comm,
            "comm_bytes_per_step": sum(v["bytes"] for v in comm.values()),
            "collectives_per_step": sum(v["count"] for v in comm.values()),
        }
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(envinfo.usable_cores())


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


def run_ranks(config: dict, out: Path) -> pd.DataFrame:
    """Measure every rank of config.alone_ranks(config), each with the threads one of N ranks
    gets on this host (at least one), and write out/ranks.csv."""
    cores = envinfo.usable_cores()
    rows = []
    for spec, rank in alone_ranks(config):
        # as runtime.bind shares a host's cores among its ranks
        threads = max(1, cores // (spec.devices // spec.nodes))
        t0 = time.perf_counter()
        got = measured(spec, threads, rank)
        for key in ("comm_by_op", "compute_steps_s"):
            if key in got:
                got[key] = json.dumps(got[key], sort_keys=True)
        rows.append(
            {
                **{k: getattr(spec, k) for k in ("precision", "optimizer", "compile")},
                "model": spec.model_name,
                "strategy": spec.strategy,
                "devices": spec.devices,
                "rank": rank,
                "threads": threads,
                **got,
            }
        )
        print(
            f"ranks {spec.model_name} {spec.strategy} x{spec.devices} rank {rank}: "
            f"{got['status']} {got.get('reason') or ''}[{time.perf_counter() - t0:.1f} s]",
            flush=True,
        )
    table = pd.DataFrame(rows).reindex(columns=list(COLUMNS))
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "ranks.csv", table.to_csv(index=False).encode())
    return table
