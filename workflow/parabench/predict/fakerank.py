"""One rank of a layout at any world size, on fake tensors: what `parabench advise`
measures, on a laptop, of a run that would need a cluster.

The model is built on the meta device and parallelized there, outside fake mode, as
a cell parallelizes it (tensor parallel over tp, activation checkpointing, FSDP2 over
dp_shard, HSDP over both data dimensions, or FSDP2's `replicate` for DDP), over torch's
`fake` process group at the layout's world size. Then, inside FakeTensorMode, its
storage is made (fake: nothing is allocated) and one training step runs: forward,
backward, optimizer. Measured on that step:

- memory, by torch's own tracker (`_tools.mem_tracker.MemTracker`): this rank's peak
  and what it holds at that peak by category (parameters, gradients, optimizer state,
  activations, temporaries), in the dtypes the step really uses. The optimizer's state
  is made before the step (its first step, on zero gradients), so the step holds it as
  every later step does;
- work, by a dispatch mode below the model: every op's FLOPs (torch's own formulas,
  on each DTensor's local shard: what this rank multiplies) and the bytes it reads and
  writes, what the GPU's roofline prices (predict/advise.py); the FLOPs a checkpointed block's
  recompute adds, apart; and, beside them, what torch.compile would fuse and which GEMMs
  Float8 would convert (FUSED, LINEAR, AMAX, CAST), so one step prices all four ways;
- communication, by the same mode: every collective this rank issues (under fake
  tensors none reaches a process group: torch's Meta kernels answer them), by the mesh
  dimension of its group, in the anatomy's units (calls, and bytes as nccl-tests sizes
  them: the gathered output, the input to reduce).

Why not a real step: a 70B model's rank holds tens of GiB; under fake tensors a step
of one block takes about a second and allocates nothing. Why not a formula: the
tracker sees what the code holds (FSDP's unsharded copies, autocast's casts, the loss's
fp32 logits), which is where formulas go wrong.

A stage of k blocks is measured at a few depths and extended linearly to its real depth,
each part of the step's peak on its own line (`at_blocks`, `extended`, `_parts`):
identical blocks hold and do the same, which tests/test_advise.py checks against a
measurement at full depth.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import math
import os
import pathlib
import signal
import statistics
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor as _DTENSOR
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._python_dispatch import TorchDispatchMode

from parabench import envinfo
from parabench.hardware import gpus
from parabench.hardware.gpus import GPU
from parabench.layout import Layout
from parabench.models import build
from parabench.models.base import Model, fake_mode, quiet_fake
from parabench.ops import BY_C10D
from parabench.predict import allocator
from parabench.process import runtime
from parabench.process.runtime import NamedMesh
from parabench.records import atomic_write_bytes
from parabench.run import peak
from parabench.spec import ModelSpec
from parabench.strategies import checkpointing
from parabench.strategies.parallelize import Parallel, parallelize

AC_LEVELS = ("none", "selective", "full")


@dataclasses.dataclass(frozen=True)
class Probe:
    """What one rank's memory and work depend on: its stage's layout (the pipeline
    degree does not count: a stage is measured as a model of its blocks, Layout.stage),
    its micro-batch, its depth, and the run's precision and optimizer."""

    layout: Layout = Layout()
    micro: int = 1  # samples per micro-batch
    blocks: int = 0  # repeated blocks in the stage; 0: the model's own depth
    precision: str = "bf16"
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", self.layout.stage)

    @property
    def world(self) -> int:
        return self.layout.world

    def replace(self, **changes) -> Probe:
        return dataclasses.replace(self, **changes)


# --- the model at a depth -------------------------------------------------------------

# Where each architecture keeps its number of repeated blocks.
_DEPTH_KEYS = {"gpt": "n_layer", "resmlp": "depth"}


def depth(spec: ModelSpec) -> int | None:
    """The model's number of repeated blocks, where its config says it (None: a model
    whose depth parabench cannot set, measured whole)."""
    sizes = spec.size_dict()
    if spec.arch == "hf":
        from parabench.models.hf import _config, _layers

        return _layers(_config(spec)) or None
    from parabench.models.facts import DEFAULTS

    key = _DEPTH_KEYS.get(spec.arch)
    if key is None:
        return None
    return int(sizes.get(key, DEFAULTS.get(spec.arch, {}).get(key, 0))) or None


def at_depth(spec: ModelSpec, blocks: int) -> ModelSpec:
    """The same model with `blocks` repeated blocks."""
    sizes = spec.size_dict()
    if spec.arch == "hf":
        cfg = dict(sizes.get("config") or {})
        cfg["num_hidden_layers"] = blocks
        return ModelSpec.of("hf", **{**sizes, "config": cfg})
    return ModelSpec.of(spec.arch, **{**sizes, _DEPTH_KEYS[spec.arch]: blocks})


def parameters(spec: ModelSpec) -> int:
    """The model's parameters, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = build(spec, 0)
    return sum(p.numel() for p in model.module.parameters())


# --- counting ---------------------------------------------------------------------------


def _local(x):
    from torch.distributed.tensor import DTensor

    return x._local_tensor if isinstance(x, DTensor) else x


def _tensors(tree) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@functools.cache
def _flop_formulas() -> dict:
    """torch's FLOP formulas, with the CPU attention kernels' (torch has none for
    them), and every attention kernel's causal call at half its square: flash kernels
    skip the masked half."""
    from torch.utils import flop_counter as fc

    formulas = dict(fc.flop_registry)
    aten = torch.ops.aten

    def cpu_fwd(q, k, v, *args, out_val=None, **kwargs):
        return fc.sdpa_flop_count(*map(_shape, (q, k, v)))

    def cpu_bwd(grad, q, k, v, *args, out_val=None, **kwargs):
        return fc.sdpa_backward_flop_count(*map(_shape, (grad, q, k, v)))

    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", cpu_fwd),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", cpu_bwd),
    ):
        if (op := getattr(aten, name, None)) is not None:
            formulas[op] = formula
    return formulas


def _shape(x) -> torch.Size:
    return x.shape if isinstance(x, torch.Tensor) else torch.Size(x)


def _heads_broadcast(func, formula: Callable) -> Callable:
    """An attention op's FLOP formula, its key and value counted at the query's heads:
    a GQA call (Llama 3's 8 key-value heads to 32 query heads, transformers passing
    enable_gqa) broadcasts them in the kernel, and torch's formulas before 2.13 assert
    equal heads ("query/key/value shapes are incompatible", torch 2.10), which failed
    every candidate of a GQA model. torch 2.13's GQA-aware formulas count the query's
    heads throughout, so the count is the same on either (tests/test_advise.py)."""
    names = [a.name for a in func._schema.arguments]
    if not {"query", "key", "value"} <= set(names):
        return formula
    q, k, v = (names.index(n) for n in ("query", "key", "value"))

    def counted(*args, **kwargs):
        # a dispatch mode gets them positionally: they have no defaults
        if max(q, k, v) < len(args):
            args = list(args)
            heads = _shape(args[q])[-3]
            for i in (k, v):
                s = _shape(args[i])
                if s[-3] != heads:  # [batch, heads, sequence, head dim]
                    args[i] = torch.Size((*s[:-3], heads, *s[-2:]))
        return formula(*args, **kwargs)

    return counted


def _is_causal(func, args, kwargs) -> bool:
    """An attention call's `is_causal`, wherever its schema puts it."""
    if "is_causal" in kwargs:
        return bool(kwargs["is_causal"])
    names = [a.name for a in func._schema.arguments]
    i = names.index("is_causal") if "is_causal" in names else -1
    return bool(args[i]) if 0 <= i < len(args) else False


ATTENTION = "attention"
MATMUL = "matmul"
MEMORY = "memory"
# FSDP2's copy of this rank's chunks into its all-gather's buffer: what it moves is the
# chunks (read, and written into the buffer's own slice), whose size dp_shard sets
# (at_shard); not the whole buffer, an output of the op that it leaves to the gather.
CHUNK = "chunk"
_COPY_IN = "fsdp::all_gather_copy_in"
# FSDP2's copies between its collectives' buffers and the unsharded tensors, in its hooks
# (which compile leaves eager): after each all-gather, the gathered buffer into the
# parameters' own (fsdp::split_with_sizes_copy: both sides padded to dp_shard's
# multiple); before each reduce-scatter, the gradients into its input buffer
# (fsdp::chunk_cat: the gradients as they are, the buffer padded). BUFFER: the kernel
# and its padded side, which grows with FSDP's padded total (at_shard); GRADS: the
# same kernel's read of the gradients, whatever dp_shard (its bytes only: no kernel of
# its own). Their outputs are `out` arguments (the ops return nothing).
BUFFER = "buffer"
GRADS = "grads"
_BUFFERED = {"fsdp::split_with_sizes_copy": False, "fsdp::chunk_cat": True}  # reads grads
# FSDP2's cast of its chunks to the compute dtype before each all-gather (mixed
# precision), in place into a buffer of its own: in its hooks, a chunk's size (CHUNK).
# In place, it returns nothing. The only foreach op of a fake step (the optimizer runs
# parameter by parameter: `_optimizer`).
_CAST_CHUNKS = "aten::_foreach_copy_"


# What torch.compile and Float8 would change, recorded beside the eager ops of the same
# step, so that one fake step prices all four ways of running it (Work.seconds):
# - LINEAR: a GEMM of an nn.Linear inside a block (its forward, its input's gradient, its
#   weight's gradient): what torchao's Float8 training converts (torchtitan's converter
#   skips the output head), at the FP8 rate;
# - FUSED: a run of memory-bound ops with no matmul, attention, collective or phase
#   change between them, as the one kernel Inductor makes of it: it reads what came from
#   outside the run and writes what the run does not itself consume;
# - AMAX, CAST: Float8's scaling of each GEMM operand (tensorwise): a read for its
#   absolute maximum, then a read and a one-byte write per element. Under compile the
#   amax fuses into the op that made the operand; the cast, which needs the amax, stays.
LINEAR = "linear"
FUSED = "fused"
AMAX = "amax"
CAST = "cast"
_GEMMS = frozenset({"aten::mm", "aten::addmm"})  # what nn.Linear's forward and backward call
# autocast's cast of a weight to the compute dtype: made again as a checkpoint recomputes
_CAST = "aten::_to_copy"


