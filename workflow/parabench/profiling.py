"""Profiled steps: a few extra steps under torch.profiler, between the timed steps.

Timed steps are never profiled (the profiler adds work to every op); these extra steps
run between runs of them (loop.plan), on the same strategy and batches of their own.
Each rank keeps its trace beside the cell's records (Chrome trace JSON, gzipped: open it
in https://ui.perfetto.dev) and reads from it what the timings alone cannot tell.

The profiler's own cost is measured, not assumed: what a recorded step costs the main
thread's CPU over what a timed step does (`profiler_cost`). A per-event cost calibrated
on a loop of small ops missed it by up to 5x: with four ranks on two cores every rank's
profiler work also keeps another rank from a core.

Memory on CPU: torch.profiler's memory events carry the allocator's running total of
bytes allocated since profiling began. What a step needs at its peak is what was
already held between steps (parameters and optimizer state, counted from the tensors;
the previous gradients are freed by zero_grad before anything is allocated) plus that
running total's peak. On CUDA the allocator's own high-water mark says it directly.
"""

from __future__ import annotations

import gzip
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from parabench.anatomy import DATA_MARK, STEP_MARK
from parabench.envinfo import usable_cores
from parabench.loop import synchronizer
from parabench.runtime import Context
from parabench.strategies.base import Strategy


@dataclass
class Profiled:
    trace: str  # file name of this rank's trace, in the cell directory
    events: list[dict]  # its Chrome trace events
    cpu_alloc_peak: int  # peak of bytes allocated on the CPU within a profiled step
    counted: list[dict]  # events of the step profiled with memory and tensor shapes
    cpu_s: list[float]  # the main thread's CPU time in each recorded step


def _run(strategy: Strategy, batches, step: int, sync, timed_fetch: bool):
    """One step as the measurement loop runs it, marked for the anatomy; returns the
    main thread's CPU time in it and the step's loss."""
    if not timed_fetch:  # synthetic batches are made outside the step, as when timed
        x, y = batches.batch(step)
    sync()
    c0 = time.thread_time()
    with record_function(STEP_MARK):
        if timed_fetch:  # DataLoader mode: the fetch is part of the step, as when timed
            with record_function(DATA_MARK):
                x, y = batches.batch(step)
        loss = strategy.step(x, y)
        sync()
    return time.thread_time() - c0, loss


class StepProfiler:
    """Runs the plan's profiled steps (loop.plan), a few at a time, each few in a
    profiler session of its own. No warm-up step: a session's first step costs no more
    than the next (within 2% here, under step-to-step noise), and what it does cost is
    in the measured `profiler_cost`."""

    def __init__(self, strategy: Strategy, batches, ctx: Context) -> None:
        self.strategy, self.batches, self.ctx = strategy, batches, ctx
        self.sync = synchronizer(strategy.devices())
        self.timed_fetch = batches.timed_fetch
        self.activities = [ProfilerActivity.CPU]
        if ctx.device.type == "cuda":
            self.activities.append(ProfilerActivity.CUDA)
        self.sessions: list[profile] = []
        self.live: profile | None = None  # the session whose steps are running
        self.cpu_s: list[float] = []

    def run(self, step: int, last: bool):
        if self.live is None:
            self.sync()
            self.live = profile(activities=self.activities)
            self.live.start()
            self.sessions.append(self.live)
        cpu, loss = _run(self.strategy, self.batches, step, self.sync, self.timed_fetch)
        self.cpu_s.append(cpu)
        if last:
            self.live.stop()
            self.live = None
        return loss

    def finish(self, next_step: int, out: Path) -> Profiled:
        """Keep this rank's trace (every session's events in one file), then profile
        one more step, `next_step`, with memory and tensor shapes (the CPU peak, and the
        bytes each collective moves): recording those works on every allocation and op,
        so that step has a session of its own and stays out of the anatomy."""
        events: list[dict] = []
        for i, session in enumerate(self.sessions):
            # one clock for all sessions: their events merge into one timeline
            events += [e for e in _exported(session) if i == 0 or e.get("ph") != "M"]
        name = f"trace-rank{self.ctx.rank}.json.gz"
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".{name}.tmp"
        try:
            # One write of one string: json.dump hands gzip thousands of small pieces.
            # With level 6 (not 9) a gpt trace takes 0.15 s, not 0.6, and is 10% larger.
            with gzip.open(tmp, "wt", compresslevel=6) as f:
                f.write(json.dumps({"traceEvents": events}))
            tmp.replace(out / name)  # whole or absent, never half-written
        finally:
            tmp.unlink(missing_ok=True)
        with profile(
            activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True
        ) as m:
            _run(self.strategy, self.batches, next_step, self.sync, self.timed_fetch)
        counted = _exported(m)
        return Profiled(name, events, cpu_alloc_peak(counted), counted, self.cpu_s)


def oversubscription(ctx: Context) -> float:
    """Threads this host's ranks want (ranks x threads each) over its cores."""
    return ctx.local_world * ctx.threads / usable_cores()


def profiler_cost(profiled_cpu: list[float], timed_cpu: list[float], share: float) -> float:
    """Seconds the profiler adds to a profiled step, from what it costs the CPU: the main
    thread's CPU time in a recorded step over that in a timed one (medians; the two
    interleave, so drift hits both alike), times `share`, the cores' oversubscription
    (threads wanting a core / cores, at least 1): work added to every rank on cores
    they share stretches each one's step by that much more. 0 without both."""
    if not profiled_cpu or not timed_cpu:
        return 0.0
    extra = statistics.median(profiled_cpu) - statistics.median(timed_cpu)
    return max(0.0, extra) * max(1.0, share)


def _exported(prof) -> list[dict]:
    """A profile's events, through the Chrome-trace export (the one stable format)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        return json.loads(Path(path).read_text()).get("traceEvents", [])
    finally:
        os.unlink(path)


def cpu_alloc_peak(events: list[dict]) -> int:
    """Peak of the CPU allocator's running total in the profiler's memory events."""
    totals = [
        e["args"].get("Total Allocated", 0)
        for e in events
        if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == 0
    ]
    return max(totals, default=0)


def peak_memory(devices: list[torch.device], held: dict[str, int], profiled: Profiled) -> int:
    """Peak bytes per device of this process: the allocator's high-water mark on CUDA
    (max over its devices); on CPU, what was held between steps plus the profiled
    steps' peak allocation (see the module's docstring)."""
    cuda = [d for d in devices if d.type == "cuda"]
    if cuda:
        return max(torch.cuda.max_memory_allocated(d) for d in cuda)
    return held["params"] + held["optimizer"] + profiled.cpu_alloc_peak
