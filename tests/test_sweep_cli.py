"""`parabench sweep CONFIG`: the whole pipeline without Snakemake, as on a GPU image that
has torch but not Snakemake (the GPU check runs this way): cells through the same
guarded launch, the collectives benchmark, the aggregate and the report; a second run
keeps what is recorded."""

import os
import subprocess
import sys

import pandas as pd
import pytest
import yaml

pytestmark = pytest.mark.slow

CONFIG = {
    "device": "cpu",
    "models": {"tiny": {"arch": "mlp", "dims": [48, 32, 24, 16, 8, 4, 1], "batch_size": 64}},
    "strategies": ["single", "ddp"],
    "devices": [1, 2],
    "repeats": 1,
    "steps": 5,
    "warmup": 1,
    "profile_steps": 2,
    "timeout_s": 60,
    "cell_timeout_s": 240,
    "collectives": {"message_bytes": [4096, 1048576]},
}


def sweep(workdir):
    return subprocess.run(
        [sys.executable, "-m", "parabench", "sweep", "config.yaml"],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
        },
    )


def test_sweep_without_snakemake_ends_in_a_report_and_resumes(tmp_path):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    proc = sweep(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = tmp_path / "results"
    summary = pd.read_csv(results / "summary.csv")
    assert (summary["status"] == "ok").all() and len(summary) == 3
    # the scaling model predicts every multi-device cell, out of sample (never one it fits)
    multi = summary["devices"] > 1
    assert summary.loc[multi, "predicted_step_s"].notna().all()
    assert summary.loc[~multi, "predicted_step_s"].isna().all()
    curves = pd.read_csv(results / "collectives.csv")
    assert set(curves["bytes"]) == {4096, 1048576} and set(curves["devices"]) == {2}
    assert (results / "report.html").stat().st_size > 10_000
    again = sweep(tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("recorded, kept") == 3, again.stdout
    assert "ranks: measured with these settings, kept" in again.stdout, again.stdout
