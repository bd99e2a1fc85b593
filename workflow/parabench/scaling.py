"""A scaling model: each multi-device cell's step predicted from one-device cells and
the collectives curves only, then set beside the measurement, out of sample.

    predicted = compute + bubble + comm

- compute: what one rank of the strategy does at n devices: the strategy's own
  one-device step (its wrapper, hooks, micro-batches included; the reference's where
  the sweep has no such cell), scaled by how the reference's step shrinks from the
  whole batch with all the threads to B/n samples with a rank's threads (`rank_steps`,
  measured back to back in the reference cell: the host's cores / n threads on CPU).
  Naive model parallel runs its stages one after another in one process: its
  one-device step, whatever n.
- time-slicing: where a host's ranks outnumber its cores, k ranks take turns on each
  core (k = ranks per core, from the binding), and a rank's compute takes k times as
  long. Said explicitly, not fitted: the report says such cells measure a shared
  processor.
- bubble: pipelines only, (n-1)/m of a stage's compute (GPipe and 1F1B alike: m
  micro-batches through n stages take m + n - 1 slots).
- comm: for each collective the cell really issued (its counted bytes and calls per
  step), the collectives benchmark's time at that size and device count. None of it is
  assumed hidden behind compute, so a strategy that overlaps it (DDP's bucketed
  all-reduce during backward) should come out faster than predicted.

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
from parabench.records import VARIANT_KEYS

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


def rank_step(reference: pd.Series, devices: int) -> float:
    """The reference's step on one rank's share at `devices` (its rank_steps), NaN
    where it was not measured."""
    found = _json(reference.get("rank_steps")).get(str(devices))
    return float(found["step_s"]) if found else np.nan


def predict(summary: pd.DataFrame, curves: pd.DataFrame, variant_keys: list[str]) -> pd.DataFrame:
    """Predicted step and its terms for every ok multi-device row whose variant has an
    ok reference and whose strategy has an ok one-device cell (or is one process)."""
    out = pd.DataFrame(index=summary.index, columns=list(COLUMNS), dtype=object)
    ok = summary[summary["status"] == "ok"]
    refs = ok[(ok["strategy"] == REFERENCE) & (ok["devices"] == 1)].set_index(variant_keys)
    ones = ok[ok["devices"] == 1].set_index([*variant_keys, "strategy"])
    for i, row in ok[ok["devices"] > 1].iterrows():
        variant = tuple(row[k] for k in variant_keys)
        key = (*variant, row["strategy"])
        if variant not in refs.index:
            continue
        reference = refs.loc[variant]
        # without the strategy's own one-device cell, it is taken to do what the
        # reference does per step (its wrapper's cost is then the model's miss)
        own = ones.loc[key] if key in ones.index else reference
        n, rec = int(row["devices"]), record(row["strategy"])
        if rec.ranks(n) == 1:  # one process: its stages (or replicas) in turn
            compute = own["step_time_s"]
        else:
            # one rank's share relative to the whole, measured back to back
            per_rank = own["step_time_s"] * rank_step(reference, n) / rank_step(reference, 1)
            compute = per_rank * max(1.0, row["ranks_per_core"])
        bubble = bubble_time(rec, compute, n, options(row))
        comm = comm_time(row["comm_by_op"], curves, n)
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


def against_measured(plan: pd.DataFrame, summary: pd.DataFrame) -> pd.DataFrame:
    """The plan's check rows (one planned rank at a device count this sweep measured)
    beside the measured cell of the same variant, strategy and count: predicted,
    measured and the error."""
    rows = plan[(plan["kind"] == "check") & (plan["status"] == "ok")]
    ok = summary[summary["status"] == "ok"]
    keys = [*VARIANT_KEYS, "strategy"]
    merged = rows.merge(
        ok[[*keys, "devices", "step_time_s"]],
        left_on=[*keys, "world_size"],
        right_on=[*keys, "devices"],
    )
    merged["plan_error"] = merged["predicted_step_s"] / merged["step_time_s"] - 1
    return merged[
        ["model", "strategy", "world_size", "predicted_step_s", "step_time_s", "plan_error"]
    ]


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
        ("compute", True): "the ranks computed slower than one rank's share measured alone "
        "(cores shared with communication's threads, or with ranks not in turn)",
        ("compute", False): "the ranks computed faster than their share measured alone "
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
