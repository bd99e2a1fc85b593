"""From a workflow config (a plain dict, already schema-checked) to benchmark cells.

Torch-free and Snakemake-free: the Snakefile calls `cells()` to build its job graph and
`problems()` to refuse a bad config before any job starts; tests call them directly.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path

from parabench.catalog import STRATEGIES, device_counts
from parabench.spec import ModelSpec, RunSpec

# Keys of a model entry that are not architecture sizes: its batch, and the strategies
# and device counts it is swept over when they differ from the config's.
MODEL_KEYS = ("arch", "batch_size", "strategies", "devices")
# Axes that multiply the cells: each is a list in the config (a single value is taken
# as a list of one), and each enters the cell's identity and path.
AXES = ("precision", "optimizer", "compile")
# Message sizes of the collectives benchmark (bytes): 1 KiB, 4 KiB, ... 64 MiB.
COLLECTIVE_SIZES = tuple(2**k for k in range(10, 27, 2))

# Plain keys copied from the config onto every cell's RunSpec.
SPEC_KEYS = (
    "steps",
    "warmup",
    "profile_steps",
    "scaling",
    "accum_steps",
    "lr",
    "seed",
    "device",
    "timeout_s",
    "data",
    "loader_workers",
    "peak_flops",
    "gpus_per_node",
)


@dataclass(frozen=True)
class Cell:
    spec: RunSpec

    @property
    def path(self) -> str:
        """Directory of the cell's records, relative to the results directory."""
        return cell_path(self.spec)


def cell_path(s: RunSpec) -> str:
    return f"runs/{s.model_name}/{s.variant}/{s.strategy}/n{s.devices}/r{s.repeat}"


def as_integers(data, schema: dict):
    """`data` with every integral float where the schema says integer made an int.
    JSON Schema counts 4.0 as an integer, so YAML's `repeats: 4.0` passes validation;
    everything downstream (range(), argv round trips, paths) needs the int."""
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "integer" in kinds and isinstance(data, float) and data.is_integer():
        return int(data)
    if isinstance(data, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        default = extra if isinstance(extra, dict) else {}
        return {k: as_integers(v, props.get(k, default)) for k, v in data.items()}
    if isinstance(data, list) and isinstance(schema.get("items"), dict):
        return [as_integers(v, schema["items"]) for v in data]
    return data


def axis(config: dict, key: str) -> list:
    """The levels of one axis (defaults: fp32, sgd, no compile)."""
    value = config.get(key, RunSpec.__dataclass_fields__[key].default)
    return list(dict.fromkeys(value)) if isinstance(value, list) else [value]


def strategies(config: dict, model: str | None = None) -> list[str]:
    """The strategies swept (for `model`, if its entry names its own); every strategy
    in the catalog when none are given."""
    own = config["models"][model].get("strategies") if model else None
    return list(own or config.get("strategies") or STRATEGIES)


def devices(config: dict, model: str) -> list[int]:
    """The device counts `model` is swept over: its own, or the config's."""
    return list(config["models"][model].get("devices") or config["devices"])


def model_spec(entry: dict) -> ModelSpec:
    return ModelSpec.of(entry["arch"], **{k: v for k, v in entry.items() if k not in MODEL_KEYS})


def spec_for(
    config: dict, model: str, strategy: str, devices: int, repeat: int, **levels
) -> RunSpec:
    """The cell's settings; `levels` picks one level of each axis (default: the first)."""
    entry = config["models"][model]
    pipe = config.get("pipeline", {})
    optional = {k: config[k] for k in SPEC_KEYS if k in config}
    for key, name in (("microbatches", "microbatches"), ("schedule", "schedule")):
        if key in pipe:
            optional[name] = pipe[key]
    if "reshard_after_forward" in config.get("fsdp", {}):
        optional["fsdp_reshard"] = config["fsdp"]["reshard_after_forward"]
    for key in AXES:
        optional[key] = levels.get(key, axis(config, key)[0])
    return RunSpec(
        strategy=strategy,
        devices=devices,
        model_name=model,
        model=model_spec(entry),
        batch_size=entry["batch_size"],
        repeat=repeat,
        **optional,
    )


def cells(config: dict) -> list[Cell]:
    out = []
    for model in config["models"]:
        for levels in itertools.product(*(axis(config, k) for k in AXES)):
            at = dict(zip(AXES, levels, strict=True))
            for strategy in strategies(config, model):
                for n in device_counts(strategy, devices(config, model)):
                    for r in range(config["repeats"]):
                        out.append(Cell(spec_for(config, model, strategy, n, r, **at)))
    return out


def problems(config: dict, workdir: Path | None = None) -> list[str]:
    """Rules the schema cannot express, each message naming the key. Empty = valid."""
    out: list[str] = []
    for name, entry in config["models"].items():
        try:
            out += model_spec(entry).problems(name)  # a custom factory is imported here
        except ValueError as e:
            out.append(f"models.{name}: {e}")
    named = {(None, s) for s in strategies(config)}
    named |= {(m, s) for m in config["models"] for s in strategies(config, m)}
    for model, s in sorted(named, key=str):
        if s not in STRATEGIES:
            key = f"models.{model}.strategies" if model else "strategies"
            out.append(f"{key}: unknown strategy {s!r}; known: {list(STRATEGIES)}")
    if out:
        return out
    # A rule broken by every cell (warmup >= steps) is said once; one broken by some
    # cells (batch not divisible at 4 devices) names them.
    where: dict[str, list[str]] = {}
    all_cells = [c.spec for c in cells(config) if c.spec.repeat == 0]
    for s in all_cells:
        for p in s.problems():
            at = f"models.{s.model_name} / {s.strategy} at devices={s.devices}"
            if at not in where.setdefault(p, []):
                where[p].append(at)
    all_at = {f"models.{s.model_name} / {s.strategy} at devices={s.devices}" for s in all_cells}
    for p, cells_at in where.items():
        out.append(p if len(cells_at) == len(all_at) else f"{p} ({'; '.join(cells_at)})")
    for key in ("cell_timeout_s",):
        if key in config and not math.isfinite(config[key]):
            out.append(f"{key}: must be a finite number, got {config[key]}")
    if workdir is not None and "results" in config:
        res = (workdir / config["results"]).resolve()
        if not res.is_relative_to(workdir.resolve()):
            out.append(f"results: {config['results']!r} lies outside the working directory")
    return out


def collective_devices(config: dict) -> list[int]:
    """Device counts that get a collectives benchmark: every n > 1 at which some cell
    runs as n ranks on one node (what the scaling model needs curves for)."""
    found = set()
    for cell in cells(config):
        s = cell.spec
        runs_ranks = s.record.uses_torchrun(s.devices) and not s.static_skip_reason()
        if s.repeat == 0 and runs_ranks and s.nodes == 1:
            found.add(s.devices)
    return sorted(found)


def collective_sizes(config: dict) -> list[int]:
    return list(config.get("collectives", {}).get("sizes") or COLLECTIVE_SIZES)
