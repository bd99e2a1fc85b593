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

from parabench.layout import REST, Layout

# How a cell's processes are started.
ONE_PROCESS = "one process"  # python -m parabench run, no process group
RANK_PER_DEVICE = "rank per device"  # one rank per device, in a process group
RANKS_IF_MANY = "ranks if many"  # ranks when devices > 1; plain one process at 1

# What a strategy keeps 1/n of on each rank (the rest is replicated).
PARAMS, GRADS, OPTIMIZER, ACTIVATIONS = "params", "grads", "optimizer", "activations"
MODEL_STATE = frozenset({PARAMS, GRADS, OPTIMIZER})

# What each mesh dimension splits on every rank (the memory model): data parallelism
# splits the batch, hence activations; sharding, tensor and pipeline parallelism split
# the model's state as well.
SPLITS = {
    "pp": MODEL_STATE | {ACTIVATIONS},
    "dp_replicate": frozenset({ACTIVATIONS}),
    "dp_shard": MODEL_STATE | {ACTIVATIONS},
    "tp": MODEL_STATE | {ACTIVATIONS},
}


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
    cuts_model: bool = False  # stages cut between blocks: needs stages <= blocks
    cuda_only_beyond_one: bool = False  # on CPU it would silently run one copy
    fixed_devices: int | None = None  # swept only at this count (single: 1)
    # held 1/n per rank beyond what its degrees split (memory model: catalog.SPLITS per
    # mesh dimension): ZeRO-1's optimizer, DataParallel's batch
    sharded: frozenset[str] = frozenset()
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
    # equivalence tolerance is derived from it (analyze/equivalence.py). None: not rounded.
    gradient_bits: int | None = None
    options: dict[str, Option] = field(default_factory=dict)
    # Its place on the named mesh, declared (its degrees settled per cell by
    # RunSpec.layout): a 1-D strategy's one dimension (ddp: dp_replicate), a composed
    # layout's several. Read for the checks, the bytes per dimension, the memory model
    # and the scaling model. None of the three one-process strategies has one.
    layout: Layout = Layout()
    takes_ac: bool = True  # activation checkpointing composes with it (per block)

    @property
    def composed(self) -> bool:
        """Several mesh dimensions at once: a composition (fsdp_tp, hsdp, ddp_pp...)."""
        return len(self.layout.declared()) > 1

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

    def processes(self, devices: int) -> int:
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
        if self.batch_split == "mesh":  # a layout: the data-parallel ranks (x micro-batches)
            lay = self.layout.at(devices, options)
            dp, m = lay.dp, options.get("microbatches", 1)
            m = m if lay.pp > 1 else 1
            say = f"its data-parallel ranks ({dp})" + (
                f" x options.{self.name}.microbatches ({m})" if m > 1 else ""
            )
            return dp * m, say
        return 1, ""


_PIPELINE_OPTIONS = {
    "microbatches": Option(4, "micro-batches per optimizer step", minimum=1),
    "schedule": Option(
        "gpipe",
        "gpipe (all forwards, then all backwards) or 1f1b (Interleaved 1F1B is advise's only: "
        "a cell runs one stage a rank)",
        choices=("gpipe", "1f1b"),
    ),
}

_RESHARD = Option(
    True,
    "true frees gathered parameters after forward (ZeRO-3); false keeps "
    "them to backward (ZeRO-2-like)",
)
_SEQUENCE = Option(
    True,
    "true shards the activations between blocks over the sequence (sequence parallel, "
    "as Megatron-LM and torchtitan run TP) where the model declares how; false keeps "
    "them whole on every tp rank",
)
# A layout's records: every one is the same class (strategies/layout.py), applying its
# degrees to the model in torchtitan's order; each differs by its declaration only.
_LAYOUT = {"impl": "layout:Composed", "launch": RANK_PER_DEVICE, "batch_split": "mesh"}


def _degree(dim: str, help: str) -> Option:
    return Option(2, f"{dim} degree: {help}", minimum=2)


