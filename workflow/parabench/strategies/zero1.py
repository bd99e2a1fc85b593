"""zero1: DDP with ZeroRedundancyOptimizer (ZeRO stage 1). Gradients are all-reduced as
in DDP; each rank then updates only the parameters it owns, with optimizer state for
those alone, and broadcasts them to the others. Optimizer state per rank shrinks to the
owned share; parameters and gradients stay replicated.

torch partitions whole parameters over ranks (largest first, to the least loaded rank),
so a model whose first layer holds most of the weights cannot be split evenly.
"""

from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from parabench.strategies.base import optimizer_class
from parabench.strategies.ddp import DistributedDataParallel


class Zero1(DistributedDataParallel):
    name = "zero1"

    def make_opt(self, params) -> torch.optim.Optimizer:
        cls, kwargs = optimizer_class(self.spec)
        group = self.ctx.group
        return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=group, **kwargs)

    def local_optimizer(self) -> torch.optim.Optimizer:
        return self.opt.optim  # the inner optimizer over this rank's parameters only
