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

Sequence parallel (the option `sequence_parallel`, on by default where the model
declares how: Model.sp_plan), as Megatron-LM (Korthikanti et al. 2022) and torchtitan
run TP: between the pairs each rank holds its 1/n of the sequence, not all of it. The
norms (and the residual adds) run on that part; a block's input is all-gathered before
its column-wise layers, and each row-wise layer's all-reduce becomes a reduce-scatter
onto the sequence: half the bytes of the all-reduce it replaces (in a ring, an
all-reduce is a reduce-scatter then an all-gather), the activations between blocks 1/n
of them. The embedding and the head are split over the vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from parabench.layout import Layout
from parabench.models.base import Model
from parabench.process.runtime import Context
from parabench.spec import RunSpec
from parabench.strategies.base import Strategy, full_params, make_optimizer, train_step

HEAD = "colwise_from_sequence"  # a sequence-parallel model's head (its sp_plan names it)

# The styles a plan names, by what each does to a (batch, sequence, width) activation.
STYLES = {
    "colwise": ColwiseParallel,  # whole input; this rank's slice of the outputs
    "rowwise": RowwiseParallel,  # this rank's slice of the inputs; outputs all-reduced
    # Sequence parallelism (Model.sp_plan): between blocks, the sequence is sharded.
    # A norm on this rank's part of the sequence (its weights replicated):
    "sequence": SequenceParallel,
    # A block's input, all-gathered from the sequence's parts before its column-wise
    # layers (its hidden states: the first positional input, or `hidden_states`):
    "gather": lambda: GatherSequence(),
    # A row-wise layer whose partial outputs are reduce-scattered onto the sequence:
    "rowwise_to_sequence": lambda: RowwiseParallel(output_layouts=Shard(1)),
    # An embedding split over the vocabulary, its output scattered onto the sequence:
    "embed_to_sequence": lambda: RowwiseParallel(
        input_layouts=Replicate(), output_layouts=Shard(1)
    ),
    # The same two, their outputs kept as DTensors: a model whose own code reads the
    # sequence's length off its hidden states (transformers' positions and masks) sees
    # the whole sequence's, and the residual stream stays one kind of tensor.
    "rowwise_to_sequence_dtensor": lambda: RowwiseParallel(
        output_layouts=Shard(1), use_local_output=False
    ),
    "embed_to_sequence_dtensor": lambda: RowwiseParallel(
        input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
    ),
    # A position table (positions first) split the same way, onto the positions:
    "positions_to_sequence": lambda: RowwiseParallel(
        input_layouts=Replicate(), output_layouts=Shard(0)
    ),
    # The head: the sequence gathered, the vocabulary split, the logits whole:
    HEAD: lambda: ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    # or the logits left split over the vocabulary, into a loss under loss_parallel:
    "colwise_to_loss": lambda: ColwiseParallel(
        input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
    ),
}


class GatherSequence(ParallelStyle):
    """A module's hidden states (its first positional input, else its `hidden_states`
    keyword) all-gathered over the sequence, whether they come as this rank's part (a
    plain tensor) or as a DTensor sharded on the sequence; torch's PrepareModuleInput
    takes one of the two calling conventions, fixed in advance. They stay a DTensor
    (replicated): in backward the column-wise layers' partial gradients sum, then one
    reduce-scatter puts them back on the sequence (a plain tensor would all-reduce
    each layer's)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def whole(x):
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
            return x.redistribute(device_mesh, (Replicate(),))

        def gather(_module, args, kwargs):
            if args:
                return (whole(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": whole(kwargs["hidden_states"])}

        module.register_forward_pre_hook(gather, with_kwargs=True)
        return module


def styles(plan: dict) -> dict:
    """The model's plan as torch's ParallelStyles (a custom one kept as it is)."""
    return {fqn: STYLES[s]() if isinstance(s, str) else s for fqn, s in plan.items()}


def plan_of(model: Model, sequence: bool, loss: bool = False) -> dict:
    """The model's tensor-parallel plan, sequence parallel where `sequence` and the
    model declares how (its sp_plan, which overrides and adds to its tp_plan); its
    head's logits left split for a parallel loss where `loss` (loss_parallel)."""
    if not sequence:
        return dict(model.tp_plan)
    plan = {**model.tp_plan, **model.sp_plan}
    return {k: "colwise_to_loss" if loss and v == HEAD else v for k, v in plan.items()}


def loss_parallel(model: Model, layout: Layout) -> bool:
    """Whether the loss runs on logits split over the vocabulary (torch's
    loss_parallel, as torchtitan's default): where TP is sequence parallel and the
    model's head is split, outside a pipeline (whose last stage gives the schedule a
    plain tensor, as its declared example is)."""
    return sequence_parallel(model, layout) and layout.pp == 1 and HEAD in model.sp_plan.values()


def plan_for(model: Model, layout: Layout) -> tuple[dict, bool]:
    """The layout's TP plan (plan_of, as the layout asks and the model allows) and
    whether its loss runs on the split logits (loss_parallel)."""
    split = loss_parallel(model, layout)
    return plan_of(model, sequence_parallel(model, layout), split), split


def sequence_parallel(model: Model, layout: Layout) -> bool:
    """Whether the layout's TP runs sequence parallel: asked, and the model allows it.
    Not in a pipeline whose stages would pass DTensors (a model whose hidden states
    stay DTensors, `_dtensor` styles): a stage sends plain tensors only."""
    if not (layout.sequence_parallel and model.sp_plan):
        return False
    dtensors = any(str(s).endswith("_dtensor") for s in model.sp_plan.values())
    return not (dtensors and layout.pp > 1)


class TensorParallel(Strategy):
    name = "tp"

    def __init__(self, model: Model, spec: RunSpec, ctx: Context) -> None:
        super().__init__(model, spec, ctx)
        mesh = ctx.mesh()
        blocks = model.module.to(ctx.device)
        plan, self.split_loss = plan_for(model, spec.layout)
        parallelize_module(blocks, mesh, styles(plan))
        self.module = blocks
        self.opt = make_optimizer(blocks.parameters(), spec)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # Every rank computes the same global loss; each contributes 1/n of it.
        loss = train_step(
            self.module, self.loss_fn, self.opt, x, y, self.autocast(), self.split_loss
        )
        return loss / self.ctx.world_size

    def full_state(self) -> dict[str, torch.Tensor] | None:
        return full_params(self.module, self.ctx)
