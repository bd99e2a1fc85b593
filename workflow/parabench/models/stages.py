"""Stages cut from a model, for pipeline and model parallelism.

An nn.Sequential is cut between its children: a stage is blocks [lo, hi), each taking
the previous one's output.

Any other module keeps its own forward, as torchtitan's stages keep their model's.
Stage k holds its blocks [lo, hi), the parts the forward runs before the first block
(embeddings) when it is the first stage, and those after the last block (final norm,
head) when it is the last. It runs the model's whole forward with what it does not
hold standing in: on a later stage the model's input is zeros, a part run before the
blocks gives zeros of its shape, and a block before the stage hands its input on. The
first block's input is swapped for the activation received, and the forward stops
when the block after the stage is called: that block's input is what the stage sends.
Parameter-free work (rotary embeddings, attention masks) runs on every stage, as in
torchtitan; parameter names stay the whole model's.

That is sound when the activation crossing a cut is all the forward carries from one
block to the next: each block takes the previous one's output (`h = block(h)`, as
transformers and torchtitan models do), not a sum formed around it (`h = h +
block(h)`). `trace` reads the forward once on a real sample, checks that, and checks
that the stages chained give the model's output; a model that fails says why
(ModelFacts.cut_skip), and its stage cells are skipped.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_map_only
from torch.utils.flop_counter import FlopCounterMode

from parabench.flops import block_flops
from parabench.models.base import Model, example_batch

TRACE_BATCH = 3  # samples in the traced forward: a batch dimension tells itself apart


@dataclass(frozen=True)
class Output:
    """A tensor the traced forward saw, for a stage that stands in for it."""

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

    costs: list[int]  # per block, what stage balancing weighs (flops.block_flops)
    prefix: tuple[str, ...] = ()  # parts holding parameters, run before the first block
    suffix: tuple[str, ...] = ()  # ... and after the last
    stand_ins: dict[str, Output] = field(default_factory=dict)  # the prefix parts' outputs
    sample: Output | None = None  # the model's input
    problem: str | None = None  # why no stage can be cut from it


def trace(model: Model) -> Trace:
    """Read the forward once on a real CPU sample (a module with a forward of its own;
    an nn.Sequential needs no reading)."""
    if model.sequential:
        return Trace(block_flops(model))
    blocks = model.block_names
    if not blocks:
        return Trace([], problem="no repeated blocks were found to cut between")
    parts, problem = _parts(model.module, blocks)
    if problem:
        return Trace([], problem=problem)
    # The counting copy (flops.py) has the same names and maths, and its FLOPs count.
    module = model.counting_module() if model.counting_module else model.module
    x = example_batch(model, TRACE_BATCH)[0]
    try:
        with _eval(module), torch.no_grad():  # no dropout: the chain is compared below
            calls, whole = _calls(module, blocks, parts, x)
            t = _read(calls, blocks, parts, x)
            if t.problem:
                return t
            act = x
            for i in range(len(blocks)):  # a cut at every boundary
                act = _cut(module, blocks, t, i, i + 1)(act)
    except Exception as e:  # a forward that a stage's stand-ins break
        why = f"its forward fails when cut into stages ({type(e).__name__}: {e})"
        return Trace([], problem=why)
    if not (isinstance(whole, torch.Tensor) and act.shape == whole.shape):
        return Trace([], problem="its forward returns no tensor, or the stages chained do not")
    if not torch.allclose(act, whole, rtol=1e-4, atol=1e-5):
        gap = float((act - whole).abs().max())
        return Trace(
            [],
            problem=(
                "the stages chained do not give its output (largest difference "
                f"{gap:.2g}): its forward carries more than one activation across blocks"
            ),
        )
    return t


def _parts(module: nn.Module, blocks: tuple[str, ...]) -> tuple[list[str], str | None]:
    """The largest submodules outside the blocks that hold parameters (embeddings, a
    final norm, the head), or why the model has parameters no stage could own. A
    ModuleList or ModuleDict is no part: it is never called, its members are."""
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
            elif any(True for _ in child.parameters()):
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
    """(name, "in" | "out", FLOPs so far, first argument | output) per call of a block
    or part, in order, and the forward's output."""
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


