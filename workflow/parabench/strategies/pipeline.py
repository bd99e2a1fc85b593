"""pipeline: the model_parallel cut, one stage per rank, with torch.distributed.pipelining.

The global batch is split into m micro-batches that flow through the stages so several
stages work at once; GPipe runs all forwards then all backwards, 1F1B interleaves them
to bound activation memory (needs m >= stages). The idle share (bubble) is
(n-1)/(m+n-1). The schedule divides gradients by m (scale_grads), so one step equals
`single`'s step on the whole batch.
"""

from __future__ import annotations

import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from parabench.models import Model
from parabench.runtime import Context
from parabench.spec import RunSpec
from parabench.strategies.base import (
    Strategy,
    cpu_params,
    gather_state,
    sgd,
    stage_cuts,
    stage_module,
)

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class Pipeline(Strategy):
    name = "pipeline"

    @classmethod
    def skip_reason(cls, spec: RunSpec, ctx: Context) -> str | None:
        if ctx.device.type == "cuda" and torch.cuda.device_count() <= ctx.local_rank:
            return (
                f"{spec.devices} stages need {spec.devices} CUDA devices; "
                f"{torch.cuda.device_count()} visible"
            )
        return None

    def __init__(self, model: Model, spec: RunSpec, ctx: Context) -> None:
        super().__init__(model, spec, ctx)
        n, r = spec.devices, ctx.rank
        self.first, self.last = r == 0, r == n - 1
        self.stage_cuts = stage_cuts(model, n)
        lo, hi = self.stage_cuts[r]
        cpu_stage = stage_module(model.blocks, lo, hi)

        # Static example tensors: shape inference would run the loss on uninitialised
        # data (BCELoss then fails about half the time). Tensors a gradient flows through
        # (every input but the first stage's, every output) must say so, or the stage
        # neither sends nor expects gradients.
        micro = spec.global_batch // spec.microbatches
        with torch.no_grad():
            act = torch.zeros(micro, model.in_features)
            for i in range(lo):
                act = model.blocks[i](act)
            example_in = act.clone()
            example_out = cpu_stage(act)
        self.module = cpu_stage.to(ctx.device)
        self.opt = sgd(self.module.parameters(), spec)
        example_in = example_in.to(ctx.device).requires_grad_(not self.first)
        stage = PipelineStage(
            self.module,
            r,
            n,
            ctx.device,
            input_args=(example_in,),
            output_args=(example_out.to(ctx.device).requires_grad_(True),),
        )
        self.schedule = SCHEDULES[spec.schedule](
            stage, n_microbatches=spec.microbatches, loss_fn=self.loss_fn
        )

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        kwargs = {"target": y, "losses": losses} if self.last else {}
        self.schedule.step(*args, **kwargs)
        self.opt.step()
        if not self.last:
            return torch.zeros((), device=self.ctx.device)
        # Each micro-batch loss is a mean over B/m samples; their mean is the global mean.
        return torch.stack([loss.detach() for loss in losses]).mean()

    def full_state(self) -> dict[str, torch.Tensor] | None:
        return gather_state(cpu_params(self.module), self.ctx)
