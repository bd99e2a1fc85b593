"""`parabench plan`: what a strategy would cost at a world size no one here has, one
real rank at a time.

One process plays rank 0 of a world of N (8 to 1,024) over a process group whose
collectives return at once (ranks.rank_of). The strategy is the real one, built as a
cell builds it: FSDP shards the model N ways, ZeRO-1 keeps 1/N of the optimizer state,
DDP buckets its gradients. For that rank:

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
(A pipeline is planned from its first stage alone, where the scaling model reads every
stage.)

Each planned rank is given the whole device at hand (what one device of N would do).
The method is checked where it can be: the scaling model predicts every multi-device
cell of the sweep the same way, from one rank measured alone (ranks.py), and the
report publishes its error against those cells.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd

from parabench import checks, envinfo
from parabench.config import spec_for
from parabench.fabric import Fabric
from parabench.ranks import measured
from parabench.records import atomic_write_bytes
from parabench.scaling import bubble_time, critical_comm
from parabench.spec import RunSpec

COLUMNS = (
    "model",
    "precision",
    "optimizer",
    "compile",
    "strategy",
    "world_size",
    "status",
    "reason",
    "scaling",
    "samples_per_rank",
    "tokens_per_sample",
    "threads",
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


def _fits(peak: int, memory: int | None) -> bool | None:
    return None if not memory else peak <= memory


def predict(row: dict, spec: RunSpec, fabric: Fabric) -> dict:
    """The planned rank's step on `fabric`, by the scaling model's terms."""
    n = spec.devices
    compute, settings = row["compute_s"], dict(spec.options)
    m = settings.get("microbatches", 1)

    def time_of(op: str, nbytes: float) -> float:
        return fabric.time(op, n, nbytes)

    # the rank planned is rank 0: for a pipeline, its first stage's sends alone
    comm = critical_comm([row["comm_by_op"]], time_of, spec.record.pipelined, m)
    bubble = bubble_time(spec.record, compute, n, settings)
    step = compute + comm + bubble
    return {
        "comm_s": comm,
        "bubble_s": bubble,
        "predicted_step_s": step,
        "samples_per_s_per_device": row["samples_per_rank"] / step,
        # what a device would do alone (its compute) over what it does in the world
        "scaling_efficiency": compute / step,
        "fits": _fits(row["peak_memory_bytes"], row["device_memory_bytes"]),
    }


def planned_specs(config: dict) -> list[RunSpec]:
    """Every planned rank: each model x strategy at the planned world sizes, at the
    plan's scaling."""
    plan = config["plan"]
    return [
        replace(spec_for(config, model, strategy, n, 0), scaling=plan["scaling"])
        for model in plan.get("models") or list(config["models"])
        for strategy in plan["strategies"]
        for n in plan["world_sizes"]
    ]


def run_plan(config: dict, fabric: Fabric, out: Path) -> pd.DataFrame:
    """Plan every rank of `config`'s plan, predict it on `fabric`, write out/plan.csv.
    A rank that fails is a row that says why (an allocation failure: it does not fit),
    never a lost plan."""
    cores = envinfo.usable_cores()
    rows = []
    for spec in planned_specs(config):
        n = spec.devices
        base = {
            "model": spec.model_name,
            "precision": spec.precision,
            "optimizer": spec.optimizer,
            "compile": spec.compile,
            "strategy": spec.strategy,
            "world_size": n,
            "scaling": spec.scaling,
            "fabric": fabric.name,
            "fabric_source": fabric.source,
            "threads": cores,
        }
        problem = checks.problems(spec, launching=False) or [checks.static_skip_reason(spec)]
        if spec.record.ranks(n) == 1:
            problem = [f"{spec.strategy} runs in one process: no world of {n} ranks to plan"]
        if any(problem):
            rows.append({**base, "status": "skipped", "reason": "; ".join(filter(None, problem))})
            continue
        t0 = time.perf_counter()
        row = {**base, **measured(spec, cores)}
        if row["status"] == "ok":
            row.update(predict(row, spec, fabric))
            row["comm_by_op"] = json.dumps(row["comm_by_op"], sort_keys=True)
        rows.append(row)
        print(
            f"plan {spec.model_name} {spec.strategy} N={n}: {row['status']}"
            f"{' ' + row['reason'] if row.get('reason') else ''} "
            f"[{time.perf_counter() - t0:.1f} s]",
            flush=True,
        )
    table = pd.DataFrame(rows).reindex(columns=list(COLUMNS))
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "plan.csv", table.to_csv(index=False).encode())
    return table
