"""The results directory's lock (parabench.jobs.lock): held once, released; a lock left by a
killed run of this host is taken over, saying so; one from another host waits for
`parabench unlock`, which refuses while its holder runs. test_one_writer.py runs it in
real sweeps and Snakemake runs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from parabench.jobs import lock


def dead_pid() -> int:
    """The pid of a process of this host that has ended."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def stale_holder(results: Path, host: str, pid: int) -> None:
    results.mkdir(parents=True, exist_ok=True)
    holder = {"host": host, "pid": pid, "since": "2025-01-01T00:00:00+00:00", "command": "old"}
    (results / lock.HOLDER_FILE).write_text(json.dumps(holder))


def test_a_lock_is_held_once_and_released(tmp_path):
    results = tmp_path / "results"
    held = lock.acquire(results, "first")
    assert lock.read_holder(results)["command"] == "first"
    with pytest.raises(lock.LockHeld, match="first") as refused:
        lock.acquire(results, "second")
    assert "so it is running" in str(refused.value)
    with pytest.raises(lock.LockHeld):
        lock.check(results)
    lock.release(held)
    lock.release(held)  # again: nothing
    assert lock.read_holder(results) is None
    with lock.held(results, "third"):
        pass
    lock.check(results)


def test_a_lock_left_by_a_dead_process_of_this_host_is_taken_over_saying_so(tmp_path):
    results = tmp_path / "results"
    pid = dead_pid()
    stale_holder(results, socket.gethostname(), pid)
    lock.check(results)  # it would be taken: no refusal
    with lock.held(results, "new") as held:
        assert f"pid {pid} on {socket.gethostname()}" in held.took_over
        assert lock.read_holder(results)["command"] == "new"


