"""The settings of one benchmark cell, and their one serialisation, both ways. Torch-free.

A cell's settings travel config -> RunSpec -> the launch's arguments -> RunSpec in each
rank -> meta.json -> RunSpec again when the results are merged. `to_argv`/`from_argv`
and `to_dict`/`from_dict` are the only two encodings, each the other's inverse; every
field of RunSpec becomes a flag by itself, so a new field needs no parser code.

Checking a spec (which combinations make no sense) is `checks.problems`; this module
holds settings only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import MISSING, asdict, dataclass, field, fields

from parabench.catalog import REFERENCE, record
from parabench.envinfo import runs_on_cuda
from parabench.layout import Layout
from parabench.models.facts import DEFAULTS
from parabench.records import CELL_DIR


class Frozen(dict):
    """A dict that can key a cache (a custom model's arguments)."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(json.dumps(self, sort_keys=True, default=str))


def _freeze(v):
    if isinstance(v, dict):
        return Frozen({k: _freeze(x) for k, x in v.items()})
    if isinstance(v, list | tuple):
        return tuple(_freeze(x) for x in v)
    return v


def _thaw(v):
    if isinstance(v, dict):
        return {k: _thaw(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return [_thaw(x) for x in v]
    return v


@dataclass(frozen=True)
class ModelSpec:
    """A model preset plus its size overrides, or a custom factory and its arguments;
    hashable so it can key caches."""

    arch: str
    sizes: tuple[tuple[str, object], ...] = field(default=())

    @classmethod
    def of(cls, arch: str, **sizes: object) -> ModelSpec:
        if arch not in DEFAULTS:
            raise ValueError(f"unknown model arch {arch!r}; known: {sorted(DEFAULTS)}")
        unknown = set(sizes) - set(DEFAULTS[arch])
        if unknown:
            raise ValueError(f"model arch {arch!r} has no size keys {sorted(unknown)}")
        if arch == "custom" and not isinstance(sizes.get("factory"), str):
            raise ValueError("arch custom needs factory: 'module.path:function'")
        if arch == "hf" and not isinstance(sizes.get("model_type"), str):
            raise ValueError("arch hf needs model_type: a transformers model type, e.g. llama")
        return cls(arch, tuple(sorted((k, _freeze(v)) for k, v in sizes.items())))

    def size_dict(self) -> dict:
        """Every size, the defaults under what was given."""
        return {**DEFAULTS[self.arch], **{k: _thaw(v) for k, v in self.sizes}}

    def to_dict(self) -> dict:
        return {"arch": self.arch, **{k: _thaw(v) for k, v in self.sizes}}

    @classmethod
    def from_dict(cls, d: dict) -> ModelSpec:
        return cls.of(d["arch"], **{k: v for k, v in d.items() if k != "arch"})


@dataclass(frozen=True)
class RunSpec:
    """Everything that defines one cell: strategy x devices x repeat of one model."""

    strategy: str
    devices: int
    model_name: str
    model: ModelSpec
    batch_size: int  # global batch (strong scaling) or per-device batch (weak)
    # The strategy's own settings (its catalog record's options), its defaults filled
    # in: only this strategy's, so another strategy's new setting leaves this cell alone.
    options: tuple[tuple[str, object], ...] = ()
    steps: int = 20  # optimizer steps in total, warm-up included
    warmup: int = 5  # leading steps left out of the timings
    profile_steps: int = 5  # extra steps under torch.profiler, between the timed ones
    repeat: int = 0
    scaling: str = "strong"
    lr: float = 0.01
    precision: str = "fp32"  # fp32 | bf16 (autocast; parameters and optimizer stay fp32)
    optimizer: str = "sgd"  # sgd | adamw
    compile: bool = False  # torch.compile each block before the strategy wraps it
    # Activation checkpointing of each repeated block: none | full | selective | every<k>
    # (layout.AC_PATTERN). Absent from the settings' dict and hash when none, so the
    # cells of configs that never name it keep their paths and hashes.
    ac: str = "none"
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    timeout_s: float = 300.0
    data: str = "synthetic"  # synthetic | dataloader
    loader_workers: int = 2
    peak_flops: float | None = None  # per device; measured with a GEMM when None
    gpus_per_node: int = 8  # where a cell must span nodes (launch only, not the maths)

    def __post_init__(self) -> None:
        # YAML gives 300 where the command line gives 300.0: one type per field, so a
        # cell's hash is the same whoever built its spec.
        for f in fields(self):
            value = getattr(self, f.name)
            is_int = isinstance(value, int) and not isinstance(value, bool)
            if f.type in ("float", "float | None") and is_int:
                object.__setattr__(self, f.name, float(value))
        given = dict(self.options)
        try:
            defaults = {k: o.default for k, o in record(self.strategy).options.items()}
        except KeyError:  # an unknown strategy: checks.problems says so
            defaults = {}
        object.__setattr__(self, "options", tuple(sorted({**defaults, **given}.items())))

    def option(self, key: str):
        """One of the strategy's own settings."""
        return dict(self.options)[key]

    @property
    def nodes(self) -> int:
        """Nodes the cell spans: GPU cells needing more devices than one node holds."""
        if self.device == "cpu" or self.devices <= self.gpus_per_node:
            return 1
        return -(-self.devices // self.gpus_per_node)

    @property
    def record(self):
        """The strategy's catalog record (known strategies only: see checks.problems)."""
        return record(self.strategy)

    @property
    def processes(self) -> int:
        """Processes the cell starts; more than one means torchrun."""
        return self.record.processes(self.devices)

    @property
    def torchrun(self) -> bool:
        """Whether the cell's processes start under torchrun (jobs/launch.py): several ranks,
        or on CUDA the one rank of a distributed strategy at one device, so that one GPU
        runs the launch path n GPUs run (the agent, a forked rank, an NCCL group bound
        to its device); `auto` is CUDA where torch is a CUDA build (it finds the GPUs).
        On the CPU one rank starts as a plain process (in-memory store), sparing the
        agent's two seconds."""
        return self.processes > 1 or (
            runs_on_cuda(self.device) and self.record.process_group(self.devices)
        )

    def cuda_devices_per_host(self, local_world: int) -> int:
        """The CUDA devices a host of `local_world` of the cell's processes must see: what
        each drives (all n of a one-process strategy such as dp or model_parallel, one
        for a rank), since local rank r drives cuda:r. Every process of a host counts
        the same, so they decide together."""
        return self.devices // self.processes * local_world

    @property
    def layout(self) -> Layout:
        """The cell's layout: its record's declaration settled at its devices and
        options, with its AC, ZeRO level (FSDP's reshard_after_forward; in a pipeline
        always ZeRO-2, torchtitan's default: each micro-batch's backward would gather
        every parameter again), sequence parallelism and schedule. All degrees 1 for
        the one-process strategies."""
        opts = dict(self.options)
        lay = self.record.layout.at(self.devices, opts)
        return lay.replace(
            zero=3 if opts.get("reshard_after_forward", True) and lay.pp == 1 else 2,
            ac=self.ac,
            sequence_parallel=bool(opts.get("sequence_parallel", True)),  # moot without tp
            schedule=opts.get("schedule", "1f1b"),
        )

    @property
    def stages(self) -> int:
        """Stages the model is cut into: a pipeline's pp degree, model parallel's
        devices (one process drives them all), else 1."""
        if not self.record.cuts_model:
            return 1
        return self.layout.pp if self.record.pipelined else self.devices

    @property
    def is_reference(self) -> bool:
        return self.strategy == REFERENCE

    @property
    def variant(self) -> str:
        """The axes that multiply the cells, as one label: fp32-sgd, bf16-adamw-compile."""
        label = f"{self.precision}-{self.optimizer}" + ("-compile" if self.compile else "")
        return label + (f"-ac{self.ac}" if self.ac != "none" else "")

    @property
    def global_batch(self) -> int:
        return self.batch_size * (self.devices if self.scaling == "weak" else 1)

    @property
    def path(self) -> str:
        """The cell's directory, relative to the results directory."""
        return CELL_DIR.format(
            model=self.model_name,
            variant=self.variant,
            strategy=self.strategy,
            devices=self.devices,
            repeat=self.repeat,
        )

    def identity(self) -> dict:
        """The cell's key in every record and table (records.CELL_KEYS, in that order)."""
        return {
            "model": self.model_name,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "compile": self.compile,
            "ac": self.ac,
            "strategy": self.strategy,
            "devices": self.devices,
            "repeat": self.repeat,
        }

    def record_fields(self) -> dict:
        """What every record of this cell carries: its key, its settings and their hash."""
        return {**self.identity(), "spec": self.to_dict(), "config_hash": self.config_hash()}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["model"] = self.model.to_dict()
        d["options"] = {k: _thaw(v) for k, v in self.options}
        if d["ac"] == "none":  # the default leaves every earlier cell's hash as it was
            del d["ac"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RunSpec:
        """Inverse of to_dict (keys this version does not know are an error)."""
        options = tuple(sorted((k, _freeze(v)) for k, v in (d.get("options") or {}).items()))
        return cls(**{**d, "model": ModelSpec.from_dict(d["model"]), "options": options})

    def config_hash(self) -> str:
        """Hash of what defines what the cell measures: its maths, sizes and settings;
        not the repeat index, nor where it runs or how long it may wait (gpus_per_node,
        timeout_s): raising a timeout after one ran out reruns nothing."""
        d = self.to_dict()
        for key in ("repeat", "gpus_per_node", "timeout_s"):
            d.pop(key)
        blob = json.dumps(d, sort_keys=True, default=list).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    # -- the command line: every field a flag; model and options as JSON

    def to_argv(self) -> list[str]:
        """The `parabench run` arguments that reproduce this spec exactly."""
        argv = []
        for key, value in self.to_dict().items():
            if value is None:
                continue
            text = json.dumps(value) if isinstance(value, dict) else str(value)
            argv += [_flag(key), text]
        return argv

    @classmethod
    def from_argv(cls, argv: list[str]) -> RunSpec:
        """Inverse of to_argv; ValueError names the flag at fault."""
        parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
        add_arguments(parser)
        try:
            args, rest = parser.parse_known_args(argv)
        except argparse.ArgumentError as e:
            raise ValueError(str(e)) from None
        if rest:
            raise ValueError(f"unknown arguments {rest}")
        return from_namespace(args)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _json_object(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


_TYPES = {"int": int, "float": float, "str": str, "bool": _bool, "float | None": float}
_JSON_FIELDS = {
    "model": 'the model as JSON: its arch and sizes, e.g. \'{"arch": "mlp", "dims": [64, 1]}\'',
    "options": "the strategy's own settings as JSON, e.g. '{\"microbatches\": 4}'",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per RunSpec field (`parabench run --help` lists them)."""
    for f in fields(RunSpec):
        required = f.default is MISSING and f.default_factory is MISSING
        if f.name in _JSON_FIELDS:
            parser.add_argument(
                _flag(f.name),
                dest=f.name,
                type=_json_object,
                required=f.name == "model",
                default={},
                help=_JSON_FIELDS[f.name],
            )
            continue
        parser.add_argument(
            _flag(f.name),
            dest=f.name,
            type=_TYPES[str(f.type)],
            required=required,
            default=None if required else f.default,
        )


def from_namespace(args: argparse.Namespace) -> RunSpec:
    d = {f.name: getattr(args, f.name) for f in fields(RunSpec)}
    try:
        return RunSpec.from_dict(d)
    except (KeyError, TypeError) as e:
        raise ValueError(f"--model: {e}") from None