Op = tuple[str, str, int, int]  # phase, kind, FLOPs, bytes moved
# A micro-batch's forward, and its backward; a checkpointed block's forward again inside
# that backward; the update. STEP: the forward and the backward together.
FORWARD, BACKWARD, RECOMPUTE, OPTIMIZER = "forward", "backward", "recompute", "optimizer"
STEP = "step"
_PHASES = {STEP: (FORWARD, BACKWARD)}


@dataclasses.dataclass
class Work:
    """What a step does on one rank: its ops, each with its FLOPs and bytes (so that a
    roofline prices each at its own bound), counted; its collectives by mesh dimension."""

    ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    comm_by_dim: dict[str, dict[str, dict[str, float]]] = dataclasses.field(default_factory=dict)
    # of the forward's and backward's FLOPs, those the repeated blocks ran (`measure`):
    # a pipeline's GPU runs its share of them, and the embedding's and head's once
    # between the stages, where its measured stage runs both (advise.predict's MFU)
    block_flops: float = 0.0

    def flops(self, phase: str | None = None) -> float:
        return sum(f * n for (p, _, f, _), n in self.ops.items() if _in(p, phase))

    def op_count(self, phase: str | None = None) -> float:
        """The eager step's kernels."""
        return sum(
            n
            for (p, kind, *_), n in self.ops.items()
            if _in(p, phase) and _runs(kind, p) and kind != GRADS
        )

    @property
    def recompute_flops(self) -> float:
        return self.flops(RECOMPUTE)

    def seconds(
        self, gpu: GPU, phase: str | None = None, compiled: bool = False, float8: bool = False
    ) -> float:
        """Its ops' time on `gpu`, each at its own roofline bound (GPU.op_time): eager,
        or as torch.compile fuses its memory-bound ops, with or without Float8 linears."""
        return sum(
            n
            * (
                nbytes / gpu.bandwidth  # a part of a BUFFER kernel: its bytes, no floor
                if kind == GRADS
                else gpu.op_time(flops, nbytes, kind == ATTENTION, float8 and kind == LINEAR)
            )
            for (p, kind, flops, nbytes), n in self.ops.items()
            if _in(p, phase) and _runs(kind, p, compiled, float8)
        )


def _runs(kind: str, phase: str, compiled: bool = False, float8: bool = False) -> bool:
    """Whether an op of `kind` runs as a kernel of its own: compile runs the fused runs
    in place of the memory-bound ops of the forward and backward (the optimizer is not
    compiled: torchtitan compiles the blocks), and Float8 adds its operands' scaling."""
    if kind == FUSED:
        return compiled
    if kind == MEMORY and phase != OPTIMIZER:
        return not compiled
    if kind == AMAX:
        return float8 and not compiled
    if kind == CAST:
        return float8
    return True


def _in(p: str, phase: str | None) -> bool:
    """Whether an op booked under phase `p` counts in `phase` (None: all; STEP: the
    forward and the backward)."""
    return phase is None or p == phase or p in _PHASES.get(phase, ())


