"""Crashes, hangs, OOMs and timeouts end in bounded time as a recorded `failed` cell with
its cause; real torchrun ranks, real `parabench launch`, as the workflow runs them."""

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import REPO, launch_argv, tiny_spec
from parabench.spec import ModelSpec

pytestmark = pytest.mark.slow

# seconds: the process-group timeout a hung collective must hit. Not shorter: it also
# bounds how far a rank may fall behind its peers before the fault fires, and on a
# loaded host (CI, two test workers on two cores) ZeRO-1's rank 1 once waited 5 s for
# rank 0 in its set-up, so that its own timeout, not the injected hang, was recorded.
PG_TIMEOUT = 10


def guarded(tmp_path, spec, fault: str, cell_timeout: float = 120, env: dict | None = None):
    out = tmp_path / "cell"
    cmd = launch_argv(spec, out, cell_timeout)
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PARABENCH_FAULT": fault, **(env or {})},
    )
    elapsed = time.monotonic() - t0
    meta = json.loads((out / "meta.json").read_text())
    if meta["status"] == "failed":
        assert (out / "steps.csv").read_text().count("\n") == 1, "header only, no partial steps"
    return proc, meta, elapsed


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("crash", "rank 1 failed first (exit code 13)"),
        ("oom", "OutOfMemoryError: injected"),
        ("hang", "Timed out"),
    ],
)
def test_rank_fault_is_a_recorded_failure(tmp_path, kind, expected):
    spec = tiny_spec("ddp", 2, timeout_s=PG_TIMEOUT)
    proc, meta, elapsed = guarded(tmp_path, spec, f"{kind}@tiny/ddp/n2/r0:rank=1:step=2")
    assert proc.returncode == 0, "a recorded failure lets the sweep go on"
    assert meta["status"] == "failed"
    assert expected in meta["reason"], meta["reason"]
    assert (meta["model"], meta["strategy"], meta["devices"]) == ("tiny", "ddp", 2)
    if kind == "hang":  # bounded by the process-group timeout, plus start-up
        assert PG_TIMEOUT <= elapsed < PG_TIMEOUT + 40, elapsed


def test_faults_hit_only_their_cell(tmp_path):
    """The fault names repeat 1: repeat 0 runs whole, and repeat 1, the same launch
    otherwise, fails of it (so the first half is not a fault that never fires)."""
    fault = "crash@tiny/ddp/n2/r1:rank=1:step=2"
    _, meta, _ = guarded(tmp_path / "r0", tiny_spec("ddp", 2), fault)
    assert meta["status"] == "ok"
    _, meta, _ = guarded(tmp_path / "r1", tiny_spec("ddp", 2, repeat=1), fault)
    assert meta["status"] == "failed" and "exit code 13" in meta["reason"], meta["reason"]


def test_cell_timeout_kills_a_hang_outside_any_collective(tmp_path):
    spec = tiny_spec("single", 1)
    proc, meta, elapsed = guarded(
        tmp_path, spec, "hang@tiny/single/n1/r0:rank=0:step=1", cell_timeout=8
    )
    assert proc.returncode == 0
    assert meta["status"] == "failed"
    assert meta["reason"] == "timed out after 8 s (cell_timeout_s); killed"
    assert 8 <= elapsed < 25
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "cell")], capture_output=True)
    assert left.returncode == 1, "no process of the killed cell may survive"


def test_cell_timeout_of_a_multi_rank_cell_records_the_timeout_alone(tmp_path):
    """Killed ranks die of the signal, as torchrun's own ranks do: none of them reports
    the kill as its exception (a forked rank keeps no handler of the agent's)."""
    spec = tiny_spec("ddp", 2)  # process-group timeout 60 s: the cell timeout comes first
    proc, meta, elapsed = guarded(
        tmp_path, spec, "hang@tiny/ddp/n2/r0:rank=0:step=1", cell_timeout=10
    )
    assert proc.returncode == 0
    assert meta["reason"] == "timed out after 10 s (cell_timeout_s); killed", meta["reason"]
    assert 10 <= elapsed < 25, elapsed
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "cell")], capture_output=True)
    assert left.returncode == 1, "no process of the killed cell may survive"


