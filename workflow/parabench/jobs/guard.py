"""Run a cell's launch command so that its outcome is always recorded.

Every launch runs under it (jobs/launch.py: `parabench launch`, `parabench launch-collectives`).
- The cell wrote meta.json (ok, skipped, or a failure rank 0 caught): keep it, exit 0.
- It died without one (a rank killed, rank 0 crashed, torchrun failed): record `failed`
  with the exit status and the last error line of its output (for a signal, where
  Python was: faulthandler's dump), exit 0.
- It ran past the timeout (a hang outside any collective timeout): kill its whole
  process group, record `failed` with the timeout, exit 0.
- The guard itself is interrupted (Ctrl-C, scancel, Snakemake stopping): pass the signal
  on, record nothing, exit non-zero, so the cell is rerun next time rather than
  remembered as a failure.
Exit 0 on a recorded failure lets the sweep go on; the failure lives in the results.

Torch-free on purpose: it starts in a few milliseconds and survives a broken torch.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from parabench import envinfo, records
from parabench.jobs import warm

_ERROR_LINE = re.compile(r"(Error|Exception|error:|Killed|Traceback)")
# torchrun's own epilogue repeats the failure; the rank's error line says more.
# A traceback's header line says only that one follows.
_NOISE = re.compile(r"ChildFailedError|elastic|Traceback \(most recent|^\s*(raise|File |\^)")


def last_error(lines: list[str]) -> str:
    for line in reversed(lines):
        if _ERROR_LINE.search(line) and not _NOISE.search(line):
            return line.strip()[:500]
    return lines[-1].strip()[:500] if lines else ""


_ROOT = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)
# One failure of torchrun's report: its rank line, its exit code on the next.
_FAILURE = re.compile(r"^\s*rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", re.M)
# What a rank's collective raises when a peer process went away: a symptom.
_LOST_PEER = re.compile(r"(closed|reset) by peer|Broken pipe|remote process exited", re.I)


_FRAME = re.compile(r'File "(.+?)", line (\d+) in (\S+)')
# faulthandler's header of the stack it dumps: the signalled thread's (all_threads=False,
# as the ranks run it) or, dumping every thread, the current one's.
_STACK = ("Stack (most recent call first)", "Current thread ")


def python_frame(lines: list[str]) -> str:
    """Where Python was when a process died of a signal, from faulthandler's dump
    (`parabench run` and `collectives` enable it): the innermost frame of the thread
    that got it."""
    for i, line in enumerate(lines[:-1]):
        if line.startswith(_STACK) and (m := _FRAME.search(lines[i + 1])):
            return f"{Path(m[1]).name}:{m[2]} in {m[3]}"
    return ""


def root_cause(lines: list[str], errors: list[dict], world: int | None) -> str:
    """The failure's root cause, in one line: the first failing rank's exception type
    and message (from its error-rank<R>.json), or, for a rank that died without one,
    how it died (torchrun's verdict: which rank failed first, exit code or signal)."""
    text = "\n".join(lines)
    m = _ROOT.search(text)
    first, code = (int(m.group(1)), int(m.group(2))) if m else (None, 0)
    raised = {e.get("rank") for e in errors}
    named = "torchrun: "
    # torchrun dates each failure it lists to the whole second: within one second its
    # "first" is a guess (it lists several where ranks are subprocesses, or agents of
    # a multi-node job; forked ranks' agent lists the one it noticed). When it names a
    # rank whose exception says a peer went away and lists one killed by a signal it
    # was not sent (the agent stops the rest with SIGTERM), that one was the cause.
    if first in raised and _LOST_PEER.search(str(errors[0].get("message", ""))):
        for rank, exit_code in ((int(r), int(c)) for r, c in _FAILURE.findall(text)):
            if exit_code < 0 and -exit_code != signal.SIGTERM and rank not in raised:
                named = f"torchrun named rank {first}, whose peer went away; "
                first, code = rank, exit_code
                break
    # The agent names the first failure it noticed; when that rank left an error, the
    # ranks' own clocks say better which exception came first (errors: earliest first).
    if errors and (first is None or first in raised):
        return records.describe_error(errors[0], world)
    if first is None:
        return ""
    cause = f"{named}rank {first} failed first ({describe_exit(code)}) without a Python exception"
    if code < 0 and (where := python_frame(lines)):
        cause += f"; Python was at {where}"
    if line := last_error([ln for ln in lines if ln.startswith(f"[rank{first}]:")]):
        cause += f"; its last error line: {line.removeprefix(f'[rank{first}]:').strip()}"
    if errors:  # what the others then saw: a symptom, kept as a clue
        cause += f"; then {records.describe_error(errors[0], world)}"
    return cause


def describe_exit(rc: int) -> str:
    """How a process ended: its exit code, or the signal that killed it."""
    if rc < 0:
        try:
            return f"killed by signal {signal.Signals(-rc).name}"
        except ValueError:  # a real-time signal has no name
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def guard(out: Path, cmd: list[str], timeout_s: float, fields: dict, ranks: int) -> int:
    """Run `cmd`, which starts `ranks` processes; make sure `out` ends with a record.
    `fields`: what a failure record carries (a cell's identity and settings:
    RunSpec.record_fields(); the collectives benchmark's kind and devices)."""
    meta = out / "meta.json"
    meta.unlink(missing_ok=True)  # a stale record must not pass for this launch's
    records.clear_rank_errors(out)
    world = None if ranks > 1 else 1  # a one-process cell's errors name no rank
    # The log's first line: the exact command, to rerun the cell by hand.
    print(shlex.join(cmd), flush=True)
    tail: collections.deque[str] = collections.deque(maxlen=200)
    started = time.monotonic()
    proc = start(cmd)

    interrupted: list[int] = []

    def forward(signum, _frame) -> None:
        interrupted.append(signum)
        _kill_group(proc, signal.SIGTERM)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)

    timed_out = False
    deadline = started + timeout_s
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    while True:
        line = proc.stdout.readline()
        if line:
            sys.stdout.write(line)
            tail.append(line.rstrip("\n"))
        elif proc.poll() is not None:
            break
        if time.monotonic() > deadline and not timed_out:  # checked even while it prints
            timed_out = True
            _kill_group(proc, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                _kill_group(proc, signal.SIGKILL)
        if not line:
            time.sleep(0.05)
    rest = proc.stdout.read() or ""
    sys.stdout.write(rest)
    tail.extend(rest.splitlines())
    rc = proc.wait()
    sys.stdout.flush()
    elapsed = time.monotonic() - started
    print(f"parabench guard: launch took {elapsed:.2f} s, {describe_exit(rc)}", file=sys.stderr)

    if interrupted:
        # A rank may have recorded its own end as a failure on the way out: a cell cut
        # short by the user is no result, failed or not, so nothing of it is kept.
        meta.unlink(missing_ok=True)
        print(
            f"parabench guard: interrupted by {signal.Signals(interrupted[0]).name}; "
            "nothing recorded, the cell will rerun",
            file=sys.stderr,
        )
        return 128 + interrupted[0]
    tail_lines = list(tail)
    cause = root_cause(tail_lines, records.read_rank_errors(out), world)
    if timed_out:
        reason = f"timed out after {timeout_s:g} s (cell_timeout_s); killed"
        if cause:
            reason += f"; before that, {cause}"
    elif meta.exists():
        try:
            if fields.get("kind") == "collectives":  # not a cell: no cell keys to check
                return 0
            recorded = records.read_meta(meta)
        except records.ResultsError as e:
            reason = f"cell wrote an invalid record: {e}"
        else:
            # Rank 0 wrote what it saw, often a peer's symptom ("connection closed"):
            # the reason becomes the root cause, rank 0's view is kept beside it.
            if recorded["status"] == "failed" and cause and cause != recorded["reason"]:
                if not cause.startswith("rank 0:"):
                    recorded["rank0_reason"] = recorded["reason"]
                recorded["reason"] = cause
                records.write_meta(meta, recorded)
            return 0
    else:
        reason = cause or f"launcher {describe_exit(rc)} without a record"
        if not cause and rc < 0 and (where := python_frame(tail_lines)):
            reason += f"; Python was at {where}"
        elif not cause and (err := last_error(tail_lines)):
            reason += f"; last error: {err}"
    write = (
        records.write_meta_only if fields.get("kind") == "collectives" else records.write_outcome
    )
    write(
        out,
        "failed",
        reason,
        **fields,
        elapsed_s=round(elapsed, 3),
        exit_code=rc,
        env={**envinfo.base(), "launch_command": cmd},
        log_tail=list(tail)[-30:],
    )
    print(f"parabench guard: recorded failure: {reason}", file=sys.stderr)
    return 0


def start(cmd: list[str]) -> subprocess.Popen | warm.WarmProcess:
    """`cmd` in a new session with its output on a pipe: forked from the run's warm
    process where there is one (parabench.jobs.warm), else a new process; which, in the log."""
    proc = warm.spawn(cmd)
    if isinstance(proc, warm.WarmProcess):
        print(f"parabench guard: warm start, pid {proc.pid}", file=sys.stderr, flush=True)
        return proc
    if proc != warm.NO_WARM_PROCESS:
        print(f"parabench guard: cold start: {proc}", file=sys.stderr, flush=True)
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
        preexec_fn=warm.die_with_parent,
    )


def _kill_group(proc: subprocess.Popen | warm.WarmProcess, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