class Counting(TorchDispatchMode):
    """Every op of a step, as one rank runs it (see the module's docstring)."""

    def __init__(self, dims: dict[str, str], gathers_weights: bool = False) -> None:
        super().__init__()
        self.work = Work()
        self.dims = dims  # process group -> mesh dimension name
        self.phase = STEP  # the micro-batch's (forward or backward, as autograd says)
        self.inside = False  # in DTensor's dispatch of an op (see _dtensor_op)
        # Float8: FSDP gathers its weights already cast (torchtitan's
        # enable_fsdp_float8_all_gather), so only activations and gradients are scaled
        self.gathers_weights = gathers_weights
        # the nn.Linear forwards running (`linears`), innermost last: whether Float8
        # converts each (a block's) or not (the head)
        self.linear: list[bool] = []
        # the storages of the weights they multiplied by, weakly (see _Run), and whether
        # converted; the converted ones' local shapes, both ways (their gradients')
        self.weights: dict[int, tuple[weakref.ref, bool]] = {}
        self.weight_shapes: set[tuple[int, ...]] = set()
        # the nn.Linear weights' own storages (`linears`), whose autocast copies are
        # weights too: the recompute's, which no forward hook sees (Counting._linear)
        self.params: dict[int, tuple[weakref.ref, bool]] = {}
        self.run: _Run | None = None  # the memory-bound ops since the last other kernel
        # which part of the step an op runs in (`_parts`, where `measure` sets it)
        self.where: Callable[[], tuple[str, str]] | None = None

    def __exit__(self, *exc):
        if not self.inside:  # not _handled's own push of this mode
            self.end_run()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:  # a query (see _DEVICE): no work
            return func(*args)
        kwargs = kwargs or {}
        name, moves, formula = _op(func)
        collective = name.startswith(("c10d::", "_c10d_functional"))
        if self.inside:  # a DTensor op's own local ops: counted at the DTensor op
            out = func(*args, **kwargs)
            if collective:
                self._collective(func, name, args, kwargs, out)
            return out
        handler = _DTENSOR._op_dispatcher._custom_op_handlers.get(func)
        if handler is not None and _DTENSOR in types:
            out = self._handled(handler, func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if collective:
            self.end_run()
            self._collective(func, name, args, kwargs, out)
            return out
        if name == _COPY_IN:
            self.end_run()
            chunks = sum(_nbytes(_local(t)) for t in _tensors(args[0]))  # its inputs
            self.work.ops[(self._phase(), CHUNK, 0, 2 * chunks)] += 1
            return out
        if name == _CAST_CHUNKS:
            self.end_run()
            moved = sum(_nbytes(_local(t)) for t in _tensors(args[:2]))  # into, from
            self.work.ops[(self._phase(), CHUNK, 0, moved)] += 1
            return out
        if (grads := _BUFFERED.get(name)) is not None:
            self.end_run()
            read = sum(_nbytes(_local(t)) for t in _tensors(args))
            written = sum(_nbytes(_local(t)) for t in _tensors(kwargs.get("out")))
            phase = self._phase()
            self.work.ops[(phase, BUFFER, 0, written + (0 if grads else read))] += 1
            if grads:
                self.work.ops[(phase, GRADS, 0, read)] += 1
            return out
        outs = _tensors(out) if moves else []
        if not outs:
            return out  # no data moved: aliases, metadata, allocation without a fill
        ins = [_local(t) for t in _tensors((args, kwargs))]
        outs = [_local(t) for t in outs]
        moved = sum(_nbytes(t) for t in [*ins, *outs])
        phase = self._phase()
        if formula is None:
            self.work.ops[(phase, MEMORY, 0, moved)] += 1
            if phase != OPTIMIZER:
                self._fuse(phase, ins, outs)
            if name == _CAST and ins and (e := _live(self.params, ins[0].untyped_storage())):
                st = outs[0].untyped_storage()
                self.weights[st._cdata] = (weakref.ref(st), e[1])
            return out
        self.end_run()
        local_args = [_local(a) if isinstance(a, torch.Tensor) else a for a in args]
        local_kwargs = {
            k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()
        }
        local_out = out if not isinstance(out, torch.Tensor) else _local(out)
        flops = int(formula(*local_args, out_val=local_out, **local_kwargs))
        kind = ATTENTION if "attention" in name else MATMUL
        if kind == ATTENTION and _is_causal(func, args, kwargs):
            flops //= 2
        operands = [a for a in local_args if isinstance(a, torch.Tensor)][-2:]
        if name in _GEMMS and self._linear(phase, operands, outs[0]):
            kind = LINEAR
            self._scaling(phase, operands, outs[0])
        self.work.ops[(phase, kind, flops, moved)] += 1
        if phase in (FORWARD, BACKWARD) and self.where and self.where()[1] in _BLOCK_PARTS:
            self.work.block_flops += flops
        return out

    def _weight(self, t: torch.Tensor) -> bool | None:
        """Whether `t` is a weight an nn.Linear multiplied by in its forward: converted
        (True) or not (False); None: no weight."""
        e = _live(self.weights, t.untyped_storage())
        return e[1] if e is not None else None

    def _linear(self, phase: str, operands, out: torch.Tensor) -> bool:
        """Whether a GEMM is a converted nn.Linear's: inside one's forward (its weight,
        the second operand, noted), or later with such a weight (recomputed, its input's
        gradient: FSDP2 gathers into the same storage each time), or, with no weight,
        making a converted weight's shape (its weight's gradient)."""
        b = operands[1]
        if self.linear and phase == FORWARD:
            st = b.untyped_storage()
            self.weights[st._cdata] = (weakref.ref(st), self.linear[-1])
            if self.linear[-1]:
                self.weight_shapes.update((tuple(b.shape), tuple(b.shape)[::-1]))
            return self.linear[-1]
        if (weight := self._weight(b)) is not None:
            return weight
        return tuple(out.shape) in self.weight_shapes

    def _scaling(self, phase: str, operands, out: torch.Tensor) -> None:
        """Float8's scaling of a linear GEMM's operands (AMAX, CAST)."""
        weight = operands[1] if self._weight(operands[1]) else None
        for t in operands:
            if self.gathers_weights and t is weight:
                continue  # gathered in Float8 (its chunk cast before the gather)
            self.work.ops[(phase, AMAX, 0, _nbytes(t))] += 1
            self.work.ops[(phase, CAST, 0, _nbytes(t) + t.numel())] += 1

    def _fuse(self, phase: str, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """A memory-bound op joins the run compile would fuse it into (FUSED)."""
        if self.run is not None and self.run.phase != phase:
            self.end_run()
        if self.run is None:
            self.run = _Run(phase)
        self.run.add(ins, outs)

    def end_run(self) -> None:
        """The run of memory-bound ops ends: booked as one fused kernel."""
        if self.run is not None:
            self.work.ops[(self.run.phase, FUSED, 0, self.run.bytes())] += 1
            self.run = None

    def _phase(self) -> str:
        if checkpointing.recomputing():
            return RECOMPUTE
        if self.phase != STEP:
            return self.phase
        # in autograd's engine: the backward (a graph task runs)
        return BACKWARD if torch._C._current_graph_task_id() != -1 else FORWARD

    def _handled(self, handler, func, args, kwargs):
        """A DTensor op that DTensor hands to a handler of its own (loss_parallel's
        reductions over the vocabulary), run with this mode pushed again, so that the
        collectives it issues are counted too: below a mode's own handler that mode sees
        nothing, and a real rank's group counts them all. The ops of DTensor's common
        path (its sharding's redistributions) stay unseen (tests/test_parallelize.py
        finds none in the layouts it runs)."""
        was, self.inside = self.inside, True
        try:
            with self:
                return handler(func, args, kwargs)
        finally:
            self.inside = was

    def _collective(self, func, name, args, kwargs, out) -> None:
        from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops

        op = BY_C10D.get(name)
        if op is None or func not in collective_ops:
            return  # wait_tensor, barriers: no bytes
        group = CollectiveOp.get_process_group(func, args)
        dim = self.dims.get(group.group_name, "world")
        nbytes = CollectiveOp.get_comm_tensor_size(func, out, args, kwargs)
        entry = self.work.comm_by_dim.setdefault(dim, {}).setdefault(
            op.name, {"count": 0.0, "bytes": 0.0}
        )
        entry["count"] += 1
        entry["bytes"] += nbytes


class _Run:
    """The memory-bound ops compile would fuse into one kernel (Counting._fuse), by
    storage: what the run reads from outside it, and what it writes. A storage is
    known by a weak reference, so that one freed and another made at its address are
    two (holding them would move the tracker's peak)."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.read: dict[int, tuple[weakref.ref, int]] = {}
        self.written: dict[int, tuple[weakref.ref, int]] = {}  # live: storage -> entry
        self.entries: list[list] = []  # [bytes, read back inside the run, the storage]

    def add(self, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        for t in ins:
            st = t.untyped_storage()
            if (e := _live(self.written, st)) is not None:
                self.entries[e[1]][1] = True
            elif _live(self.read, st) is None:
                self.read[st._cdata] = (weakref.ref(st), _nbytes(t))
        for t in outs:
            st = t.untyped_storage()
            if (e := _live(self.written, st)) is not None:
                self.entries[e[1]][0] = max(self.entries[e[1]][0], _nbytes(t))
            else:
                self.written[st._cdata] = (weakref.ref(st), len(self.entries))
                self.entries.append([_nbytes(t), False, weakref.ref(st)])

    def bytes(self) -> int:
        """Its reads from outside, and its writes that leave it: those it does not read
        back itself, and those still held when it ends (by the code after it, or saved
        for the backward); an intermediate it reads back and drops stays in registers."""
        kept = sum(n for n, back, ref in self.entries if not back or ref() is not None)
        return sum(n for _, n in self.read.values()) + kept


def _live(table: dict[int, tuple], st: torch.UntypedStorage) -> tuple | None:
    """`table`'s entry for storage `st` (by address, its weak reference first), if it is
    `st`'s and not a freed storage's whose address `st` took."""
    e = table.get(st._cdata)
    return e if e is not None and e[0]() is st else None


# A fake tensor's device, asked of it through every mode (FakeTensor dispatches its
# device): most of the ops a fake step dispatches (8,500 of 12,300 in a GPT-2 rank's
# step, most from autograd's checks), none of them work or an allocation.
_DEVICE = torch.ops.prim.device.default


@functools.cache
def _op(func) -> tuple[str, bool, object]:
    """What Counting reads of an op, once per op rather than once per call: its name,
    whether it can move data (not a view, a metadata op or an allocation: _FREE), and
    its FLOP formula, if torch has one."""
    name = func._schema.name
    moves = not (func.is_view or name in _FREE or name.startswith("prim::"))
    formulas = _flop_formulas()
    formula = formulas.get(func) or formulas.get(func._overloadpacket)
    # the [batch, heads, sequence, head dim] kernels (not the lower-level
    # _flash_attention_forward's [batch, sequence, heads, head dim])
    if formula is not None and name.startswith("aten::_scaled_dot_product_"):
        formula = _heads_broadcast(func, formula)
    return name, moves, formula


# Ops that move no data (allocation without a fill, metadata).
_FREE = frozenset(
    {
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::new_empty",
        "aten::new_empty_strided",
        "aten::detach",
        "aten::lift_fresh",
        "aten::_local_scalar_dense",
        "aten::_unsafe_view",
        "aten::set_",
        "aten::resize_",
        "aten::record_stream",
    }
)


# --- one measurement -------------------------------------------------------------------


class Shard(NamedTuple):
    """One FSDP parameter as FSDP2 shards it (`_fsdp_param.FSDPParam`): the rows of the
    tensor it splits (dim 0 of the tp-local tensor), the elements in a row, and the bytes
    per element of its sharded copy and of its optimizer state. Rank 0 holds the first
    chunk, ceil(rows / dp_shard) rows (torch.chunk's), padded in its storage alike."""

    rows: int
    row_elements: int
    param_bytes: int
    opt_bytes: int


@dataclasses.dataclass
class Measured:
    """One rank's step at a shape and depth (see the module's docstring)."""

    peak_bytes: int
    by_category: dict[str, int]  # at the peak: parameters, gradients, ...
    work: Work
    boundary_bytes: int  # one micro-batch's activations leaving the last block
    blocks: int
    # what the forward made and still holds as it ends, parameters aside: what a
    # micro-batch in flight holds (PeakTracker.in_flight)
    saved_bytes: int = 0
    block_saved_bytes: int = 0  # of which the repeated blocks made (not the head's)
    extended_from: tuple[int, int] | None = None  # the depths it was extended from
    # FSDP's sharded parameters, by shape (Shard: how many), and the dp_shard they were
    # measured at: what `at_shard` derives another dp_shard's rank from
    shards: dict[Shard, float] = dataclasses.field(default_factory=dict)
    sharded_at: int = 1
    # what CUDA's caching allocator would reserve by the step's end (allocator.replay
    # of the tracker's events); extended and derived ranks keep the measured reserve
    # over the peak
    reserved_bytes: int = 0
    derived_from: int = 0  # the dp_shard it was derived from (at_shard); 0: measured
    # its parameters' elements, and of them the blocks' nn.Linear weights' (Float8's)
    params: int = 0
    linear_params: int = 0
    # each part of the step's peak, and its categories (`_parts`): the step's peak is
    # the largest; `extended` extends each
    parts: dict[tuple[str, str], tuple[int, dict[str, int]]] = dataclasses.field(
        default_factory=dict
    )
    # of `saved_bytes`, what the forward made before the blocks (the embedding's output,
    # the positions): a pipeline's first stage holds it for each micro-batch in flight
    input_saved_bytes: int = 0
    # of a measured FSDP rank, each part of the backward and optimizer: the moments
    # that could be its peak at another dp_shard, as (total, categories, the chunks of
    # gradients held: ((Shard, bytes per element), how many) pairs, the optimizer's
    # temporaries' bytes) (`_frontiers`)
    frontiers: dict[tuple[str, str], tuple[tuple[int, dict[str, int], tuple, int], ...]] = (
        dataclasses.field(default_factory=dict)
    )

    @property
    def linear_share(self) -> float:
        return self.linear_params / self.params if self.params else 0.0


@contextlib.contextmanager
def _fake_world(size: int, local: bool = False) -> Iterator[None]:
    """Rank 0 of a world of `size` over torch's `fake` process group, or, `local`, over
    parabench's (process/nocomm.py: each collective fills its output from this rank's
    own data, so a real step computes on finite values; none waits). Within
    `kept_worlds`, the world of the last rank of this size and kind, where it was one."""
    if _KEPT is not None:
        if _KEPT.world != (size, local):
            if _KEPT.world:
                _KEPT.world, _KEPT.meshes = None, {}  # ended, whatever comes next
                _end_world()
            _begin_world(size, local)
            _KEPT.world = (size, local)
        yield
        return
    _begin_world(size, local)
    try:
        yield
    finally:
        _end_world()


def _begin_world(size: int, local: bool) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from parabench.process import nocomm

    if dist.is_initialized():
        raise RuntimeError("fakerank: a process group is already initialised here")
    # init_process_group wraps sys.excepthook to prefix "[rank0]:", again at each call:
    # a search's hundreds of worlds would prefix a traceback hundreds of times.
    hook = sys.excepthook
    try:
        if local:
            dist.init_process_group(nocomm.BACKEND, store=dist.HashStore(), rank=0, world_size=size)
        else:
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    finally:
        sys.excepthook = hook


def _end_world() -> None:
    dist.destroy_process_group()
    runtime.forget_meshes()


@dataclasses.dataclass
class _Kept:
    """The world `kept_worlds` keeps, (size, local), and its meshes by their dimensions
    and degrees."""

    world: tuple[int, bool] | None = None
    meshes: dict = dataclasses.field(default_factory=dict)


_KEPT: _Kept | None = None  # None: each rank its own world


@contextlib.contextmanager
def kept_worlds() -> Iterator[None]:
    """Ranks measured or timed within share one world while their size and kind stay
    the same, and one mesh per shape in it: DTensor's sharding plans, cached by mesh,
    then serve every later rank of the shape (a search: a third of a TP rank's fake
    step went to making them again). A new world's meshes are named apart from the last
    one's, whose plans are dropped with it (runtime.forget_meshes)."""
    global _KEPT
    if _KEPT is not None:  # already within
        yield
        return
    _KEPT = _Kept()
    try:
        yield
    finally:
        kept, _KEPT = _KEPT, None
        if kept.world and dist.is_initialized():
            _end_world()


_BUILT = itertools.count()


def _mesh(layout: Layout) -> NamedMesh | None:
    from torch.distributed.device_mesh import init_device_mesh

    dims = layout.declared()
    if not dims:
        return None
    shape = tuple(layout.degrees[d] for d in dims)
    if _KEPT is not None and (dims, shape) in _KEPT.meshes:
        mesh, tag = _KEPT.meshes[dims, shape]
        return NamedMesh(mesh, layout, tag)
    # Named apart from every other mesh: DeviceMesh compares equal by its ranks and
    # names, and torch's caches (DTensor's plans, a mesh's flattened groups) would hand
    # this one another's groups, of a world destroyed since or, in a kept world, of
    # another layout's mesh whose submesh holds the same ranks (predict/rank_alone.py's
    # _BUILT, alike).
    tag = f"_{next(_BUILT)}"
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=tuple(d + tag for d in dims))
    if _KEPT is not None:
        _KEPT.meshes[dims, shape] = (mesh, tag)
    return NamedMesh(mesh, layout, tag)


def _optimizer(module: nn.Module, probe: Probe) -> torch.optim.Optimizer:
    params = [p for p in module.parameters() if p.requires_grad]
    # foreach=False: under fake tensors, foreach over DTensors reports transient
    # global-size buffers (docs/design/advise.md); the per-parameter loop's are exact.
    if probe.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, foreach=False)
    return torch.optim.SGD(params, lr=1e-4, foreach=False)


def initial_state(opt: torch.optim.Optimizer) -> None:
    """The state `opt` holds from its first step on, which torch makes lazily in that
    step: AdamW's two moments, zeros like each parameter (a DTensor like a DTensor), and
    its step count on the CPU, as Adam._init_group makes them; SGD without momentum
    holds none. Made directly: a step's arithmetic over fake DTensors was a fifth of a
    measurement (tests/test_advise.py checks this against the state a step makes)."""
    if not isinstance(opt, torch.optim.AdamW):
        if not isinstance(opt, torch.optim.SGD) or any(g["momentum"] for g in opt.param_groups):
            raise TypeError(f"fakerank: no initial state known for {type(opt).__name__}")
        return
    for group in opt.param_groups:
        if group["amsgrad"] or group["fused"] or group["capturable"]:
            raise TypeError("fakerank: AdamW's initial state is known without amsgrad, fused")
        for p in group["params"]:
            opt.state[p] = {
                "step": torch.tensor(0.0),  # the default dtype, torch's scalar dtype
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }


@dataclasses.dataclass
class Rank:
    """One rank of a layout, built and ready to step (`rank`)."""

    model: Model
    optimizer: torch.optim.Optimizer
    batch: tuple[torch.Tensor, torch.Tensor]
    probe: Probe
    par: Parallel
    dims: dict[str, str]  # process group name -> its mesh dimension
    boundary: list[int]  # set by the last block's forward: bytes leaving it

    @property
    def module(self) -> nn.Module:
        return self.model.module


@contextlib.contextmanager
def rank(spec: ModelSpec, probe: Probe, fake: bool = True, local: bool = False) -> Iterator[Rank]:
    """Rank 0 of `probe`'s layout over torch's fake process group at its world size:
    built on the meta device, parallelized there by the cells' own `parallelize`, then
    given storage: fake (nothing allocated) or, `fake` False, real
    (tests/test_advise.py checks one against the other). The optimizer's state is made,
    as every step after the first holds it (`initial_state`). `local`: over parabench's
    own group instead, built as a cell builds its rank (`timed`): on real storage from
    the start, with the model's own initial values, and DDP as torch's
    DistributedDataParallel, which needs real storage to build (a fake rank's DDP is
    FSDP2's `replicate`, as torchtitan's)."""
    if probe.blocks:
        spec = at_depth(spec, probe.blocks)
    with _fake_world(probe.world, local), quiet_fake():
        mesh = _mesh(probe.layout)
        with contextlib.nullcontext() if local else torch.device("meta"):
            model = build(spec, 0)
        model.module.train()
        par = parallelize(
            model,
            probe.layout,
            mesh,
            precision=probe.precision,
            device=torch.device("cpu") if local else None,
            fake=not local,
        )
        dims = {g.group_name: d for d, g in mesh.groups().items()} if mesh else {}
        boundary = [0]
        # the repeated blocks: a sequential model's children are its blocks, the
        # embedding and head among them (models/base.py)
        if blocks := checkpointing.repeated(model.blocks()):
            blocks[-1].register_forward_hook(
                lambda m, a, out: boundary.__setitem__(
                    0, sum(_nbytes(_local(t)) for t in _tensors(out))
                )
            )
        with fake_mode() if fake else contextlib.nullcontext():
            if not local:
                model.module.to_empty(device="cpu")
            opt = _optimizer(model.module, probe)
            initial_state(opt)
            batch = model.batch(probe.micro, torch.Generator().manual_seed(0))
            yield Rank(model, opt, batch, probe, par, dims, boundary)


def step(
    r: Rank, counting: Counting | None = None, lap: Callable[[str], None] | None = None
) -> None:
    """One training step of the rank: forward, backward, optimizer (the optimizer's ops
    booked as its own phase where `counting`; `lap(phase)` called as each phase ends)."""
    # FSDP's mixed precision casts the parameters; without it, autocast (parallelize)
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16) if r.par.autocast else contextlib.nullcontext()
    )
    lap = lap or (lambda phase: None)
    x, y = r.batch
    with autocast:
        out = r.par.root(x)
    with loss_parallel() if r.par.split_loss else contextlib.nullcontext():
        # the loss is held through the optimizer, as a cell's train_step holds it
        loss = r.model.loss_fn(out, y)
        lap(FORWARD)
        loss.backward()
    lap(BACKWARD)
    if counting is not None:
        counting.phase = OPTIMIZER
    r.optimizer.step()
    r.optimizer.zero_grad(set_to_none=True)
    lap(OPTIMIZER)