def test_an_interrupted_multi_rank_cell_leaves_no_record(tmp_path):
    """Ctrl-C (SIGINT to the guard) mid-cell: no record, failed or not, so that a
    resumed sweep reruns the cell; every rank gone at once, none of them reporting the
    kill as its own error (rank 0 waits in the all-reduce for the hung rank 1)."""
    out = tmp_path / "cell"
    proc = subprocess.Popen(
        launch_argv(tiny_spec("ddp", 2), out, 120),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PARABENCH_FAULT": "hang@tiny/ddp/n2/r0:rank=1:step=1"},
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True)
        if len(found.stdout.split()) >= 4:  # guard, agent and two ranks
            break
        time.sleep(0.2)
    time.sleep(4)  # into the ranks' set-up or the hang: either must end the same way
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, output[-2000:]
    assert "interrupted by SIGINT; nothing recorded" in output
    assert time.monotonic() - t0 < 5, "the ranks die of the signal, not after a grace period"
    assert not (out / "meta.json").exists(), (out / "meta.json").read_text()
    assert not list(out.glob("error-rank*.json")), "a rank took the kill for its own error"
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True)
    assert left.returncode == 1, "no process of the interrupted cell may survive"


def test_a_single_process_killed_by_a_signal_says_where_python_was(tmp_path):
    spec = tiny_spec("single", 1)
    _, meta, _ = guarded(tmp_path, spec, "abort@tiny/single/n1/r0:rank=0:step=1")
    assert meta["status"] == "failed"
    assert meta["reason"].startswith(
        "launcher killed by signal SIGABRT without a record; Python was at faults.py:"
    ), meta["reason"]
    assert meta["reason"].endswith(" in fire"), meta["reason"]


def test_malformed_fault_spec_is_refused(tmp_path):
    spec = tiny_spec("single", 1)
    _, meta, _ = guarded(tmp_path, spec, "explode@everything")
    assert meta["status"] == "failed" and "PARABENCH_FAULT" in meta["reason"]


TINY_RES = ModelSpec.of("resmlp", d_in=32, width=64, depth=2, classes=10)
MINE = ModelSpec.of(
    "custom", factory="my_model:build", args={"width": 32, "depth": 4}, path=str(REPO / "examples")
)
CELL_TIMEOUT = 120


@pytest.mark.parametrize(
    "kind, strategy, settings, expected",
    [
        ("crash", "fsdp", {}, "torchrun: rank 1 failed first (exit code 13)"),
        ("hang", "fsdp", {}, "rank 0: "),
        ("oom", "zero1", {}, "rank 1: OutOfMemoryError: injected"),
        ("hang", "zero1", {}, "rank 0: "),
        (  # what a native abort looks like (a failed check, a corrupted heap)
            "abort",
            "tp",
            {"model": TINY_RES},
            "torchrun: rank 1 failed first (killed by signal SIGABRT) without a Python "
            "exception; Python was at faults.py:",
        ),
        ("hang", "tp", {"model": TINY_RES}, "rank 0: "),
        ("oom", "pipeline", {"model": MINE, "model_name": "mine"}, "OutOfMemoryError: injected"),
    ],
    ids=lambda v: v if isinstance(v, str) and " " not in v else None,
)
def test_faults_in_the_sharded_strategies_and_a_custom_model_end_recorded(
    tmp_path, kind, strategy, settings, expected
):
    """Each fault ends as a `failed` record naming the root cause, within the
    process-group timeout for a hang (a rank stuck in FSDP's all-gather, ZeRO's
    broadcast or a DTensor collective), well before the cell's own timeout."""
    spec = tiny_spec(strategy, 2, timeout_s=PG_TIMEOUT, **settings)
    model = settings.get("model_name", "tiny")
    proc, meta, elapsed = guarded(
        tmp_path,
        spec,
        f"{kind}@{model}/{strategy}/n2/r0:rank=1:step=2",
        cell_timeout=CELL_TIMEOUT,
    )
    print(
        f"\nfault {kind} in {strategy}: failed after {elapsed:.1f} s "
        f"(timeout_s {PG_TIMEOUT}, cell_timeout_s {CELL_TIMEOUT}): {meta['reason'][:160]}"
    )
    assert proc.returncode == 0
    assert meta["status"] == "failed"
    assert expected in meta["reason"], meta["reason"]
    assert "Traceback (most recent" not in meta["reason"]
    if kind == "hang":
        assert "Timed out" in meta["reason"] or "timed out" in meta["reason"], meta["reason"]
        assert PG_TIMEOUT <= elapsed < PG_TIMEOUT + 40, elapsed
    assert elapsed < CELL_TIMEOUT / 2
