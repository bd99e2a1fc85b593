"""From a workflow config (a plain dict, already schema-checked) to benchmark cells.

Torch-free and Snakemake-free: the Snakefile calls `cells()` to build its job graph and
`problems()` to refuse a bad config before any job starts; tests call them directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from parabench.catalog import device_counts
from parabench.spec import ModelSpec, RunSpec

# Keys of a model entry that are not architecture sizes.
MODEL_KEYS = ("arch", "batch_size")


@dataclass(frozen=True)
class Cell:
    spec: RunSpec

    @property
    def path(self) -> str:
        """Directory of the cell's records, relative to the results directory."""
        s = self.spec
        return f"runs/{s.model_name}/{s.strategy}/n{s.devices}/r{s.repeat}"


def model_spec(entry: dict) -> ModelSpec:
    return ModelSpec.of(entry["arch"], **{k: v for k, v in entry.items() if k not in MODEL_KEYS})


def spec_for(config: dict, model: str, strategy: str, devices: int, repeat: int) -> RunSpec:
    entry = config["models"][model]
    pipe = config.get("pipeline", {})
    optional = {
        k: config[k]
        for k in (
            "steps",
            "warmup",
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
        if k in config
    }
    if "microbatches" in pipe:
        optional["microbatches"] = pipe["microbatches"]
    if "schedule" in pipe:
        optional["schedule"] = pipe["schedule"]
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
        for strategy in config["strategies"]:
            for n in device_counts(strategy, config["devices"]):
                for r in range(config["repeats"]):
                    out.append(Cell(spec_for(config, model, strategy, n, r)))
    return out


def problems(config: dict, workdir: Path | None = None) -> list[str]:
    """Rules the schema cannot express, each message naming the key. Empty = valid."""
    out: list[str] = []
    for name, entry in config["models"].items():
        try:
            model_spec(entry)
        except ValueError as e:
            out.append(f"models.{name}: {e}")
    if out:
        return out
    # A rule broken by every cell (warmup >= steps) is said once; one broken by some
    # cells (batch not divisible at 4 devices) names them.
    where: dict[str, list[str]] = {}
    all_cells = [c.spec for c in cells(config) if c.spec.repeat == 0]
    for s in all_cells:
        for p in s.problems():
            where.setdefault(p, []).append(
                f"models.{s.model_name} / {s.strategy} at devices={s.devices}"
            )
    for p, cells_at in where.items():
        out.append(p if len(cells_at) == len(all_cells) else f"{p} ({'; '.join(cells_at)})")
    if workdir is not None and "results" in config:
        res = (workdir / config["results"]).resolve()
        if not res.is_relative_to(workdir.resolve()):
            out.append(f"results: {config['results']!r} lies outside the working directory")
    return out
