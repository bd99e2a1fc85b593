"""FLOPs of one training step, counted by PyTorch rather than estimated, and the rest of
what a cell records about its model (`model_facts`), so that no later step (aggregate,
the report, compare, a resumed sweep) ever builds a model or calls a factory.

6 * params * batch overcounts an MLP: its first layer needs no gradient with respect to
the input, so its backward is one GEMM, not two. FlopCounterMode counts what autograd
actually runs.

Everything here runs on a copy of the model without storage: on the meta device, or,
where the forward reads its tensors' values (a transformers model builds its attention
mask so), on fake tensors (FakeTensorMode). Neither allocates the model's memory nor
does its arithmetic, so a 70B model is counted in seconds; a real forward and backward
of it on the CPU would take hours.
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeCopyMode
from torch.utils.flop_counter import FlopCounterMode

from parabench.models.base import (
    Model,
    example_batch,
    fake_mode,
    fake_mode_of,
    maths_notes,
    quiet_fake,
)


def meta_copy(module: nn.Module) -> nn.Module:
    """`module` with every parameter and buffer on the meta device, the rest copied: a
    deep copy whose memo holds the meta tensors, so the real weights are never copied
    (tied weights stay tied)."""
    memo: dict = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _input(model: Model, batch: int) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype of the model's input for `batch` samples (one sample is
    drawn on the CPU, outside any fake mode, to read them)."""
    x = example_batch(model, 1)[0]
    return (batch, *x.shape[1:]), x.dtype


def _fwd_bwd(module: nn.Module, x: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter:
        module(x).float().sum().backward()
    return int(counter.get_total_flops())


def _counting(model: Model, module: nn.Module) -> nn.Module:
    """`module`, a copy of the model's, in ops FlopCounterMode counts (Model.for_counting),
    whichever path counts it: transformers' sdpa attention counts as zero where torch
    runs a fused kernel (on fake CPU tensors), and is counted on the meta device only
    while torch happens to run it there as its maths."""
    return model.for_counting(module) if model.for_counting else module


def _counted(model: Model, batch: int, measure) -> float:
    """`measure(module, input)` on the meta device, or, where the forward reads values,
    on fake tensors (a forward that creates tensors on a fixed device fails on both)."""
    shape, dtype = _input(model, batch)
    mode = fake_mode_of(model.module)
    if mode is None:
        try:
            x = torch.empty(shape, dtype=dtype, device="meta")
            return measure(_counting(model, meta_copy(model.module)), x)
        except (RuntimeError, NotImplementedError):
            pass
        mode = fake_mode()
        with FakeCopyMode(mode):
            module = copy.deepcopy(model.module)
        module = _counting(model, module)
    else:  # built on fake tensors already (planning's): no copy needed
        module = model.module
    with quiet_fake(), mode:
        return measure(module, torch.empty(shape, dtype=dtype))


def step_flops(model: Model, batch: int) -> int:
    """FLOPs of forward + backward of the whole model on `batch` samples."""
    return _counted(model, batch, _fwd_bwd)


def block_flops(model: Model, batch: int = 8) -> list[int]:
    """Forward + backward FLOPs of each block of an nn.Sequential on its own, for
    cutting balanced stages.

    The first block's input needs no gradient, the others' inputs do (they are
    activations), exactly as in training.
    """
    meta = _counting(model, meta_copy(model.module))
    shape, dtype = _input(model, batch)
    x = torch.empty(shape, dtype=dtype, device="meta")
    costs = []
    for i, block in enumerate(meta):
        if i > 0 and x.is_floating_point():  # token ids carry no gradient
            x = x.detach().requires_grad_(True)
        costs.append(_fwd_bwd(block, x))
        with torch.no_grad():
            x = block(x)
    return costs


def _outputs(module: nn.Module, x: torch.Tensor) -> int:
    """Elements of every leaf module's output in one forward of `x`."""
    total = [0]

    def hook(_module, _inputs, output) -> None:
        outs = output if isinstance(output, tuple | list) else (output,)
        total[0] += sum(o.numel() for o in outs if isinstance(o, torch.Tensor))

    leaves = [m for m in module.modules() if not list(m.children())]
    handles = [m.register_forward_hook(hook) for m in leaves]
    try:
        with torch.no_grad():
            module(x)
    finally:
        for h in handles:
            h.remove()
    return total[0]


def activation_bytes_per_sample(model: Model, element_bytes: int = 4) -> float:
    """Bytes of every leaf module's output for one sample: what a forward keeps for
    backward, roughly (an analytic estimate, shapes only; in-place and recomputed
    outputs make the real figure lower, saved inputs of some ops higher)."""
    return _counted(model, 2, _outputs) * element_bytes / 2


def _why(e: Exception) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def model_facts(model: Model, batch: int) -> dict:
    """What a cell records of the model it built (meta.json's `model_facts`), for the
    steps after it, which never build one: FLOPs of one optimizer step of `batch`
    samples, parameters and their bytes, activation bytes per sample, blocks, tokens
    per sample and the layers whose maths changes when the batch is split. A figure
    that cannot be counted (a forward that creates tensors on a fixed device) is None,
    with why. Torch's generators are left as they were."""
    params = list(model.module.parameters())  # each tied weight once
    facts: dict = {
        "params": sum(p.numel() for p in params),
        "params_bytes": sum(p.numel() * p.element_size() for p in params),
        "blocks": len(model.block_names),
        "tokens_per_sample": model.tokens_per_sample or None,
        "maths_notes": maths_notes(model),
    }
    with torch.random.fork_rng(devices=[]):
        for key, count in (
            ("flops_per_step", lambda: step_flops(model, batch)),
            ("activation_bytes_per_sample", lambda: activation_bytes_per_sample(model)),
        ):
            try:
                facts[key] = count()
            except Exception as e:
                facts[key] = None
                facts.setdefault("not_counted", {})[key] = _why(e)
    return facts
