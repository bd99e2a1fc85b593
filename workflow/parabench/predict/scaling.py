"""A scaling model: each multi-device cell's step predicted from measurements on one
device and the collectives curves only, then set beside the measurement, out of sample.

    predicted = compute + bubble + comm

- compute: one rank of the strategy at n, measured alone (predict/rank_alone.py, ranks.csv): the
  real strategy over a group whose collectives return at once, on the cores one of n
  ranks gets on the host, so its compute is its own (DDP's hooks, FSDP's shard copies,
  tensor parallel's sliced matrices, the micro-batches of a pipeline stage or of
  gradient accumulation). For a pipeline, its slowest stage. One-process strategies
  (naive model parallel, DataParallel) run their stages or replicas one after another
  in one process: their one-device step, whatever n (the reference's where the sweep
  has no such cell).
- time-slicing: where a host's ranks outnumber its cores, k ranks take turns on each
  core (k = ranks per core, from the cell's binding), and a rank's compute takes k
  times as long. Said explicitly, not fitted: the report says such cells measure a
  shared processor.
- bubble: pipelines only, (n-1)/m of a stage's compute (GPipe and 1F1B alike: m
  micro-batches through n stages take m + n - 1 slots).
- comm: for each collective the rank issued alone (counted by its group: calls and
  bytes per step), the collectives benchmark's time at that size and device count.
  None of it is assumed hidden behind compute, so a strategy that overlaps it (DDP's
  bucketed all-reduce during backward) should come out faster than predicted. A
  pipeline's transfers are the schedule's own: only the fill and the drain wait on
  them, one transfer per boundary each way (critical_comm).

The plan (predict/plan.py) predicts a rank at 8 to 1,024 devices the same way, so this model's
error at the device counts measured here is the check on the plan's method.

A cell whose prediction is off by more than 25% is flagged, and the term furthest from
its measured counterpart is named: the model's miss, said rather than hidden. The
report publishes the error (MAPE) per strategy, per device count and overall.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import numpy as np
import pandas as pd

from parabench.analyze import anatomy
from parabench.catalog import (
    ACTIVATIONS,
    GRADS,
    OPTIMIZER,
    PARAMS,
    REFERENCE,
    SPLITS,
    record,
)
from parabench.layout import MESH_DIMS, Layout
from parabench.ops import OPS

TOLERANCE = 0.25


def _json(value) -> dict:
    """A JSON column's value; {} where the cell has none (NaN, or an empty string)."""
    return json.loads(value) if isinstance(value, str) and value else {}


def options(row: pd.Series) -> dict:
    """A summary row's strategy settings (its `options` JSON)."""
    return _json(row.get("options"))


def curve_time(curves: pd.DataFrame, op: str, devices: int, nbytes: float) -> float:
    """Seconds of one `op` call of `nbytes` at `devices`, interpolated in log-log
    between measured sizes; beyond the largest, time grows with bytes at the largest
    size's bandwidth; below the smallest, the smallest's time (latency bound). NaN
    when no curve was measured."""
    c = curves[(curves["op"] == OPS[op].curve) & (curves["devices"] == devices)]
    if c.empty or not nbytes:
        return np.nan if c.empty else 0.0
    c = c.sort_values("bytes")
    x, t = c["bytes"].to_numpy(float), c["time_s"].to_numpy(float)
    if nbytes >= x[-1]:
        return float(t[-1] * nbytes / x[-1])
    if nbytes <= x[0]:
        return float(t[0])
    return float(np.exp(np.interp(np.log(nbytes), np.log(x), np.log(t))))


def comm_time(comm_by_op: str, curves: pd.DataFrame, devices: int) -> float:
    """Seconds of every collective of `comm_by_op` (JSON) on the curves at `devices`."""

    def time_of(op: str, nbytes: float) -> float:
        return curve_time(curves, op, devices, nbytes)

    return critical_comm([_json(comm_by_op)], time_of, pipelined=False, m=1)


COLUMNS = (
    "predicted_compute_s",
    "predicted_bubble_s",
    "predicted_comm_s",
    "predicted_step_s",
    "prediction_error",
    "prediction_flag",
    "prediction_miss",
)


