"""The regions of a step that the anatomy reads: forward, backward, optimizer, data,
and within them a collective's own call (launch).

Strategies mark them (`with region(FORWARD): ...`); outside a profiled step a mark
costs one check of a global. Inside one (`recording()`), each region is a
`torch.profiler.record_function` range in the trace and, on Linux, carries what the
main thread did during it, read at its edges: time on a core (`cpu_s`), time ready
but waiting for a core (`runq_s`, another rank or thread had it), and the rest of the
wall time, blocked (waiting for communication or for a neighbour). A few microseconds
a region, no per-op recording.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import os
import platform
import struct
import sys
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
# A checkpointed block's forward run again in backward (activation checkpointing):
# compute, within the backward, measured apart for what recompute costs.
RECOMPUTE = "recompute"
# Regions inside the compute regions: their time is already their parents'.
NESTED = (LAUNCH, RECOMPUTE)
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


_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}  # the syscall's number, by machine
_REFUSED = (errno.EPERM, errno.EACCES, errno.ENOSYS, errno.ENOENT, errno.EOPNOTSUPP)


def task_clock() -> int:
    """A perf event counting the calling thread's nanoseconds on a core
    (PERF_COUNT_SW_TASK_CLOCK; user and kernel time, like the thread's CPU clock:
    `exclude_kernel` only lets perf_event_paranoid 2 allow it). OSError where the
    kernel or a seccomp filter refuses it (its errno in _REFUSED: perf_event_paranoid
    above 2, containers' default profiles; ENOSYS off Linux)."""
    number = _PERF_EVENT_OPEN.get(platform.machine())
    if number is None or not sys.platform.startswith("linux"):
        raise OSError(errno.ENOSYS, f"no perf_event_open on {platform.system()}")
    # perf_event_attr, its first (64-byte) version: type PERF_TYPE_SOFTWARE, size,
    # config, sample_period, sample_type, read_format, flags (exclude_kernel,
    # exclude_hv), wakeup_events, bp_type, bp_addr
    attr = struct.pack("IIQQQQQIIQ", 1, 64, 1, 0, 0, 0, 1 << 5 | 1 << 6, 0, 0, 0)
    buf = ctypes.create_string_buffer(attr, len(attr))
    fd = ctypes.CDLL(None, use_errno=True).syscall(number, buf, 0, -1, -1, 8)  # CLOEXEC
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"perf_event_open: {os.strerror(code)}")
    return fd


class _Counters:
    """The recording thread's counters, open while a step records (opened and closed
    outside the timed step; a timed step runs with none).

    Time on a core comes from perf's task clock, read without touching the
    scheduler. The thread's CPU clock (time.thread_time) brings the kernel's
    accounting up to date (update_curr), and that ends the thread's time slice when
    one is due: read just before a collective's call, it hands the core to another
    thread there. On a gpt FSDP rank sharing its core with gloo's threads, that made
    profiled steps 5-19% slower. Where perf is refused, the CPU clock, and the
    measured profiler_overhead shows what it costs. Waiting for a core comes from
    schedstat's run delay, complete while the thread runs (its run time lags by up to
    a scheduler tick, so it is not used)."""

    def __init__(self) -> None:
        try:
            self.clock: int | None = task_clock()
        except OSError:
            self.clock = None
        try:
            self.sched: int | None = os.open(_SCHEDSTAT, os.O_RDONLY)
        except OSError:  # not Linux: no run delay
            self.sched = None

    def _task_s(self) -> float:
        return struct.unpack("Q", os.read(self.clock, 8))[0] / 1e9

    def read(self) -> tuple[float, float]:
        """Seconds on a core and waiting for one, each from its own origin: a region
        takes their differences."""
        on_core = time.thread_time() if self.clock is None else self._task_s()
        if self.sched is None:
            return on_core, 0.0
        return on_core, int(os.pread(self.sched, 128, 0).split()[1]) / 1e9

    def close(self) -> None:
        for fd in (self.clock, self.sched):
            if fd is not None:
                os.close(fd)


def on_core_clock() -> str:
    """Which clock the regions' `cpu_s` is read from here (recorded with a cell)."""
    try:
        os.close(task_clock())
    except OSError:
        return "thread CPU clock"
    return "perf task clock"


_recording: list[Region] | None = None  # the regions of the profiled step under way
_recorder: int | None = None  # the thread recording them: the counters are its own
_counters: _Counters | None = None


@contextlib.contextmanager
def region(name: str, traced: bool = True) -> Iterator[None]:
    """Mark a region of the step (free unless a profiled step is recording). Only the
    recording thread's count: a hook on another thread (CUDA's autograd runs backward
    on a device thread) would add that thread's figures to the main thread's.
    `traced` False: no range in the trace (its record_function is an op, which a
    selective checkpoint's recompute must not meet where its forward did not)."""
    if _recording is None or threading.get_ident() != _recorder:
        yield
        return
    regions, counters = _recording, _counters
    with record_function(PREFIX + name) if traced else contextlib.nullcontext():
        cpu0, runq0 = counters.read()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            wall = time.perf_counter() - t0
            cpu1, runq1 = counters.read()
            regions.append(Region(name, wall, cpu1 - cpu0, runq1 - runq0))


@contextlib.contextmanager
def recording() -> Iterator[list[Region]]:
    """Record the regions of one step, in the order they end (inner before outer)."""
    global _recording, _recorder, _counters
    found: list[Region] = []
    _counters = _Counters()
    _recording, _recorder = found, threading.get_ident()
    try:
        yield found
    finally:
        _counters.close()
        _recording = _recorder = _counters = None
