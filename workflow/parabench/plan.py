"""`parabench plan`: what a strategy would cost at a world size no one here has, one
real rank at a time.

One process plays rank 0 of a world of N (8 to 1,024) over a process group whose
collectives return at once (nocomm.py: its own data stands in for its peers'). The
strategy is the real one, built as a cell builds it: FSDP shards the model N ways,
ZeRO-1 keeps 1/N of the optimizer state, DDP buckets its gradients. For that rank:

- memory, measured: the bytes of parameters, gradients and optimizer state it holds
  between steps (from the tensors) and its peak in a step (the profiler's allocator
  total on CPU, the allocator's high-water mark on CUDA), so "does it fit" is an
  observation;
- its compute step, measured: its share of the batch (weak scaling: the per-device
  batch, whatever N; strong: the global batch / N), no communication;
- the collectives it issues per step and their bytes, counted by the group itself in
  the anatomy's units (nocomm.counting: calls, and the full buffer per call).

Its step is then predicted as the scaling model predicts a measured cell's
(scaling.py): compute + every collective at the fabric's time (fabric.py; none assumed
hidden) + a pipeline's bubble. Time is predicted; memory, compute and bytes are not.

Two kinds of row:
- `scale`: the planned world sizes, with the rank given the whole device at hand (what
  one device of N would do);
- `check`: N = 2 and 4 at the sweep's own settings, with the rank given the cores one
  of N ranks gets on this host and its compute stretched by the ranks sharing a core,
  as the scaling model does; scaling.against_measured sets them beside the measured
  cells.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist

from parabench import checks, envinfo, nocomm, profiling, runtime, strategies
from parabench.config import spec_for
from parabench.data import Shard, SyntheticBatches
from parabench.fabric import Fabric
from parabench.loop import run_step, synchronizer
from parabench.models import build
from parabench.records import atomic_write_bytes
from parabench.scaling import bubble_time
from parabench.spec import RunSpec

COLUMNS = (
    "model",
    "precision",
    "optimizer",
    "compile",
    "strategy",
    "world_size",
    "kind",
    "status",
    "reason",
    "scaling",
    "samples_per_rank",
    "tokens_per_sample",
    "threads",
    "ranks_per_core",
    "params_bytes_per_rank",
    "grads_bytes_per_rank",
    "optimizer_bytes_per_rank",
    "peak_memory_bytes",
    "device_memory_bytes",
    "fits",
    "compute_s",
    "comm_bytes_per_step",
    "collectives_per_step",
    "comm_by_op",
    "comm_s",
    "bubble_s",
    "predicted_step_s",
    "samples_per_s_per_device",
    "scaling_efficiency",
    "fabric",
    "fabric_source",
)

STEPS, WARMUP = 6, 2  # the planned rank's timed steps (median) after its warm-up


def device_memory(device: torch.device) -> int | None:
    """What one device holds: the GPU's memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return envinfo.available_memory()


def rank_of(spec: RunSpec, threads: int) -> dict:
    """Rank 0 of a world of spec.devices, in this process: what it holds, its peak, its
    compute step and the collectives it issues (see the module's docstring)."""
    world = spec.devices
    device = torch.device(runtime.resolve_device_type(spec.device))
    # One process plans every rank: the last one's leftovers, freed inside this one's
    # counted step, would lower its peak (CPU) or raise it (CUDA's high-water mark).
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    dist.init_process_group(nocomm.BACKEND, store=dist.HashStore(), rank=0, world_size=world)
    torch.set_num_threads(threads)
    try:
        group = dist.group.WORLD
        cores = envinfo.usable_cores()
        ctx = runtime.Context(0, world, 0, device, threads, True, 1, (), cores, group, group)
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
        # profiler records memory only: shapes cost a third of the plan's time.
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
            "comm_by_op": comm,
            "comm_bytes_per_step": sum(v["bytes"] for v in comm.values()),
            "collectives_per_step": sum(v["count"] for v in comm.values()),
        }
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(envinfo.usable_cores())


def _fits(peak: int, memory: int | None) -> bool | None:
    return None if not memory else peak <= memory