def measured_alone(
    ranks: pd.DataFrame | None, row: pd.Series, keys: list[str]
) -> tuple[pd.DataFrame, str]:
    """The ranks measured alone for a multi-device cell (a pipeline's: every stage),
    or none and why: a pipeline's pace is its slowest stage, so a stage missing leaves
    nothing to predict from."""
    if ranks is None or ranks.empty:
        return pd.DataFrame(), "no rank of it was measured alone (no ranks.csv: logs/ranks.log)"
    mine = ranks[ranks["devices"] == row["devices"]]
    for k in (*keys, "ac", "strategy"):
        mine = mine[mine[k] == row[k]]
    if len(bad := mine[mine["status"] != "ok"]):
        r = bad.iloc[0]
        return mine.iloc[:0], f"its rank {r['rank']} measured alone {r['status']}: {r['reason']}"
    wanted = layout_of(row).pp if record(row["strategy"]).pipelined else 1
    if len(mine) < wanted:
        return mine.iloc[:0], "no rank of it was measured alone (not in ranks.csv)"
    return mine, ""


def critical_comm(
    per_rank: list[dict], time: Callable[[str, float], float], pipelined: bool, m: int
) -> float:
    """Seconds a step waits on the collectives the ranks measured alone issued (calls
    and bytes per op, per rank), `time(op, nbytes)` per call. All of them, none hidden;
    but a pipeline's transfers are the schedule's own: a stage sends one micro-batch's
    activations or gradients while it computes the next, so only the fill and the
    drain wait on them (each stage's sends of one micro-batch: one per neighbour)."""
    total = 0.0
    for ops in per_rank if pipelined else per_rank[:1]:
        for op, v in ops.items():
            if not v.get("count") or (pipelined and op != "send"):
                continue
            calls = v["count"] / m if pipelined else v["count"]
            total += calls * time(op, v["bytes"] / v["count"])
    return total


def by_dim(row, strategy: str) -> dict[str, dict]:
    """A measured rank's collectives by mesh dimension (ranks.csv's comm_by_dim), or,
    in a row without them, its comm_by_op under the strategy's one dimension."""
    if isinstance(row.get("comm_by_dim"), str | dict) and row.get("comm_by_dim"):
        return _json(row["comm_by_dim"])
    dims = record(strategy).layout.declared()
    return {dims[0] if dims else "world": _json(row.get("comm_by_op"))}


def spans(degrees: dict[str, int]) -> dict[str, int]:
    """How many consecutive ranks each mesh dimension's group spans: its degree times
    the degrees inside it (layout.MESH_DIMS, outermost first; tp innermost). With tp 8
    inside, a dp_shard group of 8 spans 64 ranks, eight nodes, not one."""
    out, inner = {}, 1
    for d in reversed(MESH_DIMS):
        out[d] = degrees.get(d, 1) * inner
        inner *= degrees.get(d, 1)
    return out


def layout_comm(
    per_rank: list[dict[str, dict]],
    time: Callable[[str, int, float, int, int], float],
    degrees: dict[str, int],
    m: int,
    scheduled: bool = True,
) -> float:
    """Seconds a step waits on the collectives of the ranks measured alone, each mesh
    dimension's at its own degree (`time(op, ranks, nbytes, span, world)`, span: the
    consecutive ranks its group covers, which decides a link's level; world: the
    layout's ranks, whose groups call at once): a pipeline's
    transfers over pp as critical_comm counts them (every stage's, once per fill and
    drain; `scheduled` False: all of them, as a rank's own communication time counts
    them); the other dimensions' all of them, on the busiest stage (stages run at once)."""
    deg = {**degrees, "world": max(degrees.values(), default=1)}
    span = {**spans(degrees), "world": deg["world"]}
    world = math.prod(degrees.values())

    def at(d: str) -> Callable[[str, float], float]:
        return lambda op, nbytes: time(op, deg.get(d, 1), nbytes, span.get(d, 1), world)

    pp = [r.get("pp", {}) for r in per_rank]
    pipe = (
        critical_comm(pp, at("pp"), True, m) if scheduled else critical_comm(pp, at("pp"), False, 1)
    )
    rest = max(
        (
            sum(critical_comm([ops], at(d), False, 1) for d, ops in r.items() if d != "pp")
            for r in per_rank
        ),
        default=0.0,
    )
    return pipe + rest


