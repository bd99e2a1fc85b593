"""Every fact about every strategy, one record each, and the other names the config uses.

Torch-free on purpose: the Snakefile imports it at parse time to build the job graph.
The config check (which strategies exist, their own settings), the cell rules (launch,
batch divisibility, stages vs blocks, what cannot run on CPU), the rules' wildcards, the
report (labels, order, narrative template) and the memory model (what is sharded) all
read these records, so adding a strategy means one record here, one module under
strategies/ and one narrative under report/strategies/.

A strategy's own settings (fsdp's `reshard_after_forward`, pipeline's `microbatches`)
are `Option`s of its record: their defaults live here, the config sets them in a
section named after the strategy (`fsdp: {reshard_after_forward: false}`), and only
that strategy's cells carry them, so a new setting changes no other cell's hash.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# How a cell's processes are started.
ONE_PROCESS = "one process"  # python -m parabench run, no process group
RANK_PER_DEVICE = "rank per device"  # one rank per device, in a process group
RANKS_IF_MANY = "ranks if many"  # ranks when devices > 1; plain one process at 1

# What a strategy keeps 1/n of on each rank (the rest is replicated).
PARAMS, GRADS, OPTIMIZER, ACTIVATIONS = "params", "grads", "optimizer", "activations"


@dataclass(frozen=True)
class Option:
    """One setting of one strategy: its default, and what it means (config/README)."""

    default: bool | int | str
    help: str
    choices: tuple = ()  # the values allowed, where they are few
    minimum: int | None = None  # for integers

    def problem(self, key: str, value) -> str | None:
        """Why `value` cannot be this option's, naming `key`; None when it can."""
        kind = type(self.default)
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            return f"{key}: must be an integer, got {value!r}"
        if kind is not int and not isinstance(value, kind):
            return f"{key}: must be a {kind.__name__}, got {value!r}"
        if self.choices and value not in self.choices:
            return f"{key}: must be one of {list(self.choices)}, got {value!r}"
        if self.minimum is not None and value < self.minimum:
            return f"{key}: must be >= {self.minimum}, got {value}"
        return None


@dataclass(frozen=True)
class StrategyRecord:
    name: str
    label: str
    impl: str  # "module:Class" under parabench.strategies
    step: str  # what one optimizer step does, in a line (README, report)
    launch: str = ONE_PROCESS
    # What the global batch is split by; the batch must divide by it. "devices":
    # each rank takes B/n; "devices*accum": k micro-batches of B/(n*k) per rank;
    # "microbatches": the pipeline's m micro-batches; None: never split.
    batch_split: str | None = None
    cuts_model: bool = False  # stages cut between blocks: needs devices <= blocks
    cuda_only_beyond_one: bool = False  # on CPU it would silently run one copy
    fixed_devices: int | None = None  # swept only at this count (single: 1)
    sharded: frozenset[str] = frozenset()  # held 1/n per rank (memory model)
    needs_tp_plan: bool = False  # the model must declare which layers to split
    compiles: bool = True  # torch.compile composes with it (per block)
    reference: bool = False  # the baseline of speedup and equivalence
    # What its point-to-point and list collectives carry: "gradients" (fp32, like the
    # parameters), "activations" (in the compute precision: bf16 under autocast) or
    # "bf16 gradients" (compressed for the wire). The profiler records those tensors'
    # shapes but not their dtype, so bytes are counted at `wire_bytes`.
    sends: str = "gradients"
    # Gradients rounded to this many significant bits before they are averaged
    # (a compression hook): the maths differs from single's by that rounding, and the
    # equivalence tolerance is derived from it (equivalence.py). None: not rounded.
    gradient_bits: int | None = None
    options: dict[str, Option] = field(default_factory=dict)

    @property
    def pipelined(self) -> bool:
        """Stages on ranks of their own, working at once (a pipeline), not one after
        another in one process (naive model parallel)."""
        return self.cuts_model and self.launch != ONE_PROCESS

    @property
    def narrative(self) -> str:
        """The report template that explains the strategy (under report/)."""
        return f"strategies/{self.name}.html.j2"

    def wire_bytes(self, precision: str) -> int:
        """Bytes per element of what its list collectives and point-to-point carry."""
        if self.sends == "activations":
            return 2 if precision == "bf16" else 4
        return 2 if self.sends == "bf16 gradients" else 4

    def process_group(self, devices: int) -> bool:
        """Whether the cell's code runs in a process group (DDP at one rank does too)."""
        return self.launch == RANK_PER_DEVICE or (self.launch == RANKS_IF_MANY and devices > 1)

    def ranks(self, devices: int) -> int:
        """The processes a cell at `devices` starts: more than one means torchrun (and
        the only way across nodes). One rank needs no rendezvous: it starts as a plain
        process with an in-memory store, the same code path without the agent's two
        seconds of start-up."""
        return devices if self.process_group(devices) else 1

    def batch_divisor(self, devices: int, options: dict) -> tuple[int, str]:
        """(what the global batch must divide by, how to say it), (1, "") if unsplit."""
        if self.batch_split == "devices":
            return devices, f"devices ({devices})"
        if self.batch_split == "devices*accum":
            k = options["accum_steps"]
            return devices * k, f"devices x options.{self.name}.accum_steps ({devices}x{k})"
        if self.batch_split == "microbatches":
            m = options["microbatches"]
            return m, f"options.{self.name}.microbatches ({m})"
        return 1, ""


