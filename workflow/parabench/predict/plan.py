"""`parabench plan`: what a strategy would cost at a world size no one here has, one
real rank at a time.

One process plays rank 0 of a world of N (8 to 1,024) over a process group whose
collectives return at once (ranks.rank_of). The strategy is the real one, built as a
cell builds it: FSDP shards the model N ways, ZeRO-1 keeps 1/N of the optimizer state,
DDP buckets its gradients. For that rank:

- memory, measured: the bytes of parameters, gradients and optimizer state it holds
  between steps (from the tensors) and its peak in a step (the profiler's allocator
  total on CPU, the allocator's high-water mark on CUDA), so "does it fit" is an
  observation, with a tenth of the device kept free for what a GPU holds beyond it
  (`gpus.fits`; advise decides more closely: a GPU's reserve and context modelled, a
  CPU host holding every rank of a layout);
- its compute step, measured: its share of the batch (weak scaling: the per-device
  batch, whatever N; strong: the global batch / N), no communication;
- the collectives it issues per step and their bytes, counted by the group itself in
  the anatomy's units (nocomm.counting: calls, and the full buffer per call).

Its step is then predicted as the scaling model predicts a measured cell's
(predict/scaling.py): compute + every collective at the fabric's time
(hardware/fabric.py; none assumed hidden) + a pipeline's bubble. Time is predicted;
memory, compute and bytes are not.
(A pipeline is planned from its first stage alone, where the scaling model reads every
stage.)

Each planned rank is given the whole device at hand (what one device of N would do).
The method is checked where it can be: the scaling model predicts every multi-device
cell of the sweep the same way, from one rank measured alone (predict/rank_alone.py), and the
report publishes its error against those cells.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pandas as pd

from parabench import checks, envinfo
from parabench.config import plan_key, planned_specs
from parabench.hardware import gpus
from parabench.hardware.fabric import Fabric
from parabench.predict.scaling import bubble_time, layout_comm
from parabench.records import PLAN_COLUMNS, PLAN_KEY, read_rows, write_rows
from parabench.spec import RunSpec


def _dp_share(spec: RunSpec) -> float:
    """The share of a device in its data-parallel rank: 1/(tp x pp), 1 for the
    strategies without degrees (their rank is their device)."""
    return 1 / (spec.layout.tp * spec.layout.pp)


def predict(row: dict, spec: RunSpec, fabric: Fabric) -> dict:
    """The planned rank's step on `fabric`, by the scaling model's terms."""
    compute, settings = row["compute_s"], dict(spec.options)
    m = settings.get("microbatches", 1)
    # the rank planned is rank 0: for a pipeline, its first stage's sends alone
    comm = layout_comm([row["comm_by_dim"]], fabric.time, spec.layout.degrees, m)
    bubble = bubble_time(spec.record, compute, spec.stages, settings)
    step = compute + comm + bubble
    return {
        "comm_s": comm,
        "bubble_s": bubble,
        "predicted_step_s": step,
        # a data-parallel rank's samples, which its tp x pp devices share
        "samples_per_s_per_device": row["samples_per_rank"] / step * _dp_share(spec),
        # what a device would do alone (its compute) over what it does in the world
        "scaling_efficiency": compute / step,
        "fits": gpus.fits(row["peak_memory_bytes"], row["device_memory_bytes"]),
    }


def run_plan(config: dict, fabric: Fabric, out: Path) -> pd.DataFrame:
    """Plan every rank of `config`'s plan, predict it on `fabric`, and rewrite
    out/plan.csv (atomically) after each, so a crash loses none planned before it. A
    rank that fails is a row that says why (an allocation failure: it does not fit);
    rows already in out/plan.csv are kept, not planned again: launch.launch_plan, which
    runs this in a child, starts it again after a rank that killed it, having recorded
    that rank as failed."""
    from parabench.predict.rank_alone import measured  # torch: only in the process that measures

    cores = envinfo.usable_cores()
    path = out / "plan.csv"
    wanted = planned_specs(config)
    keys = {_key(plan_key(spec)) for spec in wanted}
    rows = [row for row in read_rows(path) if _key(row) in keys]
    done = {_key(row) for row in rows}
    for spec in wanted:
        if _key(plan_key(spec)) in done:
            continue
        n = spec.devices
        base = {
            **plan_key(spec),
            "scaling": spec.scaling,
            "fabric": fabric.name,
            "fabric_source": fabric.source,
            "threads": cores,
        }
        problem = checks.problems(spec, launching=False) or [checks.static_skip_reason(spec)]
        if spec.record.processes(n) == 1:
            problem = [f"{spec.strategy} runs in one process: no world of {n} ranks to plan"]
        t0 = time.perf_counter()
        if any(problem):
            row = {**base, "status": "skipped", "reason": "; ".join(filter(None, problem))}
        else:
            row = {**base, **measured(spec, cores)}
            if row["status"] == "ok":
                row.update(predict(row, spec, fabric))
                for key in ("comm_by_op", "comm_by_dim"):
                    row[key] = json.dumps(row[key], sort_keys=True)
        rows.append(row)
        write_rows(path, PLAN_COLUMNS, rows)
        if row["status"] != "skipped":
            print(
                f"plan {spec.model_name} {spec.strategy} N={n}: {row['status']}"
                f"{' ' + row['reason'] if row.get('reason') else ''} "
                f"[{time.perf_counter() - t0:.1f} s]",
                flush=True,
            )
    write_rows(path, PLAN_COLUMNS, rows)  # also when nothing was left to plan
    return pd.read_csv(path)


def _key(row: dict) -> tuple[str, ...]:
    return tuple(str(row[k]) for k in PLAN_KEY)
