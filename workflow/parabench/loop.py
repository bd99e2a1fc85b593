"""The measurement loop, written once for every strategy.

Each step: fetch the batch (outside the timer for synthetic data, inside it in
DataLoader mode, where the input pipeline is what we measure), synchronize every device
the process drives, time the step, synchronize again. CPU ops return when done; CUDA
ones are queued, hence the explicit synchronize. Warm-up steps are timed and kept but
marked, and left out of every statistic downstream.

The profiled steps of the anatomy run between the timed ones (see `plan`), never
timed themselves: a `Profiler` runs them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

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


WARMUP, TIMED, PROFILED = "warmup", "timed", "profiled"


PER_SESSION = 3  # profiled steps recorded back to back in one profiler session


def plan(steps: int, warmup: int, profile_steps: int) -> list[str]:
    """What each step of a cell is, in the order they run: `warmup` leading steps,
    then the `steps - warmup` timed steps in nearly equal runs, each followed by a
    profiler session that records PER_SESSION steps (the last session what is left).
    Interleaved, not after: a shared machine's speed drifts by 10-20% over seconds (a
    bare GEMM loop here: 16 to 19 ms within 15 s), and the anatomy must describe the
    steps that were timed, not the ones a few seconds later. A session that more timed
    steps follow is followed first by one more warm-up step: stopping the profiler
    takes each rank its own time, so the step after it starts skewed (timed and kept,
    as every warm-up step, out of the statistics). Every step trains: a cell runs
    `len(plan(...))` optimizer steps."""
    timed = steps - warmup
    kinds = [WARMUP] * warmup
    sessions = -(-profile_steps // PER_SESSION)
    if sessions == 0:
        return kinds + [TIMED] * timed
    for i in range(sessions):
        run = timed * (i + 1) // sessions - timed * i // sessions
        recorded = min(PER_SESSION, profile_steps - i * PER_SESSION)
        kinds += [TIMED] * run + [PROFILED] * recorded + ([WARMUP] if i < sessions - 1 else [])
    return kinds


class Profiler(Protocol):
    def run(self, step: int, last: bool) -> torch.Tensor:
        """Run a PROFILED step; `last`: the last of its session (the next step is not).
        Returns its loss."""


@dataclass
class Measured:
    """Per-step results of one process: the steps it timed (warm-up and timed ones)."""

    times: list[float]
    losses: list[float]
    steps: list[int] = field(default_factory=list)  # each one's index in the plan
    phases: list[str] = field(default_factory=list)  # WARMUP or TIMED
    cpu_s: list[float] = field(default_factory=list)  # the main thread's CPU time
    # Wall-clock (Unix) start of the first timed step and end of the last: the window
    # in which nothing else may run on this host (aggregate flags overlaps).
    window: tuple[float, float] | None = None
    # The loss of every step that was not timed (profiled), by its index in the plan:
    # with the timed ones', every step's loss (a divergence is dated to the step).
    untimed_losses: dict[int, float] = field(default_factory=dict)

    @property
    def timed_cpu_s(self) -> list[float]:
        return [c for c, p in zip(self.cpu_s, self.phases, strict=True) if p == TIMED]


def measure(
    strategy: Strategy,
    batches,
    steps: int | list[str],
    fault: Fault | None = None,
    profiler: Profiler | None = None,
) -> Measured:
    """Run the steps of a plan (or `steps` timed ones), timing all but the profiled."""
    kinds = [TIMED] * steps if isinstance(steps, int) else steps
    sync = synchronizer(strategy.devices())
    fault_step = fault.step if fault else -1
    out = Measured([], [])
    losses: list[torch.Tensor] = []
    untimed: dict[int, torch.Tensor] = {}
    timed_fetch = batches.timed_fetch
    for step, kind in enumerate(kinds):
        if step == fault_step:  # test-only; before the timer, so it costs the step nothing
            fault.fire()
        if kind == PROFILED:
            untimed[step] = profiler.run(step, last=kinds[step + 1 : step + 2] != [PROFILED])
            continue
        if not timed_fetch:
            x, y = batches.batch(step)
        sync()
        c0 = time.thread_time()
        t0 = time.perf_counter()
        if timed_fetch:
            x, y = batches.batch(step)
        loss = strategy.step(x, y)
        sync()
        out.times.append(time.perf_counter() - t0)
        out.cpu_s.append(time.thread_time() - c0)
        if kind == TIMED:
            now = time.time()
            start = now - out.times[-1]
            out.window = (out.window[0] if out.window else start, now)
        losses.append(loss)
        out.steps.append(step)
        out.phases.append(kind)
    # One host transfer after the loop instead of one per step.
    out.losses = torch.stack(losses).double().cpu().tolist()
    out.untimed_losses = {s: float(v) for s, v in untimed.items()}
    return out


def all_ranks(value, ctx: Context) -> list:
    """`value` from every rank, on every rank (identity without a process group)."""
    if not ctx.distributed or ctx.world_size == 1:
        return [value]
    out: list = [None] * ctx.world_size
    dist.all_gather_object(out, value)
    return out
