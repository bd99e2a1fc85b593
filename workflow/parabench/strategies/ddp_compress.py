"""ddp_compress: DDP whose communication hook all-reduces the gradients in bfloat16.

PyTorch's `bf16_compress_hook`: each gradient bucket is cast to bf16 and divided by n,
the bf16 buffer is all-reduced, and the result is cast back to fp32 for the optimizer.
DDP refuses that hook by its name unless NCCL (2.10+) is there, because older NCCL
cannot sum bf16; gloo can, so on CPU the same function is registered under a name of
our own.
Half the bytes of DDP cross the interconnect; in exchange each averaged gradient is
rounded to bf16's 8 significant bits, so the maths differs from single's by that
rounding (the tolerance is derived from it: analyze/equivalence.py, the record's
`gradient_bits`). Parameters, optimizer state and the forward stay fp32.
"""

from __future__ import annotations

from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

from parabench.models.base import Model
from parabench.process.runtime import Context
from parabench.spec import RunSpec
from parabench.strategies.ddp import DistributedDataParallel


def gloo_bf16_compress(group, bucket):  # unannotated: DDP compares real annotations
    """torch's bf16_compress_hook, under a name DDP does not check for NCCL."""
    return bf16_compress_hook(group, bucket)


class CompressedDDP(DistributedDataParallel):
    name = "ddp_compress"

    def __init__(self, model: Model, spec: RunSpec, ctx: Context) -> None:
        super().__init__(model, spec, ctx)
        hook = bf16_compress_hook if ctx.device.type == "cuda" else gloo_bf16_compress
        self.module.register_comm_hook(ctx.group, hook)
