"""`parabench sweep CONFIG`: the whole pipeline without Snakemake, one cell at a time.

For machines that have torch but not Snakemake (a GPU node's image, a container), and
for the GPU check. It plans the same cells from the same config, checks them the same
way, starts each with the same `parabench launch` command as the workflow's rule, then
aggregates and renders the same report. A cell whose record exists with the same
settings is kept, so an interrupted sweep resumes (`--retry-failed` reruns the failed
ones); so is a collectives benchmark run with the same settings, and the ranks and plan
tables while what they measure is unchanged. Like a Snakemake run, it holds the results
directory's lock while it runs (parabench.jobs.lock). Snakemake remains the way to run on a
cluster (scheduling, job groups, Slurm).
"""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from parabench import records
from parabench.catalog import CATALOG, ONE_PROCESS
from parabench.config import (
    ConfigError,
    advise_measures,
    alone_ranks,
    cells,
    collective_bytes,
    collective_devices,
    load_config,
    load_schema,
    measures,
    plan_key,
    planned_specs,
    problems,
    rank_key,
    skipped,
    with_devices,
)
from parabench.envinfo import runs_on_cuda
from parabench.hardware.fabric import PROFILES
from parabench.jobs import lock, warm
from parabench.jobs.launch import (
    advise_command,
    collectives_settings,
    launch_collectives_command,
    launch_command,
    plan_command,
    ranks_command,
)
from parabench.preflight import doctor
from parabench.records import PLAN_KEY, RANK_KEY


def visible_gpus() -> list[int]:
    """Device counts the visible GPUs allow: powers of two up to their number, and it."""
    import torch

    have = torch.cuda.device_count()
    return sorted({2**i for i in range(have.bit_length()) if 2**i <= have} | {have} - {0})


def _done(meta: Path, config_hash: str, retry_failed: bool = False) -> bool:
    """Whether the cell is recorded with these settings (and, with `retry_failed`, did
    not fail): kept, not run again."""
    try:
        recorded = records.read_meta(meta)
    except records.ResultsError:
        return False
    if retry_failed and recorded["status"] == "failed":
        return False
    return recorded.get("config_hash") == config_hash


def _benchmarked(out: Path, settings: dict) -> bool:
    """Whether the collectives benchmark in `out` ran, with these settings."""
    try:
        meta = json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    ran = meta.get("status") == "ok" and (out / "collectives.csv").exists()
    return ran and meta.get("settings") == settings


def _logged(argv: list[str], log: Path) -> int:
    """Run `argv` with its output in `log` (the launch writes its command first);
    returns its exit code."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        return subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, check=False).returncode


def dry_run(config: dict) -> list[str]:
    """What a sweep of `config` would run, a line each (`parabench sweep -n`): its cells,
    those the settings skip with their reasons, and the benchmarks beside them."""
    planned = cells(config)
    lines = [f"{len(planned)} cells, each its own launch:"]
    lines += [f"  {c.path}" for c in planned]
    lines += [
        f"skipped, {why}: {', '.join(sorted(set(where)))}" for why, where in skipped(config).items()
    ]
    lines += [f"collectives benchmark at {n} ranks" for n in collective_devices(config)]
    if alone := alone_ranks(config):
        lines.append(f"ranks: {len(alone)} ranks measured alone (the scaling model's input)")
    if config["plan"]["enabled"]:
        lines.append(f"plan: world sizes {config['plan']['world_sizes']}")
    if config["advise"]["enabled"]:
        lines.append(f"advise: {config['advise']['gpus']} x {config['advise']['gpu']}")
    return lines


class Interrupted(Exception):
    """A cell's launch was stopped (Ctrl-C, a signal): nothing of it is recorded."""


class LaunchFailed(Exception):
    """A cell's launch ended on its own without recording the cell, which its guard
    always does: it could not start (a bad argument, an import error), or a bug."""


