"""`python -m parabench.forkserver NAME [MODEL_TYPE...]`: a run's warm process (see
parabench.jobs.warm), with transformers and these model types' classes imported where given.

It listens first, so a launch that comes while it imports waits for it instead of
starting cold; imports torch and what a cell's processes and torchrun's agent import;
then forks each launch that asks (parabench.jobs.warm.spawn) into the process it asked for,
and sends its pid, then its exit status. It stays one thread and never starts CUDA,
which is what makes a fork safe (parabench.torchrun says why); if its imports broke
either, it refuses every launch, which then starts cold.

A launch's process: a new session (the guard kills its group, as a Popen's with
start_new_session), the launch's standard streams, working directory and environment,
the signal handlers a new Python has, SIGTERM when this process dies; killed (SIGTERM)
when its launch goes without waiting for it, as a guard's child is (PR_SET_PDEATHSIG).
This process ends when its run stops it (SIGTERM), or with the run (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import selectors
import shlex
import signal
import socket
import sys
import threading
import traceback

import setproctitle

from parabench import envinfo
from parabench.jobs import warm


def _preload(hf_types: list[str]) -> str | None:
    """Import what the forked processes run (with `hf_types`, transformers and those
    model types' classes); why forking would be unsafe, if it is."""
    import torch
    import torch._dynamo  # every torch.optim constructor imports it

    from parabench import strategies, torchrun  # noqa: F401
    from parabench.catalog import CATALOG

    for name in CATALOG:
        strategies.get(name)
    if hf_types:
        from parabench.models import hf

        # transformers missing or a type it lacks: each launch meets it as its own error
        with contextlib.suppress(Exception):
            hf.preload_types(hf_types)
    if torch.cuda.is_initialized():
        return "its imports started CUDA, which a forked process cannot use"
    # Python threads only: torch's import starts a native one of its own, as it does in
    # torchrun's agent, which forks its ranks in the same state (parabench.torchrun).
    if threading.active_count() > 1:
        return "its imports started a thread, which a fork would leave half-copied"
    return None


def _child(request: dict, fds: list[int], closing: list) -> None:
    """In the forked process: become the launch's process and run it. Never returns."""
    code = 1
    try:
        for s in closing:  # the warm process's sockets and selector
            s.close()
        os.setsid()
        warm.die_with_parent()
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
        _close(fds)
        from parabench import torchrun  # imported by _preload, before SIGINT was ignored

        torchrun.restore_fresh_handlers()
        argv = request["argv"]
        # What ps and pgrep show: the launch's command, shell-quoted, so that its ranks
        # read it back whole (envinfo.launch_command). Before the environment is
        # replaced: setproctitle takes over its memory on first use.
        setproctitle.setproctitle(shlex.join(argv))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[envinfo.STARTED] = "warm"  # what the records say of it
        sys.argv = [argv[0], *argv[3:]]
        sys.orig_argv = list(argv)
        # As a new Python's on a pipe: stdout block-buffered, stderr by line
        sys.stdout = os.fdopen(1, "w", closefd=False)
        sys.stderr = os.fdopen(2, "w", closefd=False, errors="backslashreplace")
        sys.stderr.reconfigure(line_buffering=True)
        if argv[2] == "parabench.torchrun":
            torchrun.main(argv[3:])
        else:
            from parabench import cli

            cli.entry()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    header, ancillary, _, _ = conn.recvmsg(8, socket.CMSG_LEN(3 * fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    size = int.from_bytes(header, "big")
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("the launch closed the connection mid-request")
        body += chunk
    return json.loads(body), list(fds)


def _refusal(request: dict, env_at_import: dict[str, str]) -> str | None:
    argv = request["argv"]
    if not warm.forkable(argv):
        return "warm start refused: not a command the warm process forks"
    if argv[0] != sys.executable:
        return f"warm start refused: it runs {argv[0]}, the warm process {sys.executable}"
    differs = sorted(
        k
        for k in set(env_at_import) | set(warm.import_time_env(request["env"]))
        if env_at_import.get(k) != request["env"].get(k)
    )
    if differs:
        return f"warm start refused: torch was imported with other {', '.join(differs)}"
    return None


def serve(name: str, hf_types: list[str]) -> None:
    warm.die_with_parent()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(warm._address(name))
    listener.listen(64)
    env_at_import = warm.import_time_env(dict(os.environ))
    try:
        unsafe = _preload(hf_types)
    except Exception as e:  # a broken torch: every launch starts cold and meets it there
        unsafe = f"its imports failed: {type(e).__name__}: {e}"
    # After the imports, which read the handlers a new Python has (parabench.torchrun's
    # ranks restore them): the run's Ctrl-C is for the guards, which stop their launches.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}  # pid -> its launch's connection
    while True:
        for key, _ in selector.select(timeout=0.05):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = _receive(conn)
                except (OSError, ValueError, ConnectionError):
                    conn.close()
                    continue
                why = unsafe and f"warm start refused: {unsafe}"
                if why := why or _refusal(request, env_at_import):
                    _close(fds)
                    conn.sendall(why.encode() + b"\n")
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    _child(request, fds, [selector, listener, conn, *children.values()])
                _close(fds)
                conn.sendall(f"{pid}\n".encode())
                children[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
            else:  # a launch's connection: it sends nothing more, so it went away
                selector.unregister(key.fileobj)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(key.data, signal.SIGTERM)
        _reap(children, selector)


def _close(fds: list[int]) -> None:
    for fd in set(fds):
        os.close(fd)


def _reap(children: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    """Each ended launch's exit status, to its launch (its guard's returncode)."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if (conn := children.pop(pid, None)) is None:
            continue
        with contextlib.suppress(OSError):  # a launch that went away hears nothing
            conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(conn)
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
