"""parallelize: a Layout applied to a model, in torchtitan's order, the one place it is.

A benchmark cell of every layout (strategies/layout.py), the rehearsal of the GPU run
(which runs those cells on fake CUDA tensors) and advise's fake-tensor rank
(predict/fakerank.py) all call `parallelize`, so a cell and advise's price of the same layout
run the same code:

1. pipeline split (pp > 1): this rank's stage (its blocks), and the stage's example
   tensors, taken now: FSDP's lazy initialisation forbids running the stage once it is
   wrapped;
2. tensor parallel over tp: the model's plan on the stage's layers, sequence parallel
   where the layout asks and the model declares how (its norms and the activations
   between blocks sharded on the sequence, its head on the vocabulary, with the loss
   parallel: tp.plan_for);
3. activation checkpointing of each repeated block (it must wrap TP's layers, so the
   recompute issues TP's collectives again, and sit inside FSDP's hooks);
4. compile: each block's forward, after AC;
5. data parallel: FSDP2 on dp_shard, or HSDP on (dp_replicate, dp_shard), per block
   then the root; or DDP over dp_replicate when nothing is sharded.

Mixed precision as torchtitan's: with FSDP, its MixedPrecisionPolicy (bf16 parameters
in compute, gradients reduced in fp32, fp32 shards the optimizer steps) and no
autocast; without it, autocast around the forward (`Parallel.autocast`).

The one branch under fake tensors (`fake`): DDP is FSDP2's `replicate` (the same
all-reduce of the same fp32 gradients), since nn.parallel's C++ reducer runs below the
dispatcher, where no fake tensor reaches it. A fake rank has no pipeline: advise
measures a stage as a model of its blocks (`Layout.stage`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from parabench.layout import Layout
from parabench.models import stages
from parabench.models.base import Model
from parabench.process.runtime import NamedMesh
from parabench.strategies import checkpointing
from parabench.strategies.base import stage_cuts
from parabench.strategies.tp import plan_for, sequence_parallel, styles


@dataclass
class Stage:
    """This rank's pipeline stage: the cut, its place, and its example tensors."""

    cut: stages.Stage
    index: int
    cuts: list[tuple[int, int]]  # every stage's [lo, hi) blocks
    example: tuple[torch.Tensor, torch.Tensor]


@dataclass
class Parallel:
    """A model with a layout applied (`parallelize`)."""

    part: nn.Module  # what this rank holds: the model or its stage, named as in the model
    root: nn.Module  # what runs the forward: FSDP's or DDP's root, or the stage to schedule
    blocks: list[nn.Module]  # the repeated blocks it holds
    split_loss: bool  # the loss runs on vocabulary-split logits (tp.loss_parallel)
    autocast: bool  # the forward runs under bf16 autocast (False: fp32, or FSDP casts)
    stage: Stage | None = None  # a pipeline's


def parallelize(
    model: Model,
    layout: Layout,
    mesh: NamedMesh | None,
    *,
    precision: str = "fp32",
    device: torch.device | None = None,
    compile: bool = False,
    micro: int = 0,
    fake: bool = False,
) -> Parallel:
    """`layout` on `model` over `mesh` (None: a layout of one device), in torchtitan's
    order (the module's docstring). `device`: where the model's storage goes first
    (None: it stays where it is, the meta device for a fake rank); `micro`: samples per
    pipeline micro-batch (the stage's example tensors)."""
    if fake and layout.pp > 1:
        raise ValueError("a fake rank measures one stage as a model of its blocks: Layout.stage")
    part, blocks, stage = model.module, model.blocks(), None
    if layout.pp > 1:  # 1. this rank's stage, and its example tensors now
        stage = _stage(model, layout, mesh, micro)
        lo, hi = stage.cuts[stage.index]
        part, blocks = stage.cut.part, blocks[lo:hi]
    if device is not None:
        part.to(device)
    split_loss = False
    if layout.tp > 1:  # 2. the plan's layers this stage holds
        plan, split_loss = plan_for(model, layout)
        apply_tp(part, mesh, plan)
    # 3. the model's repeated blocks that AC picks, those of this stage
    checkpointing.apply(model.blocks(), layout.ac, within=blocks)
    if compile:  # 4. each block's forward, in place
        for block in blocks or [part]:
            block.forward = torch.compile(block.forward)
    # torchtitan's mixed precision: FSDP's policy where it shards, else autocast
    casts = precision == "bf16" and layout.dp_shard == 1
    root: nn.Module = part
    if stage is not None:
        from parabench.strategies.pipeline import InPrecision

        root = InPrecision(stage.cut, precision, device or torch.device("cpu"), casts)
    root = _data_parallel(root, blocks, mesh, layout, precision, device, fake)  # 5.
    return Parallel(part, root, blocks, split_loss, autocast=casts, stage=stage)


def _stage(model: Model, layout: Layout, mesh: NamedMesh, micro: int) -> Stage:
    how = stages.trace(model)
    cuts = stage_cuts(model, how, layout.pp)
    index = mesh.coordinate("pp")
    lo, hi = cuts[index]
    example = stages.boundary(model, how, cuts, index, micro)
    if layout.tp > 1 and sequence_parallel(model, layout):
        example = on_sequence(example, index, layout)
    return Stage(stages.cut(model, how, lo, hi), index, cuts, example)


def on_sequence(
    example: tuple[torch.Tensor, torch.Tensor], index: int, layout: Layout
) -> tuple[torch.Tensor, torch.Tensor]:
    """A stage's (input, output) as sequence parallelism passes them between stages:
    this rank's part of the sequence (dim 1), except the first stage's input (the
    tokens, whole) and the last stage's output (the logits, gathered)."""
    x, out = example
    if index > 0:
        x = x.tensor_split(layout.tp, dim=1)[0].contiguous()
    if index < layout.pp - 1:
        out = out.tensor_split(layout.tp, dim=1)[0].contiguous()
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


def fsdp_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's mixed precision as torchtitan's default: in bf16, parameters gathered and
    computed in bf16, gradients reduced in fp32, the optimizer stepping fp32 shards (and
    no autocast); in fp32, none."""
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def _data_parallel(
    root: nn.Module,
    blocks: list[nn.Module],
    mesh: NamedMesh | None,
    layout: Layout,
    precision: str,
    device: torch.device | None,
    fake: bool,
) -> nn.Module:
    """FSDP2 (HSDP when replicated too) per block then the root, or DDP over
    dp_replicate (torch's DistributedDataParallel, or FSDP2's `replicate`); `root` as
    it was without data parallelism."""
    if layout.dp_shard > 1:
        dims = ("dp_replicate", "dp_shard") if layout.dp_replicate > 1 else ("dp_shard",)
        mp = fsdp_policy(precision)
        dp_mesh, reshard = mesh.get(*dims), layout.zero == 3
        for block in blocks:
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
        return root
    if layout.dp_replicate > 1:
        # FSDP2's replicate (torchtitan's DDP) on fake tensors, which DDP's C++ reducer
        # cannot hold, and over TP's DTensor parameters, which DDP cannot broadcast
        if fake or layout.tp > 1:
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(root, mesh=mesh.get("dp_replicate"))
            return root
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device is not None and device.type == "cuda" else None
        return DDP(root, device_ids=ids, process_group=mesh.group("dp_replicate"))
    return root