def sweep(
    config: dict,
    workdir: Path,
    force: bool = False,
    dry: bool = False,
    retry_failed: bool = False,
    command: str | None = None,
) -> Path | None:
    """Run every cell of `config` not yet recorded (`force`: every cell; `retry_failed`:
    the failed ones too), then aggregate and report, holding the results directory's
    lock in the name of `command` (lock.LockHeld if another run holds it). Returns the
    report's path; `dry`: print the plan and run nothing, and take no lock (None)."""
    found = problems(config, workdir)  # first: it refuses a results path outside workdir
    if found:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(found))
    if dry:
        print("\n".join(dry_run(config)), flush=True)
        return None
    with lock.held(workdir / config["results"], command) as held:
        if held.took_over:
            print(f"lock: took over the lock of {held.took_over}, which is gone", flush=True)
        # every launch of this host's run forked warm (parabench.jobs.warm); torch is
        # imported there while the preflight runs
        with warm.warm_process(hf_types=warm.hf_types(config)):
            return _run(config, workdir, force, retry_failed)


def _run(config: dict, workdir: Path, force: bool, retry_failed: bool) -> Path:
    """The sweep's jobs in the workflow's order; returns the report's path."""
    _preflight(config, workdir)
    results = workdir / config["results"]
    metas = _run_cells(config, results, force, retry_failed)
    benches = _run_collectives(config, results, force)
    ranks = _run_ranks(config, results, force, retry_failed)
    if config["plan"]["enabled"] or config["advise"]["enabled"]:
        # after the collectives, merged: the fabric `curves` reads them
        _aggregate(config, results, metas, benches, ranks)
    if config["plan"]["enabled"]:
        _run_plan(config, workdir, results, force, retry_failed)
    if config["advise"]["enabled"]:
        _run_advise(config, results, force)
    _aggregate(config, results, metas, benches, ranks)
    return _render(config, results)


def _preflight(config: dict, workdir: Path) -> None:
    """Every check of the doctor, here where the cells run, in a process of its own (the
    CUDA context its GPU checks open ends with it, not with the sweep); ConfigError if
    one fails."""
    lines, ok = doctor.in_child(config, sys.executable, gpus=True, cwd=workdir)
    for line in lines:
        print(f"doctor: {line}", flush=True)
    if not ok:
        raise ConfigError("this environment cannot run this config (the FAIL lines above)")


def _interrupted(code: int) -> bool:
    """Whether a launch's exit code says a signal stopped it: killed by one (negative),
    or it ended on one (128 + its number, what the guard returns when interrupted)."""
    return code < 0 or code >= 128


def _run_cells(config: dict, results: Path, force: bool, retry_failed: bool) -> list[Path]:
    """Launch each cell not recorded with its settings; returns every cell's meta.json."""
    planned = cells(config)
    metas = []
    for i, cell in enumerate(planned, 1):
        spec, out = cell.spec, results / cell.path
        meta = out / "meta.json"
        metas.append(meta)
        label = f"[{i}/{len(planned)}] {cell.path}"
        if not force and _done(meta, spec.config_hash(), retry_failed):
            print(f"{label}: recorded, kept", flush=True)
            continue
        argv = launch_command(spec, out, config["cell_timeout_s"], python=sys.executable)
        log = results / "logs" / f"{cell.path}.log"
        code = _logged(argv, log)
        if not meta.exists():  # the guard records every end but an interruption
            if _interrupted(code):
                raise Interrupted(f"{label}: stopped (exit code {code}), nothing recorded")
            raise LaunchFailed(
                f"{label}: its launch ended (exit code {code}) without recording the cell, "
                f"which it always does: it could not start, or this is a bug in the launch; "
                f"its output is in {log}"
            )
        status = records.read_meta(meta)
        print(f"{label}: {status['status']} {status.get('reason') or ''}".rstrip(), flush=True)
    return metas


