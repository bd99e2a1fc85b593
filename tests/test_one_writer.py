"""One writer per results directory, in real runs: a second `parabench sweep` on a
directory a sweep is writing is refused at once, naming the holder and the lock; so is
a sweep beside a Snakemake run, and a Snakemake run beside a sweep. Their dry runs are
not: a dry run writes nothing, and takes no lock."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import snakemake, tiny_config
from parabench.jobs import lock

pytestmark = pytest.mark.slow

SWEEP = [sys.executable, "-m", "parabench", "sweep", "config.yaml"]
# The first run's single cell never ends (until cell_timeout_s): the run is writing
# while the second one starts.
HANG = {"PARABENCH_FAULT": "hang@tiny/single/n1/r0:rank=0:step=1"}
HANGING_LOG = "results/logs/runs/tiny/fp32-sgd/single/n1/r0.log"
HOLDER = "results/.parabench.lock.json"


def start_sweep(workdir: Path) -> subprocess.Popen:
    (workdir / "config.yaml").write_text(yaml.safe_dump(tiny_config()))
    return subprocess.Popen(
        SWEEP,
        cwd=workdir,
        env={**os.environ, **HANG},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_until_writing(workdir: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Until the run is in its hanging cell."""
    deadline = time.monotonic() + timeout
    while not (workdir / HANGING_LOG).exists():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the first run never reached its cell"
        time.sleep(0.1)


def stop(proc: subprocess.Popen, sig: int) -> None:
    """Signal the run's process group (its own session), as a terminal would."""
    os.killpg(proc.pid, sig)
    proc.communicate(timeout=120)


def test_a_second_sweep_on_a_locked_directory_is_refused_at_once(tmp_path):
    first = start_sweep(tmp_path)
    try:
        wait_until_writing(tmp_path, first)
        started = time.monotonic()
        second = subprocess.run(SWEEP, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        took = time.monotonic() - started
    finally:
        stop(first, signal.SIGKILL)  # a killed run: no handler runs
    assert second.returncode != 0, "the second sweep ran beside the first"
    said = second.stderr
    holder = json.loads((tmp_path / HOLDER).read_text())  # left by the SIGKILL
    assert f"pid {first.pid} on {socket.gethostname()}" in said, said
    assert "parabench sweep config.yaml" in said and holder["since"] in said
    assert "results/.parabench.lock" in said and "Traceback" not in said
    # refused before any check that takes time: a second is the budget, on a busy
    # machine twice that
    assert took < 2.0, f"refused after {took:.2f} s"
    assert not (tmp_path / "results/runs/tiny/fp32-sgd/ddp").exists(), "the second one ran"


def test_a_sweep_beside_a_snakemake_run_is_refused(tmp_path):
    run = snakemake(tmp_path, "--cores", "1", config=tiny_config(), env=HANG, popen=True)
    try:
        wait_until_writing(tmp_path, run)
        sweep = subprocess.run(SWEEP, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert sweep.returncode != 0, "the sweep ran beside the Snakemake run"
        assert f"pid {run.pid} on {socket.gethostname()}" in sweep.stderr, sweep.stderr
        assert "so it is running" in sweep.stderr
        assert json.loads((tmp_path / HOLDER).read_text())["command"].startswith("snakemake ")
    finally:
        stop(run, signal.SIGINT)  # Ctrl-C: Snakemake's onerror gives the lock back
    assert not (tmp_path / HOLDER).exists()


def test_snakemake_beside_a_sweep_is_refused_but_its_dry_run_is_not(tmp_path):
    first = start_sweep(tmp_path)
    try:
        wait_until_writing(tmp_path, first)
        dry = snakemake(tmp_path, "-n", config=tiny_config())
        run = snakemake(tmp_path, "--cores", "1", config=tiny_config())
    finally:
        stop(first, signal.SIGINT)  # Ctrl-C: the sweep gives the lock back
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert run.returncode != 0, "Snakemake ran beside the sweep"
    said = run.stdout + run.stderr
    assert f"pid {first.pid} on {socket.gethostname()}" in said, said[-3000:]
    assert "parabench sweep config.yaml" in said
    assert not (tmp_path / "results/runs/tiny/fp32-sgd/ddp").exists(), "a job ran beside it"
    assert not (tmp_path / HOLDER).exists()


def test_a_dry_run_beside_a_holder_is_not_refused(tmp_path):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tiny_config()))
    with lock.held(tmp_path / "results", "a sweep writing"):
        dry = subprocess.run(
            [*SWEEP, "-n"], cwd=tmp_path, capture_output=True, text=True, timeout=600
        )
        assert lock.read_holder(tmp_path / "results")["command"] == "a sweep writing"
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "cells, each its own launch" in dry.stdout
    assert not (tmp_path / "results/runs").exists()


def test_no_hooks_still_takes_the_lock_and_runs_the_preflight(tmp_path):
    """--no-hooks skips onstart, onsuccess and onerror, where the lock and the preflight
    live: the run takes both all the same, refused beside a holder and by a failing
    check before any job, gives the lock back when it ends, and its dry run takes
    neither."""
    from parabench.preflight import doctor

    config = tiny_config(strategies=["single"], devices=[1])
    with lock.held(tmp_path / "results", "a sweep writing"):
        run = snakemake(tmp_path, "--cores", "1", "--no-hooks", config=config)
        dry = snakemake(tmp_path, "-n", "--no-hooks", config=config)
    said = run.stdout + run.stderr
    assert run.returncode != 0, "Snakemake ran beside the holder"
    assert "a sweep writing" in said and f"pid {os.getpid()}" in said, said[-3000:]
    assert not (tmp_path / "results/runs").exists(), "a job ran beside the holder"
    assert dry.returncode == 0, dry.stderr[-3000:]
    if doctor.torch_build()[1] is None:  # a CPU torch: the preflight refuses device cuda
        cuda = snakemake(
            tmp_path, "--cores", "1", "--no-hooks", config={**config, "device": "cuda"}
        )
        said = cuda.stdout + cuda.stderr
        assert cuda.returncode != 0 and "parabench doctor:  FAIL  torch" in said, said[-3000:]
        assert "nothing was started" in said and not (tmp_path / "results/runs").exists()
        assert not (tmp_path / HOLDER).exists(), "the refused run kept the lock"
    run = snakemake(tmp_path, "--cores", "1", "--no-hooks", config=config)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "parabench doctor:" in run.stdout + run.stderr  # its checks ran
    assert (tmp_path / "results/report.html").exists()
    assert not (tmp_path / HOLDER).exists(), "the run kept the lock"