def predict(row: dict, spec: RunSpec, fabric: Fabric) -> dict:
    """The planned rank's step on `fabric`, by the scaling model's terms."""
    n = spec.devices
    compute = row["compute_s"] * row["ranks_per_core"]
    comm = fabric.step_comm(row["comm_by_op"], n)
    bubble = bubble_time(spec.record, compute, n, dict(spec.options))
    step = compute + comm + bubble
    return {
        "compute_s": compute,
        "comm_s": comm,
        "bubble_s": bubble,
        "predicted_step_s": step,
        "samples_per_s_per_device": row["samples_per_rank"] / step,
        # what a device would do alone (its compute) over what it does in the world
        "scaling_efficiency": compute / step,
        "fits": _fits(row["peak_memory_bytes"], row["device_memory_bytes"]),
    }


def planned_specs(config: dict) -> list[tuple[str, RunSpec]]:
    """(kind, spec) of every planned rank: each model x strategy at the check sizes
    (the sweep's settings) and at the planned world sizes (the plan's scaling)."""
    plan = config["plan"]
    out = []
    for model in plan.get("models") or list(config["models"]):
        for strategy in plan["strategies"]:
            for n in plan["check_sizes"]:
                out.append(("check", spec_for(config, model, strategy, n, 0)))
            for n in plan["world_sizes"]:
                spec = spec_for(config, model, strategy, n, 0)
                out.append(("scale", replace(spec, scaling=plan["scaling"])))
    return out


def run_plan(config: dict, fabric: Fabric, out: Path, curves: Fabric | None = None) -> pd.DataFrame:
    """Plan every rank of `config`'s plan, predict it on `fabric` (the check rows on
    this machine's `curves`: they are set beside cells measured here, so their fabric
    must be this machine's), write out/plan.csv. A rank that fails is a row that says
    why (an allocation failure: it does not fit), never a lost plan."""
    cores = envinfo.usable_cores()
    rows = []
    for kind, spec in planned_specs(config):
        n = spec.devices
        base = {
            "model": spec.model_name,
            "precision": spec.precision,
            "optimizer": spec.optimizer,
            "compile": spec.compile,
            "strategy": spec.strategy,
            "world_size": n,
            "kind": kind,
            "scaling": spec.scaling,
            "fabric": fabric.name,
            "fabric_source": fabric.source,
        }
        problem = checks.problems(spec, launching=False) or [checks.static_skip_reason(spec)]
        if spec.record.ranks(n) == 1:
            problem = [f"{spec.strategy} runs in one process: no world of {n} ranks to plan"]
        on = curves if kind == "check" else fabric
        if on is None and not any(problem):
            problem = ["no collective curves were measured here to check against"]
        if any(problem):
            rows.append({**base, "status": "skipped", "reason": "; ".join(filter(None, problem))})
            continue
        base.update(fabric=on.name, fabric_source=on.source)
        # check rows: one of n ranks on this host (its cores, and k ranks per core)
        threads = max(1, cores // n) if kind == "check" else cores
        share = max(1.0, n * threads / cores) if kind == "check" else 1.0
        t0 = time.perf_counter()
        try:
            got = rank_of(spec, threads)
        except Exception as e:  # recorded, and the plan goes on
            oom = isinstance(e, torch.OutOfMemoryError | MemoryError)
            got = {"status": "failed", "reason": f"{type(e).__name__}: {e}"[:500]}
            if oom:
                got["fits"] = False
        row = {**base, **got, "threads": threads, "ranks_per_core": share}
        if got["status"] == "ok":
            row.update(predict(row, spec, on))
            row["comm_by_op"] = json.dumps(got["comm_by_op"], sort_keys=True)
        rows.append(row)
        print(
            f"plan {spec.model_name} {spec.strategy} N={n} ({kind}): {row['status']}"
            f"{' ' + row['reason'] if row.get('reason') else ''} "
            f"[{time.perf_counter() - t0:.1f} s]",
            flush=True,
        )
    table = pd.DataFrame(rows).reindex(columns=list(COLUMNS))
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "plan.csv", table.to_csv(index=False).encode())
    return table