def _run_collectives(config: dict, results: Path, force: bool) -> list[Path]:
    """Run each collectives benchmark not run with these settings; returns every one's
    meta.json."""
    benches = []
    sizes, device, timeout_s = collective_bytes(config), config["device"], config["timeout_s"]
    for n in collective_devices(config):
        out = results / "collectives" / f"n{n}"
        benches.append(out / "meta.json")
        # kept only if it ran with these settings: other message sizes are other curves
        if not force and _benchmarked(out, collectives_settings(sizes, device)):
            print(f"collectives at {n} ranks: ran with these settings, kept", flush=True)
            continue
        argv = launch_collectives_command(
            n, sizes, device, timeout_s, out, config["cell_timeout_s"], python=sys.executable
        )
        log = results / "logs" / "collectives" / f"n{n}.log"
        _logged(argv, log)
        print(f"collectives at {n} ranks: {log}", flush=True)
    return benches


# The ranks job and the plan run in processes of their own, by the workflow rules'
# commands, each under a guard (launch.guard_table): a rank that crashes or hangs ends
# as a row that says so, not as the sweep's end. Each table is kept while what it
# measures is unchanged (config.measures, what the rules rerun on): those lines are
# stored beside it (ranks.measures, plan.measures) once its job has ended well.
def _run_ranks(config: dict, results: Path, force: bool, retry_failed: bool) -> Path:
    """The ranks job (ranks.csv), unless its table measures these ranks; returns the
    table's path (absent where no cell runs several ranks: none stale is left)."""
    table = results / "ranks.csv"
    alone = alone_ranks(config)
    if not alone:
        table.unlink(missing_ok=True)
        _measures_file(table).unlink(missing_ok=True)
        return table
    wanted = [rank_key(spec, rank) for spec, rank in alone]
    lines = measures(alone)
    if not force and _kept(table, RANK_KEY, wanted, lines, retry_failed):
        print(f"ranks: measured with these settings, kept ({table})", flush=True)
    else:
        _measure("ranks", ranks_command(config, results, python=sys.executable), table, lines)
    return table


def _run_plan(config: dict, workdir: Path, results: Path, force: bool, retry_failed: bool) -> None:
    """The plan (plan.csv), unless its table plans these ranks on this fabric."""
    table = results / "plan.csv"
    planned = planned_specs(config)
    wanted = [plan_key(spec) for spec in planned]
    lines = [*measures((spec, 0) for spec in planned), _fabric_line(config, workdir, results)]
    if not force and _kept(table, PLAN_KEY, wanted, lines, retry_failed):
        print(f"plan: planned with these settings, kept ({table})", flush=True)
        return
    argv = plan_command(config, results, results / "collectives.csv", sys.executable)
    _measure("plan", argv, table, lines)


def _run_advise(config: dict, results: Path, force: bool) -> None:
    """advise.csv (and the torchtitan check), unless kept for these advise settings on
    these curves (as the rule reruns it)."""
    table = results / "advise.csv"
    curves = results / "collectives.csv"
    lines = advise_measures(config)
    if config["advise"]["fabric"] == "curves":
        lines.append(hashlib.sha256(curves.read_bytes()).hexdigest() if curves.exists() else "none")
    try:
        kept = not force and _measures_file(table).read_text().splitlines() == lines
    except OSError:
        kept = False
    if kept:
        print(f"advise: advised with these settings, kept ({table})", flush=True)
        return
    argv = advise_command(config, results, curves, sys.executable)
    _measure("advise", argv, table, lines)


def _fabric_line(config: dict, workdir: Path, results: Path) -> str:
    """What the plan's fabric is, in a line: a profile by its name; `curves` and an
    nccl-tests file by the hash of what the plan reads (other curves, another plan)."""
    fabric = config["plan"]["fabric"]
    if fabric == "curves":
        path = results / "collectives.csv"
    elif fabric in PROFILES:
        return f"fabric {fabric}"
    else:
        path = workdir / fabric
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        digest = "missing"  # the plan says why; nothing stored matches this
    return f"fabric {fabric} sha256 {digest}"


