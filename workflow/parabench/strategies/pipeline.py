"""pipeline: the model_parallel cut, one stage per rank, with torch.distributed.pipelining.

Each rank builds its stage as models/stages.py cuts it: blocks of an nn.Sequential, or
a model with a forward of its own run from one cut to the next, unchanged.

The global batch is split into m micro-batches that flow through the stages so several
stages work at once; GPipe runs all forwards then all backwards, 1F1B interleaves them
to bound activation memory (needs m >= stages). The idle share (bubble) is
(n-1)/(m+n-1). Each micro-batch's loss is divided by m before its backward, so one
step equals `single`'s step on the whole batch.

In bf16, activations and their gradients cross stage boundaries in bf16, as in real
bf16 pipelines; parameters, gradients and the optimizer stay fp32.

Without communication (Context.without_comm), the stage is built and first stepped over
the real group: the schedule's first step agrees on the stages' shapes by sending them,
which a group whose receives keep their buffers cannot answer. From its second step
on, its sends and receives return at once, its buffers holding the last real data.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from parabench.models import stages
from parabench.models.base import Model
from parabench.process.marks import OPTIMIZER, SCHEDULE, region
from parabench.process.runtime import Context
from parabench.spec import RunSpec
from parabench.strategies.base import (
    Strategy,
    autocast,
    cpu_params,
    gather_state,
    make_optimizer,
    stage_cuts,
)

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class InPrecision(nn.Module):
    """A stage run in the cell's precision. The schedule calls the stage itself, so the
    autocast context must live inside it (none where FSDP's mixed precision casts the
    parameters: `cast` False); the output is cast to the compute dtype so the next
    stage knows what it receives before anything runs."""

    def __init__(
        self, stage: nn.Module, precision: str, device: torch.device, cast: bool = True
    ) -> None:
        super().__init__()
        self.stage, self.precision, self.device = stage, precision, device
        self.cast = cast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with autocast(self.precision if self.cast else "fp32", self.device):
            return self.stage(x).to(DTYPES[self.precision])


class StageRun:
    """One rank's stage under its schedule: what a pipeline strategy and a pipelined
    layout share. `submod` is what the schedule calls (the stage in its precision,
    perhaps under FSDP or DDP, which the schedule then syncs once per step); `group`
    the pipeline's group, and `silent` the no-communication group it takes after the
    first step, or None (see the module's docstring)."""

    def __init__(
        self,
        submod: nn.Module,
        cut: stages.Stage,
        example: tuple[torch.Tensor, torch.Tensor],
        index: int,
        n: int,
        group: dist.ProcessGroup,
        silent: dist.ProcessGroup | None,
        spec: RunSpec,
        ctx: Context,
        loss_fn,
    ) -> None:
        self.first, self.last, self.cut = index == 0, index == n - 1, cut
        self.microbatches = m = spec.option("microbatches")
        # Static example tensors: shape inference would run the loss on uninitialised
        # data (BCELoss then fails about half the time). Tensors a gradient flows through
        # (every input but the first stage's, every output) must say so, or the stage
        # neither sends nor expects gradients.
        example_in, example_out = example
        wire = DTYPES[spec.precision]  # what crosses a stage boundary
        in_dtype = example_in.dtype if self.first else wire
        example_in = example_in.to(ctx.device, in_dtype).requires_grad_(not self.first)
        self.stage = PipelineStage(
            submod,
            index,
            n,
            ctx.device,
            input_args=(example_in,),
            output_args=(example_out.to(ctx.device, wire).requires_grad_(True),),
            group=group,
        )
        self._silence = silent
        # Each micro-batch's loss divided by m before its backward, not each gradient
        # by m after the last (scale_grads, in place): torchtitan's way, and the one
        # that works on DTensor gradients. Sequence-parallel TP leaves a norm's weight
        # gradient Partial until the optimizer, and torch 2.10's DTensor refuses an
        # in-place div_ on a Partial tensor (TP×PP failed there).
        self.schedule = SCHEDULES[spec.option("schedule")](
            self.stage,
            n_microbatches=m,
            loss_fn=lambda out, target: loss_fn(out, target) / m,
            scale_grads=False,
        )

    def train_step(
        self, x: torch.Tensor, y: torch.Tensor, opt: torch.optim.Optimizer
    ) -> torch.Tensor:
        """One optimizer step through the schedule: the global batch's mean loss on the
        last stage (each micro-batch loss is a mean over B/m samples, taken as 1/m of
        it, so their sum is the global one), zero elsewhere."""
        opt.zero_grad(set_to_none=True)
        losses = self.step(x, y)
        with region(OPTIMIZER):
            opt.step()
        if not self.last:
            return torch.zeros((), device=x.device)
        return torch.stack([loss.detach() for loss in losses]).sum()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        """The schedule's forwards and backwards of one step (not the update): the last
        stage's micro-batch losses, each 1/m of its micro-batch's mean; none elsewhere."""
        losses: list[torch.Tensor] = []
        # The first stage was told a contiguous input (the example is zeros), and its
        # micro-batches are x's rows, so they have x's strides: a model's batch may be a
        # view (gpt's inputs are tokens[:, :-1]). torch 2.11 checks every first-stage
        # input's strides and refuses a view; 2.13 checks only under
        # TORCH_DISTRIBUTED_DEBUG=DETAIL. contiguous() copies nothing when it already is.
        args = (x.contiguous(),) if self.first else ()
        if not (self.first or self.cut.sequential):  # its own forward takes the input
            self.cut.fed(list(x.tensor_split(self.microbatches)))
        kwargs = {"target": y, "losses": losses} if self.last else {}
        with region(SCHEDULE):
            self.schedule.step(*args, **kwargs)
        if self._silence is not None:
            self.stage.group, self._silence = self._silence, None
        return losses


class Pipeline(Strategy):
    name = "pipeline"

    def __init__(self, model: Model, spec: RunSpec, ctx: Context) -> None:
        super().__init__(model, spec, ctx)
        n, r = spec.devices, ctx.rank
        how = stages.trace(model)
        self.stage_cuts = stage_cuts(model, how, n)
        lo, hi = self.stage_cuts[r]
        cut = stages.cut(model, how, lo, hi)  # on the CPU, where the model was built
        micro = spec.global_batch // spec.option("microbatches")
        example = stages.boundary(model, how, self.stage_cuts, r, micro)
        self.cut = cut.to(ctx.device)
        self.module = cut.part  # its parameters, named as in the model
        self.opt = make_optimizer(self.module.parameters(), spec)
        self.run = StageRun(
            InPrecision(cut, spec.precision, ctx.device),
            cut,
            example,
            r,
            n,
            dist.group.WORLD,
            None if ctx.communicates else ctx.group,
            spec,
            ctx,
            self.loss_fn,
        )

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.run.train_step(x, y, self.opt)

    def full_state(self) -> dict[str, torch.Tensor] | None:
        return gather_state(cpu_params(self.module), self.ctx)
