"""A workflow config: read, checked against the schema (defaults filled from it), and
turned into benchmark cells. Torch-free and Snakemake-free: the Snakefile and
`parabench sweep` both load configs here, plan the same cells with `cells()` and
refuse a bad config before any job starts with `problems()`; tests call them directly.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from parabench import checks
from parabench.catalog import CATALOG, STRATEGIES, default_strategies, device_counts
from parabench.hardware.fabric import PROFILES
from parabench.spec import ModelSpec, RunSpec

SCHEMA = Path(__file__).resolve().parents[1] / "schemas" / "config.schema.yaml"

# Keys of a model entry that are not architecture sizes: its batch, and the strategies
# and device counts it is swept over when they differ from the config's.
MODEL_KEYS = ("arch", "batch_size", "strategies", "devices")
# Axes that multiply the cells: each is a list in the config (a single value is taken
# as a list of one), and each enters the cell's identity and path.
AXES = ("precision", "optimizer", "compile", "ac")
# Message sizes of the collectives benchmark (bytes): 1 KiB, 4 KiB, ... 64 MiB.
COLLECTIVE_BYTES = tuple(2**k for k in range(10, 27, 2))

# Plain keys copied from the config onto every cell's RunSpec.
SPEC_KEYS = (
    "steps",
    "warmup",
    "profile_steps",
    "scaling",
    "lr",
    "seed",
    "device",
    "timeout_s",
    "data",
    "loader_workers",
    "peak_flops",
    "gpus_per_node",
)


class ConfigError(ValueError):
    """A config that breaks the schema or a rule; the message names the key."""


@functools.cache
def load_schema() -> dict:
    return yaml.safe_load(SCHEMA.read_text())


def with_defaults(schema: dict, data: dict) -> dict:
    """`data` with the schema's defaults filled in, as Snakemake's validate does."""
    out = dict(data)
    for key, sub in schema.get("properties", {}).items():
        if key not in out and "default" in sub:
            out[key] = sub["default"]
        if isinstance(out.get(key), dict) and "properties" in sub:
            out[key] = with_defaults(sub, out[key])
    return out


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


def from_command_line(data, schema: dict):
    """`data`, given on Snakemake's command line (--config), as YAML reads it. Snakemake
    reads a value's top level itself (repeats=5 is an int) but what a list or mapping
    holds as strings (YAML's BaseLoader: devices=[1,2] arrives as ["1", "2"],
    plan={enabled: false} as "false"): each such string is read again by YAML's safe
    loader wherever the schema wants no string, so the command line means what the same
    text means in a config file."""
    if isinstance(data, str):
        if _allows_string(schema):
            return data
        try:
            read = yaml.safe_load(data)
        except yaml.YAMLError:
            return data  # the schema names the key
        return data if isinstance(read, str) else from_command_line(read, schema)
    if isinstance(data, dict):
        branch = _branch(schema, "object")
        props, extra = branch.get("properties", {}), branch.get("additionalProperties")
        default = extra if isinstance(extra, dict) else {}
        return {k: from_command_line(v, props.get(k, default)) for k, v in data.items()}
    if isinstance(data, list):
        items = _branch(schema, "array").get("items")
        return [from_command_line(v, items if isinstance(items, dict) else {}) for v in data]
    return data


def _allows_string(schema: dict) -> bool:
    """Whether the schema takes a string here (its type, an enum of names, a branch)."""
    if any(_allows_string(s) for s in schema.get("anyOf", [])):
        return True
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    return "string" in kinds or any(isinstance(v, str) for v in schema.get("enum", []))


def _branch(schema: dict, kind: str) -> dict:
    """The schema of a value of this JSON type: its anyOf branch of that type, if any."""
    return next((s for s in schema.get("anyOf", []) if s.get("type") == kind), schema)


def checked(data: dict) -> dict:
    """`data` checked against the schema, with the schema's defaults filled in;
    ConfigError names the key."""
    if why := schema_problem(data):
        raise ConfigError(why)
    schema = load_schema()
    return as_integers(with_defaults(schema, copy.deepcopy(data)), schema)


def schema_problem(data: dict) -> str | None:
    """The config's first break of the schema in one line naming the key (jsonschema's
    own message prints the whole schema after it), or None."""
    try:
        import jsonschema  # a dependency (pyproject): a config is never run unchecked
    except ImportError:  # PYTHONPATH=workflow on an image that lacks it (make gpu-check)
        raise ConfigError(
            "jsonschema is not installed, and parabench checks every config with it: "
            "pip install jsonschema (or pip install -e . to get every dependency)"
        ) from None

    schema = load_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    if error := jsonschema.exceptions.best_match(validator.iter_errors(data)):
        where = ".".join(map(str, error.absolute_path)) or "(top level)"
        return f"{where}: {error.message}"
    return None


def load_config(path: Path) -> dict:
    """The config file, checked against the schema and given the schema's defaults."""
    return checked(yaml.safe_load(Path(path).read_text()) or {})


