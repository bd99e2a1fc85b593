"""The measurement loop, written once for every strategy.

Each step: fetch the batch (outside the timer for synthetic data, inside it in
DataLoader mode, where the input pipeline is what we measure), synchronize every device
the process drives, time the step, synchronize again. CPU ops return when done; CUDA
ones are queued, hence the explicit synchronize. Warm-up steps are timed and kept but
marked, and left out of every statistic downstream.

The profiled steps of the anatomy run between the timed ones (see `plan`) and are timed
the same way, inside a profiler session (`Watcher.watch`): their times are not the
cell's, but their ratio to the timed ones is what profiling costs (`profiler_overhead`).
The no-communication steps (`Silent`) run in blocks between them, one after each
profiler session: every kind of step the checks compare is sampled across the whole
cell, so a shared machine's drift hits them alike.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from parabench.process.marks import DATA, STEP, region
from parabench.process.runtime import Context
from parabench.run.faults import Fault
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
# a rank timed alone, its collectives returning at once (predict/rank_alone.py): the
# median of ALONE_STEPS after ALONE_WARMUP; fakerank.timed, beside its layout's other
# ranks: the mean of at least ALONE_STEPS after ALONE_WARMUP
ALONE_STEPS, ALONE_WARMUP = 6, 2


def step_kinds(steps: int, warmup: int, profile_steps: int) -> list[str]:
    """What each step of a cell is, in the order they run: `warmup` leading steps,
    then the `steps - warmup` timed steps in nearly equal runs, each followed by a
    profiler session that records PER_SESSION steps (the last session what is left).
    Interleaved, not after: a shared machine's speed drifts by 10-20% over seconds (a
    bare GEMM loop here: 16 to 19 ms within 15 s), and the anatomy must describe the
    steps that were timed, not the ones a few seconds later. A session that more timed
    steps follow is followed first by one more warm-up step: stopping the profiler
    takes each rank its own time, so the step after it starts skewed (timed and kept,
    as every warm-up step, out of the statistics). Every step trains: a cell runs
    `len(step_kinds(...))` optimizer steps."""
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


def sessions(kinds: list[str]) -> list[tuple[list[int], list[int]]]:
    """Each profiler session of a plan: (the timed run just before it, its profiled
    steps), as step indices. A profiled step is compared with its neighbours, not with
    the whole cell's steps: a shared machine drifts more over a cell than between
    neighbours."""
    out: list[tuple[list[int], list[int]]] = []
    run: list[int] = []
    for step, kind in enumerate(kinds):
        if kind == TIMED:
            run.append(step)
        elif kind == PROFILED and out and out[-1][1][-1] == step - 1:
            out[-1][1].append(step)  # the session goes on
        elif kind == PROFILED:
            out.append((run, [step]))
            run = []
    return out


class Watcher(Protocol):
    def watch(self, last: bool) -> contextlib.AbstractContextManager:
        """Record the PROFILED step run inside; `last`: the last of its session."""


@dataclass
class Silent:
    """The no-communication check's steps: the same strategy built over a group whose
    collectives return at once (process/nocomm.py), run by `measure` in blocks, one after each
    profiler session (or after the last step when nothing is profiled), each block
    `warmup` untimed steps then `steps` timed ones. Built at the first block, when the
    real strategy's memory high-water mark has been reached (warm-up, a timed run, a
    session) without a second copy of the model beside it (`peak_before`, set by
    `build`). Its steps draw on a forked random state, so the real strategy's draws
    (dropout) are those it makes without the check. Every step is started by
    every rank at once (`barrier`, outside the timer): the collectives that would keep
    the ranks in step return at once, and ranks out of step would take turns on a
    shared host's cores instead of sharing them as in the timed steps."""

    build: Callable[[], tuple[Strategy, object]]
    barrier: Callable[[], None]
    steps: int  # timed per block
    devices: list[torch.device] = field(default_factory=list)  # whose random state to fork
    warmup: int = 1  # per block: its first step after the real strategy's is cold
    pair: tuple[Strategy, object] | None = None
    times: list[float] = field(default_factory=list)
    batch: int = 0  # the next block's first batch index
    peak_before: int | None = None  # CUDA's high-water mark when `build` ran

    def block(self) -> list[tuple[float, float]]:
        """Run one block; its timed steps' (start, end) Unix times."""
        cuda = [d.index or 0 for d in self.devices if d.type == "cuda"]
        spans = []
        with torch.random.fork_rng(devices=cuda):
            if self.pair is None:
                self.pair = self.build()
            strategy, batches = self.pair
            sync = synchronizer(strategy.devices())
            for i in range(self.warmup + self.steps):
                self.barrier()
                took, _ = run_step(strategy, batches, self.batch, sync)
                self.batch += 1
                if i >= self.warmup:
                    self.times.append(took)
                    now = time.time()
                    spans.append((now - took, now))
        self.barrier()  # the real strategy's next step starts with every rank
        return spans