def _measures_file(table: Path) -> Path:
    return table.with_suffix(".measures")


def _kept(
    table: Path, key: tuple[str, ...], wanted: list[dict], lines: list[str], retry_failed: bool
) -> bool:
    """Whether `table` holds a row for each of the `wanted` keys, measured for exactly
    `lines` (stored beside it), and, with `retry_failed`, no failed row."""
    try:
        stored = _measures_file(table).read_text().splitlines()
    except OSError:
        return False
    rows = records.read_rows(table)
    if stored != lines or (retry_failed and any(r.get("status") == "failed" for r in rows)):
        return False
    have = {tuple(str(r.get(k)) for k in key) for r in rows}
    return all(tuple(str(w[k]) for k in key) in have for w in wanted)


def _measure(what: str, argv: list[str], table: Path, lines: list[str]) -> None:
    """Run the job that writes `table` (its output in logs/<what>.log), then store the
    `lines` it measured beside it; a job cut short stores none: it runs again."""
    _measures_file(table).unlink(missing_ok=True)
    table.unlink(missing_ok=True)  # a job that fails before its guard: no stale table
    log = table.parent / "logs" / f"{what}.log"
    code = _logged(argv, log)
    if code != 0 or not table.exists():
        print(f"{what} failed: {log}", flush=True)
        return
    records.atomic_write_bytes(_measures_file(table), "".join(f"{x}\n" for x in lines).encode())
    print(f"{what}: {table}", flush=True)


def _render(config: dict, results: Path) -> Path:
    """The report (report.html), and on CUDA the listing of the CUDA paths it ran."""
    from parabench.report import TEMPLATES, render

    render(results, TEMPLATES, config, results / "report.html")
    if runs_on_cuda(config["device"]):
        print("\n".join(cuda_paths(results, config["plan"]["enabled"])), flush=True)
    return results / "report.html"


def cuda_paths(results: Path, planned: bool = True) -> list[str]:
    """Which CUDA paths a sweep ran, read from its tables, and which need more GPUs than
    it had (what `make gpu-check` ends with): a line each, `ran` or `not run`. The plan's
    table is read where the plan ran (`planned`: plan.enabled)."""
    import pandas as pd

    def table(name: str) -> pd.DataFrame:
        path = results / name
        return pd.read_csv(path) if path.is_file() and path.stat().st_size else pd.DataFrame()

    cells, ranks, curves = table("cells.csv"), table("ranks.csv"), table("collectives.csv")
    ok = cells[(cells.get("status") == "ok") & (cells.get("device_type") == "cuda")]
    if ok.empty:
        return ["CUDA paths: no cell ran on CUDA (see the report's failed and skipped cells)"]
    # the cells whose code ran in a process group (NCCL on CUDA), by their records
    grouped = [
        CATALOG[s].process_group(n) for s, n in ok[["strategy", "devices"]].itertuples(False)
    ]
    ranked = ok[grouped]
    # of those, the ones started under torchrun, as each cell's launch command says
    agent = ranked[ranked["launch_command"].fillna("").str.contains("parabench.torchrun")]

    def ran(what: str, rows: pd.DataFrame, need: str) -> str:
        return f"  {'ran    ' if len(rows) else 'not run'}  {what}" + (
            "" if len(rows) else f" ({need})"
        )

    lines = ["CUDA paths this sweep ran:"]
    lines.append(
        ran("torchrun agent, forked rank, NCCL group bound to its GPU", agent, "no rank ran")
    )
    lines.append(ran("no-communication group on CUDA (step_nocomm_s)", ranked, "no rank ran"))
    lines.append(
        ran(
            "NCCL between GPUs: DDP, ZeRO-1, FSDP2, TP, pipeline",
            ranked[ranked["devices"] > 1],
            "needs 2 GPUs",
        )
    )
    # one process driving every device (DataParallel, model parallel), by their records
    spread = [n for n, r in CATALOG.items() if r.launch == ONE_PROCESS and not r.fixed_devices]
    one = ok[ok["strategy"].isin(spread) & (ok["devices"] > 1)]
    lines.append(
        ran("one process over several GPUs: DataParallel, model parallel", one, "needs 2 GPUs")
    )
    lines.append(ran("bf16 autocast on CUDA", ok[ok["precision"] == "bf16"], "precision: [bf16]"))
    lines.append(
        ran("torch.compile on CUDA (Triton)", ok[ok["compile"].astype(bool)], "compile: [true]")
    )
    lines.append(ran("allocator peaks and the kernel-trace anatomy", ok, ""))
    at = sorted(int(n) for n in curves["devices"].unique()) if "devices" in curves else []
    lines.append(ran(f"collectives benchmark (NCCL) at {at} ranks", curves, "no benchmark ran"))
    # plan.csv only while the plan runs: a disabled plan's table is an older run's
    plan = table("plan.csv") if planned else pd.DataFrame()
    alone = [t[t["status"] == "ok"] for t in (ranks, plan) if "status" in t]
    alone = pd.concat(alone) if alone else ranks
    lines.append(
        ran("ranks measured alone on CUDA (ranks.csv, plan.csv)", alone, "none ran: plan.enabled")
    )
    lines.append(
        ran("more than one node (srun + torchrun)", cells.iloc[0:0], "needs a Slurm cluster")
    )
    return lines