@dataclass(frozen=True)
class Cell:
    spec: RunSpec

    @property
    def path(self) -> str:
        """Directory of the cell's records, relative to the results directory."""
        return self.spec.path


def axis(config: dict, key: str) -> list:
    """The levels of one axis (defaults: fp32, sgd, no compile, no checkpointing)."""
    value = config.get(key, RunSpec.__dataclass_fields__[key].default)
    return list(dict.fromkeys(value)) if isinstance(value, list) else [value]


def strategies(config: dict, model: str | None = None) -> list[str]:
    """The strategies swept (for `model`, if its entry names its own); every strategy
    of one dimension in the catalog when none are given (layouts run where named)."""
    own = config["models"][model].get("strategies") if model else None
    return list(own or config.get("strategies") or default_strategies())


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
    plain = {k: config[k] for k in SPEC_KEYS if k in config}
    for key in AXES:
        plain[key] = levels.get(key, axis(config, key)[0])
    own = (config.get("options") or {}).get(strategy) or {}
    return RunSpec(
        strategy=strategy,
        devices=devices,
        model_name=model,
        model=model_spec(entry),
        batch_size=entry["batch_size"],
        repeat=repeat,
        options=tuple(sorted(own.items())),
        **plain,
    )


def with_devices(config: dict, counts: list[int]) -> dict:
    """The config swept at these device counts (`parabench sweep --devices`, `auto`: the
    GPUs visible): its `also` cells at other counts go too, as the product's do."""
    also = [a for a in config.get("also") or [] if a["devices"] in counts]
    return {**config, "devices": list(counts), "also": also}


def strategy_options(config: dict, strategy: str) -> dict:
    """The config's settings of one strategy (options.<strategy>)."""
    return (config.get("options") or {}).get(strategy) or {}


def cells(config: dict) -> list[Cell]:
    """The product of models, axes, strategies, device counts and repeats, then the
    `also` cells that the product does not already hold."""
    out = []
    for model in config["models"]:
        for levels in itertools.product(*(axis(config, k) for k in AXES)):
            at = dict(zip(AXES, levels, strict=True))
            for strategy in strategies(config, model):
                own = strategy_options(config, strategy)
                for n in device_counts(strategy, devices(config, model), own):
                    for r in range(config["repeats"]):
                        out.append(Cell(spec_for(config, model, strategy, n, r, **at)))
    have = {c.path for c in out}
    for extra in config.get("also") or []:
        at = {k: extra[k] for k in AXES if k in extra}
        for r in range(config["repeats"]):
            spec = spec_for(config, extra["model"], extra["strategy"], extra["devices"], r, **at)
            if spec.path not in have:
                have.add(spec.path)
                out.append(Cell(spec))
    return out


def _multi_rank(config: dict) -> list[RunSpec]:
    """The cells (repeat 0) that run as several ranks on one node and can run: the
    ones with collective curves, and a rank of each measured alone."""
    return [
        s
        for s in (cell.spec for cell in cells(config))
        if s.repeat == 0 and s.processes > 1 and s.nodes == 1 and not checks.static_skip_reason(s)
    ]


