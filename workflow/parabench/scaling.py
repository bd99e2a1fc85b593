"""A scaling model: each multi-device cell's step predicted from measurements on one
device and the collectives curves only, then set beside the measurement, out of sample.

    predicted = compute + bubble + comm

- compute: one rank of the strategy at n, measured alone (ranks.py, ranks.csv): the
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
  pipeline's transfers are the schedule's own: a stage sends one micro-batch's
  activations (forward) or gradients (backward) while it computes the next, so only
  the fill and the drain wait on them, one transfer per boundary each way: each
  stage's sends per micro-batch, timed on the send/recv curve.

The plan (plan.py) predicts a rank at 8 to 1,024 devices the same way, so this model's
error at the device counts measured here is the check on the plan's method.

A cell whose prediction is off by more than 25% is flagged, and the term furthest from
its measured counterpart is named: the model's miss, said rather than hidden. The
report publishes the error (MAPE) per strategy, per device count and overall.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from parabench.catalog import ACTIVATIONS, GRADS, OPTIMIZER, PARAMS, REFERENCE, record
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
    ops = _json(comm_by_op)
    total = 0.0
    for op, v in ops.items():
        if v["count"]:
            total += v["count"] * curve_time(curves, op, devices, v["bytes"] / v["count"])
    return total


COLUMNS = (
    "predicted_compute_s",
    "predicted_bubble_s",
    "predicted_comm_s",
    "predicted_step_s",
    "prediction_error",
    "prediction_flag",
    "prediction_miss",
)


def stages(ranks: pd.DataFrame | None, row: pd.Series, keys: list[str]) -> pd.DataFrame:
    """The ranks ranks.csv measured ok for a multi-device cell (a pipeline's: one per
    stage); empty where none."""
    if ranks is None or ranks.empty:
        return pd.DataFrame(columns=["compute_s", "comm_by_op"])
    mine = ranks[(ranks["status"] == "ok") & (ranks["devices"] == row["devices"])]
    for k in (*keys, "strategy"):
        mine = mine[mine[k] == row[k]]
    return mine


def alone(ranks: pd.DataFrame | None, row: pd.Series, keys: list[str]) -> pd.Series | None:
    """The rank measured alone that sets a multi-device cell's pace: its rank 0, or a
    pipeline's slowest stage; None where none was measured ok."""
    mine = stages(ranks, row, keys)
    return mine.loc[mine["compute_s"].idxmax()] if len(mine) else None


def fill_and_drain(stages: pd.DataFrame, curves: pd.DataFrame, n: int, settings: dict) -> float:
    """A pipeline's transfers on its critical path: each stage's sends of one
    micro-batch (its sends per step / m: one per neighbour), on the send/recv curve.
    The others overlap the next micro-batch's compute."""
    m = settings.get("microbatches", 1)
    total = 0.0
    for value in stages["comm_by_op"]:
        sent = _json(value).get("send")
        if sent and sent["count"]:
            per_call = sent["bytes"] / sent["count"]
            total += sent["count"] / m * curve_time(curves, "send", n, per_call)
    return total


def predict(
    summary: pd.DataFrame,
    curves: pd.DataFrame,
    ranks: pd.DataFrame | None,
    variant_keys: list[str],
) -> pd.DataFrame:
    """Predicted step and its terms for every ok multi-device row: a multi-process
    strategy's from its rank measured alone (ranks), a one-process strategy's from its
    one-device cell (or the reference's, of its variant)."""
    out = pd.DataFrame(index=summary.index, columns=list(COLUMNS), dtype=object)
    ok = summary[summary["status"] == "ok"]
    refs = ok[(ok["strategy"] == REFERENCE) & (ok["devices"] == 1)].set_index(variant_keys)
    ones = ok[ok["devices"] == 1].set_index([*variant_keys, "strategy"])
    for i, row in ok[ok["devices"] > 1].iterrows():
        n, rec = int(row["devices"]), record(row["strategy"])
        if rec.ranks(n) == 1:  # one process: its stages (or replicas) in turn
            variant = tuple(row[k] for k in variant_keys)
            key = (*variant, row["strategy"])
            if key not in ones.index and variant not in refs.index:
                continue
            own = ones.loc[key] if key in ones.index else refs.loc[variant]
            compute, comm_by_op = own["step_time_s"], ""
        else:
            rank = alone(ranks, row, variant_keys)
            if rank is None:
                continue
            compute = rank["compute_s"] * max(1.0, row["ranks_per_core"])
            comm_by_op = rank["comm_by_op"]
        bubble = bubble_time(rec, compute, n, options(row))
        if rec.pipelined:
            comm = fill_and_drain(stages(ranks, row, variant_keys), curves, n, options(row))
        else:
            comm = comm_time(comm_by_op, curves, n)
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


def bubble_time(rec, compute: float, n: int, settings: dict) -> float:
    """A pipeline's bubble: (n-1)/m of a stage's compute (m micro-batches through n
    stages take m + n - 1 slots, n - 1 of them idle); 0 for the other strategies."""
    if not rec.pipelined or n < 2:
        return 0.0
    return compute * (n - 1) / settings.get("microbatches", 1)


def error_table(summary: pd.DataFrame) -> dict:
    """The model's mean absolute percentage error over the predicted multi-device
    cells: overall, per strategy and per device count (each with its cell count)."""
    p = summary[summary["prediction_error"].notna()]
    if p.empty:
        return {"overall": None, "cells": 0, "by_strategy": {}, "by_devices": {}}
    err = p["prediction_error"].abs()
    return {
        "overall": float(err.mean()),
        "cells": len(p),
        "by_strategy": {k: float(v) for k, v in err.groupby(p["strategy"]).mean().items()},
        "by_devices": {int(k): float(v) for k, v in err.groupby(p["devices"]).mean().items()},
    }


def _miss(row: pd.Series, compute, bubble, comm) -> str:
    """The term furthest from its measured counterpart, in words."""
    measured = {
        "compute": row["compute_s"] + row["data_s"] + row["other_s"],
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
    split_model = r.pipelined or r.needs_tp_plan
    share = {
        k: (1 / n if (k in r.sharded or split_model) else 1.0)
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
