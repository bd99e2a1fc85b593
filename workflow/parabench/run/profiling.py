"""Profiled steps: a few steps between runs of the timed ones (loop.step_kinds), recorded
lightly enough that they cost what an unprofiled step does.

Recording every ATen op doubles a small CPU step, so the anatomy's sessions record only
what it reads (`torch.profiler` limited to user-scope ranges): the step's own regions
(process/marks.py: forward, backward, optimizer, data, each with what the main thread did on
its core), the ranges torch itself puts around communication (FSDP's gathers and
reductions, a pipeline's micro-batches) and every communication op's span on the thread
that ran it (gloo's work, NCCL's); on CUDA, every kernel (CUPTI records them whatever
the scope). The loop times these steps exactly as the timed ones, so their cost is
measured, not estimated: `profiler_overhead` = profiled step / timed step (medians).

After the plan, one more step (`count`) is recorded in full, with tensor shapes and
memory: the bytes each collective moves, the CPU memory peak, and a per-op trace for
Perfetto. It stays out of the anatomy.

Memory on CPU: torch.profiler's memory events name each block allocated and freed.
What a step needs at its peak is what was already held between steps (parameters and
optimizer state, counted from the tensors; the previous gradients are freed by
zero_grad before anything is allocated) plus the peak of the bytes the step itself
had allocated and not yet freed. On CUDA the allocator's high-water mark says it: over
the plan's steps until the no-communication check's copy of the model is built (loop.
Silent), and over the counted step, after that copy is gone (collected: `release`).
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.autograd import profiler as autograd_profiler
from torch.profiler import ProfilerActivity, profile

from parabench.process import marks
from parabench.process.runtime import Context


def _chrome_events(save) -> list[dict]:
    """Events through the Chrome-trace export (the one stable format); `save(path)`
    writes it."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        save(path)
        return json.loads(Path(path).read_text()).get("traceEvents", [])
    finally:
        os.unlink(path)


class UserScopeSession:
    """A profiler session recording user-scope ranges only (and kernels on CUDA).
    torch.profiler has no public switch for that; its own _enable_profiler takes the
    scopes. Where that private call is refused (another torch), the session records
    every op instead, and the measured overhead shows what that costs."""

    def __init__(self, cuda: bool) -> None:
        self.prof = autograd_profiler.profile(use_device="cuda" if cuda else None, use_kineto=True)
        self.results = None
        self.fallback: profile | None = None

    def start(self) -> None:
        from torch._C._autograd import _enable_profiler, _prepare_profiler
        from torch._C._profiler import RecordScope

        config = self.prof.config(create_trace_id=False)
        activities = self.prof.kineto_activities
        try:
            _prepare_profiler(config, activities)
            _enable_profiler(config, activities, {RecordScope.USER_SCOPE})
        except (TypeError, RuntimeError):  # not this torch's signature: record everything
            self.fallback = profile(activities=list(activities))
            self.fallback.start()

    def stop(self) -> list[dict]:
        if self.fallback is not None:
            self.fallback.stop()
            return _chrome_events(self.fallback.export_chrome_trace)
        from torch._C._autograd import _disable_profiler

        self.results = _disable_profiler()
        return _chrome_events(self.results.save)


