"""Composed layouts: several parallelisms at once, as degrees on a named device mesh.

One class for every composed layout (fsdp_tp, hsdp, ddp_pp, fsdp_pp, tp_pp...): its
catalog record declares the degrees (a layout.Layout), RunSpec.layout settles them at the
cell's devices, runtime.start builds the mesh (pp, dp_replicate, dp_shard, tp:
outermost first, as torchtitan's ParallelDims), and strategies.parallelize applies them
to the unmodified model in torchtitan's order, the same function advise's fake-tensor
rank calls.

The root FSDP or DDP wraps is what a pipeline's schedule calls (the stage in its
precision): the schedule then runs DDP's and FSDP's gradient sync once per step, not
once per micro-batch. Without communication (Context.without_comm) every dimension is
the no-communication mesh's; a pipeline's stage still takes its first step over the
real pp group (pipeline.py says why).
"""

from __future__ import annotations

import contextlib

import torch

from parabench.models.base import Model
from parabench.process.data import Shard
from parabench.process.runtime import Context
from parabench.spec import RunSpec
from parabench.strategies.base import (
    Strategy,
    full_params,
    gather_state,
    make_optimizer,
    train_step,
)
from parabench.strategies.fsdp import mark_launches
from parabench.strategies.parallelize import parallelize
from parabench.strategies.pipeline import StageRun


class Composed(Strategy):
    name = "layout"  # each record's name: see `get`
    applies_ac_and_compile = True  # in its order, not strategies.build's

    def __init__(self, model: Model, spec: RunSpec, ctx: Context) -> None:
        super().__init__(model, spec, ctx)
        layout, mesh = spec.layout, ctx.named_mesh()
        self.layout, self.mesh = layout, mesh
        micro = (
            spec.global_batch // layout.dp // spec.option("microbatches") if layout.pp > 1 else 0
        )
        par = parallelize(
            model,
            layout,
            mesh,
            precision=spec.precision,
            device=ctx.device,
            compile=spec.compile,
            micro=micro,
        )
        if layout.dp_shard > 1:
            mark_launches(par.root)  # FSDP's collectives inside LAUNCH regions (process/marks.py)
        self.par = par
        self.module, self.root = par.part, par.root  # its parameters, named as in the model
        self.opt = make_optimizer(par.part.parameters(), spec)
        self.run: StageRun | None = None
        if par.stage is not None:
            self.stage_cuts = par.stage.cuts
            real = ctx.meshes[0].group("pp")  # the first step's shapes go over it
            self.run = StageRun(
                par.root,
                par.stage.cut,
                par.stage.example,
                par.stage.index,
                layout.pp,
                real,
                None if ctx.communicates else mesh.group("pp"),
                spec,
                ctx,
                self.loss_fn,
            )

    def autocast(self) -> contextlib.AbstractContextManager:
        # FSDP's mixed precision casts the parameters itself (torchtitan's way)
        return super().autocast() if self.par.autocast else contextlib.nullcontext()

    @property
    def shard(self) -> Shard:
        """The data-parallel rank's slice: every rank of a tp group, and every stage of
        a pipeline, takes the same one."""
        m = self.mesh
        index = m.coordinate("dp_replicate") * self.layout.dp_shard
        return Shard(index + m.coordinate("dp_shard"), self.layout.dp)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # Each rank's loss is its data-parallel slice's mean, the same on each of a tp
        # group's ranks; losses exist on the last stage only. So 1/(the ranks holding a
        # loss) of each sums to the global mean.
        holders = self.ctx.world_size // self.layout.pp
        if self.run is None:
            loss = train_step(
                self.root, self.loss_fn, self.opt, x, y, self.autocast(), self.par.split_loss
            )
        else:
            loss = self.run.train_step(x, y, self.opt)
        return loss / holders

    def full_state(self) -> dict[str, torch.Tensor] | None:
        # Each DTensor gathered over its own mesh (collective within the stage); then,
        # with stages, one rank of each stage (its first: data and tp index 0) sends its
        # stage to rank 0. Every other rank sends nothing: world copies of the model
        # through all_gather_object would be the cell's peak memory.
        whole = full_params(self.module, self.ctx, everywhere=True)
        if self.run is None:
            return whole if self.ctx.is_main else None
        m = self.mesh
        first = all(m.coordinate(d) == 0 for d in ("dp_replicate", "dp_shard", "tp"))
        return gather_state(whole if first else {}, self.ctx)