def alone_ranks(config: dict) -> list[tuple[RunSpec, int]]:
    """(spec, rank) of every rank the scaling model measures alone (predict/rank_alone.py): rank 0
    of each multi-rank cell, every rank of a pipeline's (its slowest stage sets the
    pace). Cells across nodes have no curves to predict with: none."""
    out = []
    for spec in _multi_rank(config):
        if checks.problems(spec, launching=False):
            continue  # the cell records why it did not run
        # pp is the mesh's outermost dimension: stage s begins at rank s x (n / pp)
        out.extend((spec, s * (spec.devices // spec.stages)) for s in range(spec.stages))
    return out


def ranks_of(config: dict, part: tuple[int, int] | None = None) -> list[tuple[RunSpec, int]]:
    """What one job measuring ranks alone measures: every rank of alone_ranks, or, with
    `part` (i, k), the i-th (from 1) of k nearly equal runs of them, in order."""
    ranks = alone_ranks(config)
    if part is None:
        return ranks
    i, k = part
    return ranks[(i - 1) * len(ranks) // k : i * len(ranks) // k]


# Slurm jobs: each asks for the time limit its guard enforces and this many minutes
# more (its Python's start, the guard's last records, Slurm's prologue and epilogue).
JOB_MARGIN_MIN = 5
ADVISE_MIN = 30  # advise: fake tensors, seconds per layout; its one job's limit
DOCTOR_MIN = 5  # the doctor's checks on a GPU node: seconds


def job_minutes(seconds: float) -> int:
    """The runtime (minutes) a Slurm job whose guard allows it `seconds` asks for."""
    return int(seconds // 60) + JOB_MARGIN_MIN


def rank_limit_s(config: dict) -> float:
    """Seconds one rank measured alone may take (the ranks job's, the plan's), each
    rank its own: rank_timeout_s, never more than cell_timeout_s. A rank alone builds
    what one rank of its cell builds and runs ten steps (loop.ALONE_STEPS + ALONE_WARMUP, one
    counted, one tracked), where its cell runs `steps` and its profiled steps, times
    them again without communication, and waits on its peers: it never needs more."""
    return min(config["rank_timeout_s"], config["cell_timeout_s"])


def rank_parts(config: dict) -> int:
    """How many jobs measure the ranks alone: one (a single process, as a local run's
    always is) while its ranks' limits fit in max_job_minutes, else as few as each
    fit (at least one rank each)."""
    fit = (config["max_job_minutes"] - JOB_MARGIN_MIN) * 60 // rank_limit_s(config)
    return max(1, -(-len(alone_ranks(config)) // max(1, int(fit))))


@dataclass(frozen=True)
class SlurmJob:
    """A rule whose jobs the workflow submits to Slurm: the runtime (minutes) its
    longest job asks for, what to change where a partition allows `{limit}` minutes
    and no more (naming the config key), and whether a run of this config submits any
    (the rule exists either way)."""

    rule: str
    minutes: int
    fix: str
    runs: bool = True


def slurm_jobs(config: dict) -> list[SlurmJob]:
    """Every rule the workflow may submit to Slurm for `config` (not aggregate nor
    report, which run where Snakemake does), each with its `runtime`: the rules read
    theirs here, and the preflight checks those a run submits against the partition's
    MaxTime."""
    cell = job_minutes(config["cell_timeout_s"])
    ranks, limit = alone_ranks(config), rank_limit_s(config)
    largest = -(-len(ranks) // rank_parts(config))  # the parts of rank_parts
    split = (
        "set max_job_minutes: {limit} (the ranks are then split into jobs that each "
        f"fit; a job of one rank asks {job_minutes(limit)} min: past that, lower "
        "rank_timeout_s)"
    )
    return [
        SlurmJob("benchmark", cell, "lower cell_timeout_s"),
        SlurmJob("collectives", cell, "lower cell_timeout_s", bool(collective_devices(config))),
        SlurmJob(
            "ranks",
            job_minutes(largest * limit),
            split,
            bool(ranks),
        ),
        SlurmJob(
            "plan",
            job_minutes(len(planned_specs(config)) * limit),
            "lower rank_timeout_s, or plan fewer plan.models, plan.strategies or "
            "plan.world_sizes (rank_timeout_s each)",
            config["plan"]["enabled"],
        ),
        SlurmJob("advise", ADVISE_MIN, "set advise.enabled: false", config["advise"]["enabled"]),
        # asked for by name (`snakemake ... doctor`), never by a run
        SlurmJob("doctor", DOCTOR_MIN, "run `parabench doctor` on a GPU node", False),
    ]


def rank_key(spec: RunSpec, rank: int) -> dict:
    """A ranks.csv row's key: the cell's variant, strategy, devices and the rank."""
    variant = {"model": spec.model_name, "precision": spec.precision}
    variant.update(optimizer=spec.optimizer, compile=spec.compile, ac=spec.ac)
    return {**variant, "strategy": spec.strategy, "devices": spec.devices, "rank": rank}


def planned_specs(config: dict) -> list[RunSpec]:
    """Every rank `parabench plan` plans (rank 0 of a world of N): each model x strategy
    at the planned world sizes, at the plan's scaling."""
    plan = config["plan"]
    return [
        replace(spec_for(config, model, strategy, n, 0), scaling=plan["scaling"])
        for model in plan.get("models") or list(config["models"])
        for strategy in plan["strategies"]
        for n in plan["world_sizes"]
    ]


def plan_key(spec: RunSpec) -> dict:
    """A plan.csv row's key: the planned rank's variant, strategy and world size."""
    variant = {"model": spec.model_name, "precision": spec.precision}
    variant.update(optimizer=spec.optimizer, compile=spec.compile, ac=spec.ac)
    return {**variant, "strategy": spec.strategy, "world_size": spec.devices}


def measures(ranks: Iterable[tuple[RunSpec, int]]) -> list[str]:
    """What a job that measures these ranks (the ranks job: alone_ranks; the plan:
    planned_specs, rank 0) measures, a line per rank: its cell, rank and settings hash.
    The workflow's rules compare this, and nothing else of the config (Snakemake's
    params trigger), so the job reruns when what it measures changes and only then: a
    changed cell_timeout_s, exclusive_nodes, repeats or another job's settings (the
    plan's, for the ranks job) reruns none of it. The hash is the one a cell's record
    carries (RunSpec.config_hash), so these jobs rerun where the sweep reruns a cell."""
    return [f"{spec.path} rank {rank} {spec.config_hash()}" for spec, rank in ranks]


def float8_refusal(device: str) -> str:
    """Why the cells do not run Float8 on `device` (advise prices it)."""
    if device == "cpu":
        why = "a CPU has no FP8 matmul, and torchao's Float8 training runs on CUDA only"
    else:
        why = "the cells do not run torchao's Float8 training yet (torchao is no dependency)"
    return f"{why}; advise prices Float8 on an FP8 GPU (advise.float8: true)"


def problems(config: dict, workdir: Path | None = None) -> list[str]:
    """Rules the schema cannot express, each message naming the key. Empty = valid."""
    out: list[str] = []
    for name, entry in config["models"].items():
        try:
            model_spec(entry)
        except ValueError as e:
            out.append(f"models.{name}: {e}")
    named = {(None, s) for s in strategies(config)}
    named |= {(m, s) for m in config["models"] for s in strategies(config, m)}
    for model, s in sorted(named, key=str):
        if s not in STRATEGIES:
            key = f"models.{model}.strategies" if model else "strategies"
            out.append(f"{key}: unknown strategy {s!r}; known: {list(STRATEGIES)}")
    for s in config.get("options") or {}:
        if s not in CATALOG:
            out.append(f"options.{s}: not a strategy; known: {list(STRATEGIES)}")
    for i, extra in enumerate(config.get("also") or []):
        if extra["model"] not in config["models"]:
            out.append(f"also[{i}].model: {extra['model']!r} is not a model of this config")
        if extra["strategy"] not in STRATEGIES:
            out.append(f"also[{i}].strategy: unknown strategy {extra['strategy']!r}")
    out += _layout_problems(config, named)
    if "float8" in axis(config, "precision"):
        out.append(f"precision: float8: {float8_refusal(config.get('device', 'cpu'))}")
    if out:  # the cells cannot be planned: the plan's checks would plan them
        return out
    out += plan_problems(config, workdir)
    out += advise_problems(config, workdir)
    out += rehearse_problems(config, workdir)
    if out:
        return out
    # A rule broken by every cell (warmup >= steps) is said once; one broken by some
    # cells (batch not divisible at 4 devices) names them.
    where: dict[str, list[str]] = {}
    all_cells = [c.spec for c in cells(config) if c.spec.repeat == 0]
    for s in all_cells:  # the schema's model-name pattern refuses these first
        if Path(s.path).is_absolute() or ".." in Path(s.path).parts:
            out.append(f"models.{s.model_name}: its cells' directory {s.path} leaves results/")
    for s in all_cells:
        for p in checks.problems(s):
            at = f"models.{s.model_name} / {s.strategy} at devices={s.devices}"
            if at not in where.setdefault(p, []):
                where[p].append(at)
    all_at = {f"models.{s.model_name} / {s.strategy} at devices={s.devices}" for s in all_cells}
    for p, cells_at in where.items():
        out.append(p if len(cells_at) == len(all_at) else f"{p} ({'; '.join(cells_at)})")
    if not out and all_cells and all(checks.static_skip_reason(s) for s in all_cells):
        # each reason names its key; together they rule out every cell
        reasons = sorted({checks.static_skip_reason(s) for s in all_cells})
        out += [f"{why} (and nothing else this config asks for can run)" for why in reasons]
    for key in ("cell_timeout_s", "rank_timeout_s"):
        if key in config and not math.isfinite(config[key]):
            out.append(f"{key}: must be a finite number, got {config[key]}")
    if workdir is not None and "results" in config:
        res = (workdir / config["results"]).resolve()
        if not res.is_relative_to(workdir.resolve()):
            out.append(f"results: {config['results']!r} lies outside the working directory")
    return out


def _layout_problems(config: dict, named: set) -> list[str]:
    """A layout whose degrees lay out none of its model's device counts: the key."""
    out = []
    for model, s in sorted((m, s) for m, s in named if m is not None):
        rec = CATALOG.get(s)
        if rec is None or not rec.composed:
            continue
        given = strategy_options(config, s)
        counts = devices(config, model)
        # (a bad option keeps every count: the cells' checks name it)
        if not device_counts(s, counts, given):
            opts = {**{k: o.default for k, o in rec.options.items()}, **given}
            why = rec.layout.problem(s, max(counts), opts)
            out.append(f"strategies: {s} lays out none of models.{model}'s devices {counts}: {why}")
    return out


def skipped(config: dict) -> dict[str, list[str]]:
    """The cells (repeat 0) that the settings alone skip, by reason: what planning lists
    (a strategy that cannot apply to a model at a device count, DataParallel on CPU),
    each recorded as skipped with its reason, no job asking for GPUs."""
    out: dict[str, list[str]] = {}
    for spec in (c.spec for c in cells(config) if c.spec.repeat == 0):
        if reason := checks.static_skip_reason(spec):
            out.setdefault(reason, []).append(f"{spec.model_name} {spec.variant} {spec.strategy}")
    return out


def plan_problems(config: dict, workdir: Path | None = None) -> list[str]:
    """The plan's keys: its models and strategies exist, its fabric can be found."""
    plan = config.get("plan") or {}
    if not plan.get("enabled"):
        return []
    out = []
    for m in plan.get("models") or []:
        if m not in config["models"]:
            out.append(
                f"plan.models: {m!r} is not a model of this config ({list(config['models'])})"
            )
    for s in plan.get("strategies") or []:
        if s not in STRATEGIES:
            out.append(f"plan.strategies: unknown strategy {s!r}; known: {list(STRATEGIES)}")
    out += fabric_problems("plan", plan.get("fabric", "curves"), config, workdir)
    return out


def fabric_problems(key: str, fabric: str, config: dict, workdir: Path | None) -> list[str]:
    """Why `key`.fabric cannot be used: curves with no collectives benchmark to read,
    or neither a profile nor an nccl-tests file."""
    out = []
    if fabric == "curves" and not [n for n in collective_devices(config) if n > 1]:
        out.append(
            f"{key}.fabric: curves needs a collectives benchmark, and no cell of this config "
            "runs more than one rank: name a profile or an nccl-tests output file"
        )
    known = ("curves", *PROFILES)
    if fabric not in known and not (Path(workdir or ".") / fabric).is_file():
        out.append(
            f"{key}.fabric: {fabric!r} is neither {', '.join(known)} nor an existing "
            "nccl-tests output file"
        )
    return out


def _float8_problems(adv: dict, workdir: Path | None = None) -> list[str]:
    """advise.float8 needs BF16 (Float8 replaces its matmuls and halves its gathers)
    and a GPU profile with an FP8 rate."""
    from parabench.hardware.gpus import PROFILES, THIS_MACHINE, GPUError, from_file

    out = []
    if adv.get("precision", "bf16") != "bf16":
        out.append(
            f"advise.float8: prices BF16 training's linears in FP8; precision is "
            f"{adv['precision']!r}"
        )
    gpu = adv["gpu"]
    if gpu == THIS_MACHINE:
        return [*out, "advise.float8: this-machine measures no FP8 rate; name a GPU profile"]
    try:
        profile = PROFILES.get(gpu) or from_file(Path(workdir or ".") / gpu)
    except (OSError, GPUError):
        return out  # advise.gpu's own problem, said there
    if not profile.fp8_flops:
        out.append(f"advise.float8: gpu {gpu!r} has no FP8 rate (fp8_flops)")
    return out


def advise_problems(config: dict, workdir: Path | None = None) -> list[str]:
    """The advise keys: its models exist and can be advised on, its GPU profile and
    fabric can be found, its batch is given once."""
    adv = config.get("advise") or {}
    if not adv.get("enabled"):
        return []
    from parabench.hardware.gpus import NAMES, problem

    out = []
    for m in adv.get("models") or []:
        if m not in config["models"]:
            out.append(
                f"advise.models: {m!r} is not a model of this config ({list(config['models'])})"
            )
    gpu = adv["gpu"]
    if gpu not in NAMES and (why := problem(str(Path(workdir or ".") / gpu))):
        out.append(f"advise.gpu: {gpu!r}: {why}")
    out += fabric_problems("advise", adv.get("fabric", "h100-nvlink-ndr400"), config, workdir)
    if adv.get("float8"):
        out += _float8_problems(adv, workdir)
    if "global_batch" in adv and "global_tokens" in adv:
        out.append("advise: give global_batch or global_tokens, not both")
    return out


def rehearse_problems(config: dict, workdir: Path | None = None) -> list[str]:
    """rehearse.gpu: a GPU profile or a readable profile file (not this host)."""
    from parabench.hardware.gpus import PROFILES, THIS_MACHINE, problem

    gpu = (config.get("rehearse") or {}).get("gpu", "h100")
    if gpu in PROFILES:
        return []
    if gpu == THIS_MACHINE:
        return [f"rehearse.gpu: {gpu!r} prices this host; name the GPU the cells run on"]
    if why := problem(str(Path(workdir or ".") / gpu)):
        return [f"rehearse.gpu: {gpu!r}: {why}"]
    return []


def advise_measures(config: dict) -> list[str]:
    """What advise.csv depends on, a line each (what the rule and the sweep rerun it on):
    the advise settings and each advised model's entry (its sizes, its batch_size)."""
    adv = config["advise"]
    names = adv.get("models") or list(config["models"])
    return [
        json.dumps(adv, sort_keys=True),
        *(json.dumps({n: config["models"][n]}, sort_keys=True) for n in names),
    ]


def collective_devices(config: dict) -> list[int]:
    """Device counts that get a collectives benchmark: every n > 1 at which some cell
    runs as n ranks on one node (what the scaling model needs curves for); on CUDA also
    n = 1 where a cell runs one rank under torchrun, so that one GPU runs NCCL's
    collectives through the benchmark's launch path too. A layout's collectives run
    over each mesh dimension's group: curves at each degree too."""
    counts = {s.devices for s in _multi_rank(config)}
    counts |= {k for s in _multi_rank(config) for k in s.layout.degrees.values() if k > 1}
    one = (c.spec for c in cells(config) if c.spec.repeat == 0 and c.spec.devices == 1)
    if any(s.torchrun and not checks.static_skip_reason(s) for s in one):
        counts.add(1)
    return sorted(counts)


def collective_bytes(config: dict) -> list[int]:
    """Message sizes of the collectives benchmark."""
    return list(config.get("collectives", {}).get("message_bytes") or COLLECTIVE_BYTES)
