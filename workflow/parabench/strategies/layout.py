"""Layouts: several parallelisms at once, as degrees on a named device mesh.

One class for every layout (fsdp_tp, hsdp, ddp_pp, fsdp_pp, tp_pp...): its catalog
record declares the degrees (catalog.Degrees), runtime.start builds the mesh
(pp, dp_replicate, dp_shard, tp: outermost first, as torchtitan's ParallelDims), and
`parallelize` applies them to the unmodified model in torchtitan's order:

1. pipeline split: this rank's stage (its blocks), and the stage's example tensors,
   taken now: FSDP's lazy initialisation forbids running the stage once it is wrapped;
2. tensor parallel: the model's plan over the tp dimension, on the stage's layers;
3. activation checkpointing: each repeated block's forward (it must wrap TP's layers,
   so the recompute issues TP's collectives again, and sit inside FSDP's hooks);
4. compile: each block's forward, after AC;
5. data parallel: FSDP2 on dp_shard, or HSDP on (dp_replicate, dp_shard), per block
   then the root; or DDP over dp_replicate when nothing is sharded.

The root FSDP or DDP wraps is what a pipeline's schedule calls (the stage in its
precision): the schedule then runs DDP's and FSDP's gradient sync once per step, not
once per micro-batch. Without communication (Context.without_comm) every dimension is
the no-communication mesh's; a pipeline's stage still takes its first step over the
real pp group (pipeline.py says why).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

from parabench.data import Shard
from parabench.models import stages
from parabench.models.base import Model
from parabench.runtime import Context, NamedMesh
from parabench.spec import RunSpec
from parabench.strategies import checkpointing
from parabench.strategies.base import (
    Strategy,
    full_params,
    gather_state,
    make_optimizer,
    stage_cuts,
    train_step,
)
from parabench.strategies.fsdp import mark_launches
from parabench.strategies.pipeline import InPrecision, StageRun
from parabench.strategies.tp import plan_for, sequence_parallel, styles


class Layout(Strategy):
    name = "layout"  # each record's name: see `get`
    applies_ac_and_compile = True  # in its order, not strategies.build's

    def __init__(self, model: Model, spec: RunSpec, ctx: Context) -> None:
        super().__init__(model, spec, ctx)
        deg, mesh = spec.degrees, ctx.named_mesh()
        self.degrees, self.mesh = deg, mesh
        self.dp = deg["dp_replicate"] * deg["dp_shard"]
        self.run: StageRun | None = None
        self.split_loss = False  # the loss on vocabulary-split logits (tp.loss_parallel)
        part, blocks, example = model.module, model.blocks(), None
        if deg["pp"] > 1:  # 1. this rank's stage, and its example tensors now
            how = stages.trace(model)
            self.stage_cuts = stage_cuts(model, how, deg["pp"])
            index = mesh.coordinate("pp")
            lo, hi = self.stage_cuts[index]
            cut = stages.cut(model, how, lo, hi)
            micro = spec.global_batch // self.dp // spec.option("microbatches")
            example = stages.boundary(model, how, self.stage_cuts, index, micro)
            if deg["tp"] > 1 and sequence_parallel(model, spec):
                example = on_sequence(example, index, deg)
            part, blocks = cut.part, blocks[lo:hi]
        part.to(ctx.device)
        if deg["tp"] > 1:  # 2. the plan's layers this stage holds
            plan, self.split_loss = plan_for(model, spec)
            apply_tp(part, mesh, plan)
        # 3. the model's repeated blocks that AC picks, those of this stage
        checkpointing.apply(model.blocks(), spec.ac, within=blocks)
        if spec.compile:  # 4. each block's forward, in place
            for block in blocks or [part]:
                block.forward = torch.compile(block.forward)
        root: nn.Module = part
        if deg["pp"] > 1:
            root = InPrecision(cut, spec.precision, ctx.device)
        root = apply_data_parallel(root, blocks, mesh, deg, spec, ctx)  # 5.
        self.module, self.root = part, root  # its parameters, named as in the model
        self.opt = make_optimizer(part.parameters(), spec)
        if deg["pp"] > 1:
            real = ctx.meshes[0].group("pp")  # the first step's shapes go over it
            self.run = StageRun(
                root,
                cut,
                example,
                index,
                deg["pp"],
                real,
                None if ctx.communicates else mesh.group("pp"),
                spec,
                ctx,
                self.loss_fn,
            )

    @property
    def shard(self) -> Shard:
        """The data-parallel rank's slice: every rank of a tp group, and every stage of
        a pipeline, takes the same one."""
        m = self.mesh
        index = m.coordinate("dp_replicate") * self.degrees["dp_shard"]
        return Shard(index + m.coordinate("dp_shard"), self.dp)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # Each rank's loss is its data-parallel slice's mean, the same on each of a tp
        # group's ranks; losses exist on the last stage only. So 1/(the ranks holding a
        # loss) of each sums to the global mean.
        holders = self.ctx.world_size // self.degrees["pp"]
        if self.run is None:
            loss = train_step(
                self.root, self.loss_fn, self.opt, x, y, self.autocast(), self.split_loss
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


def on_sequence(
    example: tuple[torch.Tensor, torch.Tensor], index: int, deg: dict[str, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A stage's (input, output) as sequence parallelism passes them between stages:
    this rank's part of the sequence (dim 1), except the first stage's input (the
    tokens, whole) and the last stage's output (the logits, gathered)."""
    x, out = example
    if index > 0:
        x = x.tensor_split(deg["tp"], dim=1)[0].contiguous()
    if index < deg["pp"] - 1:
        out = out.tensor_split(deg["tp"], dim=1)[0].contiguous()
    return x, out


def apply_tp(part: nn.Module, mesh: NamedMesh, plan: dict) -> None:
    """The model's tensor-parallel plan over the tp dimension, on the layers `part`
    holds (a stage holds some); an error if none of them is in the plan, which would
    otherwise leave every layer whole and pass every check."""
    here = {}
    for name, style in plan.items():
        try:
            part.get_submodule(name)
        except AttributeError:
            continue  # another stage's layer
        here[name] = style
    if not here:
        raise ValueError(f"no layer of the tensor-parallel plan {sorted(plan)} is in this stage")
    parallelize_module(part, mesh.get("tp"), styles(here))


def apply_data_parallel(
    root: nn.Module,
    blocks: list[nn.Module],
    mesh: NamedMesh,
    deg: dict[str, int],
    spec: RunSpec,
    ctx: Context,
) -> nn.Module:
    """FSDP2 (HSDP when replicated too) per block then the root, or DDP over
    dp_replicate; `root` as it was without data parallelism."""
    if deg["dp_shard"] > 1:
        dims = ("dp_replicate", "dp_shard") if deg["dp_replicate"] > 1 else ("dp_shard",)
        # torchtitan's default: no reshard after forward in a pipeline, whose
        # micro-batches would gather every parameter again for each backward.
        reshard = spec.option("reshard_after_forward") if deg["pp"] == 1 else False
        dp_mesh = mesh.get(*dims)
        for block in blocks:
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=reshard)
        mark_launches(root)
        return root
    if deg["dp_replicate"] > 1:
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return DDP(root, device_ids=ids, process_group=mesh.group("dp_replicate"))
    return root
