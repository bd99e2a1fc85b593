"""The one small interface every strategy implements, and the pieces they share.

A strategy prepares the model its way (wrap, cut, place), runs one optimizer step on
its part of a global batch, and hands back the full parameters for the equivalence
check. It never times anything: the measurement loop (loop.py) does, once for all.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from parabench.data import Shard
from parabench.flops import block_flops
from parabench.models import Model
from parabench.partition import balanced_cuts
from parabench.runtime import Context
from parabench.spec import RunSpec


class Strategy(ABC):
    name: ClassVar[str]

    #: Set when devices are stand-ins (every stage on the CPU): the code path is real,
    #: the speedup is not.
    emulated: bool = False
    #: [lo, hi) block ranges per stage, for the strategies that cut the model.
    stage_cuts: list[tuple[int, int]] | None = None

    @classmethod
    def skip_reason(cls, spec: RunSpec, ctx: Context) -> str | None:
        """Why this cell cannot give an honest number on this machine, or None."""
        return None

    def __init__(self, model: Model, spec: RunSpec, ctx: Context) -> None:
        self.spec, self.ctx = spec, ctx
        self.loss_fn = model.loss_fn

    @property
    def shard(self) -> Shard:
        """Which slice of each global batch this process consumes."""
        return Shard(0, 1)

    @property
    def data_device(self) -> torch.device:
        return self.ctx.device

    def devices(self) -> list[torch.device]:
        """Devices this process drives: synchronized after each step, memory read."""
        return [self.ctx.device]

    @abstractmethod
    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step on this process's part of the global batch. Returns this
        process's contribution to the global mean loss (contributions sum over ranks)."""

    @abstractmethod
    def full_state(self) -> dict[str, torch.Tensor] | None:
        """All parameters of the model, on CPU, named as in the unwrapped model, on rank 0
        (None on other ranks). Collective: every rank must call it."""


def cpu_params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in module.named_parameters()}


def sgd(params, spec: RunSpec) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=spec.lr)


def train_step(
    module: nn.Module, loss_fn, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """Plain forward, backward, update: the baseline every strategy is measured against."""
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(module(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def stage_cuts(model: Model, stages: int) -> list[tuple[int, int]]:
    return balanced_cuts(block_flops(model), stages)


def stage_module(blocks: nn.Sequential, lo: int, hi: int) -> nn.Sequential:
    """Blocks [lo, hi) keeping their indices as names, so a stage's parameter names
    match the whole model's (stage 1's first Linear stays '2.0.weight')."""
    return nn.Sequential(OrderedDict((str(i), blocks[i]) for i in range(lo, hi)))


def gather_state(local: dict[str, torch.Tensor], ctx: Context) -> dict[str, torch.Tensor] | None:
    """Merge per-rank parameter dicts onto rank 0 (for strategies that split the model)."""
    if not ctx.distributed or ctx.world_size == 1:
        return local
    parts: list[dict | None] = [None] * ctx.world_size
    dist.all_gather_object(parts, local)
    if not ctx.is_main:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part or {})
    return merged
