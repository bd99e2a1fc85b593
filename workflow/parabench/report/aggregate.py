"""Merge cell records into the three tables the report reads.

- steps.csv: every step of every `ok` cell (warm-up rows kept, marked).
- cells.csv: one row per cell (one launch): its statistics over timed steps, status,
  reason, environment, launch command, what each rank held, and its parameter
  difference to `single` with the equivalence verdict.
- summary.csv: one row per (model, precision, optimizer, compile, strategy, devices),
  over repeats.

Speedup is stats.speedup (against single at one device, same model and variant);
efficiency = speedup / n. Every column is described in records.SUMMARY_COLUMNS.

Any mix of outcomes merges: every cell failed or skipped, no `single`, one model
entirely failed. Figures that need a cell that did not run are left empty.

Results are data, never code: what the merge needs of a model (FLOPs per step,
parameters, activation bytes, the layers whose maths changes under a split) is what
each cell recorded of the model it built (meta.json's `model_facts`, process/flops.py). No
model is imported or built here and no factory called, whatever a meta.json names.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from parabench import records
from parabench.analyze import anatomy, equivalence, fingerprint, stats
from parabench.catalog import REFERENCE, record
from parabench.predict import crosscheck, scaling
from parabench.records import CELL_KEYS, SUMMARY_COLUMNS, SUMMARY_KEYS, VARIANT_KEYS
from parabench.run import collectives
from parabench.run.loop import sessions, step_kinds
from parabench.spec import RunSpec

# Filled from the ok cells only; NaN where none ran.
_OK_COLUMNS = (
    "recompute_s",
    "anatomy_closure",
    "work_ratio",
    "profiler_overhead",
    "profiled_step_time_s",
    "step_nocomm_s",
    "nocomm_run",
    "tokens_per_sample",
    "step_time_median_s",
    "step_time_p90_s",
    "step_time_mean_s",
    "timed_steps",
    "final_loss",
    "flops_per_step",
)


def _env_columns(meta: dict) -> dict:
    env = meta.get("env", {})
    slurm = env.get("slurm", {})
    return {
        "host": env.get("host", ""),
        "torch": env.get("torch", ""),
        "cuda": env.get("cuda") or "",
        "nccl": env.get("nccl") or "",
        "device_names": ", ".join(env.get("device_names") or []),
        "cpu_model": env.get("cpu_model", ""),
        "python": env.get("python", ""),
        "git_commit": env.get("git_commit") or "",
        "start_time": env.get("start_time", ""),
        "slurm_job_id": slurm.get("SLURM_JOB_ID", ""),
        "gpus_given": slurm.get("SLURM_GPUS_ON_NODE", ""),
        # NO: the job had its nodes to itself (exclusive_nodes); else others could share
        "slurm_oversubscribe": env.get("slurm_oversubscribe") or "",
        "cuda_visible_devices": env.get("cuda_visible_devices") or "",
        "launch_command": " ".join(env.get("launch_command", [])),
    }


ANATOMY = ("compute_s", "comm_s", "comm_exposed_s", "bubble_s", "data_s", "other_s")
# Per cell, medians over steps: the profiled steps timed like the others, and the
# no-communication steps.
STEP_CHECKS = ("profiled_step_time_s", "step_nocomm_s")


def _anatomy_columns(meta: dict, pipelined: bool) -> dict:
    """The critical anatomy (per profiled step the straggler's parts over the slowest
    rank's step, the central half of those steps averaged; see anatomy.critical) and
    the busiest rank's communication volume."""
    per_rank = [a for a in meta.get("anatomy_per_rank") or [] if a]
    out: dict = {k: np.nan for k in (*ANATOMY, "profiled_step_s")}
    if per_rank:
        crit = anatomy.critical(per_rank, pipelined)
        out.update({k: crit[k] for k in ANATOMY}, profiled_step_s=crit["step_s"])
    comm = meta.get("comm_per_rank") or []
    loads = [
        (sum(v["bytes"] for v in c.values()), sum(v["count"] for v in c.values()), c) for c in comm
    ]
    busiest = max(loads, key=lambda x: x[0], default=(np.nan, np.nan, {}))
    out.update(
        comm_bytes_per_step=busiest[0] if per_rank else np.nan,
        collectives_per_step=busiest[1] if per_rank else np.nan,
        comm_by_op=json.dumps(busiest[2], sort_keys=True) if per_rank else "",
    )
    return out


def _held(meta: dict, kind: str) -> float:
    """Bytes of `kind` held by the fullest rank (NaN when not recorded)."""
    per_rank = meta.get("held_bytes_per_rank") or []
    return max((r[kind] for r in per_rank), default=np.nan)


# Columns of a cell kept in memory only (dropped before cells.csv): what the summary's
# memory model and the equivalence's likely cause read from the cell's model facts.
_IN_MEMORY = ("hosts", "timed_window", "model_params", "activation_bytes_per_sample", "notes")


def _number(value) -> float:
    """A recorded figure, NaN where the cell could not count it (None) or a record
    carries none."""
    return np.nan if value is None else float(value)


def _cell_row(
    meta_path: Path, meta: dict, config_hash: str | None = None
) -> tuple[dict, pd.DataFrame | None]:
    try:
        spec = RunSpec.from_dict(meta["spec"])
    except (KeyError, TypeError, ValueError) as e:
        raise records.ResultsError(f"{meta_path}: unreadable cell settings ({e})") from e
    # Its settings, hashed here rather than read from the record, against the config's
    # cell of that directory: a record made for other settings is not this run's.
    if config_hash is not None and spec.config_hash() != config_hash:
        raise records.ResultsError(
            f"{meta_path}: recorded with settings other than the config's for this cell "
            f"(settings hash {spec.config_hash()}, the config's {config_hash}); rerun the "
            "cell (delete its directory) or merge it with the config it was run with"
        )
    facts = meta.get("model_facts") or {}
    row = {k: meta[k] for k in CELL_KEYS}
    row.update(
        {
            "status": meta["status"],
            "reason": meta.get("reason") or "",
            "scaling": spec.scaling,
            "global_batch": spec.global_batch,
            "steps": spec.steps,
            "warmup": spec.warmup,
            "device_type": meta.get("device_type", ""),
            "emulated": bool(meta.get("emulated", False)),
            "peak_flops_total": meta.get("peak_flops_total", np.nan),
            "peak_memory_bytes": meta.get("peak_memory_bytes", np.nan),
            "params_bytes": _held(meta, "params"),
            "grads_bytes": _held(meta, "grads"),
            "optimizer_bytes": _held(meta, "optimizer"),
            "param_travel": meta.get("param_travel", np.nan),
            "processes": meta.get("world_size") or 1,
            "threads_per_rank": meta.get("threads_per_rank", np.nan),
            "usable_cores": meta.get("env", {}).get("usable_cores", np.nan),
            "ranks_per_core": meta.get("ranks_per_core", np.nan),
            "options": json.dumps(dict(spec.to_dict()["options"]), sort_keys=True),
            **_anatomy_columns(meta, spec.record.pipelined),
            "recompute_s": anatomy.recompute(meta.get("regions_per_rank") or [], spec.ac),
            "reorder_rel_diff": meta.get("reorder_rel_diff", np.nan),
            **_env_columns(meta),
            "config_hash": meta.get("config_hash", ""),
            "dir": str(meta_path.parent),
            # in memory only (lists): the hosts it ran on and when it was timed
            "hosts": meta.get("hosts") or [meta.get("env", {}).get("host", "")],
            "timed_window": meta.get("timed_window"),
            "timed_from": (meta.get("timed_window") or [np.nan])[0],
            "timed_to": (meta.get("timed_window") or [np.nan, np.nan])[1],
            # in memory only: the model as the cell counted it
            "model_params": _number(facts.get("params")),
            "activation_bytes_per_sample": _number(facts.get("activation_bytes_per_sample")),
            "notes": facts.get("maths_notes") or {},
        }
    )
    if meta["status"] not in records.RAN:
        return row, None
    steps_path = meta_path.parent / "steps.csv"
    try:
        with open(steps_path) as f:
            records.check_step_header(steps_path, next(csv.reader(f)))
        steps = pd.read_csv(steps_path).assign(**{k: meta[k] for k in records.ALSO_READ[3]})
    except (OSError, StopIteration, pd.errors.ParserError) as e:
        raise records.ResultsError(f"{steps_path}: unreadable steps ({e})") from e
    timed = steps.loc[steps["phase"] == "timed", "step_time_s"]
    if timed.empty or timed.isna().any():
        raise records.ResultsError(f"{steps_path}: no valid timed steps")
    row.update(
        flops_per_step=_number(facts.get("flops_per_step")),
        tokens_per_sample=_number(facts.get("tokens_per_sample")),
        step_time_median_s=timed.median(),
        step_time_p90_s=timed.quantile(0.9),
        step_time_mean_s=timed.mean(),
        timed_steps=len(timed),
        final_loss=steps["loss"].iloc[-1],
    )
    profiled = meta.get("profiled_step_times") or []
    row["profiled_step_time_s"] = float(np.median(profiled)) if profiled else np.nan
    nocomm = meta.get("nocomm_step_times")
    row.update(
        _against_neighbours(spec, steps, profiled, meta.get("anatomy_per_rank") or [], nocomm)
    )
    # No process group, no communication to switch off: the step is its own check.
    row["step_nocomm_s"] = float(np.median(nocomm)) if nocomm else row["step_time_median_s"]
    row["nocomm_run"] = bool(nocomm)
    return row, steps


def _against_neighbours(
    spec: RunSpec,
    steps: pd.DataFrame,
    profiled: list[float],
    anatomies: list,
    nocomm: list[float] | None,
) -> dict:
    """Each profiler session against its neighbours, not against the whole cell: a
    shared machine drifts more over a cell (this VM's steps can turn 40% faster
    between two sessions) than between neighbours. profiler_overhead: the median over
    sessions of the session's profiled step over the timed runs on both sides of it
    (medians, loop.sessions: a drift one way cancels); anatomy_closure: the median over
    profiled steps of the critical parts' sum over those runs' timed step;
    work_ratio: the median over sessions of the critical compute + data + other
    (median) over the no-communication block run right after the session
    (loop.blocks; without one, over the timed runs)."""
    by_step = steps.set_index("step")["step_time_s"]
    critical = anatomy.critical_steps(anatomies, spec.record.pipelined)
    found = sessions(step_kinds(spec.steps, spec.warmup, spec.profile_steps))
    per_block = len(nocomm) // len(found) if nocomm and found else 0
    ratios, closures, works, k = [], [], [], 0
    for i, (run, session) in enumerate(found):
        after = found[i + 1][0] if i + 1 < len(found) else []
        timed = by_step.reindex(run + after).dropna()
        mine, parts = profiled[k : k + len(session)], critical[k : k + len(session)]
        k += len(session)
        if timed.empty or not mine:
            continue
        base = float(timed.median())
        ratios.append(float(np.median(mine)) / base)
        closures += [p["step_s"] / base for p in parts]
        if parts:
            check = nocomm[i * per_block : (i + 1) * per_block] if per_block else [base]
            work = np.median([anatomy.work(p) for p in parts])
            works.append(float(work) / float(np.median(check)))
    return {
        "profiler_overhead": float(np.median(ratios)) if ratios else np.nan,
        "anatomy_closure": float(np.median(closures)) if closures else np.nan,
        "work_ratio": float(np.median(works)) if works else np.nan,
    }


def likely_cause(notes: dict, strategy: str) -> str:
    """Why a cell that differs from single may differ: of the model's layers the cell
    recorded (flops.model_facts), the batch-dependent ones when the strategy splits the
    batch, and the random ones always."""
    found = list(notes.get("random") or [])
    if record(strategy).batch_split is not None:
        found = list(notes.get("batch") or []) + found
    return "; ".join(found)


def _param_diffs(cells: pd.DataFrame) -> pd.DataFrame:
    """Each ok cell's parameters against single's of the same model, variant and repeat,
    where both ran the same global batches (strong scaling) for the same steps: the
    largest difference, the relative one, its tolerance and the verdict.

    What each cell kept of its parameters (analyze/fingerprint.py: a small model's whole, a
    large one's sketch) is read one pair at a time: single's once per (variant,
    repeat), each cell's then released, so the merge holds about two cells' files
    whatever the number of cells (a GPU sweep has hundreds). A params.pt that is absent
    (records copied from a cluster without their parameters, as the GPU check's own copy
    does) leaves that cell not compared; one that is present but unreadable is refused."""
    cols = ["max_abs_param_diff", "rel_param_diff", "equivalence_tol", "equivalent", "likely_cause"]
    out = pd.DataFrame({c: pd.Series(np.nan, index=cells.index, dtype=object) for c in cols})
    ok = cells[cells["status"] == "ok"]
    refs = ok[(ok["strategy"] == REFERENCE) & (ok["ac"] == "none")]
    refs = refs.set_index([*VARIANT_KEYS, "repeat"])
    for key, group in ok.groupby([*VARIANT_KEYS, "repeat"], sort=False):
        if key not in refs.index:
            continue
        ref = refs.loc[key]
        mine = group[(group["scaling"] == "strong") & (group["steps"] == ref["steps"])]
        if mine.empty:
            continue
        absent = "not compared: {} params.pt absent (records copied without parameters?)"
        ref_params = Path(ref["dir"]) / "params.pt"
        if not ref_params.exists():
            out.loc[mine.index, "likely_cause"] = absent.format("single's")
            continue
        b = fingerprint.load(ref_params)
        for i, c in mine.iterrows():
            path = Path(c["dir"]) / "params.pt"
            if not path.exists():
                out.loc[i, "likely_cause"] = absent.format("its")
                continue
            a = b if c["dir"] == ref["dir"] else fingerprint.load(path)
            try:
                max_abs, l2 = fingerprint.difference(a, b)
            except ValueError as e:
                raise records.ResultsError(f"{path}: {e} from single's") from e
            del a  # the next cell's in its place, not beside it
            rel = l2 / ref["param_travel"] if ref["param_travel"] else 0.0
            tol = equivalence.tolerance(ref["reorder_rel_diff"], c["strategy"], c["devices"])
            same = bool(rel <= tol)
            cause = "" if same else likely_cause(c["notes"], c["strategy"])
            out.loc[i, cols] = [max_abs, rel, tol, same, cause]
        del b
    for c in cols[:3]:
        out[c] = out[c].astype(float)
    return out


def _status(g: pd.DataFrame) -> str:
    """A row's status over its repeats: diverged if any repeat did (a warning that
    outranks the rest), ok if any ran, else failed or skipped."""
    for status in ("diverged", "ok", "failed"):
        if (g["status"] == status).any():
            return status
    return "skipped"


def _one(g: pd.DataFrame) -> pd.Series:
    """Summary of one (model, variant, strategy, devices) over its repeats. Timings
    come from every repeat that ran (a diverged one's too, shown but never ranked);
    equivalence only from those that stayed finite."""
    ok = g[g["status"] == "ok"]
    ran = g[g["status"].isin(records.RAN)]
    not_ok = g[g["status"] != "ok"]
    status = _status(g)
    med = ran["step_time_median_s"]
    verdicts = ok["equivalent"].dropna()
    return pd.Series(
        {
            "scaling": g["scaling"].iloc[0],
            "status": status,
            "reason": not_ok["reason"].iloc[0] if len(not_ok) else "",
            "repeats_ok": len(ok),
            "overlapped_with": "; ".join(
                dict.fromkeys(w for w in g["overlapped_with"] if isinstance(w, str) and w)
            ),
            "repeats_total": len(g),
            "global_batch": g["global_batch"].iloc[0],
            "step_time_s": med.median(),
            "step_time_min_s": med.min(),
            "step_time_max_s": med.max(),
            "flops_per_step": ok["flops_per_step"].median(),
            "peak_flops_total": ok["peak_flops_total"].median(),
            "peak_memory_bytes": ok["peak_memory_bytes"].max(),
            "params_bytes": ok["params_bytes"].max(),
            "grads_bytes": ok["grads_bytes"].max(),
            "optimizer_bytes": ok["optimizer_bytes"].max(),
            "max_abs_param_diff": ok["max_abs_param_diff"].max(),
            "rel_param_diff": ok["rel_param_diff"].max(),
            "equivalence_tol": ok["equivalence_tol"].min(),
            "equivalent": bool(verdicts.all()) if len(verdicts) else None,
            "likely_cause": "; ".join(
                dict.fromkeys(c for c in ok["likely_cause"] if isinstance(c, str) and c)
            ),
            "tokens_per_sample": ok["tokens_per_sample"].median(),
            "emulated": bool(ok["emulated"].any()),
            **{
                k: ok[k].median()
                for k in (
                    *ANATOMY,
                    "recompute_s",
                    "profiled_step_s",
                    "anatomy_closure",
                    "work_ratio",
                    "profiler_overhead",
                    *STEP_CHECKS,
                )
            },
            "nocomm_run": bool(ok["nocomm_run"].any()),
            "comm_bytes_per_step": ok["comm_bytes_per_step"].median(),
            "collectives_per_step": ok["collectives_per_step"].median(),
            "comm_by_op": ok["comm_by_op"].iloc[0] if len(ok) else "",
            "device_type": g["device_type"].iloc[0],
            "processes": g["processes"].iloc[0],
            "threads_per_rank": ok["threads_per_rank"].median(),
            "usable_cores": ok["usable_cores"].median(),
            "ranks_per_core": ok["ranks_per_core"].median(),
            "options": g["options"].iloc[0],
            # in memory only, for the memory model: the model as its cells counted it
            "model_params": ran["model_params"].median(),
            "activation_bytes_per_sample": ran["activation_bytes_per_sample"].median(),
        }
    )


def summarize(
    cells: pd.DataFrame,
    steps: pd.DataFrame,
    curves: pd.DataFrame | None = None,
    ranks: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """One row per cell (repeats pooled), with its checks and the scaling model's
    prediction (from `ranks`, the ranks measured alone)."""
    if curves is None:
        curves = pd.DataFrame(columns=list(collectives.COLUMNS))
    keys = list(SUMMARY_KEYS)
    pooled = stats.step_statistics(steps, keys)
    summary = cells.groupby(keys, sort=False).apply(_one, include_groups=False)
    if len(pooled):
        summary = summary.join(pooled.set_index(keys))
    summary = summary.reset_index()
    for col in stats.STEP_COLUMNS:
        if col not in summary:
            summary[col] = np.nan
    summary["throughput"] = summary["global_batch"] / summary["step_time_s"]
    summary["tokens_per_s"] = summary["throughput"] * summary["tokens_per_sample"]
    # Speedup only between cells whose loss stayed finite (stats.reference_rows too).
    summary["speedup"] = stats.speedup(summary, summary).where(summary["status"] == "ok")
    summary["efficiency"] = summary["speedup"] / summary["devices"]
    summary = summary.join(stats.speedup_intervals(summary, steps))
    summary["achieved_flops_per_s"] = summary["flops_per_step"] / summary["step_time_s"]
    summary["mfu"] = summary["achieved_flops_per_s"] / summary["peak_flops_total"]
    summary["comm_tax_s"] = summary["step_time_s"] - summary["step_nocomm_s"]
    summary = summary.join(_mesh_columns(summary, ranks))
    summary = summary.join(crosscheck.checks(summary, curves))
    summary = summary.join(scaling.predict(summary, curves, ranks, list(VARIANT_KEYS)))
    # Only for models that ran: their cells recorded the model's size.
    ran = summary[summary["status"].isin(records.RAN)]
    memory = [
        scaling.memory_model(r, r["model_params"], r["activation_bytes_per_sample"])
        for _, r in ran.iterrows()
    ]
    memory_cols = [
        "model_params_bytes",
        "model_grads_bytes",
        "model_optimizer_bytes",
        "model_activations_bytes",
    ]
    summary = summary.join(pd.DataFrame(memory, index=ran.index, columns=memory_cols))
    summary["overlapped"] = summary["overlapped_with"].fillna("").astype(str) != ""
    summary["ideal_speedup"] = [ideal_speedup(r, summary) for _, r in summary.iterrows()]
    return summary[list(SUMMARY_COLUMNS)]


def _mesh_columns(summary: pd.DataFrame, ranks: pd.DataFrame | None) -> pd.DataFrame:
    """Each row's degrees on the mesh, and from its ranks measured alone (ranks.csv)
    the collectives by mesh dimension of the busiest and the saved activations of the
    first."""
    out = pd.DataFrame(
        [scaling.layout_of(r).degrees for _, r in summary.iterrows()], index=summary.index
    )
    out["comm_by_dim"], out["saved_activation_bytes"] = "", np.nan
    out["checkpointed_blocks"] = np.nan
    if ranks is None or ranks.empty:
        return out
    keys = [*VARIANT_KEYS, "ac", "strategy", "devices"]
    ok = ranks[ranks["status"] == "ok"]
    for (key, mine), i in _matches(ok, summary, keys):
        loads = [(_bytes(scaling.by_dim(r, r["strategy"])), r) for _, r in mine.iterrows()]
        busiest = max(loads, key=lambda x: x[0])[1]
        out.loc[i, "comm_by_dim"] = json.dumps(scaling.by_dim(busiest, key[-2]), sort_keys=True)
        first = mine.sort_values("rank").iloc[0]
        for col in ("saved_activation_bytes", "checkpointed_blocks"):
            out.loc[i, col] = first.get(col, np.nan)
    return out


def _matches(ranks: pd.DataFrame, summary: pd.DataFrame, keys: list[str]):
    """((key, its ranks), summary index) for each summary row that has ranks."""
    rows = {tuple(r[k] for k in keys): i for i, r in summary.iterrows()}
    for key, mine in ranks.groupby(keys, sort=False):
        if key in rows:
            yield (key, mine), rows[key]


def _bytes(by_dim: dict) -> float:
    return sum(v["bytes"] for ops in by_dim.values() for v in ops.values())


def ideal_speedup(row: pd.Series, summary: pd.DataFrame) -> float:
    """What this hardware could give at n devices: n GPUs give n; on CPU, n processes
    share the cores the reference already used, so at most cores / its threads."""
    n = row["devices"]
    if row["device_type"] != "cpu":
        return float(n)
    cores = summary["usable_cores"].max()
    singles = summary.loc[summary["strategy"] == REFERENCE, "threads_per_rank"].dropna()
    threads = singles.max() if len(singles) else 1
    if not cores or np.isnan(cores) or not threads:
        return float(n)
    return float(min(n, max(1.0, cores / threads)))


def load_cells(
    meta_paths: list[Path],
    collective_windows: list[dict] | None = None,
    config_hashes: Sequence[str] | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The cells' rows and steps. `config_hashes`: per meta path, the settings hash of
    the config's cell there (RunSpec.config_hash); a record of other settings is
    refused, naming its file (ResultsError)."""
    if config_hashes is not None and len(config_hashes) != len(meta_paths):
        raise ValueError(f"{len(config_hashes)} config hashes for {len(meta_paths)} cells")
    rows, frames = [], []
    for i, p in enumerate(meta_paths):
        expected = None if config_hashes is None else config_hashes[i]
        row, steps = _cell_row(Path(p), records.read_meta(Path(p)), expected)
        rows.append(row)
        if steps is not None:
            frames.append(steps)
    cells = pd.DataFrame(rows)
    for col in _OK_COLUMNS:
        if col not in cells:
            cells[col] = np.nan
    steps = (
        pd.concat(frames, ignore_index=True)
        if frames
        else pd.DataFrame(columns=list(records.STEP_COLUMNS))
    )
    cells["overlapped_with"] = overlaps(cells, collective_windows or [])
    return cells.join(_param_diffs(cells)), steps


def overlaps(cells: pd.DataFrame, others: list[dict]) -> pd.Series:
    """For each cell, the other timed jobs (cells, collectives benchmarks) whose timed
    window overlapped its own on a host they shared: their times are not comparable,
    each slowed the other. `others`: {label, hosts, window} of the jobs that are not
    cells. Empty where none overlapped."""
    jobs = [
        {"label": c["dir"], "hosts": set(c["hosts"]), "window": c["timed_window"]}
        for _, c in cells.iterrows()
        if isinstance(c.get("timed_window"), list)
    ] + [{**o, "hosts": set(o["hosts"])} for o in others if o.get("window")]
    out = pd.Series("", index=cells.index, dtype=object)
    for i, c in cells.iterrows():
        window = c.get("timed_window")
        if not isinstance(window, list):
            continue
        hit = [
            j["label"]
            for j in jobs
            if j["label"] != c["dir"]
            and j["hosts"] & set(c["hosts"])
            and j["window"][0] < window[1]
            and window[0] < j["window"][1]
        ]
        out[i] = "; ".join(hit)
    return out


def aggregate(
    meta_paths: list[Path],
    steps_out: Path,
    summary_out: Path,
    cells_out: Path,
    collective_metas: list[Path] = (),
    collectives_out: Path | None = None,
    ranks_csv: Path | None = None,
    config_hashes: Sequence[str] | None = None,
) -> None:
    """Merge the cells' records (and the collectives benchmarks') into the tables.
    `config_hashes`: per meta path, the hash of the config's cell (load_cells)."""
    rows, _failed, windows = collectives.load(list(collective_metas))
    cells, steps = load_cells(meta_paths, windows, config_hashes)
    curves = pd.DataFrame(rows, columns=list(collectives.COLUMNS))
    numeric = ("devices", "bytes", "time_s", "algbw_GBps", "busbw_GBps", "iters", "trials")
    for col in (*numeric, "world", "stride"):
        curves[col] = pd.to_numeric(curves[col])
    ranks = pd.read_csv(ranks_csv) if ranks_csv else None
    # the cells' model reads the curves over whole worlds; advise's fabric, every row
    summary = summarize(cells, steps, collectives.whole(curves), ranks)
    cells = cells.drop(columns=list(_IN_MEMORY))
    outputs = {Path(steps_out): steps, Path(cells_out): cells, Path(summary_out): summary}
    if collectives_out is not None:
        outputs[Path(collectives_out)] = curves
    # Together: all written before any replaces its old table (records.atomic_write_files
    # says what a reader can still see).
    records.atomic_write_files({p: df.to_csv(index=False).encode() for p, df in outputs.items()})
