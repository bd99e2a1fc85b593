"""grad_accum: k micro-batches of B/(n*k) per optimizer step, loss scaled by 1/k.

With n>1 ranks it runs under DDP and skips the all-reduce on all but the last
micro-batch: `no_sync` must wrap forward AND backward, since DDP arms its reducer hooks
in forward. Gradients are then all-reduced once per optimizer step.
"""

from __future__ import annotations

import contextlib

import torch

from parabench.models.base import Model
from parabench.process.data import Shard
from parabench.process.marks import BACKWARD, FORWARD, OPTIMIZER, region
from parabench.process.runtime import Context
from parabench.spec import RunSpec
from parabench.strategies.base import Strategy, cpu_params, make_optimizer
from parabench.strategies.ddp import wrap_ddp


class GradAccum(Strategy):
    name = "grad_accum"

    def __init__(self, model: Model, spec: RunSpec, ctx: Context) -> None:
        super().__init__(model, spec, ctx)
        self.k = spec.option("accum_steps")
        self.ddp = ctx.world_size > 1
        self.module = wrap_ddp(model, ctx) if self.ddp else model.module.to(ctx.device)
        self.opt = make_optimizer(self.module.parameters(), spec)

    @property
    def shard(self) -> Shard:
        return Shard(self.ctx.rank, self.ctx.world_size)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=x.device)
        xs, ys = x.chunk(self.k), y.chunk(self.k)
        for i, (xm, ym) in enumerate(zip(xs, ys, strict=True)):
            last = i == self.k - 1
            sync = contextlib.nullcontext() if last or not self.ddp else self.module.no_sync()
            with sync:
                with region(FORWARD):
                    with self.autocast():
                        out = self.module(xm)
                    loss = self.loss_fn(out, ym) / self.k
                with region(BACKWARD):
                    loss.backward()
            total += loss.detach()
        with region(OPTIMIZER):
            self.opt.step()
        return total / self.ctx.world_size

    def full_state(self) -> dict[str, torch.Tensor] | None:
        if not self.ctx.is_main:
            return None
        return cpu_params(self.module.module if self.ddp else self.module)
