"""The one small interface every strategy implements, and the pieces they share.

A strategy prepares the model its way (wrap, cut, place), runs one optimizer step on
its part of a global batch, and hands back the full parameters for the equivalence
check. It never times anything: the measurement loop (run/loop.py) does, once for all.

What every strategy shares is defined here, once: the optimizer (SGD or AdamW) and bf16
autocast around the forward with the loss in fp32. torch.compile is applied per block
by strategies.build, after the strategy has wrapped the model.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from parabench.models.base import Model
from parabench.models.partition import balanced_cuts
from parabench.models.stages import Trace
from parabench.process.data import Shard
from parabench.process.flops import block_flops
from parabench.process.marks import BACKWARD, FORWARD, OPTIMIZER, region
from parabench.process.runtime import Context
from parabench.spec import RunSpec


class Strategy(ABC):
    name: ClassVar[str]

    #: Set when devices are stand-ins (every stage on the CPU): the code path is real,
    #: the speedup is not.
    emulated: bool = False
    #: [lo, hi) block ranges per stage, for the strategies that cut the model.
    stage_cuts: list[tuple[int, int]] | None = None
    #: It checkpoints and compiles the blocks itself (a layout, in torchtitan's order);
    #: otherwise strategies.build does, around it.
    applies_ac_and_compile: bool = False

    @classmethod
    def skip_reason(cls, spec: RunSpec, ctx: Context) -> str | None:
        """Why this cell cannot give an honest number on this machine, or None."""
        if ctx.device.type != "cuda":
            return None
        # a rank measured alone (predict/rank_alone.py, predict/plan.py) is its host's one process
        need, have = spec.cuda_devices_per_host(ctx.local_world), torch.cuda.device_count()
        if have < need:
            return (
                f"{spec.strategy} at {spec.devices} devices needs {need} CUDA devices on this "
                f"host ({ctx.local_world} process(es) there); {have} visible"
            )
        if spec.precision == "bf16" and not torch.cuda.is_bf16_supported():
            return f"precision bf16: {torch.cuda.get_device_name()} has no bfloat16 support"
        return None

    #: The module this process trains (wrapped, sharded or a stage) and its optimizer.
    module: nn.Module
    opt: torch.optim.Optimizer

    def __init__(self, model: Model, spec: RunSpec, ctx: Context) -> None:
        self.spec, self.ctx = spec, ctx
        self.loss_fn = fp32_loss(model.loss_fn)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's precision context: bf16 autocast, or nothing for fp32."""
        return autocast(self.spec.precision, self.ctx.device)

    def local_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer whose state this rank holds (ZeRO's is its own shard)."""
        return self.opt

    def held_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds between
        steps, counted from the tensors themselves (a DTensor counts its local shard)."""
        params = list(self.module.parameters())
        state = [
            v
            for per_param in self.local_optimizer().state.values()
            for v in per_param.values()
            if isinstance(v, torch.Tensor)
        ]
        return {
            "params": _nbytes(params),
            "grads": _nbytes([p.grad for p in params if p.grad is not None]),
            "optimizer": _nbytes(state),
        }

    @property
    def shard(self) -> Shard:
        """Which slice of each global batch this process consumes."""
        return Shard(0, 1)

    @property
    def data_device(self) -> torch.device:
        return self.ctx.device

    def devices(self) -> list[torch.device]:
        """Devices this process drives: synchronized after each step, memory read."""
        return [self.ctx.device]

    @abstractmethod
    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step on this process's part of the global batch. Returns this
        process's contribution to the global mean loss (contributions sum over ranks)."""

    @abstractmethod
    def full_state(self) -> dict[str, torch.Tensor] | None:
        """All parameters of the model, on CPU, named as in the unwrapped model, on rank 0
        (None on other ranks). Collective: every rank must call it."""


def _nbytes(tensors: list[torch.Tensor]) -> int:
    # A DTensor's own shard, read where it is held: to_local() would run an op per
    # tensor (hundreds under a rehearsal's fake tensors) to make a view of it.
    local = [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def cpu_params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in module.named_parameters()}


def full_params(
    module: nn.Module, ctx: Context, everywhere: bool = False
) -> dict[str, torch.Tensor] | None:
    """Whole parameters on rank 0 (on every rank: `everywhere`) for a module whose
    parameters are DTensors (FSDP's shards, tensor-parallel slices) or plain replicas.
    Collective: every rank calls it. Each is on the CPU before the next is gathered, so
    the device holds one whole parameter at a time."""
    out = {}
    for k, v in module.named_parameters():
        whole = v.full_tensor() if hasattr(v, "full_tensor") else v  # gathers a DTensor
        out[k] = whole.detach().to("cpu", copy=True)
    return out if ctx.is_main or everywhere else None


def fp32_loss(loss_fn):
    """The loss on fp32 outputs: under bf16 autocast the forward's output is bf16, and
    losses such as BCE are unsafe to autocast (on CUDA they refuse)."""

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(out.float(), target)

    return loss


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def optimizer_class(spec: RunSpec) -> tuple[type[torch.optim.Optimizer], dict]:
    """The optimizer and its settings, for strategies that build it themselves (ZeRO).
    AdamW keeps torch's defaults (betas 0.9/0.999, eps 1e-8, weight decay 0.01)."""
    if spec.optimizer == "adamw":
        return torch.optim.AdamW, {"lr": spec.lr}
    return torch.optim.SGD, {"lr": spec.lr}


def make_optimizer(params, spec: RunSpec) -> torch.optim.Optimizer:
    cls, kwargs = optimizer_class(spec)
    return cls(param_groups(params), **kwargs)


def param_groups(params) -> list[dict]:
    """The parameters in one group per kind of tensor, with the same settings: plain
    tensors, and DTensors by their mesh. On CUDA, torch.optim's default is its foreach
    kernels, one call over each group's list, and they refuse a list that mixes the
    two kinds ("aten._foreach_mul_.Scalar got mixed torch.Tensor and DTensor"): a model
    whose tensor-parallel plan leaves some layers whole holds both. On the CPU the
    default loops over the parameters one by one, and the groups change nothing."""
    kinds: dict[object, list] = {}
    for p in params:
        kinds.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return [{"params": group} for group in kinds.values()]


def train_step(
    module: nn.Module,
    loss_fn,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    precision: contextlib.AbstractContextManager,
    split_loss: bool = False,
) -> torch.Tensor:
    """Plain forward, backward, update: the baseline every strategy is measured against.
    Its regions (process/marks.py) are what the anatomy reads. With `split_loss`, the loss and
    its backward run under torch's loss_parallel (logits split over the vocabulary:
    tp.loss_parallel); the loss returned is this rank's plain tensor either way."""
    split = loss_parallel if split_loss else contextlib.nullcontext
    opt.zero_grad(set_to_none=True)
    with region(FORWARD):
        with precision:
            out = module(x)
        with split():
            loss = loss_fn(out, y)
    with region(BACKWARD), split():
        loss.backward()
    with region(OPTIMIZER):
        opt.step()
    loss = loss.detach()
    return loss.to_local() if isinstance(loss, DTensor) else loss


def stage_cuts(model: Model, how: Trace, stages: int) -> list[tuple[int, int]]:
    """[lo, hi) block ranges of balanced FLOPs, or the reason no stage can be cut."""
    if how.problem:
        raise ValueError(f"no stage can be cut from this model: {how.problem}")
    return balanced_cuts(block_flops(model) if how.sequential else how.costs, stages)


def gather_state(local: dict[str, torch.Tensor], ctx: Context) -> dict[str, torch.Tensor] | None:
    """Merge per-rank parameter dicts onto rank 0 (for strategies that split the model)."""
    if not ctx.distributed or ctx.world_size == 1:
        return local
    parts: list[dict | None] = [None] * ctx.world_size
    dist.all_gather_object(parts, local)
    if not ctx.is_main:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part or {})
    return merged
