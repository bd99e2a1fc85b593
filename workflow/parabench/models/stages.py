"""Stages cut from a model, for pipeline and model parallelism.

An nn.Sequential is cut between its children: a stage is blocks [lo, hi), each taking
the previous one's output.

Any other module keeps its own forward, as torchtitan's stages keep their model's.
Stage k holds its blocks [lo, hi), the parts the forward runs before the first block
(embeddings) when it is the first stage, and those after the last block (final norm,
head) when it is the last. Every stage runs the model's whole forward on the model's
input (every pipeline rank has the batch), with what it does not hold standing in: a
part run before the blocks gives zeros of its shape, a block before the stage hands
its input on. The stage's first block's input is swapped for the activation received,
and the forward stops when the block after the stage is called: that block's input is
what the stage sends. Parameter-free work (rotary embeddings, attention masks, masks
from the input's values) runs on every stage, as in torchtitan; parameter names stay
the whole model's.

That is sound when the activation crossing a cut is all the forward carries from one
block to the next: `h = block(h)` or `h = act(block(h))`, as transformers and
torchtitan models run their layers, not `h = h + block(h)`, whose `h` the next stage
never sees. `trace` reads the forward once and checks, from autograd's graph, that the
output depends on a block's input only through the block and on its output only
through the next block; then that stages cut at every boundary, chained, run and give
a tensor of the output's shape on other samples. A model that fails says why
(ModelFacts.cut_skip), and its stage cells are skipped. All of it runs on fake tensors
(FakeTensorMode: shapes, dtypes and the graph, no values), at planning
(custom.inspect_factory) and in each pipeline or model-parallel rank alike, which reads
a fake copy of its real model; only a forward that reads values fake tensors lack is
read for real, in the rank, where the stages chained must also give the model's
output. A forward that uses a block's output off the graph (a Python attribute, an
integer tensor) is left to the run, whose equivalence check against `single` shows it.
What one sample in eval mode cannot show (a block dropped at random in training) is
caught when a stage runs: the forward must reach the stage's first and last block.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeCopyMode
from torch.utils._pytree import tree_map_only
from torch.utils.flop_counter import FlopCounterMode

from parabench.models.base import (
    FAKE_LIMITS,
    Model,
    example_batch,
    fake_mode,
    fake_mode_of,
    running,
)

TRACE_BATCH = 3  # samples in the traced forward: a batch dimension tells itself apart
CHECK_BATCH = 5  # and in the chained check, on other samples: stand-ins must follow


@dataclass(frozen=True)
class Output:
    """A part's output in the traced forward, for a stage that stands in for it."""

    shape: tuple[int, ...]  # per sample where per_sample, else whole
    dtype: torch.dtype
    per_sample: bool  # its first dimension is the batch's

    @classmethod
    def of(cls, t: torch.Tensor, batch: int) -> Output:
        per_sample = t.dim() > 0 and t.shape[0] == batch
        return cls(tuple(t.shape[1:] if per_sample else t.shape), t.dtype, per_sample)

    def zeros(self, batch: int, device: torch.device) -> torch.Tensor:
        shape = (batch, *self.shape) if self.per_sample else self.shape
        return torch.zeros(shape, dtype=self.dtype, device=device)


@dataclass
class Trace:
    """How a model's forward runs its blocks: what a cut needs."""

    # Per block, forward FLOPs, with what runs before and after the blocks on the first
    # and last: what balances stages (an nn.Sequential's: flops.block_flops)
    costs: list[int]
    sequential: bool = False  # an nn.Sequential: its blocks chain, nothing else runs
    prefix: tuple[str, ...] = ()  # parts run before the first block (embeddings)
    suffix: tuple[str, ...] = ()  # ... and after the last (final norm, head)
    late: tuple[str, ...] = ()  # parts with buffers only, run after the last block
    stand_ins: dict[str, Output] = field(default_factory=dict)  # prefix parts' outputs
    problem: str | None = None  # why no stage can be cut from it


