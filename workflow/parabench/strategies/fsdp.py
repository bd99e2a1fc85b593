"""fsdp: FSDP2, `fully_shard` on each block and then on the root, over a 1-D device mesh
of n ranks; each rank takes B/n of the global batch.

Parameters, gradients and optimizer state are sharded: each rank holds 1/n of every
parameter (dim 0, padded to divide) as a DTensor. Before a block's forward its
parameters are all-gathered; after its backward, gradients are reduce-scattered (and
averaged), so the optimizer steps on the local shard only. reshard_after_forward=True
frees the gathered parameters after forward and gathers them again in backward (ZeRO-3);
False keeps them from forward to backward (ZeRO-2-like: less communication, more memory).
In bf16, FSDP2's mixed precision as torchtitan's and the layouts' (parallelize.fsdp_policy):
bf16 parameters gathered and computed, gradients reduced in fp32, no autocast.

Each all-gather and reduce-scatter is called inside a `launch` region (process/marks.py): on
gloo the calls take the main thread 2-3 ms a step on its core (default mlp, 2 ranks),
which is communication's cost. The no-communication group's calls still copy into
their outputs (1.1-1.7 ms a step here, measured the same way), and step_nocomm_s
keeps them: the work check reads FSDP's compute a few percent low.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import fully_shard

from parabench.models.base import Model
from parabench.process import marks
from parabench.process.data import Shard
from parabench.process.runtime import Context
from parabench.spec import RunSpec
from parabench.strategies.base import Strategy, full_params, make_optimizer, train_step
from parabench.strategies.parallelize import fsdp_policy


class FullyShard(Strategy):
    name = "fsdp"

    def __init__(self, model: Model, spec: RunSpec, ctx: Context) -> None:
        super().__init__(model, spec, ctx)
        mesh = ctx.mesh()
        module = model.module.to(ctx.device)
        reshard = spec.option("reshard_after_forward")
        mp = fsdp_policy(spec.precision)  # as the layouts' FSDP (strategies/parallelize.py)
        for block in model.blocks():  # one all-gather / reduce-scatter unit per block
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
        mark_launches(module)
        self.module = module
        self.opt = make_optimizer(module.parameters(), spec)

    @property
    def shard(self) -> Shard:
        return Shard(self.ctx.rank, self.ctx.world_size)

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # FSDP's mixed precision casts the parameters

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # Gradients are averaged over ranks (reduce-scatter), as in DDP.
        loss = train_step(self.module, self.loss_fn, self.opt, x, y, self.autocast())
        return loss / self.ctx.world_size

    def full_state(self) -> dict[str, torch.Tensor] | None:
        return full_params(self.module, self.ctx)


def mark_launches(module: torch.nn.Module) -> None:
    """Every FSDP unit's collectives called inside a LAUNCH region, through FSDP's own
    hooks for custom comms (the default ones, wrapped). Where this torch has no such
    hooks, the calls stay unmarked and count as compute."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            DefaultAllGather,
            DefaultReduceScatter,
        )
    except ImportError:
        return

    all_gather, reduce_scatter = _marked(DefaultAllGather), _marked(DefaultReduceScatter)
    for unit in module.modules():
        if hasattr(unit, "set_custom_all_gather") and hasattr(unit, "set_custom_reduce_scatter"):
            unit.set_custom_all_gather(all_gather())
            unit.set_custom_reduce_scatter(reduce_scatter())


def _marked(comm: type) -> type:
    """`comm` (one of FSDP's collectives) with each call inside a LAUNCH region."""

    class Marked(comm):
        def __call__(self, *args, **kwargs):
            with marks.region(marks.LAUNCH):
                return super().__call__(*args, **kwargs)

    return Marked
