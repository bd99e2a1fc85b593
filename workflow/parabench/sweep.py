"""`parabench sweep CONFIG`: the whole pipeline without Snakemake, one cell at a time.

For machines that have torch but not Snakemake (a GPU node's image, a container), and
for the GPU check. It plans the same cells from the same config, checks them the same
way, starts each with the same `parabench launch` command as the workflow's rule, then
aggregates and renders the same report. A cell whose record exists with the same
settings is kept, so an interrupted sweep resumes; Snakemake remains the way to run
on a cluster (scheduling, job groups, Slurm).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from parabench import doctor, records
from parabench.catalog import CATALOG, ONE_PROCESS
from parabench.config import (
    ConfigError,
    alone_ranks,
    cells,
    collective_bytes,
    collective_devices,
    load_config,
    problems,
    skipped,
)
from parabench.launch import launch_collectives_command, launch_command


def visible_gpus() -> list[int]:
    """Device counts the visible GPUs allow: powers of two up to their number, and it."""
    import torch

    have = torch.cuda.device_count()
    return sorted({2**i for i in range(have.bit_length()) if 2**i <= have} | {have} - {0})


def _done(meta: Path, config_hash: str) -> bool:
    try:
        return records.read_meta(meta).get("config_hash") == config_hash
    except records.ResultsError:
        return False


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
    return lines


def sweep(config: dict, workdir: Path, force: bool = False, dry: bool = False) -> Path | None:
    """Run every cell of `config` not yet recorded, then aggregate and report. Returns
    the report's path; `dry`: print the plan and run nothing (None)."""
    found = problems(config, workdir)
    if found:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(found))
    if dry:
        print("\n".join(dry_run(config)), flush=True)
        return None
    # The preflight: every check here, where the cells run (parabench.doctor).
    checked = doctor.run_checks(config, workdir, gpus=True)
    for check in checked:
        print(f"doctor: {check.line()}", flush=True)
    if doctor.failed(checked):
        raise ConfigError("this environment cannot run this config (the FAIL lines above)")
    results = workdir / config["results"]
    planned = cells(config)
    metas = []
    for i, cell in enumerate(planned, 1):
        spec, out = cell.spec, results / cell.path
        meta = out / "meta.json"
        metas.append(meta)
        label = f"[{i}/{len(planned)}] {cell.path}"
        if not force and _done(meta, spec.config_hash()):
            print(f"{label}: recorded, kept", flush=True)
            continue
        argv = launch_command(spec, out, config["cell_timeout_s"], python=sys.executable)
        _logged(argv, results / "logs" / f"{cell.path}.log")
        status = records.read_meta(meta)
        print(f"{label}: {status['status']} {status.get('reason') or ''}".rstrip(), flush=True)

    benches = []
    for n in collective_devices(config):
        out = results / "collectives" / f"n{n}"
        benches.append(out / "meta.json")
        if not force and (out / "collectives.csv").exists():
            continue
        argv = launch_collectives_command(
            n,
            collective_bytes(config),
            config["device"],
            config["timeout_s"],
            out,
            config["cell_timeout_s"],
            python=sys.executable,
        )
        log = results / "logs" / "collectives" / f"n{n}.log"
        _logged(argv, log)
        print(f"collectives at {n} ranks: {log}", flush=True)

    # Each in a process of its own, as a cell is, so this one never imports torch; a
    # stale table never reaches the report.
    as_json = ["--config-json", json.dumps(config), "--out", str(results)]
    ranks = results / "ranks.csv"
    ranks.unlink(missing_ok=True)
    if alone_ranks(config):
        log = results / "logs" / "ranks.log"
        code = _logged([sys.executable, "-m", "parabench", "ranks", *as_json], log)
        print(f"ranks: {ranks}" if code == 0 else f"ranks failed: {log}", flush=True)

    if config["plan"]["enabled"]:
        # after the collectives: the fabric `curves` reads them
        _aggregate(config, results, metas, benches, ranks)
        (results / "plan.csv").unlink(missing_ok=True)
        curves = ["--collectives", str(results / "collectives.csv")]
        log = results / "logs" / "plan.log"
        code = _logged([sys.executable, "-m", "parabench", "plan", *as_json, *curves], log)
        print(f"plan: {results / 'plan.csv'}" if code == 0 else f"plan failed: {log}", flush=True)

    _aggregate(config, results, metas, benches, ranks)
    from parabench.report import TEMPLATES, render

    render(results, TEMPLATES, config, results / "report.html")
    if config["device"] == "cuda":
        print("\n".join(cuda_paths(results)), flush=True)
    return results / "report.html"


def cuda_paths(results: Path) -> list[str]:
    """Which CUDA paths a sweep ran, read from its tables, and which need more GPUs than
    it had (what `make gpu-check` ends with): a line each, `ran` or `not run`."""
    import pandas as pd

    def table(name: str) -> pd.DataFrame:
        path = results / name
        return pd.read_csv(path) if path.is_file() and path.stat().st_size else pd.DataFrame()

    cells, ranks, curves = table("cells.csv"), table("ranks.csv"), table("collectives.csv")
    ok = cells[(cells.get("status") == "ok") & (cells.get("device_type") == "cuda")]
    if ok.empty:
        return ["CUDA paths: no cell ran on CUDA (see the report's failed and skipped cells)"]
    ranked = ok[ok["strategy"].map(lambda s: CATALOG[s].launch != ONE_PROCESS)]

    def ran(what: str, rows: pd.DataFrame, need: str) -> str:
        return f"  {'ran    ' if len(rows) else 'not run'}  {what}" + (
            "" if len(rows) else f" ({need})"
        )

    lines = ["CUDA paths this sweep ran:"]
    lines.append(
        ran("torchrun agent, forked rank, NCCL group bound to its GPU", ranked, "no rank ran")
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
    alone = ranks[ranks.get("status") == "ok"] if "status" in ranks else ranks
    lines.append(ran("ranks measured alone on CUDA (the scaling model's input)", alone, "none ran"))
    lines.append(
        ran("more than one node (srun + torchrun)", cells.iloc[0:0], "needs a Slurm cluster")
    )
    return lines


def _aggregate(
    config: dict, results: Path, metas: list[Path], benches: list[Path], ranks: Path
) -> None:
    from parabench.aggregate import aggregate

    aggregate(
        metas,
        results / "steps.csv",
        results / "summary.csv",
        results / "cells.csv",
        benches,
        results / "collectives.csv",
        ranks if ranks.exists() else None,
    )


def main(
    config_path: Path, results: str | None, devices: str | None, force: bool, dry: bool = False
) -> int:
    try:
        config = load_config(config_path)
        if results:
            config["results"] = results
        if devices == "auto":
            config["devices"] = visible_gpus() or [1]
        elif devices:
            config["devices"] = [int(n) for n in devices.split(",")]
        report = sweep(config, Path.cwd(), force, dry)
    except ConfigError as e:
        print(f"parabench sweep: {e}", file=sys.stderr)
        return 2
    except records.ResultsError as e:
        print(f"parabench sweep: refusing to merge: {e}", file=sys.stderr)
        return 1
    if report is not None:
        print(f"report: {report}")
    return 0
