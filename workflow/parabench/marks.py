"""The regions of a step that the anatomy reads: forward, backward, optimizer, data,
and within them a collective's own call (launch).

Strategies mark them (`with region(FORWARD): ...`); outside a profiled step a mark
costs one check of a global. Inside one (`recording()`), each region is a
`torch.profiler.record_function` range in the trace and, on Linux, carries what the
main thread did during it, read from /proc/thread-self/schedstat at its edges: time
on a core (`cpu_s`), time ready but waiting for a core (`runq_s`, another rank or
thread had it), and the rest of the wall time, blocked (waiting for communication or
for a neighbour). Two reads of a small file per region: tens of microseconds a step,
no per-op recording.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from torch.profiler import record_function

STEP, DATA, FORWARD, BACKWARD, OPTIMIZER = "step", "data", "forward", "backward", "optimizer"
# Regions whose running time is the step's compute (forward, backward and the update;
# a pipeline's schedule runs its micro-batches' forwards and backwards).
SCHEDULE = "schedule"
COMPUTE = (FORWARD, BACKWARD, OPTIMIZER, SCHEDULE)
# A collective's own call on the main thread, inside those regions: launching it (on
# gloo, the work the call does before gloo's threads take over). Communication's time,
# not compute's; a strategy marks it where torch lets it reach the call (FSDP's comms).
LAUNCH = "launch"
PREFIX = "parabench."
_SCHEDSTAT = Path("/proc/thread-self/schedstat")


@dataclass
class Region:
    name: str
    wall_s: float
    cpu_s: float  # on a core
    runq_s: float  # runnable, waiting for a core

    @property
    def blocked_s(self) -> float:
        """Neither running nor waiting for a core: waiting on another thread or rank."""
        return max(0.0, self.wall_s - self.cpu_s - self.runq_s)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


_recording: list[Region] | None = None  # the regions of the profiled step under way
_recorder: int | None = None  # the thread recording them: schedstat is per thread


_files: dict[int, int] = {}  # thread id -> its open schedstat file (read in place)


def _run_delay() -> float:
    """This thread's seconds runnable but waiting for a core (schedstat's run delay,
    Linux; 0 elsewhere). The file stays open and is read again from its start:
    a third of the cost of opening it each time."""
    tid = threading.get_ident()
    fd = _files.get(tid)
    try:
        if fd is None:
            fd = _files[tid] = os.open(_SCHEDSTAT, os.O_RDONLY)
        return int(os.pread(fd, 128, 0).split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def schedstat() -> tuple[float, float]:
    """This thread's seconds on a core and waiting for one, since it started. The
    first from the thread's CPU clock (exact: the kernel brings it up to date when
    asked); the second from schedstat's run delay, complete while the thread runs.
    schedstat's own run time lags by up to a scheduler tick, so it is not used."""
    return time.thread_time(), _run_delay()


@contextlib.contextmanager
def region(name: str) -> Iterator[None]:
    """Mark a region of the step (free unless a profiled step is recording). Only the
    recording thread's count: a hook on another thread (CUDA's autograd runs backward
    on a device thread) would add that thread's figures to the main thread's."""
    if _recording is None or threading.get_ident() != _recorder:
        yield
        return
    regions = _recording
    with record_function(PREFIX + name):
        cpu0, runq0 = schedstat()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            wall = time.perf_counter() - t0
            cpu1, runq1 = schedstat()
            regions.append(Region(name, wall, cpu1 - cpu0, runq1 - runq0))


@contextlib.contextmanager
def recording() -> Iterator[list[Region]]:
    """Record the regions of one step, in the order they end (inner before outer)."""
    global _recording, _recorder
    found: list[Region] = []
    _recording, _recorder = found, threading.get_ident()
    try:
        yield found
    finally:
        _recording = _recorder = None
