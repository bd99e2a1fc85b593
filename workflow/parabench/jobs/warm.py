"""Warm starts: a local run's launches forked from one process that has imported torch.

Why: a launch's agent (parabench.torchrun) or one-process cell imports torch and what
its ranks run before its first step: 3.5 to 4 s of CPU on the 2-core machines the
default run is sized for, paid again by every cell, and most of the default run's time.
A run on one host (Snakemake's local executor, `parabench sweep`) starts one warm
process (parabench.forkserver) that imports all of that once and forks each launch's
process from there, as parabench.torchrun forks the ranks from its agent, and for the
same reason it is safe: the warm process runs no torch op, starts no thread and never
starts CUDA, so each fork begins where a fresh Python would be once its imports are
done. The timed steps are the same code in the same kind of process.

What is forked is what the guard would have started: `python -m parabench.torchrun ...`
or `python -m parabench run|collectives ...`, with the launch's working directory,
environment, and standard streams (passed over the socket); the guard reads, times and
kills it as its own child. The commands of the jobs that import torch themselves
(advise, aggregate, the ranks' and plan's measuring children) are forked too, through
`popen` or, from a rule's shell, `python -m parabench.jobs.warm CMD` (`main`), with the
job's own streams. A launch that the warm process cannot stand for, because its Python
differs or an environment variable torch reads at import differs from the one the warm
process imported with, starts cold, and says so in its log. So does every launch when
there is no warm process (a Slurm job, a cluster node) or it has gone.

This module is the client (the guard's side) and starts the server; it never imports
torch.
"""

from __future__ import annotations

import array
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence

# The environment variable that names the run's warm process (an abstract Unix socket:
# no file to clean up, no path-length limit, gone with its process).
ENV = "PARABENCH_WARM"

# Variables read when torch and its libraries are imported (threads, allocators,
# devices, logging, the interpreter's own): a launch whose values differ from the warm
# process's would not be the process it asked for, so it starts cold.
IMPORT_TIME_PREFIXES = (
    "PYTHON",
    "TORCH",
    "PYTORCH",
    "OMP_",
    "MKL_",
    "KMP_",
    "GOMP_",
    "OPENBLAS",
    "LD_",
    "CUDA",
    "NCCL",
    "NVIDIA",
    "HIP",
    "ROCM",
    "TRITON",
    "HF_",
    "TRANSFORMERS",
)

# The commands a warm process forks: torchrun's agent, and the processes of a cell or
# of the collectives benchmark that run without one.
WARM_MODULES = {("-m", "parabench.torchrun"), ("-m", "parabench")}

NO_WARM_PROCESS = "no warm process in this run"


# Where torch's compilers keep their caches: read when they compile, never at import,
# and written into a process's own environment by its first compile (cache_dir_utils),
# so that every process a compiling one starts inherits them: a test worker or a sweep
# that compiled would otherwise send every later launch cold. A forked launch takes its
# own environment before it runs (forkserver._child).
READ_WHEN_USED = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    """The part of an environment that torch and Python read when they are imported.
    Not the thread counts (OMP_, MKL_, OPENBLAS_NUM_THREADS), which Snakemake sets to
    each job's `threads`: every rank sets its own (runtime.start: torch.set_num_threads
    over the cores it is bound to), as the ranks that torchrun's agent forks already do
    whatever the agent imported torch with; nor READ_WHEN_USED."""
    return {
        k: v
        for k, v in env.items()
        if k.startswith(IMPORT_TIME_PREFIXES)
        and not k.endswith("_NUM_THREADS")
        and k not in READ_WHEN_USED
    }


def forkable(argv: list[str]) -> bool:
    """Whether `argv` is a command a warm process forks (python -m parabench...)."""
    return len(argv) >= 3 and tuple(argv[1:3]) in WARM_MODULES


def _address(name: str) -> str:
    return "\0parabench-warm-" + name


