"""tp: tensor parallelism with DTensor `parallelize_module`, over a 1-D mesh of n ranks.

The model declares pairs of layers (models.Model.tp_plan): the first of a pair is split
column-wise (each rank computes a slice of its outputs), the second row-wise (each rank
multiplies its slice of the inputs, then one all-reduce sums the partial outputs). The
elementwise activation between them needs no communication. Forward costs one
all-reduce of the activations per row-wise layer; backward one per column-wise layer
(its replicated input's gradient is a partial sum on each rank): two per MLP pair
(Megatron-LM's), four per attention block whose q, k and v are separate layers.
Every rank sees the whole batch; layers outside the plan are replicated, and compute
identical gradients on every rank.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from parabench.models.base import Model
from parabench.runtime import Context
from parabench.spec import RunSpec
from parabench.strategies.base import Strategy, full_params, make_optimizer, train_step

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def styles(plan: dict) -> dict:
    """The model's plan as torch's ParallelStyles (a custom one kept as it is)."""
    return {fqn: STYLES[s]() if isinstance(s, str) else s for fqn, s in plan.items()}


class TensorParallel(Strategy):
    name = "tp"

    def __init__(self, model: Model, spec: RunSpec, ctx: Context) -> None:
        super().__init__(model, spec, ctx)
        mesh = ctx.mesh()
        blocks = model.module.to(ctx.device)
        parallelize_module(blocks, mesh, styles(model.tp_plan))
        self.module = blocks
        self.opt = make_optimizer(blocks.parameters(), spec)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # Every rank computes the same global loss; each contributes 1/n of it.
        loss = train_step(self.module, self.loss_fn, self.opt, x, y, self.autocast())
        return loss / self.ctx.world_size

    def full_state(self) -> dict[str, torch.Tensor] | None:
        return full_params(self.module, self.ctx)
