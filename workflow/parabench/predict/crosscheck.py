"""Each part of a step's anatomy against a measurement taken apart from it.

- Work: what the anatomy calls compute, data and other, against the same strategy's
  step with every collective returning at once (`step_nocomm_s`, process/nocomm.py), timed
  without the profiler in the same cell: the step on an infinitely fast interconnect.
  For a pipeline that step has no bubble either (its stages no longer wait for each
  other), so it is the stages' own compute. The no-communication steps run in blocks
  between the plan's, one after each profiler session (loop.Silent), and the check
  pairs each session with the block right after it (`work_ratio`, the median over
  sessions): this VM's steps can turn 40% faster between two sessions, which medians
  over the whole cell would read as a disagreement. The profiled steps' own cost
  (`profiler_overhead`) is in the anatomy's figure, as it is in its parts.
- Communication: all of it (`comm_s`, hidden or not) against the collectives benchmark
  at the bytes the cell sent (`comm_curve_s`: each collective issued, timed alone).
- Bubble (pipelines): against the schedule's, (n-1)/m of a stage's compute per step
  (m micro-batches through n stages take m + n - 1 slots, n - 1 of them idle).

Where one is off by more than TOLERANCE, the cell is flagged and the report shows both
figures instead of a confident sentence; nothing is adjusted to agree. A cell whose
profiled steps have no parts (anatomy.NO_KERNEL) is flagged with that reason.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from parabench.analyze import anatomy
from parabench.catalog import record
from parabench.predict.scaling import (
    bubble_time,
    comm_time,
    curve_time,
    layout_comm,
    layout_of,
    options,
)

TOLERANCE = 0.20
COLUMNS = (
    "work_check",
    "comm_curve_s",
    "comm_check",
    "schedule_bubble_s",
    "bubble_check",
    "anatomy_flag",
    "anatomy_disagreement",
)


def _off(measured: float, check: float) -> float:
    return measured / check - 1 if check and np.isfinite(check) else np.nan


def _curve_comm(row: pd.Series, curves: pd.DataFrame, n: int) -> float:
    """The collectives the step issued, on the benchmark's curves: a layout's each
    along its mesh dimension, at its degree (its counts by dimension, from its ranks
    measured alone); any other strategy's all at n, from its trace's counts."""
    if record(row["strategy"]).composed and row.get("comm_by_dim"):
        return layout_comm(
            [json.loads(row["comm_by_dim"])],
            lambda op, k, nbytes, _span, _world: curve_time(curves, op, k, nbytes),
            layout_of(row).degrees,
            options(row).get("microbatches", 1),
            scheduled=False,  # comm_s is all of it, hidden or not
        )
    return comm_time(row["comm_by_op"], curves, n)


def check(row: pd.Series, curves: pd.DataFrame) -> dict:
    """The checks of one summary row (NaN where a check does not apply)."""
    n = int(row["devices"])
    work = anatomy.work(row)
    paired = row.get("work_ratio")
    out = {"work_check": paired - 1 if pd.notna(paired) else _off(work, row["step_nocomm_s"])}
    comm = _curve_comm(row, curves, n) if n > 1 else np.nan
    out["comm_curve_s"] = comm
    out["comm_check"] = _off(row["comm_s"], comm) if comm and row["comm_s"] else np.nan
    rec = record(row["strategy"])
    stages = layout_of(row).pp
    bubble = (
        bubble_time(rec, row["compute_s"], stages, options(row))
        if rec.pipelined and stages > 1
        else np.nan
    )
    out["schedule_bubble_s"] = bubble
    out["bubble_check"] = _off(row["bubble_s"], bubble)
    said = []
    if abs(out["work_check"]) > TOLERANCE:
        said.append(
            f"compute + data + other {work * 1e3:.2f} ms of the {row['profiled_step_s'] * 1e3:.2f}"
            f" ms step, but without communication the step takes "
            f"{row['step_nocomm_s'] * 1e3:.2f} ms (session by session, "
            f"x{out['work_check'] + 1:.2f})"
        )
    if abs(out["comm_check"]) > TOLERANCE:
        said.append(
            f"communication took {row['comm_s'] * 1e3:.2f} ms, the same collectives alone "
            f"{comm * 1e3:.2f} ms"
        )
    if abs(out["bubble_check"]) > TOLERANCE:
        said.append(
            f"the bubble measured {row['bubble_s'] * 1e3:.2f} ms, the schedule's "
            f"(n-1)/m of the stage's compute {bubble * 1e3:.2f} ms"
        )
    out["anatomy_flag"] = bool(said)
    out["anatomy_disagreement"] = "; ".join(said)
    return out


def checks(summary: pd.DataFrame, curves: pd.DataFrame) -> pd.DataFrame:
    """The checks of every row with an anatomy; a row whose anatomy has steps but no
    parts is flagged with the reason."""
    out = pd.DataFrame(index=summary.index, columns=list(COLUMNS), dtype=object)
    for i, row in summary.iterrows():
        if pd.notna(row.get("compute_s")):
            out.loc[i, list(COLUMNS)] = list(check(row, curves).values())
        elif pd.notna(row.get("profiled_step_s")):
            # profiled steps without parts: the one way, a CUDA trace with no kernel
            out.loc[i, ["anatomy_flag", "anatomy_disagreement"]] = [True, anatomy.NO_KERNEL]
    for c in ("work_check", "comm_curve_s", "comm_check", "schedule_bubble_s", "bubble_check"):
        out[c] = out[c].astype(float)
    return out
