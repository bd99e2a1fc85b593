"""Peak FLOP/s of one device, measured with a square GEMM on that device, in the cell's
precision (fp32, or bf16 for bf16 cells: tensor cores on GPUs, AMX or AVX-512 BF16 on
recent CPUs, and slower than fp32 on CPUs without them).

MFU needs a peak. A datasheet figure is rarely what a given clock, thread count or CPU
can reach, so by default we measure the best of a few GEMMs in the same process and
thread setting as the run; `peak_flops` in the config overrides it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def gemm_flops_per_s(
    device: torch.device,
    size: int | None = None,
    seconds: float = 0.1,
    sync: Callable[[], None] | None = None,
    precision: str = "fp32",
) -> float:
    """Best achieved FLOP/s of `size`x`size` matmuls over about `seconds`."""
    size = size or (8192 if device.type == "cuda" else 1024)
    sync = sync or (
        (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    )
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    for _ in range(2):  # warm-up: kernel selection, thread pool start
        torch.mm(a, b, out=out)
    sync()
    best, deadline, reps = 0.0, time.perf_counter() + seconds, 0
    while reps < 3 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        sync()
        best = max(best, 2 * size**3 / (time.perf_counter() - t0))
        reps += 1
    return best