class WarmProcess:
    """A launch forked by the warm process: what the guard needs of a Popen (pid,
    stdout, poll, wait, returncode). Its exit status comes over the socket from the warm
    process, which is its parent; a status lost with the warm process reads as killed
    by SIGKILL, once the process itself is gone."""

    def __init__(self, conn: socket.socket, pid: int, stdout) -> None:
        self._conn = conn
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._buffer = b""

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        self._conn.setblocking(False)
        try:
            while chunk := self._conn.recv(64):
                self._buffer += chunk
                if b"\n" in self._buffer:
                    break
            else:  # the warm process closed the socket without a status: it died
                if not _alive(self.pid):
                    self.returncode = -signal.SIGKILL
        except BlockingIOError:
            pass
        if b"\n" in self._buffer:
            self.returncode = int(self._buffer.split(b"\n", 1)[0])
        if self.returncode is not None:
            self._conn.close()
        return self.returncode

    def kill(self) -> None:
        """SIGKILL to the launch's process group (it runs in a session of its own)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("warm launch", timeout)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def spawn(
    argv: list[str], env: dict[str, str] | None = None, inherit: bool = False
) -> WarmProcess | str:
    """Fork `argv` from the run's warm process, its output to a new pipe (the returned
    process's `stdout`, text) or, `inherit`, to this process's stdout and stderr, in
    this directory and environment; or, where it cannot, why (a sentence for the log),
    and the caller starts it cold."""
    env = dict(os.environ if env is None else env)
    name = env.get(ENV)
    if not name or name == "0":
        return NO_WARM_PROCESS
    if not forkable(argv):
        return "not a command the warm process forks"
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(_address(name))
    except OSError as e:
        conn.close()
        return f"the run's warm process is gone ({e.strerror or e})"
    read_end, write_end = os.pipe()
    stdin = os.open(os.devnull, os.O_RDONLY)  # as the guard's Popen: no input
    try:
        request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": env}).encode()
        out = [1, 2] if inherit else [write_end, write_end]
        fds = array.array("i", [stdin, *out])
        header = len(request).to_bytes(8, "big")
        conn.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        conn.sendall(request)
        answer = b""
        while not answer.endswith(b"\n"):  # its pid, or why not; waits out its imports
            chunk = conn.recv(4096)
            if not chunk:
                raise ConnectionError("the warm process closed the connection")
            answer += chunk
    except (OSError, ConnectionError) as e:
        conn.close()
        os.close(read_end)
        return f"the run's warm process did not answer ({e})"
    finally:
        os.close(write_end)
        os.close(stdin)
    reply = answer.decode().strip()
    if not reply.isdigit():
        conn.close()
        os.close(read_end)
        return reply
    if inherit:
        os.close(read_end)
        return WarmProcess(conn, int(reply), None)
    stdout = os.fdopen(read_end, "r", errors="replace")
    return WarmProcess(conn, int(reply), stdout)


def popen(argv: list[str]) -> subprocess.Popen | WarmProcess:
    """`argv` with this process's standard streams: forked from the run's warm process
    where it can be, else a new process (why, on stderr, where there is a warm process).
    Either ends with this one (PR_SET_PDEATHSIG; the warm process kills a fork whose
    caller has gone)."""
    proc = spawn(argv, inherit=True)
    if isinstance(proc, WarmProcess):
        print(f"parabench: warm start, pid {proc.pid}", file=sys.stderr, flush=True)
        return proc
    if proc != NO_WARM_PROCESS:
        print(f"parabench: cold start: {proc}", file=sys.stderr, flush=True)
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)


def main(argv: list[str]) -> int:
    """`python -m parabench.jobs.warm python -m parabench COMMAND ...`: the command, warm
    where it can be (popen), its exit status this process's (128 + a signal's number
    where one ended it, as a shell says it). The rules start advise and aggregate so;
    interrupted, the command is killed."""
    os.environ.setdefault("PYTHONSAFEPATH", "1")  # as every parabench command (cli.main)
    # `python` on the PATH, as the rules name it, is this interpreter: named as the warm
    # process names its own, which forks only what runs on it
    exe = shutil.which(argv[0])
    if exe and os.path.samefile(exe, sys.executable):
        argv = [sys.executable, *argv[1:]]
    proc = popen(argv)
    try:
        code = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return code if code >= 0 else 128 - code


def hf_types(config: dict) -> list[str]:
    """The transformers model types a run of `config` builds in the launches it forks:
    its `arch: hf` models', and Llama's where advise checks torchtitan's runs (Llama 3.1
    shapes, predict/published.py)."""
    # before the config's checks (run_held): a model without its type is theirs to name
    models = (config.get("models") or {}).values()
    types = {m.get("model_type") for m in models if isinstance(m, dict) and m.get("arch") == "hf"}
    types.discard(None)
    advise = config.get("advise") or {}
    if advise.get("enabled") and advise.get("torchtitan"):
        types.add("llama")
    return sorted(types)


@contextlib.contextmanager
def warm_process(
    env: dict[str, str] | None = None, hf_types: Sequence[str] = ()
) -> Iterator[str | None]:
    """A warm process for the launches started while this is open, named in this
    process's environment (ENV) so that they find it; stopped on the way out, and gone
    with this process even if it is killed (PR_SET_PDEATHSIG). It imports transformers
    and `hf_types`' classes too, where given (see `hf_types`). Yields its name, or None
    where one is already named (an outer run's), PARABENCH_WARM=0 turns them off, or
    setproctitle is not installed."""
    # setproctitle: a forked launch shows its own command in ps and pgrep, not the warm
    # process's; without it (a bare GPU image), launches start cold
    if os.environ.get(ENV) or importlib.util.find_spec("setproctitle") is None:
        yield None  # an outer run's, or 0: off
        return
    name = uuid.uuid4().hex
    # Started as the launches' Python is: no working directory on sys.path (cli.main).
    server_env = {**(os.environ if env is None else env), "PYTHONSAFEPATH": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "parabench.forkserver", name, *hf_types],
        stdin=subprocess.DEVNULL,
        env=server_env,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    os.environ[ENV] = name
    try:
        yield name
    finally:
        os.environ.pop(ENV, None)
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def elsewhere() -> Iterator[None]:
    """For a run whose jobs start on a cluster: no warm process named to them while this
    is open. A job on this host (a workstation's Slurm, a login node's) would otherwise
    reach an outer run's and have its launches forked outside its own allocation, its
    cgroup, CPUs and limits."""
    saved = os.environ.pop(ENV, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[ENV] = saved


def die_with_parent() -> None:
    """In a child, before it runs: get SIGTERM when its parent dies, even by SIGKILL, so
    that a killed run leaves no process behind writing into a cell being rerun (Linux:
    PR_SET_PDEATHSIG; elsewhere nothing)."""
    with contextlib.suppress(OSError):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda sig, frame: sys.exit(128 + sig))
    sys.exit(main(sys.argv[1:]))
