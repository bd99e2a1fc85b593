"""`parabench sweep` on a directory it has run before: `--retry-failed` reruns the failed
cells and keeps every other; the collectives benchmark is kept while its settings hold
and rerun when they change (other message sizes are other curves); the ranks and plan
tables are kept while what they measure holds (and the plan's curves), as Snakemake
keeps them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pandas as pd
import pytest
import yaml

from conftest import tiny_config
from parabench import records
from parabench.config import alone_ranks, load_config, measures

pytestmark = pytest.mark.slow

CONFIG = tiny_config(
    profile_steps=2,
    collectives={"message_bytes": [4096]},
    plan={"enabled": True, "strategies": ["ddp"], "world_sizes": [8], "fabric": "curves"},
)
CELLS = ["single/n1", "ddp/n1", "ddp/n2"]


def sweep(workdir, *args, env=None):
    proc = subprocess.run(
        [sys.executable, "-m", "parabench", "sweep", "config.yaml", *args],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
            **(env or {}),
        },
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def logged(workdir) -> dict:
    """The ranks and plan jobs' logs, as they stand: rewritten by each run of the job."""
    return {
        job: (log.stat().st_mtime_ns, log.read_text())
        for job in ("ranks", "plan")
        if (log := workdir / f"results/logs/{job}.log").exists()
    }


def meta(workdir, cell):
    return (workdir / f"results/runs/tiny/fp32-sgd/{cell}/r0/meta.json").read_text()


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A sweep whose ddp cell at 2 devices failed (a rank crashed)."""
    work = tmp_path_factory.mktemp("swept")
    (work / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    sweep(work, env={"PARABENCH_FAULT": "crash@tiny/ddp/n2/r0:rank=1:step=2"})
    assert json.loads(meta(work, "ddp/n2"))["status"] == "failed"
    return work


@pytest.fixture
def again(swept, tmp_path):
    work = tmp_path / "again"
    shutil.copytree(swept, work)
    return work


def test_retry_failed_reruns_the_failed_cells_only(again):
    before = {cell: meta(again, cell) for cell in CELLS}
    proc = sweep(again, "--retry-failed")
    assert proc.stdout.count("recorded, kept") == 2, proc.stdout
    for cell in CELLS[:2]:
        assert meta(again, cell) == before[cell], f"{cell} was rerun"
    assert json.loads(meta(again, "ddp/n2"))["status"] == "ok"
    summary = pd.read_csv(again / "results/summary.csv")
    assert (summary["status"] == "ok").all()


def test_the_collectives_rerun_when_their_settings_change_and_only_then(again):
    config = {**CONFIG, "collectives": {"message_bytes": [4096, 65536]}}
    (again / "config.yaml").write_text(yaml.safe_dump(config))
    before = logged(again)
    proc = sweep(again)
    # other curves: the plan that reads them reruns; the ranks measured alone do not
    after = logged(again)
    assert after["ranks"] == before["ranks"] and after["plan"] != before["plan"], proc.stdout
    curves = pd.read_csv(again / "results/collectives.csv")
    assert set(curves["bytes"]) == {4096, 65536}
    recorded = json.loads((again / "results/collectives/n2/meta.json").read_text())
    assert recorded["settings"]["message_bytes"] == [4096, 65536]
    # the same settings: kept, and the failed cell too (no --retry-failed)
    proc = sweep(again)
    assert "collectives at 2 ranks: ran with these settings, kept" in proc.stdout
    assert proc.stdout.count("recorded, kept") == 3, proc.stdout
    assert json.loads((again / "results/collectives/n2/meta.json").read_text()) == recorded


def test_ranks_and_plan_are_kept_while_what_they_measure_holds(again):
    before = logged(again)
    assert set(before) == {"ranks", "plan"}
    proc = sweep(again)
    assert "ranks: measured with these settings, kept" in proc.stdout, proc.stdout
    assert "plan: planned with these settings, kept" in proc.stdout, proc.stdout
    assert logged(again) == before, "a ranks or plan process ran again"

    # a failed row is kept, as a failed cell is, but for --retry-failed
    ranks = again / "results/ranks.csv"
    rows = records.read_rows(ranks)
    rows[0].update(status="failed", reason="RuntimeError: made up")
    records.write_rows(ranks, records.RANK_COLUMNS, rows)
    sweep(again)
    assert logged(again) == before
    sweep(again, "--retry-failed")
    assert (pd.read_csv(ranks)["status"] == "ok").all()
    again_logged = logged(again)
    assert again_logged["ranks"] != before["ranks"] and again_logged["plan"] == before["plan"]

    # other steps: other measurements, both rerun
    (again / "config.yaml").write_text(yaml.safe_dump({**CONFIG, "steps": 6}))
    proc = sweep(again)
    after = logged(again)
    assert all(after[job] != again_logged[job] for job in after), proc.stdout
    stored = (again / "results/ranks.measures").read_text().splitlines()
    assert stored == measures(alone_ranks(load_config(again / "config.yaml")))