_PIPELINE_OPTIONS = {
    "microbatches": Option(4, "micro-batches per optimizer step", minimum=1),
    "schedule": Option(
        "gpipe", "gpipe (all forwards, then all backwards) or 1f1b", choices=("gpipe", "1f1b")
    ),
}

_RECORDS = (
    StrategyRecord(
        "single",
        "single device",
        "single:Single",
        "one device, the whole global batch B",
        fixed_devices=1,
        reference=True,
    ),
    StrategyRecord(
        "dp",
        "DataParallel",
        "dp:DataParallel",
        "`nn.DataParallel`: one process scatters B over n GPUs, gathers on GPU 0",
        batch_split="devices",
        cuda_only_beyond_one=True,
        sharded=frozenset({ACTIVATIONS}),
        compiles=False,  # it replicates the module every forward
    ),
    StrategyRecord(
        "ddp",
        "DDP",
        "ddp:DistributedDataParallel",
        "`DistributedDataParallel`, B/n per rank, bucketed all-reduce overlapping backward",
        launch=RANK_PER_DEVICE,
        batch_split="devices",
        sharded=frozenset({ACTIVATIONS}),
    ),
    StrategyRecord(
        "ddp_compress",
        "DDP, bf16 gradients",
        "ddp_compress:CompressedDDP",
        "DDP whose communication hook all-reduces gradients in bf16: half the bytes",
        launch=RANK_PER_DEVICE,
        batch_split="devices",
        sharded=frozenset({ACTIVATIONS}),
        sends="bf16 gradients",
        gradient_bits=8,  # bfloat16: 8 significant bits
    ),
    StrategyRecord(
        "zero1",
        "ZeRO-1",
        "zero1:Zero1",
        "DDP with `ZeroRedundancyOptimizer`: optimizer state sharded over ranks",
        launch=RANK_PER_DEVICE,
        batch_split="devices",
        sharded=frozenset({OPTIMIZER, ACTIVATIONS}),
    ),
    StrategyRecord(
        "fsdp",
        "FSDP2",
        "fsdp:FullyShard",
        "FSDP2 `fully_shard` per block: parameters, gradients and optimizer state sharded",
        launch=RANK_PER_DEVICE,
        batch_split="devices",
        sharded=frozenset({PARAMS, GRADS, OPTIMIZER, ACTIVATIONS}),
        options={
            "reshard_after_forward": Option(
                True,
                "true frees gathered parameters after forward (ZeRO-3); false keeps "
                "them to backward (ZeRO-2-like)",
            )
        },
    ),
    StrategyRecord(
        "tp",
        "tensor parallel",
        "tp:TensorParallel",
        "DTensor `parallelize_module`: the model's layer pairs split column- then row-wise",
        launch=RANK_PER_DEVICE,
        needs_tp_plan=True,
        sends="activations",
    ),
    StrategyRecord(
        "model_parallel",
        "model parallel",
        "model_parallel:ModelParallel",
        "the model cut into n stages on n devices, one process, no overlap",
        cuts_model=True,
    ),
    StrategyRecord(
        "pipeline",
        "pipeline",
        "pipeline:Pipeline",
        "the same cut over n ranks, `torch.distributed.pipelining`, m micro-batches",
        launch=RANK_PER_DEVICE,
        batch_split="microbatches",
        cuts_model=True,
        sends="activations",
        options=_PIPELINE_OPTIONS,
    ),
    StrategyRecord(
        "grad_accum",
        "gradient accumulation",
        "grad_accum:GradAccum",
        "k micro-batches of B/(n·k), under DDP when n>1 with `no_sync` on all but the last",
        launch=RANKS_IF_MANY,
        batch_split="devices*accum",
        sharded=frozenset({ACTIVATIONS}),
        options={"accum_steps": Option(2, "micro-batches per optimizer step", minimum=1)},
    ),
)

CATALOG: dict[str, StrategyRecord] = {r.name: r for r in _RECORDS}
STRATEGIES: tuple[str, ...] = tuple(CATALOG)
LABELS: dict[str, str] = {r.name: r.label for r in _RECORDS}
# The strategy every other is measured against: speedup and equivalence.
REFERENCE: str = next(r.name for r in _RECORDS if r.reference)

PRECISIONS: tuple[str, ...] = ("fp32", "bf16")
OPTIMIZERS: tuple[str, ...] = ("sgd", "adamw")


def record(strategy: str) -> StrategyRecord:
    """The record of a known strategy (callers check names with `problems()` first)."""
    return CATALOG[strategy]


def device_counts(strategy: str, devices: list[int]) -> list[int]:
    """The device counts a strategy is swept over (`single` is one device by definition)."""
    fixed = CATALOG[strategy].fixed_devices
    return [fixed] if fixed else sorted(set(devices))


def multi_rank(strategies: list[str] | tuple[str, ...] = STRATEGIES) -> list[str]:
    """Strategies that can run as torchrun ranks, hence across nodes."""
    return [s for s in strategies if CATALOG[s].launch != ONE_PROCESS]
