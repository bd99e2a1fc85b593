"""single: one device, the whole global batch. The baseline for speedup and equivalence."""

from __future__ import annotations

import torch

from parabench.models.base import Model
from parabench.process.runtime import Context
from parabench.spec import RunSpec
from parabench.strategies.base import Strategy, cpu_params, make_optimizer, train_step


class Single(Strategy):
    name = "single"

    def __init__(self, model: Model, spec: RunSpec, ctx: Context) -> None:
        super().__init__(model, spec, ctx)
        self.module = model.module.to(ctx.device)
        self.opt = make_optimizer(self.module.parameters(), spec)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return train_step(self.module, self.loss_fn, self.opt, x, y, self.autocast())

    def full_state(self) -> dict[str, torch.Tensor]:
        return cpu_params(self.module)