def _read(calls: list[tuple], blocks, parts, x) -> Trace:
    """The trace from the calls, or the first reason no cut would be sound."""
    entered = [c for c in calls if c[0] in blocks and c[1] == "in"]
    if [c[0] for c in entered] != list(blocks):
        order = ", ".join(c[0] for c in entered) or "none"
        why = f"its forward does not call its blocks once each in order ({order})"
        return Trace([], problem=why)
    first = calls.index(entered[0])
    last = max(i for i, c in enumerate(calls) if c[0] == blocks[-1] and c[1] == "out")
    out_of = {c[0]: c[3] for c in calls if c[1] == "out"}
    for i, (name, _, _, arg) in enumerate(entered):
        if not isinstance(arg, torch.Tensor):
            return Trace([], problem=f"block {name} takes no tensor as its first argument")
        if not isinstance(out_of[name], torch.Tensor):
            kind = type(out_of[name]).__name__
            return Trace([], problem=f"block {name} returns a {kind}, not one tensor")
        if i and arg is not out_of[blocks[i - 1]]:
            return Trace(
                [],
                problem=(
                    f"block {name}'s input is not block {blocks[i - 1]}'s output: the "
                    "forward combines them with more (as in h = h + block(h)), which a "
                    "cut between them would lose"
                ),
            )
    prefix, suffix = [], []
    for part in parts:
        at = [i for i, c in enumerate(calls) if c[0] == part]
        if all(i < first for i in at):
            prefix.append(part)  # (a part never called: the first stage keeps it)
        elif all(i > last for i in at):
            suffix.append(part)
        else:
            return Trace([], problem=f"its forward runs {part} between its blocks")
    stand_ins = {}
    for part in prefix:
        out = out_of.get(part)
        if part in out_of and not isinstance(out, torch.Tensor):
            kind = type(out).__name__
            return Trace([], problem=f"{part} returns a {kind}, which no stage can stand in for")
        if out is not None:
            stand_ins[part] = Output.of(out, TRACE_BATCH)
    # Forward FLOPs per block, what runs before and after them on the first and last.
    costs = [c[2] for c in calls if c[0] in blocks and c[1] == "out"]
    starts = [c[2] for c in entered]
    costs = [end - start for start, end in zip(starts, costs, strict=True)]
    costs[0] += starts[0]
    costs[-1] += calls[-1][2] - calls[last][2]
    sample = Output.of(x, TRACE_BATCH)
    return Trace(costs, tuple(prefix), tuple(suffix), stand_ins, sample)


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
    the last). `part` holds its parameters under the whole model's names."""

    def __init__(
        self, part: nn.Module, blocks: tuple[str, ...], sample: Output | None, lo: int, hi: int
    ) -> None:
        super().__init__()
        self.part, self.blocks, self.sample, self.lo, self.hi = part, blocks, sample, lo, hi

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sample is None:  # an nn.Sequential: its blocks chain
            return self.part(x)
        first, last = self.lo == 0, self.hi == len(self.blocks)
        with contextlib.ExitStack() as hooks:
            if not first:
                received = x
                swap = self.part.get_submodule(self.blocks[self.lo]).register_forward_pre_hook(
                    lambda _m, args: (received, *args[1:])
                )
                hooks.callback(swap.remove)
                x = self.sample.zeros(x.shape[0], x.device)
            if not last:
                stop = self.part.get_submodule(self.blocks[self.hi]).register_forward_pre_hook(
                    _send
                )
                hooks.callback(stop.remove)
            try:
                return self.part(x)
            except _Sent as sent:
                return sent.activation


class _Sent(Exception):
    """Not an error: how a stage leaves the model's forward at its cut."""

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
        raise RuntimeError(f"a stage reached {self.name}, which it does not hold")


def cut(model: Model, t: Trace, lo: int, hi: int) -> Stage:
    """Stage [lo, hi) of `model`. It shares the model's modules (no copy of a weight);
    the model itself is left as it is."""
    return _cut(model.module, model.block_names, t, lo, hi)


def _cut(module: nn.Module, blocks: tuple[str, ...], t: Trace, lo: int, hi: int) -> Stage:
    if t.problem:
        raise ValueError(t.problem)
    if t.sample is None:  # nn.Sequential: the blocks [lo, hi), keeping their indices
        part = nn.Sequential(OrderedDict((str(i), module[i]) for i in range(lo, hi)))
        return Stage(part, blocks, None, lo, hi)
    swaps: dict[str, nn.Module] = {}
    if lo > 0:
        swaps.update({b: _HandOn() for b in blocks[:lo]})
        swaps.update({p: _StandIn(t.stand_ins[p]) for p in t.prefix if p in t.stand_ins})
        swaps.update({p: _Absent(p) for p in t.prefix if p not in t.stand_ins})
    if hi < len(blocks):
        swaps.update({name: _Absent(name) for name in (*blocks[hi:], *t.suffix)})
    return Stage(_swapped(module, swaps), blocks, t.sample, lo, hi)


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
    """Model parallelism in one process: each stage's blocks on its device, the parts
    run before them on the first device, those after on the last; each block and later
    part moves what it is given onto its device first (as accelerate's device_map)."""
    if t.problem:
        raise ValueError(t.problem)
    model.module.to(devices[0])
    owners = [(model.block_names[lo:hi], d) for (lo, hi), d in zip(cuts, devices, strict=True)]
    for names, device in [*owners, (t.suffix, devices[-1])]:
        for name in names:
            sub = model.module.get_submodule(name).to(device)
            sub.register_forward_pre_hook(functools.partial(_move, device), with_kwargs=True)


def _move(device: torch.device, _module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    def to(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    return tree_map_only(torch.Tensor, to, (args, kwargs))


def boundary(model: Model, t: Trace, cuts: list[tuple[int, int]], stage: int, n: int):
    """(input, output) of `stage` on n samples of the model's batch, on the CPU: the
    shapes and dtypes a pipeline stage tells its neighbours."""
    act = example_batch(model, n)[0]
    with torch.no_grad():
        for lo, hi in cuts[:stage]:
            act = cut(model, t, lo, hi)(act)
        lo, hi = cuts[stage]
        return act, cut(model, t, lo, hi)(act)
