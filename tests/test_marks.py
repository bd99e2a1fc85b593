"""What a marked region records about the main thread: its time on a core from a clock
that does not disturb the scheduler, agreeing with the thread's CPU clock, and its
blocked time; nothing from another thread."""

from __future__ import annotations

import errno
import os
import sys
import threading
import time

import pytest

from parabench.process import marks


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_region_splits_its_wall_time_into_on_core_and_blocked():
    """50 ms on the core, then 50 ms asleep: the region says so, by the same count
    as the thread's CPU clock. Within 3 ms: perf's task clock and the thread's CPU
    clock account a switch in and out of the core apart, and on a loaded host (CI,
    two test workers on two cores) they were seen 1.4 ms apart over these 50 ms; a
    process-wide clock, or the wrong thread's, would be off by whole spins."""
    with marks.recording(), marks.region(marks.LAUNCH):  # record_function's first use
        pass
    with marks.recording() as found:
        cpu0 = time.thread_time()
        with marks.region(marks.LAUNCH):
            _spin(0.05)
            time.sleep(0.05)
        cpu = time.thread_time() - cpu0
    (launch,) = found
    assert launch.cpu_s == pytest.approx(cpu, abs=3e-3)
    assert launch.cpu_s == pytest.approx(0.05, abs=5e-3)
    assert launch.blocked_s == pytest.approx(0.05, abs=1e-2)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="perf is Linux's")
def test_where_perf_allows_it_the_regions_read_its_task_clock_of_their_thread_alone():
    """perf_event_paranoid 2 (the kernel's default) lets a thread count itself; the
    thread's CPU clock is then not read in a profiled step (each read may end its
    time slice). The clock counts the recording thread alone: another thread
    spinning while the main one sleeps adds nothing."""
    try:
        os.close(marks.task_clock())
    except OSError as refused:
        if refused.errno in marks._REFUSED:  # a paranoid kernel, a seccomp filter
            pytest.skip(f"perf refused here: {refused}")
        raise  # a malformed request: the code's fault
    assert marks.on_core_clock() == "perf task clock"

    with marks.recording() as found, marks.region(marks.FORWARD):
        worker = threading.Thread(target=_spin, args=(0.03,))
        worker.start()
        worker.join()
    (forward,) = found
    assert forward.wall_s >= 0.03
    assert forward.cpu_s < 0.01, "the other thread's time counted as the main thread's"
    assert marks._counters is None, "the counters stay open after the step"


def test_regions_on_another_thread_are_not_recorded():
    """CUDA's autograd runs backward hooks (FSDP's collectives) on a device thread:
    its figures are not the main thread's."""

    def hook() -> None:
        with marks.region(marks.LAUNCH):
            _spin(0.001)

    with marks.recording() as found:
        worker = threading.Thread(target=hook)
        worker.start()
        worker.join()
        with marks.region(marks.BACKWARD):
            pass
    assert [r.name for r in found] == [marks.BACKWARD]


def test_where_perf_is_refused_the_regions_read_the_threads_cpu_clock(monkeypatch):
    """A paranoid kernel or a seccomp filter: the same figures from the CPU clock."""

    def refused() -> int:
        raise PermissionError(errno.EPERM, "perf_event_open: Operation not permitted")

    monkeypatch.setattr(marks, "task_clock", refused)
    assert marks.on_core_clock() == "thread CPU clock"
    with marks.recording() as found, marks.region(marks.FORWARD):
        _spin(0.02)
    (forward,) = found
    assert forward.cpu_s == pytest.approx(0.02, abs=3e-3)
