"""dp: nn.DataParallel. One process scatters the batch over n GPUs, replicates the model
on every forward, and gathers outputs on GPU 0, where the loss is computed.

On a CPU-only torch, DataParallel silently ignores device_ids and runs one copy; a cell
asking for n>1 devices there is skipped, never timed under a "DataParallel" label.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from parabench.checks import static_skip_reason
from parabench.models.base import Model
from parabench.runtime import Context
from parabench.spec import RunSpec
from parabench.strategies.base import Strategy, cpu_params, make_optimizer, train_step


class DataParallel(Strategy):
    name = "dp"

    @classmethod
    def skip_reason(cls, spec: RunSpec, ctx: Context) -> str | None:
        if ctx.device.type != "cuda":  # also device "auto" that found no GPU
            return static_skip_reason(replace(spec, device="cpu"))
        return super().skip_reason(spec, ctx)

    def __init__(self, model: Model, spec: RunSpec, ctx: Context) -> None:
        super().__init__(model, spec, ctx)
        inner = model.module.to(ctx.device)
        ids = list(range(spec.devices)) if ctx.device.type == "cuda" else None
        self.module = nn.DataParallel(inner, device_ids=ids)
        self.opt = make_optimizer(self.module.parameters(), spec)
        self._devices = [torch.device("cuda", i) for i in ids] if ids else [ctx.device]

    def devices(self) -> list[torch.device]:
        return self._devices

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return train_step(self.module, self.loss_fn, self.opt, x, y, self.autocast())

    def full_state(self) -> dict[str, torch.Tensor]:
        return cpu_params(self.module.module)
