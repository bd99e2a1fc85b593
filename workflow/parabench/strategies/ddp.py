"""ddp: DistributedDataParallel, one process per device (torchrun). Each rank takes its
B/n slice of the global batch; DDP all-reduces gradient buckets during backward, so
communication overlaps the remaining backward compute. NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from parabench.models.base import Model
from parabench.process.data import Shard
from parabench.process.runtime import Context
from parabench.spec import RunSpec
from parabench.strategies.base import Strategy, cpu_params, make_optimizer, train_step


def wrap_ddp(model: Model, ctx: Context) -> DDP:
    module = model.module.to(ctx.device)
    # On CPU, device_ids must be None: the module stays where it is.
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DDP(module, device_ids=ids, process_group=ctx.group)


class DistributedDataParallel(Strategy):
    name = "ddp"

    def __init__(self, model: Model, spec: RunSpec, ctx: Context) -> None:
        super().__init__(model, spec, ctx)
        self.module = wrap_ddp(model, ctx)
        self.opt = self.make_opt(self.module.parameters())

    def make_opt(self, params) -> torch.optim.Optimizer:
        return make_optimizer(params, self.spec)

    @property
    def shard(self) -> Shard:
        return Shard(self.ctx.rank, self.ctx.world_size)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # DDP averages gradients over ranks, so the mean of per-rank mean losses is the
        # global mean loss: each rank contributes 1/n of its own.
        loss = train_step(self.module, self.loss_fn, self.opt, x, y, self.autocast())
        return loss / self.ctx.world_size

    def full_state(self) -> dict[str, torch.Tensor] | None:
        # Replicas are identical after every step; rank 0's copy is the model.
        return cpu_params(self.module.module) if self.ctx.is_main else None
