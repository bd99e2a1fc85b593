"""The settings of one benchmark cell and their cross-checks, torch-free.

The Snakefile calls `RunSpec.problems()` for every cell before any job starts, and
`parabench run` calls it again, so a bad combination fails with one message naming the
config key whichever way the cell was started.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from parabench.catalog import ARCHS, SCHEDULES, STRATEGIES, uses_torchrun

# Defaults mirror the seeds: demo.py's MLP and the DDP tutorial's SeqNet.
DEFAULTS: dict[str, dict] = {
    "mlp": {"dims": [1000, 400, 300, 200, 100, 50, 1]},
    "seqnet": {"dims": [784, 200, 200, 10]},
    "resmlp": {"d_in": 256, "width": 256, "depth": 8, "classes": 10},
}
assert set(DEFAULTS) == set(ARCHS)


@dataclass(frozen=True)
class ModelSpec:
    """A model preset plus its size overrides; hashable so it can key caches."""

    arch: str
    sizes: tuple[tuple[str, object], ...] = field(default=())

    @classmethod
    def of(cls, arch: str, **sizes: object) -> ModelSpec:
        if arch not in DEFAULTS:
            raise ValueError(f"unknown model arch {arch!r}; known: {sorted(DEFAULTS)}")
        unknown = set(sizes) - set(DEFAULTS[arch])
        if unknown:
            raise ValueError(f"model arch {arch!r} has no size keys {sorted(unknown)}")
        frozen = tuple(
            sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in sizes.items())
        )
        return cls(arch, frozen)

    def size(self, key: str):
        return dict(self.sizes).get(key, DEFAULTS[self.arch][key])

    def n_blocks(self) -> int:
        """Blocks a stage cut can fall between (see models.build)."""
        if self.arch == "resmlp":
            return self.size("depth") + 2
        return len(self.size("dims")) - 1


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
    repeat: int = 0
    scaling: str = "strong"
    accum_steps: int = 2
    microbatches: int = 4
    schedule: str = "gpipe"
    lr: float = 0.01
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    timeout_s: float = 300.0
    data: str = "synthetic"  # synthetic | dataloader
    loader_workers: int = 2
    peak_flops: float | None = None  # per device; measured with a GEMM when None
    gpus_per_node: int = 8  # where a cell must span nodes (launch only, not the maths)

    @property
    def nodes(self) -> int:
        """Nodes the cell spans: GPU cells needing more devices than one node holds."""
        if self.device == "cpu" or self.devices <= self.gpus_per_node:
            return 1
        return -(-self.devices // self.gpus_per_node)

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
        if self.strategy == "single" and self.devices != 1:
            out.append("devices: strategy 'single' runs on exactly one device")
        for key in ("steps", "batch_size", "accum_steps", "microbatches"):
            if getattr(self, key) < 1:
                out.append(f"{key}: must be >= 1, got {getattr(self, key)}")
        if not 0 <= self.warmup < self.steps:
            out.append(
                f"warmup: must be >= 0 and < steps ({self.steps}) so some steps are timed, "
                f"got {self.warmup}"
            )
        if self.timeout_s <= 0:
            out.append(f"timeout_s: must be > 0, got {self.timeout_s}")
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
        out += self._divisibility()
        if self.strategy in ("model_parallel", "pipeline") and self.devices > self.model.n_blocks():
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
        b, n = self.global_batch, self.devices
        parts = {
            "ddp": (n, f"devices ({n})"),
            "dp": (n, f"devices ({n})"),
            "grad_accum": (n * self.accum_steps, f"devices x accum_steps ({n}x{self.accum_steps})"),
            "pipeline": (self.microbatches, f"pipeline.microbatches ({self.microbatches})"),
        }
        if self.strategy in parts:
            div, what = parts[self.strategy]
            if b % div:
                return [f"batch_size: global batch {b} is not divisible by {what}"]
        return []

    def static_skip_reason(self) -> str | None:
        """A skip knowable from the settings alone, so no process need import torch to
        find out. Runtime checks (CUDA devices visible) live in each strategy."""
        if self.strategy == "dp" and self.devices > 1 and self.device == "cpu":
            return (
                f"nn.DataParallel needs {self.devices} CUDA devices; on CPU it silently runs "
                "a single copy, so no honest multi-device number exists"
            )
        if self.nodes > 1 and not uses_torchrun(self.strategy, self.devices):
            return (
                f"{self.strategy} runs in one process, which cannot span nodes: "
                f"{self.devices} devices > gpus_per_node ({self.gpus_per_node})"
            )
        return None

    def identity(self) -> dict:
        """The cell's key in every record and table."""
        return {
            "model": self.model_name,
            "strategy": self.strategy,
            "devices": self.devices,
            "repeat": self.repeat,
        }

    def record_fields(self) -> dict:
        """What every record of this cell carries: its key, its settings and their hash."""
        return {**self.identity(), "spec": self.to_dict(), "config_hash": self.config_hash()}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["model"] = {"arch": self.model.arch, **dict(self.model.sizes)}
        return d

    def config_hash(self) -> str:
        """Hash of what defines the maths and sizes (not the repeat index)."""
        d = self.to_dict()
        d.pop("repeat")
        d.pop("gpus_per_node")
        blob = json.dumps(d, sort_keys=True, default=list).encode()
        return hashlib.sha256(blob).hexdigest()[:12]
