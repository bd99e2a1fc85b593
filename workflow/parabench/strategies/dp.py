"""dp: nn.DataParallel. One process scatters the batch over n GPUs, replicates the model
on every forward, and gathers outputs on GPU 0, where the loss is computed.

On a CPU-only torch, DataParallel silently ignores device_ids and runs one copy; a cell
asking for n>1 devices there is skipped, never timed under a "DataParallel" label.

Each replica runs its forward in a thread of its own (nn.parallel.parallel_apply), which
enters autocast without a dtype, and the autocast dtype is per thread: a new thread's
is CUDA's default, fp16. So the replicas enter the cell's precision themselves
(`_Precision`); otherwise a bf16 cell would compute in fp16.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from parabench.checks import static_skip_reason
from parabench.models.base import Model
from parabench.process.runtime import Context
from parabench.spec import RunSpec
from parabench.strategies.base import (
    Strategy,
    autocast,
    cpu_params,
    make_optimizer,
    train_step,
)


class _Precision(nn.Module):
    """`module` under the cell's precision, entered by whichever thread runs it."""

    def __init__(self, module: nn.Module, precision: str, device: torch.device) -> None:
        super().__init__()
        self.module = module
        self.precision, self.device = precision, device

    def forward(self, *args, **kwargs):
        with autocast(self.precision, self.device):
            return self.module(*args, **kwargs)


class DataParallel(Strategy):
    name = "dp"

    @classmethod
    def skip_reason(cls, spec: RunSpec, ctx: Context) -> str | None:
        if ctx.device.type != "cuda":  # also device "auto" that found no GPU
            return static_skip_reason(replace(spec, device="cpu"))
        return super().skip_reason(spec, ctx)

    def __init__(self, model: Model, spec: RunSpec, ctx: Context) -> None:
        super().__init__(model, spec, ctx)
        self._model = model.module.to(ctx.device)
        ids = list(range(spec.devices)) if ctx.device.type == "cuda" else None
        replica = _Precision(self._model, spec.precision, ctx.device)
        self.module = nn.DataParallel(replica, device_ids=ids)
        self.opt = make_optimizer(self.module.parameters(), spec)
        self._devices = [torch.device("cuda", i) for i in ids] if ids else [ctx.device]

    def devices(self) -> list[torch.device]:
        return self._devices

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # The outer autocast is the shared step's; the replicas enter their own.
        return train_step(self.module, self.loss_fn, self.opt, x, y, self.autocast())

    def full_state(self) -> dict[str, torch.Tensor]:
        return cpu_params(self._model)  # named as in the unwrapped model