def trace(model: Model) -> Trace:
    """Read the forward once and check a cut at every boundary (a module with a forward
    of its own; an nn.Sequential needs no reading), on fake tensors: shapes, dtypes and
    autograd's graph, no values, no memory of the model's size, no arithmetic. A model
    built on them (planning's) is read as it is, a real one (a rank's) on a fake copy:
    a rank holds no further copy of its weights and runs no forward of the whole model
    on the CPU (a 7B model: 28 GB and minutes). Where the forward reads values fake
    tensors do not have, planning leaves the check to the rank, and the rank reads the
    real model for real, on a copy sharing its weights (_light_copy), where the stages
    chained must also give the model's output."""
    if model.sequential:
        return Trace([], sequential=True)
    blocks = model.block_names
    if not blocks:
        return Trace([], problem="no repeated blocks were found to cut between")
    parts, problem = _parts(model.module, blocks)
    if problem:
        return Trace([], problem=problem)
    if fake_mode_of(model.module) is not None:
        try:
            return _trace(model, model.module, parts)
        except FAKE_LIMITS:
            return Trace([])  # the values it reads are unknown here: the rank checks
    try:
        return _trace(model, _counting(model, _fake_copy(model.module)), parts)
    except FAKE_LIMITS:
        return _trace(model, _counting(model, _light_copy(model.module)), parts)


def _fake_copy(module: nn.Module) -> nn.Module:
    """`module` on fake tensors: its weights' shapes, none of their memory."""
    with FakeCopyMode(fake_mode()):
        return copy.deepcopy(module)


def _light_copy(module: nn.Module) -> nn.Module:
    """`module` for a real forward that must leave it as it was (a forward may change
    buffers, counters): its parameters shared, not copied, its buffers (small: rotary
    tables, running statistics) and the rest copied."""
    memo: dict = {id(p): p for p in module.parameters()}
    memo |= {id(b): b.clone() for b in module.buffers()}
    return copy.deepcopy(module, memo)


def _counting(model: Model, module: nn.Module) -> nn.Module:
    # The counting copy (process/flops.py) has the same names and maths, and its FLOPs count.
    return model.for_counting(module) if model.for_counting else module


def _trace(model: Model, module: nn.Module, parts: list[str]) -> Trace:
    """trace() on `module`, the model's or a copy of it, fake or real; FAKE_LIMITS
    where the forward reads values `module` does not have."""
    blocks = model.block_names
    x = example_batch(model, TRACE_BATCH)[0]
    other = example_batch(model, CHECK_BATCH, seed=1)[0]
    try:
        with running(module) as bring, _eval(module):  # no dropout: the chain is compared
            x, other = bring(x), bring(other)
            with torch.no_grad():
                calls, whole = _calls(module, blocks, parts, x)
            holders = {p for p in parts if any(True for _ in module.get_submodule(p).parameters())}
            t = _read(calls, blocks, parts, holders)
            if t.problem:
                return t
            if not isinstance(whole, torch.Tensor):
                return Trace([], problem="its forward returns no tensor")
            if why := _carried(module, blocks, x):
                return Trace([], problem=why)
            with torch.no_grad():
                whole = module(other)
                act = other
                for i in range(len(blocks)):  # a cut at every boundary
                    act = _cut(module, blocks, t, i, i + 1).fed([other])(act)
    except FAKE_LIMITS:
        raise
    except Exception as e:  # a forward that a stage's stand-ins break
        why = f"its forward fails when cut into stages ({type(e).__name__}: {e})"
        return Trace([], problem=why)
    if not (isinstance(act, torch.Tensor) and act.shape == whole.shape):
        return Trace([], problem="the stages chained do not return a tensor of its output's shape")
    if fake_mode_of(module) is not None:  # no values to compare: the graph said it
        return t
    if not torch.allclose(act, whole, rtol=1e-4, atol=1e-5):
        gap = float((act - whole).abs().max())
        return Trace(
            [],
            problem=(
                f"the stages chained do not give its output (largest difference {gap:.2g}): "
                "its forward carries more across a cut than the activation a block is given"
            ),
        )
    return t