def _aggregate(
    config: dict, results: Path, metas: list[Path], benches: list[Path], ranks: Path
) -> None:
    from parabench.report.aggregate import aggregate

    aggregate(
        metas,
        results / "steps.csv",
        results / "summary.csv",
        results / "cells.csv",
        benches,
        results / "collectives.csv",
        ranks if ranks.exists() else None,
        # a record of other settings than the config's cell is refused, its file named
        config_hashes=[c.spec.config_hash() for c in cells(config)],
    )


def _results_dir(config_path: Path, results: str | None) -> Path:
    """The results directory a config names, read before the config is checked (the
    schema's default where it names none); where the file cannot be read, the default
    (load_config then says why)."""
    try:
        raw = yaml.safe_load(Path(config_path).read_text())
    except (OSError, yaml.YAMLError):
        raw = None
    named = raw.get("results") if isinstance(raw, dict) else None
    return Path.cwd() / str(results or named or load_schema()["properties"]["results"]["default"])


def main(
    config_path: Path,
    results: str | None,
    devices: str | None,
    force: bool,
    dry: bool = False,
    retry_failed: bool = False,
) -> int:
    try:
        # Refused at once where another run holds the results directory: before the
        # schema's checks, which take a second (loading jsonschema). A dry run writes
        # nothing: never refused (nor is Snakemake's).
        if not dry:
            lock.check(_results_dir(config_path, results))
        config = load_config(config_path)
        if results:
            config["results"] = results
        if devices == "auto":
            config = with_devices(config, visible_gpus() or [1])
        elif devices:
            config = with_devices(config, [int(n) for n in devices.split(",")])
        command = shlex.join(["parabench", *sys.argv[1:]])
        report = sweep(config, Path.cwd(), force, dry, retry_failed, command)
    except ConfigError as e:
        print(f"parabench sweep: {e}", file=sys.stderr)
        return 2
    except lock.LockHeld as e:
        print(f"parabench sweep: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:
        print(f"parabench sweep: {e}; run again to resume", file=sys.stderr)
        return 130
    except LaunchFailed as e:
        print(f"parabench sweep: {e}", file=sys.stderr)
        return 1
    except records.ResultsError as e:
        print(f"parabench sweep: refusing to merge: {e}", file=sys.stderr)
        return 1
    if report is not None:
        print(f"report: {report}")
    return 0
