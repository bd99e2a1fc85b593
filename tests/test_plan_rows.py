"""`parabench plan` records each planned rank as it finishes: a rank that kills the
process (as the OOM killer does) is a failed row saying so, and the ranks after it are
still planned; plan.csv is whole at every moment."""

from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd
import pytest
import yaml

from conftest import tiny_config

pytestmark = pytest.mark.slow


def plan(tmp_path, fault: str):
    config = tiny_config(
        plan={
            "enabled": True,
            "strategies": ["ddp"],
            "world_sizes": [8, 16, 32],
            "fabric": "h100-nvlink-ndr400",
        }
    )
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run(
        [sys.executable, "-m", "parabench", "plan", str(path), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PARABENCH_FAULT": fault},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return pd.read_csv(tmp_path / "plan.csv").set_index("world_size")


def test_a_killed_planned_rank_is_a_failed_row_and_the_plan_goes_on(tmp_path):
    rows = plan(tmp_path, "abort@tiny/ddp/n16/r0:rank=0:step=1")
    assert list(rows.index) == [8, 16, 32]
    assert {"status", "reason", "fabric", "predicted_step_s"} <= set(rows.columns)
    assert rows.loc[16, "status"] == "failed"
    assert "killed by signal SIGABRT" in rows.loc[16, "reason"]
    assert "while measuring it" in rows.loc[16, "reason"]
    assert rows.loc[16, "fabric"] == "h100-nvlink-ndr400"
    for n in (8, 32):  # before it, and after it in a process started again
        assert rows.loc[n, "status"] == "ok", rows.loc[n, "reason"]
        assert rows.loc[n, "predicted_step_s"] > 0


def test_a_rank_that_exits_the_process_fails_the_ranks_it_never_reached(tmp_path):
    """An exit code (not a signal) is the process's own end, not one rank's: the rest
    are failed rows saying they were never measured, not planned again."""
    rows = plan(tmp_path, "crash@tiny/ddp/n8/r0:rank=0:step=1")
    assert (rows["status"] == "failed").all()
    assert "exit code 13" in rows.loc[8, "reason"]
    assert "before it was measured" in rows.loc[16, "reason"]
