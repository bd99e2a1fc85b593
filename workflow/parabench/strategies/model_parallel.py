"""model_parallel: one process, the model cut into n consecutive stages on n devices.

Activations move stage to stage in forward, gradients back in backward, one stage busy
at a time (the seeds' naive scheme: no micro-batches, no overlap). On CPU every stage
sits on `cpu`: the code path is real, the speedup is not (the record says emulated).
"""

from __future__ import annotations

import torch
from torch import nn

from parabench.models.base import Model
from parabench.runtime import Context
from parabench.spec import RunSpec
from parabench.strategies.base import (
    Strategy,
    cpu_params,
    make_optimizer,
    stage_cuts,
    stage_module,
    train_step,
)


class Staged(nn.Module):
    """Stages on their devices; forward carries the activation across."""

    def __init__(self, stages: list[nn.Module], devices: list[torch.device]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(s.to(d) for s, d in zip(stages, devices, strict=True))
        self.placement = devices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage, device in zip(self.stages, self.placement, strict=True):
            x = stage(x.to(device, non_blocking=True))
        return x


class ModelParallel(Strategy):
    name = "model_parallel"

    def __init__(self, model: Model, spec: RunSpec, ctx: Context) -> None:
        super().__init__(model, spec, ctx)
        n = spec.devices
        if ctx.device.type == "cuda":
            self._devices = [torch.device("cuda", i) for i in range(n)]
        else:
            self._devices = [ctx.device] * n
            self.emulated = n > 1
        self.stage_cuts = stage_cuts(model, n)
        stages = [stage_module(model.module, lo, hi) for lo, hi in self.stage_cuts]
        self.module = Staged(stages, self._devices)
        self.opt = make_optimizer(self.module.parameters(), spec)

    @property
    def data_device(self) -> torch.device:
        return self._devices[0]

    def devices(self) -> list[torch.device]:
        return list(dict.fromkeys(self._devices))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # The labels must reach the last stage, where the loss is computed.
        y = y.to(self._devices[-1], non_blocking=True)
        return train_step(self.module, self.loss_fn, self.opt, x, y, self.autocast())

    def full_state(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for stage in self.module.stages:
            out.update(cpu_params(stage))
        return out
