"""What a marked region records about the main thread: its time on a core from a clock
that does not disturb the scheduler, agreeing with the thread's CPU clock, and its
blocked time; nothing from another thread."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from parabench import marks

PARANOID = Path("/proc/sys/kernel/perf_event_paranoid")


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_region_splits_its_wall_time_into_on_core_and_blocked():
    """50 ms on the core, then 50 ms asleep: the region says so, by the same count
    as the thread's CPU clock (within a millisecond: the clocks' own reads)."""
    with marks.recording(), marks.region(marks.LAUNCH):  # as a step's regions find it
        pass
    with marks.recording() as found:
        cpu0 = time.thread_time()
        with marks.region(marks.LAUNCH):
            _spin(0.05)
            time.sleep(0.05)
        cpu = time.thread_time() - cpu0
    (launch,) = found
    assert launch.cpu_s == pytest.approx(cpu, abs=1e-3)
    assert launch.cpu_s == pytest.approx(0.05, abs=5e-3)
    assert launch.blocked_s == pytest.approx(0.05, abs=1e-2)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not PARANOID.exists(), reason="perf is Linux's"
)
def test_on_a_linux_that_allows_it_the_regions_read_perfs_task_clock():
    """perf_event_paranoid 2 (the kernel's default) lets a thread count itself; the
    thread's CPU clock is then not read in a profiled step (each read may end its
    time slice). Another thread gets a clock of its own, counting only itself."""
    if int(PARANOID.read_text()) > 2:
        pytest.skip(f"perf_event_paranoid {PARANOID.read_text().strip()} refuses perf")
    assert marks.on_core_clock() == "perf task clock"

    seen: dict[str, float] = {}

    def other() -> None:
        start = marks.schedstat()[0]
        _spin(0.03)
        seen["other"] = marks.schedstat()[0] - start

    start = marks.schedstat()[0]
    worker = threading.Thread(target=other)
    worker.start()
    worker.join()
    assert seen["other"] == pytest.approx(0.03, abs=3e-3)
    assert marks.schedstat()[0] - start < 0.01, "the main thread's clock counted the other's"


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
