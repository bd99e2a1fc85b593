"""A scaling model: each cell's step predicted from measured pieces only, then set
beside the measurement.

    predicted = compute + bubble + comm + overhead

- compute: `single`'s compute (its anatomy) x the share of the work one rank does
  (1/n when the batch, the layers' matrices or the model's stages are split; all of it
  for naive model parallel, whose stages run one after another), divided by the speed
  of one rank relative to `single`. On CPU the n ranks of a node share its cores:
  a rank runs on min(its threads, cores / n) cores where `single` had all of them.
- bubble: pipelines only, (n-1)/m of a stage's compute (GPipe and 1F1B alike: m
  micro-batches through n stages take m + n - 1 slots).
- comm: for each collective the cell really issued (its profiled count and bytes per
  step), the collective benchmark's time at that size and device count. The model
  assumes none of it is hidden behind compute, so a strategy that overlaps (DDP's
  bucketed all-reduce during backward) should come out faster than predicted.
- overhead: `single`'s data and other time (Python, launch), the same per step.

A cell whose prediction is off by more than 25% is flagged, and the term furthest from
its measured counterpart is named: the model's miss, said rather than hidden.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from parabench.catalog import ACTIVATIONS, GRADS, OPTIMIZER, PARAMS, REFERENCE, record
from parabench.ops import OPS

TOLERANCE = 0.25


def options(row: pd.Series) -> dict:
    """A summary row's strategy settings (its `options` JSON)."""
    return json.loads(row["options"]) if isinstance(row.get("options"), str) else {}


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
    ops = json.loads(comm_by_op) if isinstance(comm_by_op, str) and comm_by_op else {}
    total = 0.0
    for op, v in ops.items():
        if v["count"]:
            total += v["count"] * curve_time(curves, op, devices, v["bytes"] / v["count"])
    return total


def work_share(strategy: str, devices: int) -> float:
    """The fraction of single's compute one rank (or stage) does per step."""
    r = record(strategy)
    if devices == 1 or (r.cuts_model and not r.pipelined):
        return 1.0  # naive model parallel: the stages run one after another
    return 1.0 / devices


def rank_speed(row: pd.Series, single: pd.Series) -> float:
    """One rank's speed relative to single's: on CPU, the cores it really gets."""
    if row["device_type"] != "cpu" or row["processes"] <= 1:
        return 1.0
    cores = single["usable_cores"] or 1
    return min(row["threads_per_rank"], cores / row["processes"]) / (
        single["threads_per_rank"] or 1
    )


def predict(summary: pd.DataFrame, curves: pd.DataFrame, variant_keys: list[str]) -> pd.DataFrame:
    """Predicted step and its terms for every ok row with an ok `single` to start from."""
    cols = [
        "predicted_compute_s",
        "predicted_bubble_s",
        "predicted_comm_s",
        "predicted_overhead_s",
        "predicted_step_s",
        "prediction_error",
        "prediction_flag",
        "prediction_miss",
    ]
    out = pd.DataFrame(index=summary.index, columns=cols, dtype=object)
    singles = summary[(summary["strategy"] == REFERENCE) & (summary["status"] == "ok")]
    singles = singles.set_index(variant_keys)
    for i, row in summary[summary["status"] == "ok"].iterrows():
        key = tuple(row[k] for k in variant_keys)
        if key not in singles.index or pd.isna(row.get("compute_s")):
            continue
        single = singles.loc[key]
        if pd.isna(single["compute_s"]):
            continue
        n = int(row["devices"])
        compute = single["compute_s"] * work_share(row["strategy"], n) / rank_speed(row, single)
        bubble = 0.0
        if record(row["strategy"]).pipelined:
            bubble = compute * (n - 1) / options(row).get("microbatches", 1)
        comm = comm_time(row["comm_by_op"], curves, n) if n > 1 else 0.0
        overhead = single["data_s"] + single["other_s"]
        predicted = compute + bubble + comm + overhead
        error = predicted / row["step_time_s"] - 1
        miss = ""
        if abs(error) > TOLERANCE:
            miss = _miss(row, compute, bubble, comm, overhead)
        out.loc[i, cols] = [
            compute,
            bubble,
            comm,
            overhead,
            predicted,
            error,
            abs(error) > TOLERANCE,
            miss,
        ]
    for c in cols[:6]:
        out[c] = out[c].astype(float)
    return out


def _miss(row: pd.Series, compute, bubble, comm, overhead) -> str:
    """The term furthest from its measured counterpart, in words."""
    measured = {
        "compute": row["compute_s"],
        "communication": row["comm_exposed_s"],
        "bubble": row["bubble_s"],
        "overhead": row["data_s"] + row["other_s"],
    }
    predicted = {"compute": compute, "communication": comm, "bubble": bubble, "overhead": overhead}
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
        ("compute", True): "ranks sharing the cores run slower than their share of them",
        ("compute", False): "the split work ran faster than its share of single's",
        ("communication", True): "collectives ran slower inside the step than alone "
        "(they compete with compute for the same cores or links)",
        ("communication", False): "compute hid part of the communication (overlap the "
        "model does not count)",
        ("bubble", True): "stages wait on each other more than (n-1)/m predicts "
        "(unbalanced stages, or send/recv on the critical path)",
        ("bubble", False): "stages overlapped better than (n-1)/m",
        ("overhead", True): "more Python and launch work per step than single's",
        ("overhead", False): "less per-step overhead than single's",
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
