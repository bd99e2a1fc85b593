"""The contract every model keeps, presets and custom ones alike, and what is read off it.

A model is a module plus a loss and a batch generator:
- module(inputs) -> output; loss(output, target) -> scalar mean over the batch
- batch(batch_size, generator) -> (inputs, targets), deterministic given the generator,
  batch dimension first; parabench moves it to the device and slices it per rank
- block_names: the module's repeated blocks (FSDP's units, what `compile` compiles,
  what pipeline and model parallel cut their stages between: stages.py). Where the
  module is an nn.Sequential, its children are the blocks, each taking the previous
  one's output; any other module runs its own forward, unchanged.
- tp_plan (optional): module name (relative to the module) -> "colwise" | "rowwise"
  (or a torch ParallelStyle), each column-wise layer followed by its row-wise partner
- sp_plan (optional): what makes that plan sequence parallel (strategies/tp.py's
  STYLES): the norms, each block's input, the row-wise layers' outputs, the embedding
  and the head, for a model whose activations are (batch, sequence, width)
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)


@dataclass
class Model:
    module: nn.Module
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # batch(n, generator) -> (inputs, targets). Presets draw on the generator's device;
    # a custom model's batch is drawn on the CPU (device_batches False) and moved.
    batch: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    # Tensor parallelism: module names (relative to `module`) -> "colwise" | "rowwise".
    tp_plan: dict = field(default_factory=dict)
    device_batches: bool = True
    # Sequence parallelism: names -> STYLES of strategies/tp.py, over and beside tp_plan.
    sp_plan: dict = field(default_factory=dict)
    tokens_per_sample: int = 0  # language models: tokens in one sample (throughput)
    # The repeated blocks' names in `module`; an nn.Sequential's are its children.
    block_names: tuple[str, ...] = ()
    # Given a copy of `module`, the same maths in ops FlopCounterMode can all count,
    # where the model's own has one it cannot (transformers' sdpa attention on CPU):
    # process/flops.py, stages.trace.
    for_counting: Callable[[nn.Module], nn.Module] | None = None

    def __post_init__(self) -> None:
        if not self.block_names and self.sequential:
            self.block_names = tuple(name for name, _ in self.module.named_children())

    @property
    def sequential(self) -> bool:
        """The stage-cut contract: blocks in order, each taking the previous output."""
        return isinstance(self.module, nn.Sequential)

    def blocks(self) -> list[nn.Module]:
        return [self.module.get_submodule(name) for name in self.block_names]

    @property
    def label(self) -> str:
        """How the user's factory named the module (layer names in messages)."""
        return "blocks" if self.sequential else "module"


def example_batch(model: Model, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A CPU batch of n samples, for shapes and checks."""
    gen = torch.Generator().manual_seed(seed)
    return model.batch(n, gen)


def maths_notes(model: Model) -> dict[str, list[str]]:
    """Layers whose result depends on how the batch is split ("batch") or on random
    draws ("random"): under data parallelism or micro-batching their maths really
    changes, so a strategy that splits the batch differs from `single` for a reason,
    named here; random draws differ under every strategy."""
    notes: dict[str, list[str]] = {"batch": [], "random": []}
    for name, m in model.module.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            notes["batch"].append(
                f"{type(m).__name__} at {model.label}.{name} normalises over the samples one "
                "rank or micro-batch sees (B/n or B/m), not the whole batch B "
                "(SyncBatchNorm would restore it across ranks)"
            )
        elif isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            notes["random"].append(
                f"{type(m).__name__}(p={m.p}) at {model.label}.{name} draws random masks, "
                "which no two strategies draw alike"
            )
    return notes


# Fake tensors (torch's FakeTensorMode) have shapes, dtypes and devices but no storage
# and no values: a model built under the mode allocates nothing, so planning looks
# inside a 70B model in seconds. What needs values cannot run on them: these are how
# torch says so (not the model's fault; the cell, which runs it for real, will tell).
FAKE_LIMITS = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)


def fake_mode() -> FakeTensorMode:
    """A mode for building and running a model on fake tensors. Real tensors a model
    holds outside its parameters (a constant made at import) are taken as they are."""
    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def quiet_fake() -> Iterator[None]:
    """Torch logs a traceback for every op that fails on fake tensors, before raising
    it: a model's shape error, which the caller reports in one line naming the key."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def fake_mode_of(module: nn.Module) -> FakeTensorMode | None:
    """The mode `module` was built under, or None for a real module."""
    for t in itertools.chain(module.parameters(), module.buffers()):
        if isinstance(t, FakeTensor):
            return t.fake_mode
    return None


@contextlib.contextmanager
def running(module: nn.Module) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
    """Where to run `module`: inside its fake mode where it was built on fake tensors
    (so that what its forward creates is fake too), yielding what brings a real tensor
    (a batch drawn on the CPU) to it."""
    mode = fake_mode_of(module)
    if mode is None:
        yield lambda t: t
        return
    with quiet_fake(), mode:
        yield mode.from_tensor