def timed(spec: ModelSpec, probe: Probe, ranks: int = 1) -> dict[str, float]:
    """`_timed_here` (see there), in a fresh process where a process forked from this
    one cannot run a backward: before torch 2.13, once this process has run one on fake
    tensors (a fake rank's step) or through DTensors (FSDP's, TP's), autograd refuses it
    in every fork ("Unable to handle autograd's threading in combination with
    fork-based multiprocessing"), and the copies stepping beside the timed rank would
    die. A process that multiprocessing's forkserver forks is a child of a new Python,
    which has run no backward. Either way the copies are forked before the timed rank's
    first step, so that what the probe found still holds when they are."""
    if ranks < 2 or _forks_run_autograd():
        return _timed_here(spec, probe, ranks)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    # its workers are no daemons, so they may fork the copies; bound to this process's
    # cores, not the forkserver's
    cores = sorted(os.sched_getaffinity(0))
    with ProcessPoolExecutor(1, ctx, initializer=os.sched_setaffinity, initargs=(0, cores)) as one:
        try:
            return one.submit(_timed_here, spec, probe, ranks).result()
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
            raise RuntimeError(f"fakerank.timed, in a fresh process: {why}") from e


_FORKS_REFUSE = False  # once refused, for good: nothing undoes a backward


def _forks_run_autograd(timeout_s: float = 30.0) -> bool:
    """Whether a process forked from this one can run a backward (see `timed`): asked
    of a forked child, since no torch API tells; a child that has not answered within
    `timeout_s` (stuck on a lock another thread held at the fork) says no."""
    global _FORKS_REFUSE
    if _FORKS_REFUSE:
        return False
    pid = os.fork()
    if pid == 0:  # the child: exit at once, whatever happens, running nothing else
        code = 1
        try:
            x = torch.ones(1, requires_grad=True)
            (x * 2).sum().backward()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout_s
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            done = os.waitpid(pid, 0)
            break
        time.sleep(0.005)
    _FORKS_REFUSE = done[1] != 0
    return not _FORKS_REFUSE


