"""Merge cell records into the three tables the report reads.

- steps.csv: every step of every `ok` cell (warm-up rows kept, marked).
- cells.csv: one row per cell (one launch): its statistics over timed steps, status,
  reason, environment, launch command, and its parameter difference to `single`.
- summary.csv: one row per (model, strategy, devices) over repeats.

Speedup is throughput(strategy, n) / throughput(single, 1). Under strong scaling (same
global batch) that equals T(single) / T(strategy, n); under weak scaling (per-device
batch fixed) it is the throughput ratio. Efficiency = speedup / n in both cases.
"""

from __future__ import annotations

import csv
import functools
import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from parabench import records
from parabench.flops import step_flops
from parabench.models import build
from parabench.spec import ModelSpec

SUMMARY_COLUMNS: dict[str, str] = {
    "model": "model label",
    "strategy": "strategy",
    "devices": "devices",
    "scaling": "strong (global batch fixed) or weak (per-device batch fixed)",
    "status": "ok if any repeat ran, else skipped or failed",
    "reason": "why repeats were skipped or failed (first one), empty when all ran",
    "repeats_ok": "repeats that ran",
    "repeats_total": "repeats configured",
    "global_batch": "samples per optimizer step",
    "step_time_s": "median over repeats of each repeat's median timed step (headline)",
    "step_time_min_s": "fastest repeat's median step",
    "step_time_max_s": "slowest repeat's",
    "step_time_p50_s": "median over all timed steps of all repeats",
    "step_time_p90_s": "90th percentile over all timed steps of all repeats",
    "throughput": "samples per second = global_batch / step_time_s",
    "speedup": "throughput / throughput of single at 1 device, same model",
    "efficiency": "speedup / devices",
    "flops_per_step": "FLOPs of one optimizer step (FlopCounterMode)",
    "achieved_flops": "flops_per_step / step_time_s",
    "mfu": "achieved_flops / peak FLOP/s of the devices used",
    "peak_memory_bytes": "max over repeats of the peak per device",
    "max_abs_param_diff": "largest |parameter - single's| after the run, over repeats",
    "emulated": "true when devices were stand-ins (stages all on one CPU)",
}


def _cell_row(meta_path: Path, meta: dict) -> tuple[dict, pd.DataFrame | None]:
    spec = meta.get("spec", {})
    env = meta.get("env", {})
    row = {k: meta[k] for k in records.META_KEYS if k != "schema_version"}
    row.update(
        {
            "reason": meta.get("reason") or "",
            "scaling": spec.get("scaling", "strong"),
            "global_batch": spec.get("batch_size", 0)
            * (meta["devices"] if spec.get("scaling") == "weak" else 1),
            "steps": spec.get("steps"),
            "warmup": spec.get("warmup"),
            "device_type": meta.get("device_type", ""),
            "emulated": bool(meta.get("emulated", False)),
            "peak_flops_total": meta.get("peak_flops_total", np.nan),
            "peak_memory_bytes": meta.get("peak_memory_bytes", np.nan),
            "host": env.get("host", ""),
            "torch": env.get("torch", ""),
            "cuda": env.get("cuda") or "",
            "nccl": env.get("nccl") or "",
            "device_names": ", ".join(env.get("device_names") or []),
            "cpu_model": env.get("cpu_model", ""),
            "python": env.get("python", ""),
            "git_commit": env.get("git_commit") or "",
            "start_time": env.get("start_time", ""),
            "slurm_job_id": env.get("slurm", {}).get("SLURM_JOB_ID", ""),
            "gpus_given": env.get("slurm", {}).get("SLURM_GPUS_ON_NODE", ""),
            "cuda_visible_devices": env.get("cuda_visible_devices") or "",
            "config_hash": meta.get("config_hash", ""),
            "launch_command": " ".join(env.get("launch_command", [])),
            "dir": str(meta_path.parent),
        }
    )
    if meta["status"] != "ok":
        return row, None
    steps_path = meta_path.parent / "steps.csv"
    try:
        with open(steps_path) as f:
            records.check_step_header(steps_path, next(csv.reader(f)))
        steps = pd.read_csv(steps_path)
    except (OSError, StopIteration, pd.errors.ParserError) as e:
        raise records.ResultsError(f"{steps_path}: unreadable steps ({e})") from e
    timed = steps.loc[steps["phase"] == "timed", "step_time_s"]
    if timed.empty or timed.isna().any():
        raise records.ResultsError(f"{steps_path}: no valid timed steps")
    row.update(
        flops_per_step=_flops(spec["model"], row["global_batch"]),
        step_time_median_s=timed.median(),
        step_time_p90_s=timed.quantile(0.9),
        step_time_mean_s=timed.mean(),
        timed_steps=len(timed),
        final_loss=steps["loss"].iloc[-1],
    )
    return row, steps


