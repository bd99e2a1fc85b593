"""Every fact about every strategy, one record each, and the other names the config uses.

Torch-free on purpose: the Snakefile imports it at parse time to build the job graph.
The config check (which strategies exist), the cell rules (launch, batch divisibility,
stages vs blocks, what cannot run on CPU), the rules' wildcards, the report (labels,
order, narrative template) and the memory model (what is sharded) all read these
records, so adding a strategy means one record here, one module under strategies/ and
one narrative under report/strategies/.
"""

from __future__ import annotations

from dataclasses import dataclass

# How a cell's processes are started.
ONE_PROCESS = "one process"  # python -m parabench run, no process group
RANK_PER_DEVICE = "rank per device"  # one rank per device, in a process group
RANKS_IF_MANY = "ranks if many"  # ranks when devices > 1; plain one process at 1

# What a strategy keeps 1/n of on each rank (the rest is replicated).
PARAMS, GRADS, OPTIMIZER, ACTIVATIONS = "params", "grads", "optimizer", "activations"


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
    # parameters) or "activations" (in the compute precision: bf16 under autocast).
    # The profiler records those tensors' shapes but not their dtype.
    sends: str = "gradients"

    @property
    def pipelined(self) -> bool:
        """Stages on ranks of their own, working at once (a pipeline), not one after
        another in one process (naive model parallel)."""
        return self.cuts_model and self.launch != ONE_PROCESS

    @property
    def narrative(self) -> str:
        """The report template that explains the strategy (under report/)."""
        return f"strategies/{self.name}.html.j2"

    def process_group(self, devices: int) -> bool:
        """Whether the cell's code runs in a process group (DDP at one rank does too)."""
        return self.launch == RANK_PER_DEVICE or (self.launch == RANKS_IF_MANY and devices > 1)

    def uses_torchrun(self, devices: int) -> bool:
        """Whether torchrun starts the cell. One rank needs no rendezvous: it starts as a
        plain process with an in-memory store, the same code path without the agent's
        two seconds of start-up."""
        return self.process_group(devices) and devices > 1

    def batch_divisor(self, devices: int, accum_steps: int, microbatches: int) -> tuple[int, str]:
        """(what the global batch must divide by, how to say it), (1, "") if unsplit."""
        if self.batch_split == "devices":
            return devices, f"devices ({devices})"
        if self.batch_split == "devices*accum":
            return devices * accum_steps, f"devices x accum_steps ({devices}x{accum_steps})"
        if self.batch_split == "microbatches":
            return microbatches, f"pipeline.microbatches ({microbatches})"
        return 1, ""


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
    ),
    StrategyRecord(
        "grad_accum",
        "gradient accumulation",
        "grad_accum:GradAccum",
        "k micro-batches of B/(n·k), under DDP when n>1 with `no_sync` on all but the last",
        launch=RANKS_IF_MANY,
        batch_split="devices*accum",
        sharded=frozenset({ACTIVATIONS}),
    ),
)

CATALOG: dict[str, StrategyRecord] = {r.name: r for r in _RECORDS}
STRATEGIES: tuple[str, ...] = tuple(CATALOG)
LABELS: dict[str, str] = {r.name: r.label for r in _RECORDS}

ARCHS: tuple[str, ...] = ("mlp", "seqnet", "resmlp", "gpt")  # presets; "custom": your own
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")
PRECISIONS: tuple[str, ...] = ("fp32", "bf16")
OPTIMIZERS: tuple[str, ...] = ("sgd", "adamw")


def record(strategy: str) -> StrategyRecord:
    """The record of a known strategy (callers check names with `problems()` first)."""
    return CATALOG[strategy]


def uses_torchrun(strategy: str, devices: int) -> bool:
    """True when the cell is launched as `devices` ranks by torchrun."""
    return CATALOG[strategy].uses_torchrun(devices)


def device_counts(strategy: str, devices: list[int]) -> list[int]:
    """The device counts a strategy is swept over (`single` is one device by definition)."""
    fixed = CATALOG[strategy].fixed_devices
    return [fixed] if fixed else sorted(set(devices))


def multi_rank(strategies: list[str] | tuple[str, ...] = STRATEGIES) -> list[str]:
    """Strategies that can run as torchrun ranks, hence across nodes."""
    return [s for s in strategies if CATALOG[s].launch != ONE_PROCESS]
