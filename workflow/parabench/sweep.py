"""`parabench sweep CONFIG`: the whole pipeline without Snakemake, one cell at a time.

For machines that have torch but not Snakemake (a GPU node's image, a container), and
for the GPU check. It plans the same cells from the same config, checks them the same
way, starts each through the same guarded launch as the workflow's rule, then
aggregates and renders the same report. A cell whose record exists with the same
settings is kept, so an interrupted sweep resumes; Snakemake remains the way to run
on a cluster (scheduling, job groups, Slurm).
"""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
from pathlib import Path

import yaml

from parabench import records
from parabench.config import (
    as_integers,
    cells,
    collective_devices,
    collective_sizes,
    problems,
)
from parabench.launch import collectives_argv, guarded_argv

SCHEMA = Path(__file__).resolve().parents[1] / "schemas" / "config.schema.yaml"
TEMPLATES = Path(__file__).resolve().parents[2] / "report"


class ConfigError(ValueError):
    """A config that breaks the schema or a rule; the message names the key."""


def with_defaults(schema: dict, data: dict) -> dict:
    """`data` with the schema's defaults filled in, as Snakemake's validate does."""
    out = dict(data)
    for key, sub in schema.get("properties", {}).items():
        if key not in out and "default" in sub:
            out[key] = sub["default"]
        if isinstance(out.get(key), dict) and "properties" in sub:
            out[key] = with_defaults(sub, out[key])
    return out


@functools.cache
def load_schema() -> dict:
    return yaml.safe_load(SCHEMA.read_text())


def load_config(path: Path) -> dict:
    """The config file, checked against the schema and given the schema's defaults."""
    return checked(yaml.safe_load(Path(path).read_text()) or {})


def checked(data: dict) -> dict:
    """`data` checked against the schema (where jsonschema is installed: it comes with
    Snakemake), with the schema's defaults filled in; ConfigError names the key."""
    schema = load_schema()
    try:
        import jsonschema
    except ImportError:  # e.g. a GPU image without Snakemake; problems() still runs
        pass
    else:
        validator = jsonschema.validators.validator_for(schema)(schema)
        if error := jsonschema.exceptions.best_match(validator.iter_errors(data)):
            where = ".".join(map(str, error.absolute_path)) or "(top level)"
            raise ConfigError(f"{where}: {error.message}")
    return as_integers(with_defaults(schema, copy.deepcopy(data)), schema)


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
        log = results / "logs" / f"{cell.path}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        argv = guarded_argv(spec, out, config["cell_timeout_s"], python=sys.executable)
        with open(log, "w") as f:
            f.write(" ".join(argv) + "\n")
            f.flush()
            subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, check=False)
        status = records.read_meta(meta)
        print(f"{label}: {status['status']} {status.get('reason') or ''}".rstrip(), flush=True)

    benches = []
    for n in collective_devices(config):
        out = results / "collectives" / f"n{n}"
        benches.append(out / "meta.json")
        if not force and (out / "collectives.csv").exists():
            continue
        argv = collectives_argv(
            n, collective_sizes(config), config["device"], config["timeout_s"], out, sys.executable
        )
        guarded = [sys.executable, "-m", "parabench", "guard", "--out", str(out)]
        guarded += ["--timeout", f"{config['cell_timeout_s']:g}", "--", *argv]
        log = results / "logs" / "collectives" / f"n{n}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            subprocess.run(guarded, stdout=f, stderr=subprocess.STDOUT, check=False)
        print(f"collectives at {n} ranks: {log}", flush=True)

    from parabench.aggregate import aggregate
    from parabench.report import render

    aggregate(
        metas,
        results / "steps.csv",
        results / "summary.csv",
        results / "cells.csv",
        benches,
        results / "collectives.csv",
    )
    render(results, TEMPLATES, config, results / "report.html")
    return results / "report.html"


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
