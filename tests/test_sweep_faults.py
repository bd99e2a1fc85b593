"""A sweep meets trouble: one failed cell leaves the rest whole, Ctrl-C and SIGKILL
resume without rerunning finished cells, untrustworthy results are refused by name, and
a bad config stops before any job starts. Real Snakemake, real processes. And
`parabench sweep` tells a launch stopped by a signal (run again to resume) from one that
ended on its own without a record (its log named)."""

import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from conftest import snakemake, tiny_config
from parabench import records
from parabench.jobs import sweep
from parabench.run.loop import PROFILED, step_kinds
from report_fixture import make_results

TINY = {"arch": "mlp", "dims": [48, 32, 24, 16, 8, 4, 1], "batch_size": 64}
BASE = {
    "device": "cpu",
    "models": {"tiny": TINY},
    "strategies": ["single", "ddp"],
    "devices": [1, 2],
    "repeats": 1,
    "steps": 5,
    "warmup": 1,
    "profile_steps": 4,
    "timeout_s": 10,
    "cell_timeout_s": 120,
}


@pytest.mark.slow
def test_one_failed_cell_leaves_the_sweep_whole(tmp_path):
    proc = snakemake(
        tmp_path,
        "--cores",
        "2",
        config=BASE,
        env={"PARABENCH_FAULT": "crash@tiny/ddp/n2/r0:rank=1:step=2"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = pd.read_csv(tmp_path / "results/summary.csv").set_index(["strategy", "devices"])
    assert summary.loc[("single", 1), "status"] == "ok"
    assert summary.loc[("ddp", 1), "status"] == "ok"
    assert summary.loc[("ddp", 2), "status"] == "failed"
    reason = summary.loc[("ddp", 2), "reason"]
    assert "rank 1 failed first (exit code 13)" in reason
    report = (tmp_path / "results/report.html").read_text()
    problems = report.split('id="problems"')[1].split('id="reproduce"')[0]
    assert "rank 1 failed first (exit code 13)" in problems


# Python-only cells (a few seconds each) so the sweep is still running when signalled:
# four, so that two finish, one is cut short and one has not started.
INTERRUPTED = {
    **BASE,
    "strategies": ["single", "model_parallel"],
    "devices": [1],
    "repeats": 2,
}
CELLS = 4


def incomplete_outputs(workdir) -> set:
    """Outputs Snakemake marked incomplete: jobs running when the sweep was stopped.
    Markers are urlsafe-base64 names, split into '@'-prefixed chunks when long."""
    root = workdir / ".snakemake/incomplete"
    out = set()
    for marker in root.rglob("*") if root.exists() else ():
        if marker.is_file():
            b64 = "".join(part.removeprefix("@") for part in marker.relative_to(root).parts)
            out.add(workdir / base64.urlsafe_b64decode(b64).decode())
    return out


def running_in(workdir) -> list[str]:
    """Command lines of processes working in `workdir` (the cells of that sweep: their
    command lines hold relative paths, so their working directory is what names them)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and Path(os.readlink(proc / "cwd")) == workdir:
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return found


def metas(workdir):
    return {p: p.read_text() for p in (workdir / "results/runs").rglob("meta.json")}


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_interrupted_sweep_resumes_without_rerunning_finished_cells(tmp_path, sig):
    proc = snakemake(tmp_path, "--cores", "1", config=INTERRUPTED, popen=True)
    deadline = time.monotonic() + 180
    while len(metas(tmp_path)) < 2 if (tmp_path / "results/runs").exists() else True:
        assert time.monotonic() < deadline and proc.poll() is None, "sweep ended too soon"
        time.sleep(0.2)
    # Into the next cell: a launch whose cell has no record yet (not the one whose record
    # was just written, on its way out). Not a fixed wait: warm launches of these cells
    # take about a second each, and 1.5 s once let both that were left finish.
    while not any(
        not (tmp_path / cmd.split(" --out ")[1].split()[0] / "meta.json").exists()
        for cmd in running_in(tmp_path)
        if " launch " in cmd and " --out " in cmd
    ):
        assert time.monotonic() < deadline and proc.poll() is None, "sweep ended too soon"
        time.sleep(0.05)
    time.sleep(0.2)
    # SIGINT to the process group is a Ctrl-C in a terminal; SIGKILL of the group is a
    # killed session: no handler runs, not Snakemake's and not the guard's.
    os.killpg(proc.pid, sig)
    proc.wait(timeout=60)
    gone_by = time.monotonic() + 2
    while (left := running_in(tmp_path)) and time.monotonic() < gone_by:
        time.sleep(0.1)
    assert not left, f"cells still running after {sig.name}: {left}"

    # A cell in flight may have written its record before the kill, but Snakemake never
    # saw its job end: it is marked incomplete and must be rerun, never trusted.
    in_flight = incomplete_outputs(tmp_path)
    finished = {p: t for p, t in metas(tmp_path).items() if p not in in_flight}
    assert 2 <= len(finished) < CELLS
    for path, text in finished.items():  # nothing half-written was left as a result
        assert json.loads(text)["status"] == "ok", path
        rows = [
            k
            for k in step_kinds(BASE["steps"], BASE["warmup"], BASE["profile_steps"])
            if k != PROFILED
        ]
        assert (path.parent / "steps.csv").read_text().count("\n") == 1 + len(rows)

    if sig == signal.SIGKILL:
        # Snakemake keeps its lock after a SIGKILL (it cannot tell a dead run from a live
        # one elsewhere) and says to unlock; a user does exactly this.
        unlock = snakemake(tmp_path, "--unlock", config=INTERRUPTED)
        assert unlock.returncode == 0, unlock.stderr[-2000:]
    # A plain rerun: profiles/default (keep-going, rerun-incomplete) applies here too.
    rerun = snakemake(tmp_path, "--cores", "1", config=INTERRUPTED)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    after = metas(tmp_path)
    assert len(after) == CELLS
    for path, text in finished.items():
        assert after[path] == text, f"{path} was rerun"
    for path in in_flight & set(after):
        assert json.loads(after[path])["status"] == "ok"
    summary = pd.read_csv(tmp_path / "results/summary.csv")
    assert (summary["status"] == "ok").all() and (summary["repeats_ok"] == 2).all()


@pytest.mark.slow
@pytest.mark.parametrize(
    "damage, message",
    [
        ("truncate", "unreadable results metadata"),
        ("version", "results schema version 0"),
        ("columns", f"do not match schema v{records.SCHEMA_VERSION}"),
    ],
)
def test_aggregate_refuses_untrustworthy_results_naming_the_file(tmp_path, damage, message):
    metas_ = make_results(tmp_path)
    bad = metas_[3]
    if damage == "truncate":
        bad.write_text(bad.read_text()[:40])
    elif damage == "version":
        version = f'"schema_version": {records.SCHEMA_VERSION}'
        bad.write_text(bad.read_text().replace(version, '"schema_version": 0'))
    else:
        steps = bad.parent / "steps.csv"
        steps.write_text(steps.read_text().replace("step_time_s", "seconds", 1))
    out = tmp_path / "merged"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "parabench",
            "aggregate",
            "--meta",
            *map(str, metas_),
            "--steps-out",
            str(out / "steps.csv"),
            "--summary-out",
            str(out / "summary.csv"),
            "--cells-out",
            str(out / "cells.csv"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert message in proc.stderr
    assert str(bad.parent) in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists(), "nothing merged from untrustworthy input"


@pytest.mark.slow
@pytest.mark.parametrize(
    "over, key",
    [
        ({"strategies": ["fsdp3"]}, "strategies"),
        ({"models": {"tiny": {**TINY, "arch": "transformer"}}}, "arch"),
        ({"bogus": 1}, "'bogus' was unexpected"),
        ({"devices": [0]}, "devices"),
        ({"devices": [1.5]}, "devices"),
        ({"repeats": 0}, "repeats"),
        ({"steps": 0}, "steps"),
        ({"warmup": 5}, "warmup"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"models": {"tiny": {**TINY, "batch_size": 63}}}, "batch_size"),
        (
            {
                "options": {"pipeline": {"microbatches": 2, "schedule": "1f1b"}},
                "strategies": ["pipeline"],
                "devices": [4],
            },
            "pipeline.microbatches",
        ),
        (
            {
                "models": {"tiny": {**TINY, "dims": [48, 8, 1]}},
                "strategies": ["pipeline"],
                "devices": [4],
            },
            "only 2 blocks",
        ),
        ({"results": "../outside"}, "results"),
        ({"results": "r; rm -rf ~"}, "results"),
        ({"models": {"a;b": TINY}}, "models"),
    ],
)
def test_bad_config_fails_before_any_job_naming_the_key(tmp_path, over, key):
    proc = snakemake(tmp_path, "-n", config={**BASE, **over})
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert key in out, out[-2000:]
    assert "invalid config" in out or "Error validating config file" in out
    assert not (tmp_path / "results").exists() and not (tmp_path / "logs").exists()


@pytest.mark.parametrize(
    "ends, code, interrupted",
    [
        ("sys.exit(2)", 1, False),  # argparse refused it
        ("import parabench_missing", 1, False),  # an import error
        ("pass", 1, False),  # exit 0, and still no record: a bug in the launch
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 130, True),
        ("sys.exit(130)", 130, True),  # the guard, after a Ctrl-C
    ],
    ids=["exit-2", "import-error", "exit-0", "SIGKILL", "exit-130"],
)
def test_a_launch_that_ends_without_a_record_is_told_from_an_interruption(
    tmp_path, monkeypatch, capsys, ends, code, interrupted
):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tiny_config()))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sweep.doctor, "run_checks", lambda *args, **kwargs: [])
    launch = [sys.executable, "-c", f"import sys; {ends}"]  # in place of `parabench launch`
    monkeypatch.setattr(sweep, "launch_command", lambda *args, **kwargs: launch)
    assert sweep.main(Path("config.yaml"), None, None, False) == code
    said = capsys.readouterr().err
    log = "results/logs/runs/tiny/fp32-sgd/single/n1/r0.log"
    assert ("run again to resume" in said) == interrupted, said
    if not interrupted:
        assert "without recording the cell" in said and str(tmp_path / log) in said, said
    assert not (tmp_path / "results/.parabench.lock.json").exists()  # given back