# A pipelined layout's: stages cut between blocks over pp, activations between them,
# the pipeline's settings with its pp degree.
_STAGED = {
    **_LAYOUT,
    "cuts_model": True,
    "sends": "activations",
    "options": {"pp": _degree("pp", "pipeline stages"), **_PIPELINE_OPTIONS},
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
        takes_ac=False,  # the same: its replicas' forwards are not the blocks'
    ),
    StrategyRecord(
        "ddp",
        "DDP",
        "ddp:DistributedDataParallel",
        "`DistributedDataParallel`, B/n per rank, bucketed all-reduce overlapping backward",
        launch=RANK_PER_DEVICE,
        batch_split="devices",
        sharded=frozenset({ACTIVATIONS}),
        layout=Layout(dp_replicate=REST),
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
        layout=Layout(dp_replicate=REST),
    ),
    StrategyRecord(
        "zero1",
        "ZeRO-1",
        "zero1:Zero1",
        "DDP with `ZeroRedundancyOptimizer`: optimizer state sharded over ranks",
        launch=RANK_PER_DEVICE,
        batch_split="devices",
        sharded=frozenset({OPTIMIZER, ACTIVATIONS}),
        layout=Layout(dp_replicate=REST),  # its optimizer shards are not a mesh degree
    ),
    StrategyRecord(
        "fsdp",
        "FSDP2",
        "fsdp:FullyShard",
        "FSDP2 `fully_shard` per block: parameters, gradients and optimizer state sharded",
        launch=RANK_PER_DEVICE,
        batch_split="devices",
        sharded=frozenset({PARAMS, GRADS, OPTIMIZER, ACTIVATIONS}),
        options={"reshard_after_forward": _RESHARD},
        layout=Layout(dp_shard=REST),
    ),
    StrategyRecord(
        "tp",
        "tensor parallel",
        "tp:TensorParallel",
        "DTensor `parallelize_module`: the model's layer pairs split column- then row-wise, "
        "the sequence between them sharded",
        launch=RANK_PER_DEVICE,
        needs_tp_plan=True,
        sends="activations",
        options={"sequence_parallel": _SEQUENCE},
        layout=Layout(tp=REST),
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
        layout=Layout(pp=REST),
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
        layout=Layout(dp_replicate=REST),
    ),
    # -- layouts: several degrees on the mesh at once (config/README.md, "Layouts")
    StrategyRecord(
        "fsdp_tp",
        "FSDP×TP",
        step="FSDP2 over dp_shard, tensor parallel inside each tp group (Llama 3 70B's 2D)",
        layout=Layout(dp_shard=REST, tp="tp"),
        needs_tp_plan=True,
        options={
            "tp": _degree("tp", "ranks that split each layer; dp_shard takes the rest"),
            "reshard_after_forward": _RESHARD,
            "sequence_parallel": _SEQUENCE,
        },
        **_LAYOUT,
    ),
    StrategyRecord(
        "hsdp",
        "HSDP",
        step="FSDP2 shards within each dp_shard group, replicas across dp_replicate all-reduce",
        layout=Layout(dp_replicate="dp_replicate", dp_shard=REST),
        options={
            "dp_replicate": _degree("dp_replicate", "replicas (across nodes, typically)"),
            "reshard_after_forward": _RESHARD,
        },
        **_LAYOUT,
    ),
    StrategyRecord(
        "ddp_pp",
        "DDP×PP",
        step="pipeline stages over pp, each stage's replicas under DDP over dp_replicate",
        layout=Layout(pp="pp", dp_replicate=REST),
        **_STAGED,
    ),
    StrategyRecord(
        "fsdp_pp",
        "FSDP×PP",
        step="pipeline stages over pp, each stage sharded by FSDP2 over dp_shard",
        layout=Layout(pp="pp", dp_shard=REST),
        **_STAGED,
    ),
    StrategyRecord(
        "tp_pp",
        "TP×PP",
        step="pipeline stages over pp, each stage's layers split by tensor parallelism",
        layout=Layout(pp="pp", tp=REST),
        needs_tp_plan=True,
        **{**_STAGED, "options": {**_STAGED["options"], "sequence_parallel": _SEQUENCE}},
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


def default_strategies() -> tuple[str, ...]:
    """What a config without `strategies` sweeps: every strategy of one dimension.
    Layouts run where a config names them (each needs 4 or more devices)."""
    return tuple(r.name for r in _RECORDS if not r.composed)


def device_counts(strategy: str, devices: list[int], options: dict | None = None) -> list[int]:
    """The device counts a strategy is swept over: `single` at one device by definition,
    a layout where its degrees lay the devices out (fsdp_tp with tp 2: 4, 8...)."""
    rec = CATALOG[strategy]
    if rec.fixed_devices:
        return [rec.fixed_devices]
    if rec.composed:
        given = options or {}
        if any(k in rec.options and rec.options[k].problem(k, v) for k, v in given.items()):
            return sorted(set(devices))  # its cells' checks name the option at fault
        opts = {**{k: o.default for k, o in rec.options.items()}, **given}
        return [n for n in sorted(set(devices)) if not rec.layout.problem(rec.name, n, opts)]
    return sorted(set(devices))


def multi_rank(strategies: list[str] | tuple[str, ...] = STRATEGIES) -> list[str]:
    """Strategies that can run as torchrun ranks, hence across nodes."""
    return [s for s in strategies if CATALOG[s].launch != ONE_PROCESS]