def _timed_here(spec: ModelSpec, probe: Probe, ranks: int = 1) -> dict[str, float]:
    """Seconds of each phase of the rank's step (FORWARD with the loss, BACKWARD with
    any recompute, OPTIMIZER), run on this host's CPU on real tensors, its collectives
    returning at once on its own data, after a warm-up (loop's ALONE_WARMUP; the rank
    is the layout advise prices, built by `parallelize` as a cell builds it: `rank`'s
    `local`; rank_alone times a cell's own strategy).

    As `ranks` ranks of a cell run on this host: each process bound to its share of the
    cores (runtime.share), the rank timed with as many intra-op threads while the
    others step beside it (copies of it forked before its first step, `timed`; one
    thread each: GNU OpenMP does not
    survive a fork, and a copy with more than one core's share shares none with the
    timed rank), so that ranks sharing a core take turns, and contend for its caches,
    as a cell's do. So each phase is the mean over at least ALONE_STEPS steps and
    _WINDOW_S seconds, turns and all, where a rank alone takes the median. What
    `this-machine` knows of a rank's compute where the rank fits here
    (predict/advise.py: a CPU's cost per op is mostly the host's work around it, which
    no roofline holds)."""
    import multiprocessing

    from parabench.run.loop import ALONE_STEPS, ALONE_WARMUP

    cores = sorted(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    laps: list[dict[str, float]] = []
    fork = multiprocessing.get_context("fork")
    stop, others = fork.Event(), []
    # each copy's steps, counted where the timed rank reads them: every copy must step
    # while it is timed, or it was timed beside fewer ranks than it says
    steps = fork.Array("q", max(ranks - 1, 1), lock=False)
    mine = runtime.share(0, ranks, cores)
    try:
        # its threads from the start, as a cell's: none left spinning from a wider pool
        torch.set_num_threads(len(mine))
        with rank(spec, probe, fake=False, local=True) as r:
            for i in range(1, ranks):
                args = (r, runtime.share(i, ranks, cores), os.getpid(), steps, i - 1, stop)
                others.append(fork.Process(target=_beside, args=args, daemon=True))
                others[-1].start()
            _stepping(others, steps, _BESIDE_START_S)
            _bind(mine)
            for _ in range(ALONE_WARMUP):
                step(r)
            began = steps[: len(others)]
            start = time.perf_counter()
            while len(laps) < ALONE_STEPS or time.perf_counter() - start < _WINDOW_S:
                got, t0 = {}, [time.perf_counter()]

                def lap(phase: str, got=got, t0=t0) -> None:
                    now = time.perf_counter()
                    got[phase], t0[0] = now - t0[0], now

                step(r, lap=lap)
                laps.append(got)
            # each copy stepped at least once more since its timed steps began
            _stepping(others, steps, _BESIDE_START_S, began)
    finally:
        try:
            stop.set()
            deadline = time.monotonic() + _BESIDE_START_S  # for all of them, not each
            for proc in others:
                proc.join(timeout=max(deadline - time.monotonic(), 0.0))
        finally:
            for proc in others:
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            _bind(cores)
            torch.set_num_threads(before)
    if failed := [p.exitcode for p in others if p.exitcode != 0]:
        raise RuntimeError(f"fakerank.timed: ranks beside it ended with exit codes {failed}")
    return {p: statistics.fmean(t[p] for t in laps) for p in (FORWARD, BACKWARD, OPTIMIZER)}


def _stepping(others: list, steps, timeout_s: float, since: list[int] | None = None) -> None:
    """Wait until each copy in `others` has stepped (its count past `since`'s, or past
    0: its first step begun), failing at once where one has died."""
    since = since or [0] * len(others)
    deadline = time.monotonic() + timeout_s
    while any(steps[i] <= since[i] for i in range(len(others))):
        if dead := [p.exitcode for p in others if p.exitcode is not None]:
            raise RuntimeError(f"fakerank.timed: a rank beside it died (exit codes {dead})")
        if time.monotonic() > deadline:
            raise RuntimeError("fakerank.timed: a rank beside it did not step")
        time.sleep(0.001)


# Seconds a forked rank may take to start, or to stop.
_BESIDE_START_S = 60.0
# The least time the timed steps span: ranks sharing a core take turns in the
# scheduler's slices (milliseconds), so a window of a few short steps could fall
# within one slice and never see the others' turns.
_WINDOW_S = 0.1


def _bind(cores: list[int]) -> None:
    """Bind every thread of this process to `cores`: sched_setaffinity(0) binds the
    calling thread only, and the intra-op threads already started would keep theirs."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that has ended since
            os.sched_setaffinity(int(tid), cores)


def _beside(r: Rank, cores: list[int], parent: int, steps, i: int, stop) -> None:
    """A forked copy of the timed rank, bound to `cores` with one thread, stepping until
    told to stop or its parent is gone, counting its steps begun in steps[i] (`timed`)."""
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(1)
    while not stop.is_set() and os.getppid() == parent:
        steps[i] += 1
        step(r)


@contextlib.contextmanager
def linears(module: nn.Module, blocks: list[nn.Module], counting: Counting) -> Iterator[float]:
    """Tell `counting` when an nn.Linear runs its forward, and whether Float8 converts
    it: a block's, not the head's (Counting._linear); yields the converted weights'
    elements (what FSDP's Float8 all-gather sends at a byte each)."""
    converted = {id(m) for b in blocks for m in b.modules() if isinstance(m, nn.Linear)}
    mods = [m for m in module.modules() if isinstance(m, nn.Linear)]

    # not while a checkpoint recomputes: it stops a block's forward early, once it
    # has what the backward needs, so a Linear's post-hook may never run there
    def enter(m: nn.Module, *_) -> None:
        if not checkpointing.recomputing():
            counting.linear.append(id(m) in converted)
            # the weight it runs with (FSDP's unsharded one), which autocast casts
            st = _local(m.weight).untyped_storage()
            counting.params[st._cdata] = (weakref.ref(st), id(m) in converted)

    def leave(*_) -> None:
        if not checkpointing.recomputing():
            counting.linear.pop()

    handles = [
        h
        for m in mods
        for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))
    ]
    try:
        yield sum(m.weight.numel() for m in mods if id(m) in converted)
    finally:
        for h in handles:
            h.remove()


def local_bytes(t: torch.Tensor) -> int:
    """A tensor's bytes on this rank (a DTensor's local shard)."""
    return _nbytes(_local(t))


# Depth of DTensor's sharding propagation on this thread's stack (see _shadows).
_SHADOW = threading.local()


