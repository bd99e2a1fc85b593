"""FLOPs of one training step, counted by PyTorch rather than estimated.

6 * params * batch overcounts an MLP: its first layer needs no gradient with respect to
the input, so its backward is one GEMM, not two. FlopCounterMode counts what autograd
actually runs.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from parabench.models.base import Model, example_batch


def _meta_input(model: Model, batch: int) -> torch.Tensor:
    """The model's input for `batch` samples, as a shape-only meta tensor."""
    return example_batch(model, batch)[0].to("meta")


def _fwd_bwd(module: nn.Module, x: torch.Tensor, loss) -> int:
    with FlopCounterMode(display=False) as counter:
        out = module(x)
        loss(out).backward()
    return int(counter.get_total_flops())


def step_flops(model: Model, batch: int) -> int:
    """FLOPs of forward + backward of the whole model on `batch` samples (meta tensors:
    shapes only, no memory, no compute). A forward that reads its tensors' values (a
    transformers model builds its attention mask so) cannot run on meta tensors: it is
    counted on one real sample on the CPU, times the batch (a step's FLOPs are the sum
    of its samples'), and its gradients are dropped after."""
    try:
        meta = copy.deepcopy(model.module).to("meta")
        return _fwd_bwd(meta, _meta_input(model, batch), lambda out: out.sum())
    except RuntimeError:
        x = example_batch(model, 1)[0]
        module = model.counting_module() if model.counting_module else model.module
        try:
            return batch * _fwd_bwd(module, x, lambda out: out.float().sum())
        finally:
            module.zero_grad(set_to_none=True)


def block_flops(model: Model, batch: int = 8) -> list[int]:
    """Forward + backward FLOPs of each block on its own, for cutting balanced stages.

    The first block's input needs no gradient, the others' inputs do (they are
    activations), exactly as in training.
    """
    meta = copy.deepcopy(model.module).to("meta")
    x = _meta_input(model, batch)
    costs = []
    for i, block in enumerate(meta):
        if i > 0 and x.is_floating_point():  # token ids carry no gradient
            x = x.detach().requires_grad_(True)
        costs.append(_fwd_bwd(block, x, lambda out: out.sum()))
        with torch.no_grad():
            x = block(x)
    return costs


def activation_bytes_per_sample(model: Model, element_bytes: int = 4) -> float:
    """Bytes of every leaf module's output for one sample: what a forward keeps for
    backward, roughly (an analytic estimate on meta tensors; in-place and recomputed
    outputs make the real figure lower, saved inputs of some ops higher)."""
    meta = copy.deepcopy(model.module).to("meta")
    total = [0]

    def hook(_module, _inputs, output) -> None:
        outs = output if isinstance(output, tuple | list) else (output,)
        total[0] += sum(o.numel() for o in outs if isinstance(o, torch.Tensor))

    def count(module: nn.Module, x: torch.Tensor) -> None:
        leaves = [m for m in module.modules() if not list(m.children())]
        handles = [m.register_forward_hook(hook) for m in leaves]
        try:
            with torch.no_grad():
                module(x)
        finally:
            for h in handles:
                h.remove()

    try:
        count(meta, _meta_input(model, 2))
    except RuntimeError:  # a forward that reads values (as in step_flops): real samples
        total[0] = 0
        count(model.module, example_batch(model, 2)[0])
    return total[0] * element_bytes / 2