def predict(
    summary: pd.DataFrame,
    curves: pd.DataFrame,
    ranks: pd.DataFrame | None,
    variant_keys: list[str],
) -> pd.DataFrame:
    """Predicted step and its terms for every ok multi-device row: a multi-process
    strategy's from its ranks measured alone (ranks), a one-process strategy's from
    its one-device cell (or the reference's, of its variant). A row with nothing to
    predict from says why in prediction_miss."""
    out = pd.DataFrame(index=summary.index, columns=list(COLUMNS), dtype=object)
    ok = summary[summary["status"] == "ok"]
    refs = ok[(ok["strategy"] == REFERENCE) & (ok["devices"] == 1) & (ok["ac"] == "none")]
    refs = refs.set_index(variant_keys)
    ones = ok[ok["devices"] == 1].set_index([*variant_keys, "ac", "strategy"])
    for i, row in ok[ok["devices"] > 1].iterrows():
        n, rec, settings = int(row["devices"]), record(row["strategy"]), options(row)
        if rec.processes(n) == 1:  # one process: its stages (or replicas) in turn
            variant = tuple(row[k] for k in variant_keys)
            key = (*variant, row["ac"], row["strategy"])
            if key not in ones.index and variant not in refs.index:
                out.loc[i, "prediction_miss"] = (
                    "no prediction: no one-device cell of it or of single"
                )
                continue
            own = ones.loc[key] if key in ones.index else refs.loc[variant]
            compute, comm = own["step_time_s"], 0.0
        else:
            mine, why = measured_alone(ranks, row, variant_keys)
            if why:
                out.loc[i, "prediction_miss"] = f"no prediction: {why}"
                continue
            compute = mine["compute_s"].max() * max(1.0, row["ranks_per_core"])
            comm = layout_comm(
                [by_dim(r, row["strategy"]) for _, r in mine.iterrows()],
                lambda op, k, nbytes, _span, _world: curve_time(curves, op, k, nbytes),
                layout_of(row).degrees,
                settings.get("microbatches", 1),
            )
        bubble = bubble_time(rec, compute, layout_of(row).pp, settings)
        predicted = compute + bubble + comm
        error = predicted / row["step_time_s"] - 1
        miss = _miss(row, compute, bubble, comm) if abs(error) > TOLERANCE else ""
        out.loc[i, list(COLUMNS)] = [
            compute,
            bubble,
            comm,
            predicted,
            error,
            abs(error) > TOLERANCE,
            miss,
        ]
    for c in COLUMNS[:5]:
        out[c] = out[c].astype(float)
    return out


def layout_of(row) -> Layout:
    """A summary row's degrees on the mesh (its record's layout at its devices and
    options)."""
    rec = record(row["strategy"])
    opts = {**{k: o.default for k, o in rec.options.items()}, **options(row)}
    return rec.layout.at(int(row["devices"]), opts)


def bubble_time(rec, compute: float, n: int, settings: dict) -> float:
    """A pipeline's bubble: (n-1)/m of a stage's compute (m micro-batches through n
    stages take m + n - 1 slots, n - 1 of them idle); 0 for the other strategies."""
    if not rec.pipelined or n < 2:
        return 0.0
    return compute * (n - 1) / settings.get("microbatches", 1)