def blocks(kinds: list[str]) -> list[int]:
    """The steps of a plan after which a no-communication block runs: the last of each
    profiler session, or the last step when nothing is profiled."""
    return [session[-1] for _, session in sessions(kinds)] or [len(kinds) - 1]


@dataclass
class Measured:
    """Per-step results of one process: the steps it timed (warm-up and timed ones),
    and the profiled steps' times apart."""

    times: list[float]
    losses: list[float]
    steps: list[int] = field(default_factory=list)  # each one's index in the plan
    phases: list[str] = field(default_factory=list)  # WARMUP or TIMED
    profiled_times: list[float] = field(default_factory=list)  # timed the same way
    # Wall-clock (Unix) start of the first timed step and end of the last: the window
    # in which nothing else may run on this host (aggregate flags overlaps).
    window: tuple[float, float] | None = None
    # The loss of every step that was not timed (profiled), by its index in the plan:
    # with the timed ones', every step's loss (a divergence is dated to the step).
    untimed_losses: dict[int, float] = field(default_factory=dict)
    # The no-communication steps' times (Silent); None where they did not run.
    nocomm_times: list[float] | None = None

    def widen(self, start: float, end: float) -> None:
        self.window = (min(start, self.window[0]), end) if self.window else (start, end)


def run_step(strategy: Strategy, batches, step: int, sync: Callable[[], None]):
    """One step as every step runs: the batch, a synchronize, the step (marked, with
    its data fetch inside it in DataLoader mode), a synchronize. Returns (seconds the
    step took, its loss)."""
    if not batches.timed_fetch:  # synthetic batches are made outside the step
        x, y = batches.batch(step)
    sync()
    t0 = time.perf_counter()
    with region(STEP):
        if batches.timed_fetch:  # DataLoader mode: the fetch is part of the step
            with region(DATA):
                x, y = batches.batch(step)
        loss = strategy.step(x, y)
        sync()
    return time.perf_counter() - t0, loss


def measure(
    strategy: Strategy,
    batches,
    steps: int | list[str],
    fault: Fault | None = None,
    watcher: Watcher | None = None,
    silent: Silent | None = None,
) -> Measured:
    """Run the steps of a plan (or `steps` timed ones), timing every one; the profiled
    ones under `watcher`, the no-communication blocks of `silent` between them."""
    kinds = [TIMED] * steps if isinstance(steps, int) else steps
    sync = synchronizer(strategy.devices())
    fault_step = fault.step if fault else -1
    after = set(blocks(kinds)) if silent else set()
    if silent:  # batches the plan and the counted step never use
        silent.batch = len(kinds) + 1
    out = Measured([], [])
    losses: list[torch.Tensor] = []
    untimed: dict[int, torch.Tensor] = {}
    for step, kind in enumerate(kinds):
        if step == fault_step:  # test-only; before the timer, so it costs the step nothing
            fault.fire()
        if kind == PROFILED:
            last = kinds[step + 1 : step + 2] != [PROFILED]
            with watcher.watch(last):
                took, untimed[step] = run_step(strategy, batches, step, sync)
            out.profiled_times.append(took)
        else:
            took, loss = run_step(strategy, batches, step, sync)
            out.times.append(took)
            losses.append(loss)
            out.steps.append(step)
            out.phases.append(kind)
            if kind == TIMED:
                now = time.time()
                out.widen(now - took, now)
        if step in after:
            for span in silent.block():
                out.widen(*span)
    # One host transfer after the loop instead of one per step.
    out.losses = torch.stack(losses).double().cpu().tolist()
    out.untimed_losses = {s: float(v) for s, v in untimed.items()}
    out.nocomm_times = silent.times if silent else None
    return out


def all_ranks(value, ctx: Context) -> list:
    """`value` from every rank, on every rank (identity without a process group)."""
    if not ctx.distributed or ctx.world_size == 1:
        return [value]
    out: list = [None] * ctx.world_size
    dist.all_gather_object(out, value)
    return out