@dataclass
class StepProfiler:
    """Runs the cell's profiled steps' sessions, a few steps each (loop.step_kinds), and
    keeps what they recorded. `watch` is what the measurement loop wraps a profiled
    step in; everything else the loop does to it is what it does to a timed step."""

    ctx: Context
    events: list[dict] = field(default_factory=list)  # every session's, one clock
    regions: list[list[dict]] = field(default_factory=list)  # per profiled step
    _live: UserScopeSession | None = None

    @contextlib.contextmanager
    def watch(self, last: bool) -> Iterator[None]:
        """Record one step; `last`: the last of its session, which then stops."""
        if self._live is None:
            self._live = UserScopeSession(self.ctx.device.type == "cuda")
            self._live.start()
        with marks.recording() as found:
            yield
        self.regions.append([r.as_dict() for r in found])
        if last:
            events = self._live.stop()
            # one clock for all sessions: only the first one's metadata is kept
            self.events += [e for e in events if not self.events or e.get("ph") != "M"]
            self._live = None

    def count(self, run_step, shapes: bool = True) -> list[dict]:
        """Record one more step, `run_step()`, with memory and (`shapes`) tensor
        shapes: the CPU memory peak and the bytes each collective moves. Recording
        those works on every allocation and op, so this step has a session of its own
        and stays out of the anatomy."""
        activities = [ProfilerActivity.CPU]
        if self.ctx.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        counting = profile(activities=activities, profile_memory=True, record_shapes=shapes)
        with counting as m, marks.recording():  # its step range bounds what is counted
            run_step()
        return _chrome_events(m.export_chrome_trace)

    def save(self, out: Path, counted: list[dict]) -> str:
        """This rank's trace beside the cell's records: the profiled steps (light) and
        the counted step (every op), in one file on one clock; returns its name."""
        name = f"trace-rank{self.ctx.rank}.json.gz"
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".{name}.tmp"
        events = self.events + [e for e in counted if e.get("ph") != "M"]
        try:
            # One write of one string: json.dump hands gzip thousands of small pieces.
            with gzip.open(tmp, "wt", compresslevel=6) as f:
                f.write(json.dumps({"traceEvents": events}))
            tmp.replace(out / name)  # whole or absent, never half-written
        finally:
            tmp.unlink(missing_ok=True)
        return name


def cpu_alloc_peak(events: list[dict]) -> int:
    """Peak bytes live at once among the CPU blocks allocated in this session (from
    the profiler's memory events, by address). Not the events' running total: that is
    the process's, across its sessions, and falls when a block of an earlier session
    is freed (one process plans many ranks, predict/plan.py)."""
    live: dict[int, int] = {}
    total = peak = 0
    memory = (e for e in events if e.get("name") == "[memory]")
    for e in sorted(memory, key=lambda e: e["ts"]):
        args = e["args"]
        if args.get("Device Type") != 0:
            continue
        if args["Bytes"] > 0:
            live[args["Addr"]] = args["Bytes"]
            total += args["Bytes"]
            peak = max(peak, total)
        else:
            total -= live.pop(args["Addr"], 0)
    return peak


def high_water(devices: list[torch.device]) -> int | None:
    """The CUDA allocator's high-water mark, max over these devices (None on CPU)."""
    cuda = [d for d in devices if d.type == "cuda"]
    return max(torch.cuda.max_memory_allocated(d) for d in cuda) if cuda else None


def release(devices: list[torch.device]) -> None:
    """Free now what nothing references any more, and give CUDA's cached blocks back: a
    dropped copy of a model often lives on in reference cycles (a block holding its
    compiled forward, bound to the block; FSDP's state; autograd graphs) until a
    collection, and the memory read next would still count it."""
    gc.collect()
    if any(d.type == "cuda" for d in devices):
        torch.cuda.empty_cache()


def reset_high_water(devices: list[torch.device]) -> None:
    """Start the CUDA allocator's high-water mark again from what is allocated now."""
    for d in devices:
        if d.type == "cuda":
            torch.cuda.reset_peak_memory_stats(d)


def peak_memory(
    devices: list[torch.device],
    held: dict[str, int],
    counted: list[dict],
    earlier: int | None = None,
) -> int:
    """Peak bytes per device of this process: on CUDA the allocator's high-water mark,
    the larger of now and `earlier` (one taken before the marks were reset: before
    another copy of the model shared the devices); on CPU, what was held between steps
    plus the counted step's peak allocation (see the module's docstring)."""
    mark = high_water(devices)
    if mark is not None:
        return max(mark, earlier or 0)
    return held["params"] + held["optimizer"] + cpu_alloc_peak(counted)