@functools.cache
def _shadows() -> None:
    """Mark DTensor's sharding propagation while it runs. To learn an op's output
    strides it runs the op on fake tensors of the global shape (torch calls them
    "shadow" tensors), inside the active fake mode, so a tracker's mode sees them as
    allocations: a 70B TP rank's logits counted whole, 63 GiB twice over, where the
    rank holds 1/8 of them. A real run allocates none of them."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    meta = ShardingPropagator._propagate_tensor_meta_non_cached

    @functools.wraps(meta)
    def marked(self, op_schema):
        _SHADOW.depth = getattr(_SHADOW, "depth", 0) + 1
        try:
            return meta(self, op_schema)
        finally:
            _SHADOW.depth -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = marked


def _in_shadow() -> bool:
    return getattr(_SHADOW, "depth", 0) > 0


@functools.cache
def _tracker_class() -> type:
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    _shadows()

    class PeakTracker(MemTracker):
        """torch's MemTracker keeping its step-wide peak and each part's (`where`,
        `_parts`) only: its per-module peaks, which advise reads none of, cost a pass
        over every module after every op (a third of a fake step). Its snapshots at
        each module's end of forward stay. It logs every storage made, resized and
        freed, in order (`events`), for the caching allocator's model
        (predict/allocator.py)."""

        def __init__(self) -> None:
            super().__init__()
            self.events: list[tuple[str, int, int]] = []
            # the peak of each part of the step (`where`: which part an op runs in),
            # with its categories: what `extended` extends part by part
            self.where: Callable[[], tuple[str, str]] | None = None
            self.part_peaks: dict[tuple[str, str], tuple[int, dict]] = {}
            # each storage the forward makes, by its info (held: an id is not reused),
            # with the part that made it (`in_flight`)
            self.made: dict[int, tuple[object, str]] = {}
            # where set (a list), every moment of the backward and the optimizer: its
            # part, total, events so far and categories (`_frontiers`)
            self.series: list | None = None

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            kind = u_type.name
            if kind == "ADD" and self.where is not None:
                phase, part = self.where()
                if phase == FORWARD:
                    self.made[id(winfo)] = (winfo, part)
            if kind == "ADD" or (kind == "SIZE" and winfo.mem_consumed > 0):
                self.events.append(("malloc", id(winfo), winfo.mem_consumed))
            elif kind in ("DEL", "SIZE"):
                self.events.append(("free", id(winfo), 0))

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # a device query (_DEVICE) makes no tensor and frees none: nothing to track,
            # and the peak cannot move (every op that allocates updates it as it runs);
            # nor do DTensor's shadow tensors exist on the rank (_shadows)
            if func is _DEVICE or _in_shadow():
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def in_flight(self, module: nn.Module) -> tuple[int, int, int]:
            """What the forward made that is still held as it ends (call it there),
            the parameters aside (FSDP's unsharded copies, which ZeRO-2 keeps): in all,
            of it what the repeated blocks made, and what the forward made before them.
            A pipeline's stage holds this for each micro-batch in flight, whatever it
            holds once; autocast's bf16 copies of the weights count, as each
            micro-batch of a stage makes and saves its own (its autocast is entered per
            micro-batch: strategies/pipeline.py). Why not the tracker's activations:
            its categories move a storage to the parameters when a module first uses
            it, so FSDP's gathers into one block and frees of another made a block's
            activations negative under full checkpointing."""
            params = {id(st) for p in module.parameters() for st in get_untyped_storages(_local(p))}
            held = [
                (winfo.mem_consumed, self.made[id(winfo)][1])
                for st, (winfo, _) in list(self._WINFO.items())
                if id(winfo) in self.made and id(st) not in params
            ]
            self.made = {}  # nothing later is asked of it
            blocks = sum(n for n, part in held if part in _BLOCK_PARTS)
            before = sum(n for n, part in held if part == "before")
            return sum(n for n, _ in held), blocks, before

        def _update_peak_stats(self, peak_state) -> None:
            part = self.where() if self.where is not None else None
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)
                # one device (a rank's), as `measure` reads the peak
                if part is not None and self.part_peaks.get(part, (-1,))[0] < snap[_TOTAL_KEY]:
                    self.part_peaks[part] = (snap[_TOTAL_KEY], dict(snap))
                if self.series is not None and part is not None and part[0] != FORWARD:
                    self.series.append((part, snap[_TOTAL_KEY], len(self.events), dict(snap)))

    return PeakTracker


@functools.cache
def total_tracker_class() -> type:
    """PeakTracker following no module: the step's total peak, all the rehearsal reads
    (preflight/rehearse.py). Its module hooks are most of its cost (a multi-grad hook registered
    at each module's call), and MemTracker refuses a root module called twice in a step
    (gradient accumulation's and a pipeline's micro-batches). Every tensor the step
    makes is still tracked as the ops make it, gradients included; only the split by
    category then differs (gradients count as temporaries)."""

    class Blind:
        """What MemTracker asks of its module tracker: where the step is, forward or
        backward, by autograd's own state."""

        parents = frozenset({"Global"})

        def register_user_hooks(self, *hooks) -> None:
            pass

        def clear_user_hooks(self) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *args) -> None:
            pass

        @property
        def is_bw(self) -> bool:
            return torch._C._current_graph_task_id() != -1

    class TotalTracker(_tracker_class()):
        def __init__(self) -> None:
            super().__init__()
            self._mod_tracker = Blind()

    return TotalTracker


# The parts of a step (`_parts`) in which the repeated blocks run.
_BLOCK_PARTS = ("first", "inner", "last")


def _parts(tracker, blocks: list[nn.Module], counting: Counting) -> Callable[[], tuple[str, str]]:
    """Which part of the step an op runs in: the optimizer; or the forward or the
    backward, in the first, last or an inner block, or outside them, before or after
    the blocks ran. Each part's peak is a line in the depth (an inner block's: the
    first or the last inner one's, whichever the slopes favour, at every depth from 3),
    where the step's peak can move from one part to another as blocks are added: the
    loss's buffers at a few blocks, gradients held unsharded at 32 (`extended`)."""
    index: dict[str, int] = {}
    ran = set()  # the phases some block has run in
    named = False  # every block named in `index`

    def where() -> tuple[str, str]:
        nonlocal named
        if counting.phase == OPTIMIZER:
            return (OPTIMIZER, "")
        phase = BACKWARD if torch._C._current_graph_task_id() != -1 else FORWARD
        mods = tracker._mod_tracker
        if not named:  # named as the tracker first meets them
            names = [mods.get_known_fqn(b) for b in blocks]
            index.update((n, i) for i, n in enumerate(names) if n is not None)
            named = None not in names
        # Two blocks can be running at once, as one's backward hands its input's
        # gradient to the next: the one entered last (the forward's deeper, the
        # backward's shallower) is the part, not whichever the set of names yields
        # first, which follows the names' hashes and so the depth (its lines then
        # zigzag and never settle: `_settled`)
        running = [i for name in mods.parents if (i := index.get(name)) is not None]
        if running:
            ran.add(phase)
            i = min(running) if phase == BACKWARD else max(running)
            last = len(blocks) - 1
            return (phase, "first" if i == 0 else "last" if i == last else "inner")
        return (phase, "after" if phase in ran else "before")

    return where


def measure(spec: ModelSpec, probe: Probe) -> Measured:
    """One rank's step at `probe` (and `probe.blocks` blocks, where set) under fake
    tensors: its peak memory by category, its work and its collectives."""
    key = (spec, probe)
    if key in _MEASURED:
        return _MEASURED[key]
    if (kept := _stored(key)) is not None:
        _MEASURED[key] = kept
        return kept
    global _RAN
    _RAN += 1
    with rank(spec, probe) as r:
        tracker = _tracker_class()()
        tracker.track_external(r.module, r.optimizer)
        counting = Counting(r.dims, gathers_weights=probe.layout.dp_shard > 1)
        # the repeated blocks: a sequential model's embedding and head are outside them
        blocks = checkpointing.repeated(r.model.blocks())
        hooks = linears(r.module, blocks, counting)
        tracker.where = _parts(tracker, blocks, counting)
        counting.where = tracker.where
        held: list[tuple[int, int, int]] = []
        sharded = probe.layout.dp_shard > 1
        if sharded:  # what `at_shard` derives a peak holding gradients from
            tracker.series = []
        grads: dict[int, tuple[int, tuple]] = {}
        stepped = 0  # the events before the optimizer's

        def lap(phase: str) -> None:
            nonlocal grads, stepped
            if phase == FORWARD:
                held.append(tracker.in_flight(r.module))
            elif phase == BACKWARD and sharded:
                grads, stepped = _chunk_grads(tracker, r.module, r.optimizer), len(tracker.events)

        with hooks as weights, tracker, counting:
            step(r, counting, lap)
        peak = tracker.get_tracker_snapshot("peak")
        saved, block_saved, input_saved = held[0]
        shards = _shards(r.module, r.optimizer)
        params = sum(p.numel() for p in r.module.parameters())
    at = next(iter(peak.values())) if peak else {}
    parts = {k: (t, _categories(snap)) for k, (t, snap) in tracker.part_peaks.items()}
    if parts and max(t for t, _ in parts.values()) != at.get("Total", 0):
        raise RuntimeError("fakerank: the step's peak is no part's peak (_parts)")
    frontiers = _frontiers(tracker.series, tracker.events, grads, stepped) if sharded else {}
    for part, points in frontiers.items():
        if max(p[0] for p in points) != parts[part][0]:
            raise RuntimeError(f"fakerank: {part}'s frontier misses its peak (_frontiers)")
    _MEASURED[key] = Measured(
        int(at.get("Total", 0)),
        _categories(at),
        counting.work,
        r.boundary[0],
        len(blocks),
        saved,
        block_saved,
        input_saved_bytes=input_saved,
        shards=shards,
        sharded_at=probe.layout.dp_shard,
        reserved_bytes=allocator.replay(tracker.events).peak_reserved,
        params=params,
        linear_params=weights,
        parts=parts,
        frontiers=frontiers,
    )
    _store(key, _MEASURED[key])
    return _MEASURED[key]


def _categories(snap: dict) -> dict[str, int]:
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    return {str(getattr(k, "name", k)).lower(): int(v) for k, v in snap.items() if k != _TOTAL_KEY}


# Each (spec, probe) measured in this process: a stage's depths are measured once for
# every pipeline degree that extends from them (at_blocks). Read-only once made
# (at_shard and extended copy). A search hands a worker what it needs of them and
# takes back what the worker measured (`memo`, `remember`).
_MEASURED: dict[tuple, Measured] = {}


def memo(spec: ModelSpec, probes, known: frozenset = frozenset()) -> tuple[dict, dict]:
    """What this process measured of `spec` at the shapes of `probes` (any depth), less
    the `known` ones (`steps_known`: what the other process already has), and the depths
    their shapes settled at (at_blocks): for `remember` in another."""
    shapes = {p.replace(blocks=0) for p in probes}
    return (
        {
            k: v
            for k, v in _MEASURED.items()
            if k[0] == spec and k not in known and k[1].replace(blocks=0) in shapes
        },
        {k: v for k, v in _SETTLED.items() if k[0] == spec},
    )


def steps_known() -> frozenset:
    """The fake steps this process holds, by key (for `memo`'s `known`)."""
    return frozenset(_MEASURED)


def remember(got: tuple[dict, dict]) -> None:
    """Take in measurements made elsewhere (`memo`)."""
    _MEASURED.update(got[0])
    _SETTLED.update(got[1])


def measurements() -> int:
    """How many fake steps this process holds (measured, remembered or stored)."""
    return len(_MEASURED)


def steps_run() -> int:
    """How many fake steps this process has run (`measure`: not remembered or stored)."""
    return _RAN


_RAN = 0

# --- measurements kept on disk ---------------------------------------------------------

# Where `measure` keeps each fake step it takes, and looks for it before taking it: the
# directory `parabench advise --cache` names (spawned workers inherit it), unset for
# none. What a rank holds and does depends on nothing a search varies besides its model
# and probe (not the GPU, fabric, N or pricing), so a second search of the same model,
# on other GPUs or at other N, reads its ranks here instead of stepping them again.
CACHE_ENV = "PARABENCH_ADVISE_CACHE"


@functools.cache
def _code_stamp() -> str:
    """What else a measurement depends on: the versions of Python, torch and
    transformers, and parabench's own code (every module of the package, hashed), so
    that no change to any of them ever reads a step taken before it."""
    import hashlib
    import importlib.metadata
    import platform

    import parabench

    h = hashlib.sha256()
    for package in ("torch", "transformers"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            h.update(f"{package} {importlib.metadata.version(package)}\n".encode())
    h.update(f"{platform.python_version()} {torch.__version__}\n".encode())
    root = pathlib.Path(parabench.__file__).parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _cache_path(key: tuple) -> str | None:
    """The file of `key`'s measurement (its model and probe, whose reprs name every
    field), or None where no cache is set."""
    import hashlib

    if not (root := os.environ.get(CACHE_ENV)):
        return None
    name = hashlib.sha256(repr(key).encode()).hexdigest()
    return os.path.join(root, _code_stamp(), name[:2], f"{name}.pickle")


def _stored(key: tuple) -> Measured | None:
    """`key`'s measurement from the cache, if it is there and is `key`'s."""
    import pickle

    if (path := _cache_path(key)) is None:
        return None
    try:
        with open(path, "rb") as f:
            stored_key, m = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError):
        return None  # none, or unreadable: measured again
    return m if stored_key == key else None


def _store(key: tuple, m: Measured) -> None:
    """Keep `key`'s measurement in the cache, written whole or not at all (workers
    measuring side by side may write the same key)."""
    import pickle

    if (path := _cache_path(key)) is None:
        return
    # a cache that cannot be written costs only the next search's time
    with contextlib.suppress(OSError):
        atomic_write_bytes(pathlib.Path(path), pickle.dumps((key, m)))


def _shards(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[Shard, float]:
    """The rank's FSDP parameters by shape (Shard), read from FSDP2's own records of
    how it split each; none where no module is FSDP-sharded (dp_shard 1)."""
    return dict(collections.Counter(shard for _, shard in _fsdp_params(module, optimizer)))


def _fsdp_params(module: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[tuple]:
    """Each of the rank's FSDP parameters (FSDP2's FSDPParam) and its Shard."""
    from torch.distributed.fsdp import FSDPModule

    for mod in module.modules():
        if not isinstance(mod, FSDPModule):
            continue
        state = mod._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch before per-parameter meshes: one group or none
            groups = [state._fsdp_param_group] if state._fsdp_param_group else []
        for group in groups:
            for fp in group.fsdp_params:
                size, dim = fp._orig_size, fp.fsdp_placement.dim
                if dim != 0:
                    raise NotImplementedError(f"FSDP shards a parameter on dim {dim}")
                rows = size[0] if len(size) else 1
                local = _local(fp.sharded_param)  # no op: the tracker may be running
                opt = sum(
                    t.element_size()
                    for t in optimizer.state.get(fp.sharded_param, {}).values()
                    if isinstance(t, torch.Tensor) and _local(t).numel() == local.numel() > 1
                )
                yield fp, Shard(rows, size.numel() // max(rows, 1), local.element_size(), opt)


def _chunk_grads(tracker, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The storages of the gradients' chunks (FSDP's reduce-scatter outputs, each
    sharded parameter's gradient a view of one) as the backward leaves them, by their
    tracker info's id: the index of the event that made each (an id can be an earlier,
    freed info's), and the chunks in it as ((Shard, bytes per element), how many)."""
    from torch.distributed._tools.common_utils import get_untyped_storages

    chunks: dict[int, collections.Counter] = {}
    for fp, shard in _fsdp_params(module, optimizer):
        if (grad := fp.sharded_param.grad) is None:
            continue
        local = _local(grad)
        for st in get_untyped_storages(local):
            if (winfo := tracker._WINFO.get(st, (None,))[0]) is not None:
                chunks.setdefault(id(winfo), collections.Counter())[
                    (shard, local.element_size())
                ] += 1
    made = {}
    for i, (kind, wid, _) in enumerate(tracker.events):
        if kind == "malloc" and wid in chunks:
            made[wid] = i  # the last: the storage held now
    return {wid: (made[wid], tuple(sorted(c.items()))) for wid, c in chunks.items() if wid in made}


def _frontiers(series: list, events: list, grads: dict, stepped: int) -> dict:
    """Each part of the backward and the optimizer (`PeakTracker.series`): the moments
    that could be its peak at a larger dp_shard (`at_shard`), each as (total,
    categories, the gradients' chunks held, the optimizer's temporaries' bytes: what
    it made from event `stepped` on and holds, each the shape of a parameter's chunk).
    There every moment holds what it holds here, moved by the same, less what the
    gradients' chunks and the temporaries shrink by, plus what its unsharded
    parameters grow by with FSDP's padding; and the chunks only accumulate until
    zero_grad frees them. So a moment that a later one matches in what it holds
    besides, in its parameters, in its temporaries and in the chunks is never the
    peak (what the parameters grow by rises with them where the padding grows with
    dp_shard, as at every multiple of 2 and, for Llama's and GPT-2's widths, at 3):
    few are left, the part's peak here among them (each block's backward adds its
    chunks once)."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    births = {i: wid for wid, (i, _) in grads.items()}
    out: dict[tuple[str, str], list] = {}
    live: dict[int, int] = {}  # chunk storage id -> its bytes
    temps: dict[int, int] = {}  # the optimizer's, id -> bytes
    held, made, seen = 0, 0, 0
    key: frozenset = frozenset()
    for part, total, n, snap in series:
        if n > seen:
            for i in range(seen, n):
                kind, wid, size = events[i]
                if kind == "malloc" and births.get(i) == wid:
                    live[wid] = size
                elif kind == "malloc" and i >= stepped:
                    temps[wid] = size
                elif kind == "free":
                    live.pop(wid, None)
                    temps.pop(wid, None)
            seen, key = n, frozenset(live)
            held, made = sum(live.values()), sum(temps.values())
        now = (total - held - made, snap.get(_MemRefType.PARAM, 0), made)
        points = out.setdefault(part, [])
        if points and _under(now, points[-1][0]) and key <= points[-1][1]:
            continue  # matched by the moment before (the first to hold it is the peak)
        while points and _under(points[-1][0], now) and points[-1][1] <= key:
            points.pop()  # matched by this moment: never the peak
        points.append((now, key, total, snap))

    def chunks(key: frozenset) -> tuple:
        c: collections.Counter = collections.Counter()
        for wid in key:
            for shard, k in grads[wid][1]:
                c[shard] += k
        return tuple(sorted(c.items()))

    return {
        part: tuple(
            (total, _categories(snap), chunks(key), now[2]) for now, key, total, snap in points
        )
        for part, points in out.items()
    }


def _under(a: tuple, b: tuple) -> bool:
    return all(x <= y for x, y in zip(a, b, strict=True))


def at_shard(m: Measured, dp_shard: int, replicas: int = 1) -> Measured:
    """The rank measured in `m` with FSDP sharding over `dp_shard` ranks instead of
    `m.sharded_at`, and for HSDP, `replicas` of it. What a rank holds and does whatever
    dp_shard (its activations, its matmuls, its unsharded copies, the buffers of its
    collectives) is the same; what dp_shard splits is each parameter's chunk (Shard),
    held all step:

    - memory: at any moment the rank holds what it holds at the measured dp_shard,
      moved by the change in the sharded parameters and their optimizer state (the
      same at every moment), in the gradients' chunks it holds then (which
      accumulate over the backward) and in the optimizer's temporaries. So a
      measured rank's parts each peak at the moment of their frontier (`_frontiers`)
      that holds most there; an extended one (no moments kept) only where its peak
      holds no gradients (`derivable`), where it stays (else `derived` derives its
      depths);
    - communication: the dp_shard dimension's gathered and reduced buffers with the
      padded total (chunk x dp_shard);
    - HSDP: FSDP's rank, which all-reduces each reduced chunk over the replicas (the
      dp_replicate dimension), in place: the same memory and ops (tests/test_advise.py).

    - work: the optimizer's ops, and FSDP's copies of the chunks into its all-gathers'
      buffers (CHUNK), scale with the elements of the chunks; its copies out of the
      gathered buffers and into the reduced ones (BUFFER) with the padded total;
    - the unsharded copies the peak holds (parameters less their chunks: ZeRO-2's,
      all of them) grow with FSDP's padding, as the model's padded total.

    tests/test_advise.py holds derived ranks to measured ones."""
    s0 = m.sharded_at
    if not m.shards and dp_shard > 1:
        raise ValueError(f"at_shard: the rank at dp_shard {s0} has no FSDP shards to derive from")
    if dp_shard == s0 and replicas == 1:
        return m

    def total(s: int, per_row) -> float:
        return sum(n * math.ceil(k.rows / s) * per_row(k) for k, n in m.shards.items())

    d_param = total(dp_shard, lambda k: k.row_elements * k.param_bytes) - total(
        s0, lambda k: k.row_elements * k.param_bytes
    )
    d_opt = total(dp_shard, lambda k: k.row_elements * k.opt_bytes) - total(
        s0, lambda k: k.row_elements * k.opt_bytes
    )
    chunk = total(dp_shard, lambda k: k.row_elements) / total(s0, lambda k: k.row_elements)
    padded = (dp_shard * total(dp_shard, lambda k: k.row_elements)) / (
        s0 * total(s0, lambda k: k.row_elements)
    )
    ops: collections.Counter = collections.Counter()
    for (phase, kind, flops, nbytes), n in m.work.ops.items():
        if phase == OPTIMIZER or kind == CHUNK:
            flops, nbytes = round(flops * chunk), round(nbytes * chunk)
        elif kind == BUFFER:  # FSDP's gathered and reduced buffers: the padded total
            nbytes = round(nbytes * padded)
        ops[(phase, kind, flops, nbytes)] += n
    comm = {
        dim: {
            op: {"count": e["count"], "bytes": e["bytes"] * (padded if dim == "dp_shard" else 1)}
            for op, e in by_op.items()
        }
        for dim, by_op in m.work.comm_by_dim.items()
    }
    if replicas > 1:
        reduced = comm["dp_shard"]["reduce_scatter"]
        comm["dp_replicate"] = {
            "all_reduce": {"count": reduced["count"], "bytes": reduced["bytes"] / dp_shard}
        }
    chunks = total(s0, lambda k: k.row_elements * k.param_bytes)

    def moved(
        held: int, by: dict[str, int], grads: tuple = (), temps: int = 0
    ) -> tuple[int, dict[str, int]]:
        """A moment's total and categories at dp_shard: the chunks and their optimizer
        state moved, the unsharded copies (the parameters' bytes less their chunks)
        grown with FSDP's padding, the gradients' chunks held moved, and the
        optimizer's temporaries with the chunks (`_frontiers`; as its ops, by the
        model's chunk ratio)."""
        d_held = max(by.get("param", 0) - chunks, 0) * (padded - 1)
        d_grad = sum(
            n * size * k.row_elements * (math.ceil(k.rows / dp_shard) - math.ceil(k.rows / s0))
            for (k, size), n in grads
        )
        d_temps = round(temps * (chunk - 1))
        out = dict(by)
        out["param"] = int(by.get("param", 0) + d_param + d_held)
        out["opt"] = int(by.get("opt", 0) + d_opt + d_temps)
        if d_grad:
            out["grad"] = int(by.get("grad", 0) + d_grad)
        return int(held + d_param + d_opt + d_held + d_grad + d_temps), out

    parts = {}
    if m.parts and m.extended_from is None and not m.derived_from:
        # measured: each part at whichever of its moments peaks at dp_shard
        for part, (held, by) in m.parts.items():
            points = m.frontiers.get(part) or ((held, by, ()),)
            parts[part] = max((moved(*p) for p in points), key=lambda p: p[0])
        peak, by = max(parts.values(), key=lambda p: p[0])
    elif derivable(m):  # extended: its peak holds no gradients, and stays where it was
        peak, by = moved(m.peak_bytes, m.by_category)
    else:
        raise ValueError(
            "at_shard: an extended rank whose peak holds gradients is derived depth by "
            "depth (fakerank.derived)"
        )
    return dataclasses.replace(
        m,
        peak_bytes=peak,
        reserved_bytes=int(m.reserved_bytes + peak - m.peak_bytes),
        by_category=by,
        work=Work(ops, comm, m.work.block_flops),
        sharded_at=dp_shard,
        derived_from=s0,
        parts=parts,
        frontiers={},
    )


def derivable(m: Measured) -> bool:
    """Whether `at_shard` holds for `m` as extended from two depths: its peak holds no
    gradients (which appear over the backward, so with another dp_shard the peak
    could fall at another moment, which only a measured rank's frontiers tell)."""
    return not m.by_category.get("grad", 0)


def derived(
    spec: ModelSpec, probe: Probe, m: Measured, dp_shard: int, replicas: int = 1
) -> Measured:
    """`m`, the rank of `probe` at its blocks, at dp_shard (and for HSDP `replicas`):
    `at_shard` of it, or where it was extended from two depths and its peak holds
    gradients, the line through those depths each derived (at_shard of a measured rank
    finds its peak among the moments that can peak there: `_frontiers`)."""
    if m.extended_from is None or derivable(m):
        return at_shard(m, dp_shard, replicas)
    low, high = (
        at_shard(measure(spec, probe.replace(blocks=b)), dp_shard, replicas)
        for b in m.extended_from
    )
    return dataclasses.replace(extended(low, high, m.blocks), derived_from=m.sharded_at)


def extended(low: Measured, high: Measured, blocks: int) -> Measured:
    """`blocks` blocks, from measurements at two depths: each further block adds what
    one block added between them (memory, ops, collectives), so every figure is
    low + (high - low) x (blocks - low's) / (high's - low's)."""
    k = (blocks - low.blocks) / (high.blocks - low.blocks)

    def line(a: float, b: float) -> float:
        return a + (b - a) * k

    ops = collections.Counter()
    for op in _union(low.work.ops, high.work.ops):
        if n := line(low.work.ops.get(op, 0), high.work.ops.get(op, 0)):
            ops[op] = n
    comm = {}
    for dim in _union(low.work.comm_by_dim, high.work.comm_by_dim):
        lo, hi = low.work.comm_by_dim.get(dim, {}), high.work.comm_by_dim.get(dim, {})
        comm[dim] = {
            op: {
                f: line(lo.get(op, {}).get(f, 0.0), hi.get(op, {}).get(f, 0.0))
                for f in ("count", "bytes")
            }
            for op in _union(lo, hi)
        }
    # each part's peak on its own line: the deeper step's peak is the largest of them
    # (at a few blocks it may be another part's, with a smaller slope)
    if set(low.parts) != set(high.parts):
        raise ValueError(
            f"fakerank: blocks {low.blocks} and {high.blocks} ran different parts of the step"
        )
    parts = {
        part: (
            int(line(low.parts[part][0], high.parts[part][0])),
            _line_dict(low.parts[part][1], high.parts[part][1], line, int),
        )
        for part in low.parts
    }
    if parts:
        peak, by = max(parts.values(), key=lambda p: p[0])
    else:
        peak = int(line(low.peak_bytes, high.peak_bytes))
        by = _line_dict(low.by_category, high.by_category, line, int)
    work = Work(ops, comm, line(low.work.block_flops, high.work.block_flops))
    shards = _line_dict(low.shards, high.shards, line)
    return Measured(
        peak,
        by,
        work,
        high.boundary_bytes,
        blocks,
        int(line(low.saved_bytes, high.saved_bytes)),
        int(line(low.block_saved_bytes, high.block_saved_bytes)),
        (low.blocks, high.blocks),
        shards=shards,
        sharded_at=high.sharded_at,
        params=int(line(low.params, high.params)),
        linear_params=int(line(low.linear_params, high.linear_params)),
        # the reserve over the peak as at the deeper depth: each block's allocations
        # repeat the one before's, which the allocator's cached blocks serve (at a few
        # blocks the reserve still absorbs what a block adds: not a line to extend)
        reserved_bytes=peak + max(high.reserved_bytes - high.peak_bytes, 0),
        parts=parts,
        input_saved_bytes=int(line(low.input_saved_bytes, high.input_saved_bytes)),
    )


def _union(a, b) -> list:
    """The keys of `a`, then those of `b` it lacks, in order: a set's order follows the
    strings' hashes, which Python seeds afresh in every process, and sums in it differ
    in their last bits from one process (or cache, `_stored`) to the next."""
    return list(dict.fromkeys([*a, *b]))


def _line_dict(
    low: dict, high: dict, line: Callable[[float, float], float], kind: type = float
) -> dict:
    """Each key's value on `line` (missing: 0), as `kind`."""
    return {k: kind(line(low.get(k, 0), high.get(k, 0))) for k in _union(low, high)}


# The first depth a stage is measured at: below it the step's peak falls elsewhere (at
# one block, where the loss's buffers meet the first blocks' FSDP copies).
FIRST_PROBE = 3
# Two successive blocks adding the same to the peak, within this, settle the slope.
SETTLED = 0.01


# The depth from which a rank's blocks each added the same, by its shape less its
# micro-batch and checkpointing: a micro-batch scales the activations and the loss's
# buffers alike, and checkpointing shrinks what each block keeps, not where the peak
# falls, so the shape's other options settle there too (tests/test_advise.py), and are
# measured at that depth and the next only.
_SETTLED: dict[tuple, int] = {}


def _settled(three: list[Measured]) -> bool:
    """Whether three successive depths added the same twice (within SETTLED): to the
    step's peak, and to each part's (each is extended on its own line)."""
    lines = [[m.peak_bytes for m in three]]
    lines += [[m.parts.get(part, (0,))[0] for m in three] for part in three[-1].parts]
    return all(abs((c - b) - (b - a)) <= SETTLED * max(abs(c - b), 1) for a, b, c in lines)


def at_blocks(spec: ModelSpec, probe: Probe, blocks: int) -> Measured:
    """The rank of `probe` with `blocks` repeated blocks: measured at successive depths
    from FIRST_PROBE until two successive blocks add the same to the peak and to each
    part's (`_settled`: the step's parts have settled into lines: tests/test_advise.py), then
    extended from the last two; measured at `blocks` itself where the search gets there
    first, or where the model's depth cannot be set."""
    if depth(spec) is None:
        return measure(spec, probe.replace(blocks=0))
    if blocks <= FIRST_PROBE + 1:
        return measure(spec, probe.replace(blocks=blocks))
    key = (spec, probe.replace(micro=0, blocks=0, layout=probe.layout.replace(ac="")))
    if (k := _SETTLED.get(key)) and k + 1 < blocks:
        low, high = (measure(spec, probe.replace(blocks=b)) for b in (k, k + 1))
        return extended(low, high, blocks)
    probes = [measure(spec, probe.replace(blocks=k)) for k in (FIRST_PROBE, FIRST_PROBE + 1)]
    while True:
        k = probes[-1].blocks + 1
        if k >= blocks:
            return measure(spec, probe.replace(blocks=blocks))
        probes.append(measure(spec, probe.replace(blocks=k)))
        if _settled(probes[-3:]):
            # extended from the depths every later rank of the shape is (so that the
            # order a search measures in changes nothing)
            _SETTLED[key] = probes[-3].blocks
            return extended(probes[-3], probes[-2], blocks)


# --- this host, as a device ---------------------------------------------------------


def this_machine(device: str, precision: str, size: int = 512) -> GPU:
    """This host as the device the run's cells run on (`device`: the config's, auto
    resolved as the cells resolve it), its GEMM measured in the cells' `precision`: its
    first GPU (`_this_gpu`), or its CPU: a GEMM's rate on one thread, a copy's
    bandwidth, and the time an op takes through torch's dispatcher (what small ops cost
    here), each the best of several runs, and the cores its ranks share."""
    if runtime.resolve_device_type(device) == "cuda":
        return _this_gpu(precision)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:

        def best(fn, runs: int = 7) -> float:
            fn()
            times = []
            for _ in range(runs):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return min(times)

        gemm = peak.gemm_flops_per_s(torch.device("cpu"), size, precision=precision)
        x = torch.randn(64 * 2**20 // 4)  # 64 MiB: past the caches
        y = torch.empty_like(x)
        copy = 2 * x.numel() * 4 / best(lambda: y.copy_(x))
        floor = _op_cost(best)
    finally:
        torch.set_num_threads(threads)
    cores = envinfo.usable_cores()
    # a rank's process holds about what this one does, torch imported (this one holds
    # more: what advise imports beside, so the host is not taken as roomier than it is)
    process = envinfo.resident_memory() or 0
    return GPU(
        gpus.THIS_MACHINE,
        gemm,
        gemm,
        float(envinfo.available_memory() or 0),
        copy,
        f"this host's CPU, measured on one thread: {precision} GEMM {size}x{size}x{size} "
        f"{gemm / 1e9:.1f} GFLOP/s, copy {copy / 1e9:.1f} GB/s, {floor * 1e6:.1f} us per "
        f"op of a small model's training step (autograd and the optimizer included); "
        f"{cores} cores shared by the ranks, each rank's process {process / 2**30:.2f} GiB "
        "besides its tensors (this one's resident memory)",
        op_floor_s=floor,
        cores=cores,
        process_bytes=float(process),
    )


def _op_cost(best) -> float:
    """Seconds per op of a small model's whole training step on this host: its time
    over its ops (counted as advise counts a rank's), what a step of small ops costs
    here beyond their arithmetic (dispatch, autograd, the optimizer's loop)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(64, 64), nn.GELU())))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 64)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    counting = Counting({})
    with counting:
        step()
    return best(step) / max(1.0, counting.work.op_count())


def _this_gpu(precision: str, size: int = 8192) -> GPU:
    """The first GPU: a GEMM's rate in the cells' `precision` (fp32 with TF32 as this
    process has it, which is the cells' setting: nothing here changes it, and each cell
    records it) and a copy's bandwidth, measured; its memory; its datasheet peak and
    attention's rate where `gpus.DEVICES` knows its name and the run is bf16 (the
    datasheet's peak is BF16's), else the measured rate. Each rank has a GPU of its own:
    no cores are shared (`cores` 0). Not run on a GPU yet: the first GPU run
    (docs/examples/h200) did not ask for this-machine; tests/test_cuda_paths.py fakes
    what it reads."""
    if not torch.cuda.is_available():
        raise gpus.GPUError(
            "advise.gpu: this-machine measures the device the cells run on, and device is "
            "cuda, but torch sees no GPU on this host"
        )
    dev = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(dev)
    memory = torch.cuda.get_device_properties(dev).total_memory
    gemm = peak.gemm_flops_per_s(dev, size, precision=precision)
    copy = _copy_rate(dev)
    torch.cuda.empty_cache()
    arithmetic = precision
    if precision == "fp32":
        tf32 = torch.backends.cuda.matmul.allow_tf32
        arithmetic = f"fp32 (TF32 {'on' if tf32 else 'off'}: matmul.allow_tf32, as the cells run)"
    sheet = gpus.DEVICES.get(name)
    if sheet and precision == "bf16":
        peak_flops, attention, said = sheet.peak_flops, sheet.attention_flops, sheet.source
    elif sheet:
        peak_flops, attention = gemm, 0.0
        said = "the measured rate: its datasheet's peak is BF16's, and the run is fp32"
    else:
        peak_flops, attention = gemm, 0.0
        said = f"the measured rate: {name!r} is not in gpus.DEVICES"
    return GPU(
        gpus.THIS_MACHINE,
        peak_flops,
        gemm,
        float(memory),
        copy,
        f"{name}, measured: {arithmetic} GEMM {size}^3 {gemm / 1e12:.1f} TFLOP/s, copy "
        f"{copy / 1e9:.0f} GB/s; peak {peak_flops / 1e12:.1f} TFLOP/s ({said})",
        attention_flops=attention,
    )


def _copy_rate(dev: torch.device) -> float:
    """Bytes/s a 1 GiB device-to-device copy reads and writes, the best of five (CUDA
    events); its tensors freed on return."""
    x = torch.empty(2**30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    y.copy_(x)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * x.numel() / min(times)