def _carried(module: nn.Module, blocks: tuple[str, ...], x: torch.Tensor) -> str | None:
    """Why a cut would lose what the forward carries past a block, read from autograd's
    graph (on fake tensors too): each block is given a leaf of its own in place of its
    input, so the output depends on what the forward formed as a block's input only
    where the forward uses it besides the block (h = h + block(h): a stage beginning at
    that block would not have it), and on the leaf only through the block's output,
    which must reach the output only as the next block's input (a stage ending at that
    block sends nothing else). Inputs that carry no gradient (token ids, the model's
    own input, which every stage has) are not checked."""
    formed: dict[str, torch.Tensor] = {}
    leaves: dict[str, torch.Tensor] = {}

    def given(name: str, _m: nn.Module, args: tuple) -> tuple | None:
        if not (args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point()):
            return None
        formed[name] = args[0]
        leaves[name] = args[0].detach().requires_grad_(True)
        return (leaves[name], *args[1:])

    with contextlib.ExitStack() as hooks, torch.enable_grad():
        for name in blocks:
            at = module.get_submodule(name).register_forward_pre_hook(
                functools.partial(given, name)
            )
            hooks.callback(at.remove)
        out = module(x)
    inputs = [b for b in blocks if b in formed and formed[b].requires_grad]
    outputs = [b for b in blocks[:-1] if b in leaves]
    wrt = [formed[b] for b in inputs] + [leaves[b] for b in outputs]
    if not (isinstance(out, torch.Tensor) and out.requires_grad and wrt):
        return None
    grads = torch.autograd.grad(out.float().sum(), wrt, allow_unused=True)
    used = [b for b, g in zip(inputs, grads, strict=False) if g is not None]
    if used:
        # the last: an earlier input is often used only through it (h carried on)
        b = used[-1]
        which = f"beginning at {b}" if b != blocks[0] else "after the first"
        return (
            f"its forward uses block {b}'s input again besides the block (as in h = h + "
            f"block(h)): a stage {which} would not have it"
        )
    sent = [b for b, g in zip(outputs, grads[len(inputs) :], strict=True) if g is not None]
    if sent:
        b, after = sent[0], blocks[blocks.index(sent[0]) + 1]
        return (
            f"its forward uses block {b}'s output besides handing it to block {after}: a "
            f"stage ending at {b} would send only {after}'s input"
        )
    return None


def _parts(module: nn.Module, blocks: tuple[str, ...]) -> tuple[list[str], str | None]:
    """The largest submodules outside the blocks that hold parameters or buffers
    (embeddings, rotary tables, a final norm, the head), or why the model has
    parameters no stage could own. A ModuleList or ModuleDict is no part: it is never
    called, its members are."""
    parts: list[str] = []

    def walk(prefix: str, mod: nn.Module) -> str | None:
        if own := [n for n, _ in mod.named_parameters(recurse=False)]:
            return f"{prefix.rstrip('.') or 'the model'} holds parameters of its own ({own[0]})"
        for name, child in mod.named_children():
            full = prefix + name
            if full in blocks:
                continue
            if any(b.startswith(full + ".") for b in blocks) or isinstance(
                child, nn.ModuleList | nn.ModuleDict
            ):
                if why := walk(full + ".", child):
                    return why
            elif any(True for _ in child.parameters()) or any(True for _ in child.buffers()):
                parts.append(full)
        return None

    if why := walk("", module):
        return parts, why
    owner: dict[int, str] = {}
    for name in (*parts, *blocks):
        for p in module.get_submodule(name).parameters():
            if (other := owner.setdefault(id(p), name)) != name:
                return parts, (
                    f"{other} and {name} share a parameter (tied weights): the stages "
                    "holding them would each train their own copy"
                )
    return parts, None


