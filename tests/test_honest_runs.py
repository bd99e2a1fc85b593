"""Honest numbers however parabench is run: a user's --configfile is the whole config;
two cells timed side by side on one host are flagged in the summary and the report;
a run whose loss becomes NaN is a finding (diverged, dated, not ranked, not compared),
not a result. (That `snakemake --cores 2` times one cell at a time is checked on the
workflow test's own sweep: tests/test_workflow.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from conftest import planned_outputs, snakemake, tiny_config, tiny_spec
from parabench.jobs.launch import launch_command
from parabench.spec import ModelSpec

TINY_GPT = {
    "arch": "gpt",
    "vocab": 64,
    "seq_len": 8,
    "n_layer": 2,
    "n_head": 2,
    "d_model": 16,
    "batch_size": 8,
}


def test_a_users_configfile_is_the_whole_config(tmp_path):
    """Snakemake deep-merges --configfile into a Snakefile's `configfile:`; the default
    config's models must not come along with the user's."""
    config = tiny_config(models={"mine": dict(TINY_GPT)}, strategies=["single"])
    proc = snakemake(tmp_path, "-n", config=config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outputs = [p for line in planned_outputs(proc) for p in line.split(", ")]
    cells = [p for p in outputs if "/runs/" in p and p.endswith("meta.json")]
    assert cells == ["results/runs/mine/fp32-sgd/single/n1/r0/meta.json"], cells


@pytest.mark.slow
def test_cells_timed_side_by_side_are_flagged(tmp_path):
    """Two cells launched at once on this host (what `--resources timed_cells=2` asks
    for): both are flagged, each naming the other, and the report's headline says so."""
    model = ModelSpec.of("mlp", dims=[256, 256, 256, 1])
    specs = [
        tiny_spec(s, 1, model=model, batch_size=256, steps=400, warmup=5) for s in ("single", "ddp")
    ]
    outs = [tmp_path / s.strategy for s in specs]
    procs = [
        subprocess.Popen(launch_command(s, o, 300, sys.executable), stdout=subprocess.DEVNULL)
        for s, o in zip(specs, outs, strict=True)
    ]
    assert [p.wait(300) for p in procs] == [0, 0]
    metas = [json.loads((o / "meta.json").read_text()) for o in outs]
    assert [m["status"] for m in metas] == ["ok", "ok"]
    (a0, a1), (b0, b1) = (m["timed_window"] for m in metas)
    assert a0 < b1 and b0 < a1, "the two launches did not overlap: the test proves nothing"
    results = tmp_path / "results"
    cli = [sys.executable, "-m", "parabench"]
    tables = {f"--{t}-out": str(results / f"{t}.csv") for t in ("steps", "cells", "summary")}
    metas_args = [str(o / "meta.json") for o in outs]
    flags = [x for kv in tables.items() for x in kv]
    subprocess.run([*cli, "aggregate", "--meta", *metas_args, *flags], check=True)
    summary = pd.read_csv(results / "summary.csv").set_index("strategy")
    assert summary["overlapped"].all()
    assert str(outs[1]) in summary.loc["single", "overlapped_with"]
    assert str(outs[0]) in summary.loc["ddp", "overlapped_with"]
    report = results / "report.html"
    subprocess.run([*cli, "report", "--results", str(results), "--out", str(report)], check=True)
    assert "Timed side by side: 2 cells" in report.read_text()


@pytest.mark.slow
def test_a_diverging_run_is_a_finding_not_a_result(tmp_path):
    config = tiny_config(
        models={"g": dict(TINY_GPT)},
        strategies=["single", "ddp"],
        optimizer="adamw",
        lr=900,
        steps=8,
        profile_steps=3,
    )
    proc = snakemake(tmp_path, "--cores", "2", config=config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = pd.read_csv(tmp_path / "results/summary.csv")
    assert (summary["status"] == "diverged").all(), summary[["strategy", "devices", "status"]]
    for reason in summary["reason"]:
        assert reason.startswith("diverged: the loss became nan at step "), reason
        assert "learning rate (900 with adamw)" in reason
    assert summary["equivalent"].isna().all(), "not comparable, never False with NaN"
    assert summary["speedup"].isna().all(), "a diverged run's times are never ranked"
    assert summary["step_time_s"].notna().all(), "its times are kept"
    html = (tmp_path / "results/report.html").read_text()
    assert "Diverged: 3 cells" in html
    assert "Not comparable (the loss became NaN or inf" in html
