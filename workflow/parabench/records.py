"""The results contract: one cell writes steps.csv + meta.json (+ params.pt) atomically.

Defined once here, with a version. meta.json is written last and is the commit marker:
a cell directory without it never happened. Columns are documented in STEP_COLUMNS and
in docs/results.md.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

SCHEMA_VERSION = 5
# Version 3, before activation checkpointing joined a cell's key: read as `ac: none`
# (what those cells ran), so a finished result survives the upgrade; its settings hash
# is unchanged too (RunSpec leaves `ac` out of it when none). Version 4, before a large
# model's params.pt became its fingerprint (analyze/fingerprint.py): the same records; their
# params.pt, every model's parameters whole, is read where it is what version 5 keeps
# (at most fingerprint.EXACT_MAX elements) and refused, naming it, where it is not.
ALSO_READ = {3: {"ac": "none"}, 4: {}}
STATUSES = ("ok", "skipped", "failed", "diverged")
# Statuses whose cells ran their steps (steps.csv holds them): a diverged cell's loss
# became NaN or inf, so its times are kept but never ranked, its parameters never compared.
RAN = ("ok", "diverged")

# A cell's directory under the results directory: its key, the axes as one variant
# label (fp32-sgd, bf16-adamw-compile). The workflow's wildcards read the same pattern.
CELL_DIR = "runs/{model}/{variant}/{strategy}/n{devices}/r{repeat}"

# A cell's key, in every record and table (RunSpec.identity() gives it).
CELL_KEYS = ("model", "precision", "optimizer", "compile", "ac", "strategy", "devices", "repeat")
# The same without the repeat: one row of summary.csv.
SUMMARY_KEYS = CELL_KEYS[:-1]
# The axes a speedup is taken within: a strategy is compared with `single` of the same
# model, precision, optimizer and compile setting, without activation checkpointing
# (which leaves the maths as it was): an AC cell's speedup shows what recompute costs.
VARIANT_KEYS = ("model", "precision", "optimizer", "compile")

# One row per optimizer step of one cell (warm-up rows kept, marked by `phase`).
STEP_COLUMNS: dict[str, str] = {
    "schema_version": "version of this contract",
    "model": "model label from the config",
    "precision": "fp32, or bf16 (autocast; parameters and optimizer in fp32)",
    "optimizer": "sgd or adamw",
    "compile": "True when each block's forward ran under torch.compile",
    "ac": "activation checkpointing: none, full, selective or every<k> (blocks)",
    "strategy": "strategy name",
    "devices": "devices (GPUs, or CPU processes / stage slots) the cell used",
    "repeat": "index of the separate launch this cell was",
    "step": "optimizer step index, from 0, warm-up included; the profiled steps between "
    "timed runs take the missing indices",
    "phase": "'warmup' (excluded from statistics) or 'timed'",
    "step_time_s": "wall time of the step, synchronized; max over ranks",
    "step_time_min_s": "fastest rank's time for the same step (rank skew = max - min)",
    "loss": "global loss of the step (sum of the ranks' contributions); nan or inf: diverged",
    "samples": "samples in the global batch of the step",
}

META_KEYS = ("schema_version", "status", "reason", *CELL_KEYS)


# ranks.csv (predict/rank_alone.py): one row per rank measured alone, what the scaling model reads
RANK_KEY = (*VARIANT_KEYS, "ac", "strategy", "devices", "rank")
RANK_COLUMNS = (
    *RANK_KEY,
    "status",
    "reason",
    "threads",
    "samples_per_rank",
    "compute_s",
    "compute_steps_s",
    "comm_by_op",
    "comm_by_dim",
    "comm_bytes_per_step",
    "collectives_per_step",
    "params_bytes_per_rank",
    "grads_bytes_per_rank",
    "optimizer_bytes_per_rank",
    "peak_memory_bytes",
    "saved_activation_bytes",
    "checkpointed_blocks",
)


# rehearsal.csv (preflight/rehearse.py): one row per rank of a cell rehearsed on fake tensors;
# docs/results.md defines each column.
REHEARSAL_KEY = RANK_KEY
REHEARSAL_COLUMNS = (
    *REHEARSAL_KEY,
    "status",
    "reason",
    "device",
    "gpu",
    "peak_memory_bytes",
    "device_memory_bytes",
    "fits",
    "held_bytes",
    "flops_per_step",
    "compute_s_estimate",
    "seconds",
    "config_hash",
    "code_hash",
)


# plan.csv (predict/plan.py): one row per planned rank, rank 0 of a world of N
PLAN_KEY = (*VARIANT_KEYS, "ac", "strategy", "world_size")
PLAN_COLUMNS = (
    *PLAN_KEY,
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
    "comm_by_dim",
    "comm_s",
    "bubble_s",
    "predicted_step_s",
    "samples_per_s_per_device",
    "scaling_efficiency",
    "fabric",
    "fabric_source",
)

# results/advise.csv (predict/advise.py): one row per candidate layout; docs/results.md
# defines each column.
ADVISE_COLUMNS = (
    "model",
    "params",
    "gpus",
    "gpu",
    "fabric",
    "precision",
    "optimizer",
    "compile",
    "float8",
    "global_batch",
    "tokens_per_sample",
    "layout",
    "pp",
    "dp_replicate",
    "dp_shard",
    "tp",
    "schedule",
    "ac",
    "zero",
    "micro_batch",
    "accumulation",
    "status",
    "reason",
    "rank",
    "memory_bytes",
    "reserved_bytes",
    "overhead_bytes",
    "memory_source",
    "param_bytes",
    "grad_bytes",
    "opt_bytes",
    "act_bytes",
    "temp_bytes",
    "device_memory_bytes",
    "fits",
    "compute_s",
    "recompute_s",
    "compute_source",
    "roofline_compute_s",
    "comm_s",
    "comm_hidden_s",
    "bubble_s",
    "step_s",
    "samples_per_s_per_gpu",
    "tokens_per_s_per_gpu",
    "flops_per_gpu",
    "mfu",
    "binding",
    "leaves_out",
    "comm_by_dim",
)

# results/advise-torchtitan.csv: advise's prediction of each of torchtitan's published
# runs (published.TORCHTITAN_TABLES) beside what it reported.
TORCHTITAN_COLUMNS = (
    "table",
    "run",
    "source",
    *ADVISE_COLUMNS,
    "published_tokens_per_s_per_gpu",
    "tps_error",
    "published_memory_gib",
    "predicted_memory_gib",
    "memory_error",
    "predicted_reserved_gib",
    "reserved_error",
    "not_modelled",
)


def read_rows(path: Path) -> list[dict]:
    """The rows of a CSV that write_rows wrote, as strings; none if it does not exist."""
    try:
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    except FileNotFoundError:
        return []


def concat_rows(paths: list[Path], out: Path, columns: tuple[str, ...]) -> str:
    """One table of the rows of several written by write_rows (a job's parts), in
    their order, atomically; returns a line saying so, for the log."""
    rows = [row for path in paths for row in read_rows(Path(path))]
    write_rows(out, columns, rows)
    return f"{out}: {len(rows)} rows of {', '.join(map(str, paths))}\n"


def write_rows(path: Path, columns: tuple[str, ...], rows: list[dict]) -> None:
    """A CSV of `rows` under `columns` (missing values empty, others dropped), atomically."""
    atomic_write_bytes(path, csv_text(columns, rows).encode())


def csv_text(columns: tuple[str, ...], rows: list[dict], header: bool = True) -> str:
    """`rows` as write_rows writes them, with its header line or without."""
    buf = io.StringIO()
    writer = csv.DictWriter(
        buf, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n"
    )
    if header:
        writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()


class ResultsError(ValueError):
    """A results file that cannot be trusted (corrupt, wrong schema); names the file."""


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary name in the same directory, then rename: a reader (or a
    killed run) sees the old file or the whole new one, never a half-written one."""
    atomic_write_files({path: data})


def atomic_write_files(files: Mapping[Path, bytes]) -> None:
    """Write each file to a temporary name in its directory, all of them, and only
    then rename each over its own: a failure while writing (a full disk, a kill)
    leaves every old file as it was. The renames are one system call each, so a reader
    may still see the old files and the new ones mixed for the microseconds between
    two of them, and a crash in those microseconds leaves the mix; never a
    half-written file."""
    staged: list[tuple[str, Path]] = []
    try:
        for path, data in files.items():
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            staged.append((tmp, path))
            os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp's 0600 would keep a shared report private
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        while staged:  # each renamed is no longer a temporary to remove
            tmp, path = staged[0]
            os.replace(tmp, path)
            staged.pop(0)
    except BaseException:
        for tmp, _ in staged:
            Path(tmp).unlink(missing_ok=True)
        raise


def write_steps(path: Path, rows: list[dict]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(STEP_COLUMNS), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({"schema_version": SCHEMA_VERSION, **row})
    atomic_write_bytes(path, buf.getvalue().encode())


def write_meta(path: Path, meta: dict) -> None:
    if meta.get("status") not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {meta.get('status')!r}")
    meta = {"schema_version": SCHEMA_VERSION, **meta}
    atomic_write_bytes(
        path, (json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n").encode()
    )


def write_ran(
    out: Path, rows: list[dict], params: bytes, diverged: str | None = None, **fields
) -> None:
    """A cell that ran: parameters, then steps, then meta.json, the commit marker.
    `diverged`: why its loss stopped being a number (status diverged), else ok."""
    atomic_write_bytes(out / "params.pt", params)
    write_steps(out / "steps.csv", rows)
    status = "diverged" if diverged else "ok"
    write_meta(out / "meta.json", {"status": status, "reason": diverged, **fields})


def write_outcome(out: Path, status: str, reason: str, **fields) -> None:
    """A record without steps (skipped or failed): empty steps.csv, then meta.json."""
    write_steps(out / "steps.csv", [])
    write_meta(out / "meta.json", {"status": status, "reason": reason, **fields})


def write_meta_only(out: Path, status: str, reason: str, **fields) -> None:
    """A record of something that is not a cell (the collectives benchmark): no steps."""
    write_meta(out / "meta.json", {"status": status, "reason": reason, **fields})


def read_meta(path: Path) -> dict:
    """Load and check one meta.json; raise ResultsError naming the file if untrustworthy."""
    try:
        meta = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ResultsError(f"{path}: unreadable results metadata ({e})") from e
    if not isinstance(meta, dict):
        raise ResultsError(f"{path}: results metadata is not a JSON object")
    version = meta.get("schema_version")
    if version in ALSO_READ:
        meta = {**ALSO_READ[version], **meta}
    elif version != SCHEMA_VERSION:
        raise ResultsError(
            f"{path}: results schema version {version!r}, this parabench reads {SCHEMA_VERSION}; "
            "re-run the cell (delete its directory) or aggregate with the matching version"
        )
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise ResultsError(f"{path}: results metadata lacks {missing}")
    if meta["status"] not in STATUSES:
        raise ResultsError(f"{path}: unknown status {meta['status']!r}")
    return meta


def check_step_header(path: Path, header: list[str]) -> None:
    """The columns of steps.csv: this version's, or an older one's that ALSO_READ fills."""
    older = [c for c in STEP_COLUMNS if c not in ALSO_READ[3]]
    if header != list(STEP_COLUMNS) and header != older:
        raise ResultsError(
            f"{path}: step columns {header} do not match schema v{SCHEMA_VERSION} "
            f"{list(STEP_COLUMNS)}"
        )


# Each rank that catches an exception leaves error-rank<R>.json beside the cell's
# records, so the launcher can name the root cause (the first rank to fail, its
# exception type and message) rather than a peer's symptom or a traceback's first line.
ERROR_GLOB = "error-rank*.json"


def write_rank_error(out: Path, rank: int, exc: BaseException, tb: str) -> None:
    error = {
        "rank": rank,
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": tb,
        "time": time.time(),
    }
    atomic_write_bytes(Path(out) / f"error-rank{rank}.json", json.dumps(error).encode())


def read_rank_errors(out: Path) -> list[dict]:
    """The ranks' errors, earliest first (unreadable files are skipped: a rank killed
    mid-write leaves only a temporary file, which the glob does not match)."""
    found = []
    for p in Path(out).glob(ERROR_GLOB):
        with contextlib.suppress(OSError, json.JSONDecodeError):
            found.append(json.loads(p.read_text()))
    return sorted(found, key=lambda e: e.get("time", 0))


def clear_rank_errors(out: Path) -> None:
    for p in Path(out).glob(ERROR_GLOB):
        p.unlink(missing_ok=True)


def describe_error(error: dict, world: int | None = None) -> str:
    """'rank 1: RuntimeError: message' (no rank prefix for a one-process cell), on
    one line, at most 500 characters."""
    message = " ".join(str(error.get("message", "")).split())
    text = f"{error.get('type', 'Error')}: {message}" if message else error.get("type", "")
    if world != 1:
        text = f"rank {error.get('rank')}: {text}"
    return text[:500]


# One row per (model, precision, optimizer, compile, strategy, devices) in summary.csv,
# over repeats (aggregate.summarize writes them, in this order).
SUMMARY_COLUMNS: dict[str, str] = {
    "model": "model label",
    "precision": "fp32 or bf16",
    "optimizer": "sgd or adamw",
    "compile": "each block's forward under torch.compile",
    "ac": "activation checkpointing: none, full, selective or every<k>",
    "strategy": "strategy",
    "devices": "devices",
    "pp": "pipeline degree on the mesh (stages)",
    "dp_replicate": "replicated data-parallel degree (DDP's, HSDP's replicas)",
    "dp_shard": "sharded data-parallel degree (FSDP's)",
    "tp": "tensor-parallel degree",
    "scaling": "strong (global batch fixed) or weak (per-device batch fixed)",
    "status": "diverged if any repeat's loss became NaN or inf; else ok if any repeat ran, "
    "else skipped or failed",
    "reason": "why repeats were skipped or failed (first one), empty when all ran",
    "repeats_ok": "repeats that ran",
    "repeats_total": "repeats configured",
    "overlapped": "True when a repeat's timed steps overlapped another timed job on its host",
    "overlapped_with": "those other jobs (cells' directories, collectives benchmarks)",
    "global_batch": "samples per optimizer step",
    "step_time_s": "median over repeats of each repeat's median timed step (headline)",
    "step_time_min_s": "fastest repeat's median step",
    "step_time_max_s": "slowest repeat's",
    "step_time_ci_low_s": "95% bootstrap interval of step_time_s (repeats, then steps)",
    "step_time_ci_high_s": "upper end of that interval",
    "step_time_p50_s": "median over all timed steps of all repeats",
    "step_time_p90_s": "90th percentile over all timed steps of all repeats",
    "step_time_p95_s": "95th percentile over all timed steps of all repeats",
    "step_time_iqr_s": "interquartile range over all timed steps of all repeats",
    "noisy": "True when step_time_iqr_s / step_time_p50_s > 10%",
    "rank_spread": "slowest rank's step over the fastest's, median over steps",
    "throughput": "samples per second = global_batch / step_time_s",
    "tokens_per_s": "language models: tokens per second = throughput x tokens per sample",
    "speedup": "throughput / throughput of single at 1 device, same model and variant",
    "efficiency": "speedup / devices",
    "speedup_ci_low": "95% bootstrap interval of speedup (both cells resampled)",
    "speedup_ci_high": "upper end of that interval",
    "efficiency_ci_low": "speedup_ci_low / devices",
    "efficiency_ci_high": "speedup_ci_high / devices",
    "flops_per_step": "FLOPs of one optimizer step (FlopCounterMode)",
    "achieved_flops_per_s": "flops_per_step / step_time_s: FLOP/s achieved",
    "mfu": "achieved_flops_per_s / peak FLOP/s of the devices used, in the cell's precision",
    "peak_memory_bytes": "max over repeats of the peak per device",
    "params_bytes": "parameter bytes held by the fullest rank between steps",
    "grads_bytes": "gradient bytes held by the fullest rank between steps",
    "optimizer_bytes": "optimizer-state bytes held by the fullest rank between steps",
    "max_abs_param_diff": "largest |parameter - single's| after the run, over repeats (over "
    "a sample of 2^20 where the model has more than 2^22 parameters: analyze/fingerprint.py)",
    "rel_param_diff": "‖params - single's‖ / ‖single's - initial‖, max over repeats (from "
    "count sketches, within 1.4%, where the model has more than 2^22 parameters)",
    "equivalence_tol": "rel_param_diff allowed: 25 x single's reversed-order distance",
    "equivalent": "True: same maths as single; False: differs; empty: not comparable "
    "(or its params.pt or single's not kept)",
    "likely_cause": "where a cell differs: the model's layers that change under this split; "
    "where it was not compared for want of a params.pt, that",
    "emulated": "true when devices were stand-ins (stages all on one CPU)",
    "options": "the strategy's own settings, as JSON (its catalog record's options)",
    "compute_s": "critical profiled step (the straggler's parts over the slowest rank's step, "
    "interquartile mean over steps): forward, backward, optimizer",
    "comm_s": "all communication's own time (collectives, send/recv), hidden or not",
    "comm_exposed_s": "communication the rank waited for (on CPU also the turns its compute "
    "lost to communication's threads): not hidden by compute",
    "bubble_s": "pipelines: a stage waiting for its neighbour, transfers included",
    "recompute_s": "activation checkpointing: the forward run again in backward (a share of "
    "compute_s; 0 without AC; empty where backward ran off the main thread, as on CUDA)",
    "data_s": "batch fetch (DataLoader mode) and host-to-device copies",
    "other_s": "the rest of the profiled step: Python between regions, launch overhead",
    "profiled_step_s": "the parts' sum: the critical profiled step",
    "anatomy_closure": "median over profiled steps of the parts' sum / the timed runs on "
    "both sides of its session: 1 when the parts explain the unprofiled step",
    "profiled_step_time_s": "median profiled step, timed like the timed ones (max over ranks)",
    "profiler_overhead": "median over profiler sessions of their profiled step / the timed "
    "runs on both sides (medians): what profiling cost a step",
    "step_nocomm_s": "median step of the same strategy with every collective returning at "
    "once (no process group: the step itself): the step on an infinitely fast interconnect",
    "nocomm_run": "True where the no-communication steps ran (a process group existed)",
    "comm_tax_s": "step_time_s - step_nocomm_s: what communication costs the step",
    "work_ratio": "per profiler session, the critical compute + data + other over the "
    "no-communication steps run right after it (no process group: the timed runs on both "
    "sides); the median over sessions",
    "work_check": "work_ratio - 1: the part of the step not spent waiting, by the anatomy "
    "against the no-communication steps beside it",
    "comm_curve_s": "the collectives benchmark's time for the collectives issued, none hidden",
    "comm_check": "comm_s / comm_curve_s - 1",
    "schedule_bubble_s": "pipelines: (n-1)/m of the stage's compute, the schedule's bubble",
    "bubble_check": "bubble_s / schedule_bubble_s - 1",
    "anatomy_flag": "True when a check is off by more than 20%",
    "anatomy_disagreement": "where flagged: each check off, with both figures",
    "comm_bytes_per_step": "bytes handed to collectives and send/recv per step, busiest rank",
    "collectives_per_step": "collectives and send/recv issued per step, busiest rank",
    "comm_by_op": "per op: collectives and bytes per step (JSON), busiest rank",
    "comm_by_dim": "per mesh dimension, per op: collectives and bytes per step (JSON), counted "
    "by each dimension's group on the busiest rank measured alone (ranks.csv)",
    "saved_activation_bytes": "activations saved for backward after the forward, rank 0 "
    "measured alone, by torch's MemTracker (ranks.csv)",
    "checkpointed_blocks": "blocks activation checkpointing recomputes (ranks.csv)",
    "predicted_compute_s": "scaling model: one rank of the strategy at n measured alone "
    "(ranks.csv; a pipeline's slowest stage) x ranks_per_core; one-process strategies: "
    "their one-device step",
    "predicted_bubble_s": "scaling model: (n-1)/m of a stage's compute (pipelines)",
    "predicted_comm_s": "scaling model: each collective the rank alone issued, timed on the curves",
    "predicted_step_s": "scaling model: the sum of the three terms above",
    "prediction_error": "predicted_step_s / step_time_s - 1 (multi-device cells)",
    "prediction_flag": "True when the prediction is off by more than 25%",
    "prediction_miss": "where flagged: the term the model misses most, and why; where "
    "there is no prediction, why",
    "ranks_per_core": "ranks taking turns on each core of a rank's binding (time-slicing "
    "above 1: the cell measures a shared processor)",
    "model_params_bytes": "analytic parameter bytes per rank",
    "model_grads_bytes": "analytic gradient bytes per rank",
    "model_optimizer_bytes": "analytic optimizer-state bytes per rank",
    "model_activations_bytes": "analytic activation bytes per rank (layer outputs)",
    "ideal_speedup": "what this hardware could give: n on GPUs; on CPU bounded by cores",
}