def _calls(module: nn.Module, blocks, parts, x) -> tuple[list[tuple], object]:
    """(name, "in" | "out", FLOPs so far, first positional argument | output) per call
    of a block or part, in order, and the forward's output."""
    calls: list[tuple] = []
    with FlopCounterMode(display=False) as counter, contextlib.ExitStack() as hooks:

        def seen(name, when, value):
            calls.append((name, when, counter.get_total_flops(), value))

        for name in (*blocks, *parts):
            sub = module.get_submodule(name)
            pre = sub.register_forward_pre_hook(
                lambda _m, args, n=name: seen(n, "in", args[0] if args else None)
            )
            post = sub.register_forward_hook(lambda _m, _a, out, n=name: seen(n, "out", out))
            hooks.callback(pre.remove)
            hooks.callback(post.remove)
        whole = module(x)
        total = counter.get_total_flops()
    calls.append((None, "end", total, None))
    return calls, whole


def _read(calls: list[tuple], blocks, parts, holders: set[str]) -> Trace:
    """The trace from the calls, or the first reason no cut could work. `holders`:
    the parts that hold parameters."""
    entered = [c for c in calls if c[0] in blocks and c[1] == "in"]
    if [c[0] for c in entered] != list(blocks):
        order = ", ".join(c[0] for c in entered) or "none"
        why = f"its forward does not call its blocks once each in order ({order})"
        return Trace([], problem=why)
    first = calls.index(entered[0])
    last = max(i for i, c in enumerate(calls) if c[0] == blocks[-1] and c[1] == "out")
    out_of = {c[0]: c[3] for c in calls if c[1] == "out"}
    for name, _, _, arg in entered:
        if not isinstance(arg, torch.Tensor):
            why = (
                f"block {name} is not given a tensor as its first positional argument "
                "(the activation a cut passes on)"
            )
            return Trace([], problem=why)
        if not isinstance(out_of[name], torch.Tensor):
            kind = type(out_of[name]).__name__
            return Trace([], problem=f"block {name} returns a {kind}, not one tensor")
    prefix, suffix, late = [], [], []
    for part in parts:
        at = [i for i, c in enumerate(calls) if c[0] == part]
        if part not in holders:  # buffers only (rotary tables): run on every stage
            if at and all(i > last for i in at):
                late.append(part)
        elif all(i < first for i in at):
            prefix.append(part)  # (a part never called: the first stage keeps it)
        elif all(i > last for i in at):
            suffix.append(part)
        else:
            when = "between" if any(first < i < last for i in at) else "before and after"
            return Trace([], problem=f"its forward calls {part} {when} its blocks")
    stand_ins = {}
    for part in prefix:
        out = out_of.get(part)
        if part in out_of and not isinstance(out, torch.Tensor):
            kind = type(out).__name__
            return Trace([], problem=f"{part} returns a {kind}, which no stage can stand in for")
        if out is not None:
            stand_ins[part] = Output.of(out, TRACE_BATCH)
    # Forward FLOPs per block, what runs before and after them on the first and last.
    ends = [c[2] for c in calls if c[0] in blocks and c[1] == "out"]
    starts = [c[2] for c in entered]
    costs = [end - start for start, end in zip(starts, ends, strict=True)]
    costs[0] += starts[0]
    costs[-1] += calls[-1][2] - calls[last][2]
    return Trace(costs, False, tuple(prefix), tuple(suffix), tuple(late), stand_ins)


@contextlib.contextmanager
def _eval(module: nn.Module):
    modes = {m: m.training for m in module.modules()}
    module.eval()
    try:
        yield
    finally:
        for m, training in modes.items():
            m.training = training


