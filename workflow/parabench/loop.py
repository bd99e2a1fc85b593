"""The measurement loop, written once for every strategy.

Each step: fetch the batch (outside the timer for synthetic data, inside it in
DataLoader mode, where the input pipeline is what we measure), synchronize every device
the process drives, time the step, synchronize again. CPU ops return when done; CUDA
ones are queued, hence the explicit synchronize. Warm-up steps are timed and kept but
marked, and left out of every statistic downstream.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parabench.faults import Fault
from parabench.runtime import Context
from parabench.strategies.base import Strategy


def synchronizer(devices: list[torch.device]) -> Callable[[], None]:
    cuda = [d for d in devices if d.type == "cuda"]
    if not cuda:
        return lambda: None

    def sync() -> None:
        for d in cuda:
            torch.cuda.synchronize(d)

    return sync


@dataclass
class Measured:
    """Per-step results of one process."""

    times: list[float]
    losses: list[float]


def measure(strategy: Strategy, batches, steps: int, fault: Fault | None = None) -> Measured:
    sync = synchronizer(strategy.devices())
    fault_step = fault.step if fault else -1
    times: list[float] = []
    losses: list[torch.Tensor] = []
    timed_fetch = batches.timed_fetch
    for step in range(steps):
        if step == fault_step:  # test-only; before the timer, so it costs the step nothing
            fault.fire()
        if not timed_fetch:
            x, y = batches.batch(step)
        sync()
        t0 = time.perf_counter()
        if timed_fetch:
            x, y = batches.batch(step)
        loss = strategy.step(x, y)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    # One host transfer after the loop instead of one per step.
    return Measured(times, torch.stack(losses).double().cpu().tolist())


def all_ranks(value, ctx: Context) -> list:
    """`value` from every rank, on every rank (identity without a process group)."""
    if not ctx.distributed or ctx.world_size == 1:
        return [value]
    out: list = [None] * ctx.world_size
    dist.all_gather_object(out, value)
    return out
