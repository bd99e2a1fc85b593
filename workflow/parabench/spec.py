"""The settings of one benchmark cell and their cross-checks, torch-free.

The Snakefile calls `RunSpec.problems()` for every cell before any job starts, and
`parabench run` calls it again, so a bad combination fails with one message naming the
config key whichever way the cell was started.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, fields

from parabench.catalog import (
    ARCHS,
    CATALOG,
    OPTIMIZERS,
    PRECISIONS,
    SCHEDULES,
    STRATEGIES,
    record,
)

# On device cpu each "device" is a process on one machine: past this, a typo, not a plan.
MAX_CPU_DEVICES = 64

# Defaults mirror the seeds: demo.py's MLP and the DDP tutorial's SeqNet; gpt's are
# GPT-2 small's shape. A custom model names its factory and the factory's arguments.
DEFAULTS: dict[str, dict] = {
    "mlp": {"dims": [1000, 400, 300, 200, 100, 50, 1]},
    "seqnet": {"dims": [784, 200, 200, 10]},
    "resmlp": {"d_in": 256, "width": 256, "depth": 8, "classes": 10},
    "gpt": {"vocab": 50257, "seq_len": 1024, "n_layer": 12, "n_head": 12, "d_model": 768},
    "custom": {"factory": None, "args": {}},
}
assert set(DEFAULTS) == {*ARCHS, "custom"}


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
        return cls(arch, tuple(sorted((k, _freeze(v)) for k, v in sizes.items())))

    def size(self, key: str):
        return dict(self.sizes).get(key, DEFAULTS[self.arch][key])

    def n_blocks(self) -> int:
        """Blocks a stage cut can fall between (see models.build)."""
        if self.arch == "resmlp":
            return self.size("depth") + 2
        if self.arch == "gpt":
            return self.size("n_layer") + 2  # embedding, the layers, the head
        if self.arch == "custom":
            return self.custom().n_blocks
        return len(self.size("dims")) - 1

    def has_tp_plan(self) -> bool:
        """Whether the model declares layer pairs for tensor parallelism (models.tp_plan):
        every preset does; a custom model only if its factory returns a plan."""
        return self.arch in ARCHS or (self.arch == "custom" and self.custom().has_tp_plan)

    def problems(self, name: str) -> list[str]:
        """Sizes that cannot build a model, naming the key (models.<name>.<key>)."""
        if self.arch == "gpt":
            d, heads = self.size("d_model"), self.size("n_head")
            if d % heads:
                return [f"models.{name}.d_model: {d} is not divisible by n_head ({heads})"]
        if self.arch == "custom":
            return [f"models.{name}.factory: {p}" for p in self.custom().problems]
        return []

    def tp_problem(self, devices: int) -> str | None:
        """Why tensor parallelism cannot split this model over `devices`, or None."""
        if self.arch == "gpt" and self.size("n_head") % devices:
            return (
                f"n_head: {self.size('n_head')} attention heads do not split evenly over "
                f"{devices} tensor-parallel ranks"
            )
        if self.arch in ("mlp", "seqnet"):
            # The plan splits Linear pairs (0, 1), (2, 3), ...: each pair's inner width
            # (the first's outputs, the second's inputs) is cut into n slices.
            dims = list(self.size("dims"))
            inner = [dims[i + 1] for i in range(0, len(dims) - 2, 2)]
            if bad := [w for w in inner if w % devices]:
                return (
                    f"dims: tensor parallel splits the widths {inner} over {devices} ranks, "
                    f"and {bad} do not divide by {devices}"
                )
        if self.arch == "resmlp" and (4 * self.size("width")) % devices:
            hidden = 4 * self.size("width")
            return f"width: the MLP's 4 x width ({hidden}) does not divide by {devices}"
        return None

    def custom(self):
        """What the custom factory builds (imported and checked once; needs torch)."""
        from parabench.custom import inspect_factory

        return inspect_factory(self)

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
    steps: int = 20  # optimizer steps in total, warm-up included
    warmup: int = 5  # leading steps left out of the timings
    profile_steps: int = 5  # extra steps under torch.profiler, between the timed ones
    repeat: int = 0
    scaling: str = "strong"
    accum_steps: int = 2
    microbatches: int = 4
    schedule: str = "gpipe"
    lr: float = 0.01
    precision: str = "fp32"  # fp32 | bf16 (autocast; parameters and optimizer stay fp32)
    optimizer: str = "sgd"  # sgd | adamw
    compile: bool = False  # torch.compile each block before the strategy wraps it
    fsdp_reshard: bool = True  # fsdp.reshard_after_forward: ZeRO-3 (true) or ZeRO-2-like
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

    @property
    def nodes(self) -> int:
        """Nodes the cell spans: GPU cells needing more devices than one node holds."""
        if self.device == "cpu" or self.devices <= self.gpus_per_node:
            return 1
        return -(-self.devices // self.gpus_per_node)

    @property
    def record(self):
        """The strategy's catalog record (known strategies only: see problems())."""
        return record(self.strategy)

    @property
    def variant(self) -> str:
        """The axes that multiply the cells, as one label: fp32-sgd, bf16-adamw-compile."""
        return f"{self.precision}-{self.optimizer}" + ("-compile" if self.compile else "")

    @property
    def global_batch(self) -> int:
        return self.batch_size * (self.devices if self.scaling == "weak" else 1)

    def problems(self) -> list[str]:
        """Every broken rule, each naming the key at fault. Empty means valid."""
        out: list[str] = []
        if self.strategy not in STRATEGIES:
            out.append(f"strategies: unknown strategy {self.strategy!r}; known: {list(STRATEGIES)}")
        if self.devices < 1:
            out.append(f"devices: must be >= 1, got {self.devices}")
        fixed = CATALOG[self.strategy].fixed_devices if self.strategy in CATALOG else None
        if fixed and self.devices != fixed:
            out.append(f"devices: strategy {self.strategy!r} runs on exactly {fixed} device")
        if self.precision not in PRECISIONS:
            out.append(f"precision: must be one of {list(PRECISIONS)}, got {self.precision!r}")
        if self.optimizer not in OPTIMIZERS:
            out.append(f"optimizer: must be one of {list(OPTIMIZERS)}, got {self.optimizer!r}")
        for key in ("steps", "batch_size", "accum_steps", "microbatches", "profile_steps"):
            if getattr(self, key) < 1:
                out.append(f"{key}: must be >= 1, got {getattr(self, key)}")
        if not 0 <= self.warmup < self.steps:
            out.append(
                f"warmup: must be >= 0 and < steps ({self.steps}) so some steps are timed, "
                f"got {self.warmup}"
            )
        # YAML holds .nan and .inf, which pass every bound of a JSON schema.
        for key in ("lr", "timeout_s", "peak_flops"):
            value = getattr(self, key)
            if value is not None and not math.isfinite(value):
                out.append(f"{key}: must be a finite number, got {value}")
        if self.timeout_s <= 0:
            out.append(f"timeout_s: must be > 0, got {self.timeout_s}")
        if self.device == "cpu" and self.devices > MAX_CPU_DEVICES:
            out.append(
                f"devices: {self.devices} on device cpu means {self.devices} processes on one "
                f"machine; at most {MAX_CPU_DEVICES}"
            )
        if self.scaling not in ("strong", "weak"):
            out.append(f"scaling: must be 'strong' or 'weak', got {self.scaling!r}")
        if self.schedule not in SCHEDULES:
            out.append(
                f"pipeline.schedule: must be one of {list(SCHEDULES)}, got {self.schedule!r}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            out.append(f"device: must be auto, cpu or cuda, got {self.device!r}")
        if self.data not in ("synthetic", "dataloader"):
            out.append(f"data: must be synthetic or dataloader, got {self.data!r}")
        if out:
            return out
        out += self.model.problems(self.model_name)
        if out:
            return out
        out += self._divisibility()
        if self.record.needs_tp_plan and not self.model.has_tp_plan():
            out.append(
                f"strategies: {self.strategy} needs a tensor-parallel plan, and "
                f"models.{self.model_name} declares none (a custom factory returns tp_plan)"
            )
        elif self.record.needs_tp_plan and (why := self.model.tp_problem(self.devices)):
            out.append(f"models.{self.model_name}.{why}")
        if self.record.cuts_model and self.devices > self.model.n_blocks():
            out.append(
                f"devices: {self.strategy} at {self.devices} devices needs {self.devices} stages "
                f"but model {self.model_name!r} has only {self.model.n_blocks()} blocks"
            )
        if self.nodes > 1 and self.devices % self.nodes:
            out.append(
                f"devices: {self.devices} devices over {self.nodes} nodes "
                f"(gpus_per_node {self.gpus_per_node}) is not the same count on every node"
            )
        if (
            self.strategy == "pipeline"
            and self.schedule == "1f1b"
            and self.microbatches < self.devices
        ):
            out.append(
                f"pipeline.microbatches: 1F1B needs micro-batches >= stages "
                f"({self.microbatches} < {self.devices})"
            )
        return out

    def _divisibility(self) -> list[str]:
        div, what = self.record.batch_divisor(self.devices, self.accum_steps, self.microbatches)
        if self.global_batch % div:
            return [f"batch_size: global batch {self.global_batch} is not divisible by {what}"]
        return []

    def static_skip_reason(self) -> str | None:
        """A skip knowable from the settings alone, so no process need import torch to
        find out. Runtime checks (CUDA devices visible) live in each strategy."""
        rec = self.record
        if rec.cuda_only_beyond_one and self.devices > 1 and self.device == "cpu":
            return (
                f"{rec.label} needs {self.devices} CUDA devices; on CPU it silently runs "
                "a single copy, so no honest multi-device number exists"
            )
        if self.nodes > 1 and not rec.uses_torchrun(self.devices):
            return (
                f"{self.strategy} runs in one process, which cannot span nodes: "
                f"{self.devices} devices > gpus_per_node ({self.gpus_per_node})"
            )
        if self.compile and not rec.compiles:
            return f"torch.compile does not compose with {rec.label} (compile: true)"
        return None

    def identity(self) -> dict:
        """The cell's key in every record and table (records.CELL_KEYS, in that order)."""
        return {
            "model": self.model_name,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "compile": self.compile,
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
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RunSpec:
        """Inverse of to_dict (keys this version does not know are an error)."""
        return cls(**{**d, "model": ModelSpec.from_dict(d["model"])})

    def config_hash(self) -> str:
        """Hash of what defines the maths and sizes (not the repeat index)."""
        d = self.to_dict()
        d.pop("repeat")
        d.pop("gpus_per_node")
        blob = json.dumps(d, sort_keys=True, default=list).encode()
        return hashlib.sha256(blob).hexdigest()[:12]
