"""One writer per results directory: the lock that `parabench sweep` and a Snakemake run
hold for as long as they run.

Snakemake locks its own working directory, which covers neither a `parabench sweep`
beside it nor two Snakemake runs with different --directory writing one results
directory; two writers interleave, each deleting and rewriting cell files, and the
mixed record looks valid. So each run that writes results holds this lock, and a second
one is refused at once, told who holds it.

RESULTS/.parabench.lock is locked with flock(2): the kernel releases it when its holder
dies, however it dies, so a crashed run never blocks the next one on its host. Beside
it, RESULTS/.parabench.lock.json names the holder (host, pid, since when, its command);
a holder that ends removes it. The lock file itself is never deleted: a process that
opened it before the deletion would lock a file no one else sees.

Across hosts (a shared filesystem): over NFS, Linux (2.6.12 on) carries flock to the
server as a POSIX lock, so it holds between hosts too. With the `nolock` or
`local_lock=flock|all` mount options, and on Lustre mounted `localflock`, it holds only
between the processes of one host; on Lustre without `flock` it is refused. So the
holder file is a lock too: it appears whole or not at all (link(2), atomic over NFS;
where the filesystem has no hard links, an exclusive create, which a reader may find
empty for an instant, and is refused by), and a run that finds one refuses to start
unless its holder was a process of this host that is gone (a run killed by SIGKILL:
taken over, saying so, by a rename only one run can win). One from another host is
left for a person to clear with `parabench unlock RESULTS`, once that run is known to
have ended: no host can tell whether a process elsewhere still runs.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import shlex
import socket
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

LOCK_FILE = ".parabench.lock"
HOLDER_FILE = ".parabench.lock.json"


class LockHeld(RuntimeError):
    """The results directory has another writer; the message names it and how to clear
    a lock whose holder is gone."""


@dataclass
class Lock:
    """A held lock: release() it, or it is released when the process exits."""

    results: Path
    holder: dict
    fd: int | None  # None where this filesystem has no flock: the holder file is the lock
    took_over: str = ""  # the stale holder this lock replaced, described; empty if none
    released: bool = field(default=False, repr=False)


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (Linux), to tell it from a
    later process given the same pid; None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        # the command name (2nd field) may hold spaces and parentheses: split after it
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def describe(holder: dict | None) -> str:
    """'pid 123 on node01, since 2025-06-01T12:00:00+00:00: parabench sweep ...'."""
    if not holder:
        return "an unknown holder (its holder file is unreadable)"
    return (
        f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('since')}: "
        f"{holder.get('command')}"
    )


def read_holder(results: Path) -> dict | None:
    """The holder's details, or None where there is no holder file or it is unreadable."""
    try:
        holder = json.loads((Path(results) / HOLDER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _gone(holder: dict | None) -> bool:
    """Whether the holder was a process of this host that no longer runs (the pid is
    free, or now names a process started later)."""
    if not holder or holder.get("host") != socket.gethostname():
        return False
    pid = holder.get("pid")
    if not isinstance(pid, int) or not _running(pid):
        return True
    started = holder.get("start_ticks")
    return started is not None and _start_ticks(pid) not in (None, started)


def _refusal(results: Path, holder: dict | None, live: bool) -> str:
    """Why a second writer is refused: who holds the lock, and how to clear a stale one."""
    where = Path(results) / HOLDER_FILE
    head = f"results directory {str(results)!r} is locked by another run: {describe(holder)}"
    if live:  # it holds the flock: running (the kernel frees it when it ends)
        return (
            f"{head}. It holds the directory's lock ({Path(results) / LOCK_FILE}), so it is "
            "running: one writer per results directory; wait for it to end, or stop it."
        )
    pid, host = (holder or {}).get("pid"), (holder or {}).get("host")
    here = host == socket.gethostname()
    state = "its process still runs" if here else "this host cannot tell whether it still runs"
    return (
        f"{head}. Its lock file ({where}) remains, and {state}. "
        f"If it has ended (killed, or its host went down), check that it no "
        f"longer runs (`ps -p {pid}` on {host}), then run "
        f"`parabench unlock {shlex.quote(str(results))}`, or delete {where}."
    )


def _flock(fd: int) -> bool:
    """Lock `fd` without waiting: True if locked, False where this filesystem has no
    flock; BlockingIOError where another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # EWOULDBLOCK: held
        raise
    except OSError:  # e.g. Lustre without -o flock (ENOSYS), NFS without lockd (ENOLCK)
        return False
    return True


def _open(results: Path, create: bool) -> int:
    """The lock file, opened to be locked: for writing where this user may (flock over
    NFS is a POSIX write lock, which needs it), else for reading (a results directory
    shared with a colleague who created the file). os.open's descriptor is not
    inherited (PEP 446): no process the run starts holds the lock after it ends."""
    path, flags = results / LOCK_FILE, os.O_CREAT if create else 0
    try:
        return os.open(path, os.O_RDWR | flags, 0o666)
    except PermissionError:
        return os.open(path, os.O_RDONLY)


def _publish(results: Path, holder: dict) -> bool:
    """Create the holder file whole, unless one exists (False)."""
    data = (json.dumps(holder, indent=2) + "\n").encode()
    fd, tmp = tempfile.mkstemp(dir=results, prefix=f"{HOLDER_FILE}.", suffix=".tmp")
    try:
        _write_whole(fd, data)
        try:
            os.link(tmp, results / HOLDER_FILE)  # fails if it exists, atomically (NFS too)
        except FileExistsError:
            return False
        except OSError:
            # No hard links here (EPERM, EOPNOTSUPP: some FUSE, SMB and object-store
            # mounts): an exclusive create, as exclusive, though not whole at once (a
            # reader seeing it empty is refused: an unreadable holder is never taken over).
            return _create(results / HOLDER_FILE, data)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return True


def _widen(fd: int) -> None:
    """Make the holder file readable by all: mkstemp's 0600 (or a umask of 077) would
    hide the holder from a colleague. A mount without modes may refuse: it decides."""
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o644)


def _write_whole(fd: int, data: bytes) -> None:
    """`data` into the new file `fd`, readable by all, on disk before it is named."""
    _widen(fd)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _create(path: Path, data: bytes) -> bool:
    """Create `path` holding `data` with O_CREAT|O_EXCL, unless it exists (False)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    try:
        _write_whole(fd, data)
    except BaseException:
        path.unlink(missing_ok=True)  # ours, half-written: it would refuse every run
        raise
    return True


def _take_over(results: Path, stale: dict, token: str) -> bool:
    """Move the stale holder file aside if it still is `stale`: True if this run did,
    False if it was gone (another run moved it first). Where flock does not hold across
    hosts, two runs may find the same stale holder: only one can win the rename, and
    one that moved a new holder instead puts it back and is refused (LockHeld)."""
    aside = results / f"{HOLDER_FILE}.stale.{token}"
    try:
        os.rename(results / HOLDER_FILE, aside)
    except FileNotFoundError:
        return False
    try:
        raw = aside.read_bytes()
        moved = json.loads(raw)
    except (OSError, ValueError):
        raw, moved = b"", None
    if moved == stale:
        aside.unlink(missing_ok=True)
        return True
    # Another run took the stale one over first, and this moved its new holder file
    # aside: put it back, never over one published in that instant.
    try:
        os.link(aside, results / HOLDER_FILE)
    except FileExistsError:
        pass
    except OSError:  # no hard links here
        _create(results / HOLDER_FILE, raw)
    aside.unlink(missing_ok=True)
    raise LockHeld(_refusal(results, moved if isinstance(moved, dict) else None, live=False))


def acquire(results: Path, command: str | None = None) -> Lock:
    """Lock `results` (created if missing) for this process, or raise LockHeld naming the
    holder. A holder file left by a process of this host that is gone is taken over
    (Lock.took_over says whose). Released by release(), or when the process exits."""
    results = Path(results)
    results.mkdir(parents=True, exist_ok=True)
    fd: int | None = _open(results, create=True)
    try:
        locked = _flock(fd)
    except BlockingIOError:
        os.close(fd)
        raise LockHeld(_refusal(results, read_holder(results), live=True)) from None
    if not locked:
        os.close(fd)
        fd = None
    try:
        holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "start_ticks": _start_ticks(os.getpid()),
            "since": datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": command or shlex.join(sys.argv),
            "token": uuid.uuid4().hex,
            "flock": fd is not None,
        }
        took_over = ""
        while not _publish(results, holder):
            old = read_holder(results)
            if old is None and not (results / HOLDER_FILE).exists():
                continue  # its holder has just released it
            if not _gone(old):
                raise LockHeld(_refusal(results, old, live=False))
            if _take_over(results, old, holder["token"]):
                took_over = describe(old)
    except BaseException:
        if fd is not None:  # a refusal, an I/O error: the flock is never left held
            os.close(fd)
        raise
    lock = Lock(results, holder, fd, took_over)
    atexit.register(release, lock)
    return lock


def check(results: Path) -> None:
    """Raise LockHeld where acquire() would, creating and keeping nothing: a look that
    costs milliseconds, so a second writer is refused before checks that take seconds."""
    results = Path(results)
    try:
        fd = _open(results, create=False)
    except OSError:  # never locked (or unreadable: acquire says so)
        return
    try:
        if _flock(fd):  # free: given back at once
            fcntl.flock(fd, fcntl.LOCK_UN)
    except BlockingIOError:
        raise LockHeld(_refusal(results, read_holder(results), live=True)) from None
    finally:
        os.close(fd)
    holder = read_holder(results)
    if (results / HOLDER_FILE).exists() and not _gone(holder):
        raise LockHeld(_refusal(results, holder, live=False))


def release(lock: Lock) -> None:
    """Give the lock up (again, or in any process but its holder: a no-op). Removes the
    holder file only while it is still this lock's (`parabench unlock` may have removed
    it, and another run taken it)."""
    if lock.released or os.getpid() != lock.holder["pid"]:
        # A forked child (torchrun's agent forking ranks, multiprocessing) shares the
        # descriptor and runs this at exit: the lock is its parent's to give up.
        return
    lock.released = True
    current = read_holder(lock.results)
    if current and current.get("token") == lock.holder["token"]:
        (lock.results / HOLDER_FILE).unlink(missing_ok=True)
    if lock.fd is not None:
        # LOCK_UN releases it for every copy of the descriptor (a process forked since)
        fcntl.flock(lock.fd, fcntl.LOCK_UN)
        os.close(lock.fd)


@contextlib.contextmanager
def held(results: Path, command: str | None = None) -> Iterator[Lock]:
    """`results` locked for the block (acquire, then release)."""
    lock = acquire(results, command)
    try:
        yield lock
    finally:
        release(lock)


def unlock(results: Path) -> str:
    """Clear a lock whose holder is gone (`parabench unlock`): remove its holder file,
    unless a live process holds the flock (LockHeld). Returns what it did, in a line."""
    results = Path(results)
    if not (results / HOLDER_FILE).exists():
        return f"{results} is not locked"
    holder = read_holder(results)
    fd = _open(results, create=True)
    try:
        _flock(fd)
    except BlockingIOError:
        raise LockHeld(
            f"{results} is locked by a running process, {describe(holder)}; stop that run "
            f"first (`fuser -v {results / LOCK_FILE}` shows which process holds it)"
        ) from None
    else:
        (results / HOLDER_FILE).unlink(missing_ok=True)
    finally:
        os.close(fd)
    return f"removed the lock of {describe(holder)}"
