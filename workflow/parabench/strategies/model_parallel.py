"""model_parallel: one process, the model cut into n consecutive stages on n devices.

Each stage's blocks sit on its device (models/stages.py cuts them) and the model's own
forward runs, each block moving its input to its device first; activations move stage
to stage in forward, gradients back in backward, one stage busy at a time (the seeds'
naive scheme: no micro-batches, no overlap; transformers' device_map does the same).
On CPU every stage sits on `cpu`: the code path is real, the speedup is not (the
record says emulated).
"""

from __future__ import annotations

import torch

from parabench.models import stages
from parabench.models.base import Model
from parabench.process.runtime import Context
from parabench.spec import RunSpec
from parabench.strategies.base import (
    Strategy,
    cpu_params,
    make_optimizer,
    stage_cuts,
    train_step,
)


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
        how = stages.trace(model)
        self.stage_cuts = stage_cuts(model, how, n)
        stages.place(model, how, self.stage_cuts, self._devices)
        self.module = model.module
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
        return cpu_params(self.module)