@functools.cache
def _flops_cached(arch: str, sizes: str, batch: int) -> int:
    model = build(ModelSpec.of(arch, **json.loads(sizes)), seed=0)
    return step_flops(model, batch)


def _flops(model: dict, batch: int) -> int:
    """FLOPs of one optimizer step: a property of the model and global batch, the same
    for every strategy, so counted here once per model rather than in every cell
    (FlopCounterMode's first use imports torch._dynamo: two seconds per process)."""
    sizes = {k: v for k, v in model.items() if k != "arch"}
    return _flops_cached(model["arch"], json.dumps(sizes, sort_keys=True), int(batch))


def _param_diffs(cells: pd.DataFrame) -> pd.Series:
    """Max |param - single's| per cell, against single's cell of the same model and
    repeat, where both ran the same global batches (strong scaling) for the same steps."""
    out = pd.Series(np.nan, index=cells.index)
    ok = cells[cells["status"] == "ok"]
    refs = ok[ok["strategy"] == "single"].set_index(["model", "repeat"])
    cache: dict[str, dict] = {}

    def load(d: str) -> dict:
        if d not in cache:
            cache[d] = torch.load(Path(d) / "params.pt", map_location="cpu", weights_only=True)
        return cache[d]

    for i, c in ok.iterrows():
        key = (c["model"], c["repeat"])
        if key not in refs.index or c["scaling"] != "strong":
            continue
        ref = refs.loc[key]
        if ref["steps"] != c["steps"]:
            continue
        a, b = load(c["dir"]), load(ref["dir"])
        if a.keys() != b.keys():
            raise records.ResultsError(
                f"{c['dir']}/params.pt: parameter names differ from single's"
            )
        out[i] = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    return out


def summarize(cells: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    keys = ["model", "strategy", "devices"]
    timed = steps[steps["phase"] == "timed"]
    pooled = timed.groupby(keys)["step_time_s"].agg(
        step_time_p50_s="median", step_time_p90_s=lambda s: s.quantile(0.9)
    )

    def one(g: pd.DataFrame) -> pd.Series:
        ok = g[g["status"] == "ok"]
        not_ok = g[g["status"] != "ok"]
        status = "ok" if len(ok) else ("failed" if (g["status"] == "failed").any() else "skipped")
        med = ok["step_time_median_s"]
        return pd.Series(
            {
                "scaling": g["scaling"].iloc[0],
                "status": status,
                "reason": not_ok["reason"].iloc[0] if len(not_ok) else "",
                "repeats_ok": len(ok),
                "repeats_total": len(g),
                "global_batch": g["global_batch"].iloc[0],
                "step_time_s": med.median(),
                "step_time_min_s": med.min(),
                "step_time_max_s": med.max(),
                "flops_per_step": ok["flops_per_step"].median(),
                "peak_flops_total": ok["peak_flops_total"].median(),
                "peak_memory_bytes": ok["peak_memory_bytes"].max(),
                "max_abs_param_diff": ok["max_abs_param_diff"].max(),
                "emulated": bool(ok["emulated"].any()),
            }
        )

    summary = cells.groupby(keys, sort=False).apply(one, include_groups=False)
    summary = summary.join(pooled).reset_index()
    summary["throughput"] = summary["global_batch"] / summary["step_time_s"]
    base = summary[(summary["strategy"] == "single") & (summary["devices"] == 1)]
    base_thr = summary["model"].map(base.set_index("model")["throughput"])
    summary["speedup"] = summary["throughput"] / base_thr
    summary["efficiency"] = summary["speedup"] / summary["devices"]
    summary["achieved_flops"] = summary["flops_per_step"] / summary["step_time_s"]
    summary["mfu"] = summary["achieved_flops"] / summary["peak_flops_total"]
    return summary[list(SUMMARY_COLUMNS)]


def load_cells(meta_paths: list[Path]) -> tuple[pd.DataFrame, pd.DataFrame]:
    rows, frames = [], []
    for p in meta_paths:
        row, steps = _cell_row(Path(p), records.read_meta(Path(p)))
        rows.append(row)
        if steps is not None:
            frames.append(steps)
    cells = pd.DataFrame(rows)
    steps = (
        pd.concat(frames, ignore_index=True)
        if frames
        else pd.DataFrame(columns=list(records.STEP_COLUMNS))
    )
    for col in (
        "step_time_median_s",
        "step_time_p90_s",
        "step_time_mean_s",
        "timed_steps",
        "final_loss",
    ):
        if col not in cells:
            cells[col] = np.nan
    cells["max_abs_param_diff"] = _param_diffs(cells)
    return cells, steps


def aggregate(meta_paths: list[Path], steps_out: Path, summary_out: Path, cells_out: Path) -> None:
    cells, steps = load_cells(meta_paths)
    summary = summarize(cells, steps)
    for df, path in ((steps, steps_out), (cells, cells_out), (summary, summary_out)):
        records.atomic_write_bytes(Path(path), df.to_csv(index=False).encode())
