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
import os
import platform
import struct
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
# thread id -> its perf task clock and that clock's offset (None: refused)
_clocks: dict[int, tuple[int, float] | None] = {}


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


_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}  # the syscall's number, by machine


def _task_clock() -> int | None:
    """A perf event counting the calling thread's nanoseconds on a core
    (PERF_COUNT_SW_TASK_CLOCK), or None where the kernel or a seccomp filter refuses
    it (perf_event_paranoid above 2, containers' default profiles) or off Linux.
    Counting user and kernel time like the thread's CPU clock; `exclude_kernel` only
    lets perf_event_paranoid 2 allow it."""
    number = _PERF_EVENT_OPEN.get(platform.machine())
    if number is None or not _SCHEDSTAT.parent.exists():
        return None
    # perf_event_attr, its first (64-byte) version: type PERF_TYPE_SOFTWARE, size,
    # config, sample_period, sample_type, read_format, flags (exclude_kernel,
    # exclude_hv), wakeup_events, bp_type, bp_addr
    attr = struct.pack("IIQQQQQIIQ", 1, 64, 1, 0, 0, 0, 1 << 5 | 1 << 6, 0, 0, 0)
    try:
        fd = ctypes.CDLL(None, use_errno=True).syscall(
            number,
            ctypes.create_string_buffer(attr, len(attr)),
            0,
            -1,
            -1,
            8,  # CLOEXEC
        )
    except (OSError, AttributeError):
        return None
    return fd if fd >= 0 else None


def _on_core() -> float:
    """This thread's seconds on a core since it started, read without touching the
    scheduler. The thread's CPU clock (time.thread_time) brings the kernel's
    accounting up to date (update_curr), and that ends the thread's time slice when
    one is due: read just before a collective's call, it hands the core to another
    thread there. On a gpt FSDP rank sharing its core with gloo's threads that made
    a profiled step 5-9 ms (10-20%) slower. perf's task clock keeps its own count:
    one read of 8 bytes. Where perf is refused, the CPU clock, and the measured
    profiler_overhead shows what it costs."""
    tid = threading.get_ident()
    if tid not in _clocks:
        fd = _task_clock()
        # counted from the thread's start like its CPU clock, so the two agree
        _clocks[tid] = None if fd is None else (fd, time.thread_time() - _read(fd))
    clock = _clocks[tid]
    return time.thread_time() if clock is None else _read(clock[0]) + clock[1]


def _read(fd: int) -> float:
    return struct.unpack("Q", os.read(fd, 8))[0] / 1e9


def on_core_clock() -> str:
    """Which clock `cpu_s` is read from on this thread (recorded with a cell)."""
    _on_core()
    return "thread CPU clock" if _clocks[threading.get_ident()] is None else "perf task clock"


def schedstat() -> tuple[float, float]:
    """This thread's seconds on a core and waiting for one, since it started. The
    first from perf's task clock (or the thread's CPU clock; both exact); the second
    from schedstat's run delay, complete while the thread runs. schedstat's own run
    time lags by up to a scheduler tick, so it is not used."""
    return _on_core(), _run_delay()


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
    _on_core()  # the thread's clock opened here, before the step is timed
    found: list[Region] = []
    _recording, _recorder = found, threading.get_ident()
    try:
        yield found
    finally:
        _recording = _recorder = None