class Stage(nn.Module):
    """Blocks [lo, hi) of a model: the stage's input (the model's on the first stage,
    the activation received on the others) -> what it sends on (the model's output on
    the last). `part` holds its parameters under the whole model's names.

    A later stage of a module with a forward of its own runs that forward on the
    model's real input, so what the forward derives from it (a padding mask) is right
    on every stage: `fed` queues the inputs of its next forwards (one per micro-batch,
    in the order the schedule runs them)."""

    def __init__(
        self, part: nn.Module, blocks: tuple[str, ...], t: Trace, lo: int, hi: int
    ) -> None:
        super().__init__()
        self.part, self.blocks, self.sequential = part, blocks, t.sequential
        self.lo, self.hi = lo, hi
        self._inputs: list[torch.Tensor] = []

    def fed(self, inputs: list[torch.Tensor]) -> Stage:
        self._inputs = list(inputs)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequential:  # its blocks chain
            return self.part(x)
        first, last = self.lo == 0, self.hi == len(self.blocks)
        seen: list[str] = []
        with contextlib.ExitStack() as hooks:
            if not first:
                if not self._inputs:
                    raise RuntimeError(f"stage from block {self.blocks[self.lo]} has no input fed")
                received, x = x, self._inputs.pop(0)

                def swap(_m: nn.Module, args: tuple) -> tuple:
                    seen.append("swapped")
                    return (received, *args[1:])

                at = self.part.get_submodule(self.blocks[self.lo]).register_forward_pre_hook(swap)
                hooks.callback(at.remove)
            if not last:
                at = self.part.get_submodule(self.blocks[self.hi]).register_forward_pre_hook(_send)
                hooks.callback(at.remove)
            try:
                out = self.part(x)
            except _Sent as sent:
                out = sent.activation
            except _Reached as e:  # past the stage's end without passing it
                raise RuntimeError(f"{self._skipped(self.hi)}; {e}") from None
            else:
                if not last:
                    raise RuntimeError(self._skipped(self.hi))
            if not first and not seen:
                raise RuntimeError(self._skipped(self.lo))
            return out

    def _skipped(self, block: int) -> str:
        # a block a training forward leaves out (layerdrop, stochastic depth)
        return (
            f"the forward did not call block {self.blocks[block]}, where this stage "
            "begins or ends (a block dropped at random in training cannot be cut at)"
        )


class _Sent(BaseException):
    """Not an error: how a stage leaves the model's forward at its cut (a
    BaseException, so a forward's own `except Exception` lets it through)."""

    def __init__(self, activation: torch.Tensor) -> None:
        super().__init__()
        self.activation = activation


def _send(_module: nn.Module, args: tuple) -> None:
    raise _Sent(args[0])


class _HandOn(nn.Module):
    """A block of an earlier stage: its input goes on (and is swapped at the stage)."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return x


class _StandIn(nn.Module):
    """A part of the first stage, seen from a later one: zeros of the shape it gives."""

    def __init__(self, out: Output) -> None:
        super().__init__()
        self.out = out
        self.register_buffer("where", torch.empty(0), persistent=False)  # moves with .to

    def forward(self, *args, **kwargs) -> torch.Tensor:
        given = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if self.out.per_sample and not given:
            raise RuntimeError("a stand-in for a per-sample part was given no tensor")
        return self.out.zeros(given[0].shape[0] if given else 0, self.where.device)


class _Absent(nn.Module):
    """A part of a later stage: never reached, the forward stopping before it."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, *args, **kwargs):
        raise _Reached(f"it reached {self.name}, which it does not hold")


class _Reached(RuntimeError):
    pass


def cut(model: Model, t: Trace, lo: int, hi: int) -> Stage:
    """Stage [lo, hi) of `model`. It shares the model's modules (no copy of a weight);
    the model itself is left as it is."""
    return _cut(model.module, model.block_names, t, lo, hi)


def _cut(module: nn.Module, blocks: tuple[str, ...], t: Trace, lo: int, hi: int) -> Stage:
    if t.problem:
        raise ValueError(t.problem)
    if t.sequential:  # the blocks [lo, hi), keeping their indices as names
        part = nn.Sequential(OrderedDict((str(i), module[i]) for i in range(lo, hi)))
        return Stage(part, blocks, t, lo, hi)
    swaps: dict[str, nn.Module] = {}
    if lo > 0:
        swaps.update({b: _HandOn() for b in blocks[:lo]})
        swaps.update({p: _StandIn(t.stand_ins[p]) for p in t.prefix if p in t.stand_ins})
        swaps.update({p: _Absent(p) for p in t.prefix if p not in t.stand_ins})
    if hi < len(blocks):
        swaps.update({name: _Absent(name) for name in (*blocks[hi:], *t.suffix)})
    return Stage(_swapped(module, swaps), blocks, t, lo, hi)


