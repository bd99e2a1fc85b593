"""Profiled steps: a few extra steps under torch.profiler, after the timed steps.

Timed steps are never profiled (the profiler adds work to every op); these extra steps
run after the timed ones and after the parameters for the equivalence check are saved,
on the same strategy and fresh batches. Each rank keeps its trace beside the cell's
records (Chrome trace JSON, gzipped: open it in https://ui.perfetto.dev) and reads from
it what the timings alone cannot tell.

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
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from parabench.anatomy import DATA_MARK, STEP_MARK
from parabench.loop import synchronizer
from parabench.runtime import Context
from parabench.strategies.base import Strategy


@dataclass
class Profiled:
    trace: str  # file name of this rank's trace, in the cell directory
    events: list[dict]  # its Chrome trace events
    cpu_alloc_peak: int  # peak of bytes allocated on the CPU within a profiled step
    counted: list[dict]  # events of the step profiled with memory and tensor shapes
    event_cost_s: float  # what the profiler adds to the step per event it records


def _run(strategy: Strategy, batches, steps: range, sync, timed_fetch: bool) -> None:
    for step in steps:
        if not timed_fetch:  # synthetic batches are made outside the step, as when timed
            x, y = batches.batch(step)
        sync()
        with record_function(STEP_MARK):
            if timed_fetch:  # DataLoader mode: the fetch is part of the step, as when timed
                with record_function(DATA_MARK):
                    x, y = batches.batch(step)
            strategy.step(x, y)
            sync()


def profile_steps(
    strategy: Strategy, batches, first_step: int, count: int, ctx: Context, out: Path
) -> Profiled:
    """Run `count` steps from `first_step` under the profiler and keep this rank's
    trace (the step's anatomy), then one more step profiled with memory and tensor
    shapes (the CPU peak, and the bytes each collective moves). The profiler's own
    first-step cost is kept out of the trace by a warm-up step it does not record;
    memory and shape recording (work on every allocation and op) by their own step."""
    sync = synchronizer(strategy.devices())
    activities = [ProfilerActivity.CPU]
    if ctx.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    timed_fetch = getattr(batches, "timed_fetch", False)
    sync()
    with profile(
        activities=activities,
        schedule=schedule(wait=0, warmup=1, active=count, repeat=1),
    ) as prof:
        for step in range(first_step, first_step + 1 + count):
            _run(strategy, batches, range(step, step + 1), sync, timed_fetch)
            prof.step()
    name = f"trace-rank{ctx.rank}.json.gz"
    raw = out / f".{name}.tmp.json"
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(raw))
    try:
        events = json.loads(raw.read_text()).get("traceEvents", [])
        with open(raw, "rb") as src, gzip.open(out / f".{name}.tmp", "wb") as dst:
            shutil.copyfileobj(src, dst)
        (out / f".{name}.tmp").replace(out / name)  # whole or absent, never half-written
    finally:
        raw.unlink(missing_ok=True)
        (out / f".{name}.tmp").unlink(missing_ok=True)

    last = first_step + 1 + count
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as m:
        _run(strategy, batches, range(last, last + 1), sync, timed_fetch)
    counted = _exported(m)
    return Profiled(name, events, cpu_alloc_peak(counted), counted, event_cost(activities))


def event_cost(activities: list, steps: int = 50, rounds: int = 5) -> float:
    """Seconds the profiler adds to the thread that runs an op, per event it records,
    measured in this process as it runs now (under the same contention as its steps):
    a tiny training step (matmul, relu, backward, update: the kinds of events a real
    step records, autograd's included) timed bare and under the anatomy's profiler
    settings; per round the extra time over the events recorded, the median of
    `rounds`. The anatomy takes events x this out of each profiled step. (Per event,
    not per call: `x.add_(1)` alone records five.)"""
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def loop() -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            (x @ w).relu().sum().backward()
            with torch.no_grad():
                w.sub_(w.grad, alpha=0.01)
            w.grad = None
        return time.perf_counter() - t0

    loop()  # first calls warm the dispatcher and autograd, not the profiler
    extra, events = [], 0
    for _ in range(rounds):
        bare = loop()
        with profile(activities=activities) as prof:
            watched = loop()
        extra.append(watched - bare)
        events = events or len(prof.events())  # the same each round; counting is slow
    return max(0.0, statistics.median(extra) / max(1, events))


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