def test_a_lock_from_another_host_waits_for_unlock(tmp_path):
    results = tmp_path / "results"
    stale_holder(results, "node-elsewhere", 4242)
    with pytest.raises(lock.LockHeld) as refused:
        lock.acquire(results, "new")
    said = str(refused.value)
    assert "pid 4242 on node-elsewhere" in said and "cannot tell whether it still runs" in said
    assert f"parabench unlock {results}" in said and lock.HOLDER_FILE in said
    proc = subprocess.run(
        [sys.executable, "-m", "parabench", "unlock", str(results)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "removed the lock of pid 4242 on node-elsewhere" in proc.stdout
    with lock.held(results, "new") as held:
        assert not held.took_over


def test_unlock_refuses_while_the_holder_runs(tmp_path):
    results = tmp_path / "results"
    with lock.held(results, "running"):
        proc = subprocess.run(
            [sys.executable, "-m", "parabench", "unlock", str(results)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 1
        assert "locked by a running process" in proc.stderr
        assert lock.read_holder(results)["command"] == "running"


def test_release_leaves_a_lock_that_is_no_longer_its_own(tmp_path):
    results = tmp_path / "results"
    held = lock.acquire(results, "first")
    (results / lock.HOLDER_FILE).unlink()  # `parabench unlock`, then another run took it
    stale_holder(results, "node-elsewhere", 1)
    lock.release(held)
    assert lock.read_holder(results)["host"] == "node-elsewhere"


def test_without_flock_the_holder_file_is_the_lock(tmp_path, monkeypatch):
    """Lustre without `-o flock` refuses flock (ENOSYS): a second writer is still refused,
    by the holder file, and the first one's release frees the directory."""
    import errno
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    results = tmp_path / "results"
    held = lock.acquire(results, "first")
    assert held.fd is None and lock.read_holder(results)["flock"] is False
    with pytest.raises(lock.LockHeld, match=r"pid .* first"):
        lock.acquire(results, "second")
    lock.release(held)
    with lock.held(results, "third"):
        pass


def no_flock(monkeypatch) -> None:
    """flock holds only within a host here (NFS `local_lock`, Lustre `localflock`), as
    between runs on two hosts: the holder file is the lock. Refused, as on Lustre."""
    import errno
    import fcntl

    def refused(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", refused)


def test_two_runs_taking_over_one_stale_lock_leave_one_writer(tmp_path, monkeypatch):
    """Both find the same stale holder; the second takes it over and publishes its own
    just before the first moves the stale one away: the first must not remove the
    second's, and is refused naming it."""
    no_flock(monkeypatch)
    results = tmp_path / "results"
    stale_holder(results, socket.gethostname(), dead_pid())
    real_rename, real_unlink = os.rename, Path.unlink
    second = []

    def the_second_runs_first(path) -> None:
        if Path(path).name == lock.HOLDER_FILE and not second:
            second.append(None)  # once: the second run's own moves are real
            second[0] = lock.acquire(results, "second")

    def rename(src, dst, *args, **kwargs):
        the_second_runs_first(src)
        return real_rename(src, dst, *args, **kwargs)

    def unlink(self, missing_ok=False):
        the_second_runs_first(self)
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(Path, "unlink", unlink)
    with pytest.raises(lock.LockHeld, match=r"pid \d+ on .*: second"):
        lock.acquire(results, "first")
    assert second[0].took_over, "the second run took the stale lock over"
    assert lock.read_holder(results)["token"] == second[0].holder["token"]
    assert sorted(p.name for p in results.iterdir()) == [lock.LOCK_FILE, lock.HOLDER_FILE]
    lock.release(second[0])
    assert lock.read_holder(results) is None


@pytest.mark.parametrize("errno_name", ["EPERM", "EOPNOTSUPP"])
def test_without_hard_links_the_holder_file_is_created_exclusively(
    tmp_path, monkeypatch, errno_name
):
    """Some FUSE, SMB and object-store mounts refuse link(2): the holder file is created
    with O_EXCL instead, and still refuses a second writer."""
    import errno

    def no_links(src, dst, *args, **kwargs):
        raise OSError(getattr(errno, errno_name), os.strerror(getattr(errno, errno_name)))

    monkeypatch.setattr(os, "link", no_links)
    no_flock(monkeypatch)
    results = tmp_path / "results"
    held = lock.acquire(results, "first")
    assert lock.read_holder(results)["command"] == "first"
    assert (results / lock.HOLDER_FILE).stat().st_mode & 0o777 == 0o644
    with pytest.raises(lock.LockHeld, match="first"):
        lock.acquire(results, "second")
    lock.release(held)
    assert lock.read_holder(results) is None
    stale_holder(results, socket.gethostname(), dead_pid())  # taken over without links too
    with lock.held(results, "third") as third:
        assert third.took_over and lock.read_holder(results)["command"] == "third"
    assert sorted(p.name for p in results.iterdir()) == [lock.LOCK_FILE]


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_an_acquire_that_fails_leaves_no_descriptor_and_no_flock(tmp_path, monkeypatch):
    """An I/O error while publishing the holder propagates, the lock file's descriptor
    closed: a leaked one would hold the flock, and refuse every later run of this host
    until this process ends."""
    import errno

    results = tmp_path / "results"
    results.mkdir()
    before = open_fds()

    def broken(results, holder):
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as patched:
        patched.setattr(lock, "_publish", broken)
        with pytest.raises(OSError, match="Input/output error"):
            lock.acquire(results, "first")
    assert open_fds() == before
    with lock.held(results, "second") as held:
        assert held.fd is not None  # the flock was free


FORKED = """
import os, sys, fcntl
from parabench.jobs import lock
held = lock.acquire(sys.argv[1], "parent")
child = os.fork()
if child == 0:
    sys.exit(0)  # a normal exit: the atexit handlers run, release among them
os.waitpid(child, 0)
fd = os.open(os.path.join(sys.argv[1], lock.LOCK_FILE), os.O_RDWR)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("flock free")
except BlockingIOError:
    print("flock held")
print("holder", (lock.read_holder(sys.argv[1]) or {}).get("command"))
"""


def test_a_forked_child_leaves_its_parents_lock(tmp_path):
    """A child forked by the holder (torchrun's agent forking ranks, multiprocessing)
    shares its descriptor and its atexit handlers: its exit releases nothing."""
    results = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-c", FORKED, str(results)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["flock held", "holder parent"], proc.stdout
    assert lock.read_holder(results) is None  # the parent released it at its own exit