def _swapped(module: nn.Module, swaps: dict[str, nn.Module], prefix: str = "") -> nn.Module:
    """`module` with the submodules named in `swaps` replaced: each module on the way
    to one is a shallow copy with children of its own, the rest is shared."""
    if not any(name.startswith(prefix) for name in swaps):
        return module
    new = copy.copy(module)
    new._modules = dict(module._modules)
    for name, child in module._modules.items():
        full = prefix + name
        new._modules[name] = swaps[full] if full in swaps else _swapped(child, swaps, full + ".")
    return new


def place(model: Model, t: Trace, cuts: list[tuple[int, int]], devices: list[torch.device]) -> None:
    """Model parallelism in one process: each stage's blocks on its device, what runs
    after them on the last device, the rest on the first, each moved there once;
    each block and later part moves what it is given onto its device first (as
    transformers' device_map does)."""
    if t.problem:
        raise ValueError(t.problem)
    blocks = model.block_names
    where = {b: devices[k] for k, (lo, hi) in enumerate(cuts) for b in blocks[lo:hi]}
    where |= dict.fromkeys((*t.suffix, *t.late), devices[-1])
    for name, device in where.items():
        sub = model.module.get_submodule(name).to(device)
        if device != devices[0]:  # on the first device, its inputs are there already
            sub.register_forward_pre_hook(functools.partial(_move, device), with_kwargs=True)
    _to_except(model.module, set(where), devices[0])


def _to_except(module: nn.Module, placed: set[str], device: torch.device, prefix: str = "") -> None:
    """Move `module` to `device`, all but the submodules already placed."""
    if not any(name.startswith(prefix) for name in placed):
        module.to(device)
        return
    for key, buf in module._buffers.items():
        if buf is not None:
            module._buffers[key] = buf.to(device)
    for param in module._parameters.values():
        if param is not None:
            param.data = param.data.to(device)
    for name, child in module.named_children():
        if prefix + name not in placed:
            _to_except(child, placed, device, f"{prefix}{name}.")


def _move(device: torch.device, _module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    def to(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    return tree_map_only(torch.Tensor, to, (args, kwargs))


def boundary(
    model: Model, t: Trace, cuts: list[tuple[int, int]], stage: int, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) of `stage` on n samples of the model's batch, on the CPU: the
    shapes and dtypes a pipeline stage tells its neighbours, as zeros. Read on a fake
    copy of the model (no weight copied, none of the stages up to it run for real on
    the CPU); on the model itself where its forward reads values fake tensors lack."""
    x = example_batch(model, n)[0]
    if fake_mode_of(model.module) is not None:
        return _boundary(model.module, model.block_names, t, cuts[: stage + 1], x)
    try:
        return _boundary(_fake_copy(model.module), model.block_names, t, cuts[: stage + 1], x)
    except FAKE_LIMITS:
        return _boundary(model.module, model.block_names, t, cuts[: stage + 1], x)


def _boundary(
    module: nn.Module, blocks: tuple[str, ...], t: Trace, cuts: list[tuple[int, int]], x
) -> tuple[torch.Tensor, torch.Tensor]:
    """The last of `cuts`' (input, output) on input `x`, as zeros on the CPU."""
    with running(module) as bring, torch.no_grad():
        # on the module's device: a model built on the meta device (the rehearsal's) is
        # copied to fake tensors on meta, which a CPU batch cannot meet
        x = bring(x).to(next(module.parameters(), x).device)
        act = x
        for lo, hi in cuts[:-1]:
            act = _cut(module, blocks, t, lo, hi).fed([x])(act)
        out = _cut(module, blocks, t, *cuts[-1]).fed([x])(act)
    return torch.zeros(act.shape, dtype=act.dtype), torch.zeros(out.shape, dtype=out.dtype)