def error_table(summary: pd.DataFrame) -> dict:
    """The model's mean absolute percentage error over the predicted multi-device
    cells: overall, per strategy and per device count (each with its cell count); and
    the ok multi-device cells it could not predict, each with why (never left out
    silently: the error is over the others)."""
    p = summary[summary["prediction_error"].notna()]
    ok = summary[(summary["status"] == "ok") & (summary["devices"] > 1)]
    unpredicted = [
        f"{r['model']} {r['strategy']} x{r['devices']}: "
        + str(r["prediction_miss"]).removeprefix("no prediction: ")
        for _, r in ok[ok["prediction_error"].isna()].iterrows()
    ]
    if p.empty:
        return {
            "overall": None,
            "cells": 0,
            "by_strategy": {},
            "by_devices": {},
            "unpredicted": unpredicted,
        }
    err = p["prediction_error"].abs()
    return {
        "overall": float(err.mean()),
        "cells": len(p),
        "unpredicted": unpredicted,
        "by_strategy": {k: float(v) for k, v in err.groupby(p["strategy"]).mean().items()},
        "by_devices": {int(k): float(v) for k, v in err.groupby(p["devices"]).mean().items()},
    }


def _miss(row: pd.Series, compute, bubble, comm) -> str:
    """The term furthest from its measured counterpart, in words."""
    measured = {
        "compute": anatomy.work(row),
        "communication": row["comm_exposed_s"],
        "bubble": row["bubble_s"],
    }
    predicted = {"compute": compute, "communication": comm, "bubble": bubble}
    if np.isnan(predicted["communication"]):
        return "communication: no collective curve at this device count"
    term = max(measured, key=lambda k: abs(measured[k] - predicted[k]))
    drift = row["step_time_s"] - row["profiled_step_s"]
    if abs(drift) > abs(measured[term] - predicted[term]):
        # The timed and the profiled steps disagree more than any term does: the miss is
        # in the measurement (noise between them, or the profiler's own cost), not the model.
        return (
            f"no term: the timed steps' median ({row['step_time_s'] * 1e3:.2f} ms) and the "
            f"profiled step ({row['profiled_step_s'] * 1e3:.2f} ms) differ by more than any "
            "term (noise between them, or the profiler's cost)"
        )
    m, p = measured[term] * 1e3, predicted[term] * 1e3
    why = {
        ("compute", True): "the ranks computed slower than one rank measured alone "
        "(cores shared with communication's threads, or with ranks not in turn)",
        ("compute", False): "the ranks computed faster than one rank measured alone "
        "(ranks sharing a core took turns less than k-fold: some waited)",
        ("communication", True): "collectives ran slower inside the step than alone "
        "(they compete with compute for the same cores or links)",
        ("communication", False): "compute hid part of the communication (overlap the "
        "model does not count)",
        ("bubble", True): "stages wait on each other more than (n-1)/m predicts "
        "(unbalanced stages, or send/recv on the critical path)",
        ("bubble", False): "stages overlapped better than (n-1)/m",
    }[(term, m > p)]
    return f"{term}: measured {m:.2f} ms, model {p:.2f} ms; {why}"


def memory_model(row: pd.Series, params: float, act_per_sample: float) -> dict[str, float]:
    """Analytic bytes per rank: parameters, gradients, optimizer state (fp32; AdamW
    keeps 2 states per parameter, SGD none) and activations, each 1/n where the
    strategy splits it (sharded, or cut into stages or matrix slices)."""
    r = record(row["strategy"])
    n = int(row["devices"])
    deg = layout_of(row).degrees
    # each mesh dimension splits what catalog.SPLITS says; a strategy's own sharding
    # (ZeRO-1's optimizer, DataParallel's batch) splits over all n
    share = {
        k: min(
            1 / n if k in r.sharded else 1.0,
            1 / math.prod(deg[d] for d in deg if k in SPLITS[d]),
        )
        for k in (PARAMS, GRADS, OPTIMIZER, ACTIVATIONS)
    }
    states = 2 if row["optimizer"] == "adamw" else 0
    samples = row["global_batch"]
    if r.batch_split == "devices*accum":
        samples = samples / options(row).get("accum_steps", 1)
    width = 2 if row["precision"] == "bf16" else 4
    return {
        "model_params_bytes": params * 4 * share[PARAMS],
        "model_grads_bytes": params * 4 * share[GRADS],
        "model_optimizer_bytes": params * 4 * states * share[OPTIMIZER],
        "model_activations_bytes": act_per_sample * width / 4 * samples * share[ACTIVATIONS],
    }
