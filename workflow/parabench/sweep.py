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

from parabench import records
from parabench.config import (
    ConfigError,
    alone_ranks,
    cells,
    collective_bytes,
    collective_devices,
    load_config,
    problems,
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


def sweep(config: dict, workdir: Path, force: bool = False) -> Path:
    """Run every cell of `config` not yet recorded, then aggregate and report. Returns
    the report's path."""
    found = problems(config, workdir)
    if found:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(found))
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
    return results / "report.html"


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


def main(config_path: Path, results: str | None, devices: str | None, force: bool) -> int:
    try:
        config = load_config(config_path)
        if results:
            config["results"] = results
        if devices == "auto":
            config["devices"] = visible_gpus() or [1]
        elif devices:
            config["devices"] = [int(n) for n in devices.split(",")]
        report = sweep(config, Path.cwd(), force)
    except ConfigError as e:
        print(f"parabench sweep: {e}", file=sys.stderr)
        return 2
    except records.ResultsError as e:
        print(f"parabench sweep: refusing to merge: {e}", file=sys.stderr)
        return 1
    print(f"report: {report}")
    return 0
