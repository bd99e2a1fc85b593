"""Every sweep ends in summary.csv and report.html, and the headline says what happened
in words, whatever mix of outcomes: every cell failed, every cell skipped, one model
failed while another ran, only one-device cells ran, no `single` at all. Real Snakemake,
real cells; the mixes are made the cheap ways a user makes them by mistake.

All five sweeps share one working directory, each with its own `results:`, as two
configs of one project would: their logs must not overwrite each other's."""

from __future__ import annotations

import html
import json
import re
import subprocess

import pandas as pd
import pytest

from conftest import launch_argv, snakemake, tiny_spec

pytestmark = pytest.mark.slow

TINY = {"arch": "mlp", "dims": [48, 32, 24, 16, 8, 4, 1], "batch_size": 64}
BASE = {
    "device": "cpu",
    "models": {"tiny": TINY},
    "repeats": 1,
    "steps": 4,
    "warmup": 1,
    "profile_steps": 1,
    "timeout_s": 20,
    "cell_timeout_s": 120,
}
NO_GPU = "torch sees no CUDA device"

# A user's model with a bug that shows only in its data, which the preflight does not
# draw: its labels count from 1, so the last class is past the end.
BROKEN_FACTORY = """
import torch
from torch import nn


def build(width=16, classes=4):
    blocks = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, classes))

    def batch(n, generator):
        x = torch.randn(n, width, generator=generator)
        return x, torch.randint(1, classes + 1, (n,), generator=generator)

    return {"blocks": blocks, "loss": nn.CrossEntropyLoss(), "batch": batch}
"""
OUT_OF_BOUNDS = "Target 4 is out of bounds"

MIXES = {
    # Every cell fails, torchrun's too, each saying why.
    "all_failed": {
        "models": {"tiny": {"arch": "custom", "factory": "broken:build", "batch_size": 64}},
        "strategies": ["single", "ddp"],
        "devices": [1, 2],
    },
    # DataParallel finding no GPU gives no honest number: skipped, with the reason. On
    # device auto the cell finds out (device cpu is refused up front: nothing can run).
    "all_skipped": {"device": "auto", "strategies": ["dp"], "devices": [2]},
    # A size nobody can allocate: that model fails, naming itself; the other runs.
    "one_model_failed": {
        "models": {
            "tiny": TINY,
            "huge": {"arch": "mlp", "dims": [2**20, 2**20, 1], "batch_size": 8},
        },
        "strategies": ["single"],
        "devices": [1],
    },
    "only_single": {"strategies": ["single", "dp"], "devices": [1, 2]},
    "no_single": {"strategies": ["ddp"], "devices": [2]},
}


def outcome_text(report: str) -> str:
    """The words of the report's outcome box, tags stripped."""
    box = report.split('id="outcome"', 1)[1].split("</div>", 1)[0]
    return html.unescape(re.sub(r"<[^>]+>", " ", box))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    work = tmp_path_factory.mktemp("outcomes")
    (work / "broken.py").write_text(BROKEN_FACTORY)
    return work


@pytest.fixture(scope="module")
def sweeps(workdir):
    """Each mix run once, in its own results directory of the one working directory."""
    out = {}
    for name, over in MIXES.items():
        config = {**BASE, **over, "results": f"results/{name}"}
        proc = snakemake(workdir, "--cores", "2", config=config)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        res = workdir / config["results"]
        out[name] = {
            "summary": pd.read_csv(res / "summary.csv"),
            "report": (res / "report.html").read_text(),
            "results": res,
        }
    return out


def test_every_cell_failed_says_so_and_why(sweeps):
    s = sweeps["all_failed"]
    assert (s["summary"]["status"] == "failed").all()
    words = outcome_text(s["report"])
    assert "Every cell failed (3 of 3)" in words and OUT_OF_BOUNDS in words, words
    for strategy, devices in [("single", 1), ("ddp", 2)]:
        cell = s["results"] / f"runs/tiny/fp32-sgd/{strategy}/n{devices}/r0"
        meta = json.loads((cell / "meta.json").read_text())
        assert OUT_OF_BOUNDS in meta["reason"] and "Traceback" not in meta["reason"], meta
        assert "Traceback" in meta["traceback"], "the full traceback stays in the record"


@pytest.mark.parametrize("strategy, devices", [("single", 1), ("ddp", 2)])
def test_cuda_without_a_gpu_names_the_missing_gpu(strategy, devices, tmp_path):
    """A Slurm job that forgot its GPUs runs the cell's own command on a node the
    preflight could not see (here the preflight refuses a cuda run: tests/
    test_shipped_configs.py). One-process and torchrun cells alike say the cause, not a
    traceback."""
    spec = tiny_spec(strategy, devices, device="cuda")
    proc = subprocess.run(launch_argv(spec, tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["status"] == "failed"
    assert NO_GPU in meta["reason"] and "Traceback" not in meta["reason"], meta["reason"]
    assert meta["reason"].startswith("LaunchError" if devices == 1 else "rank ")
    errors = sorted(p.name for p in tmp_path.glob("error-rank*.json"))
    assert errors == [f"error-rank{r}.json" for r in range(devices)]
    assert "Traceback" in meta["traceback"], "the full traceback stays in the record"


def test_every_cell_skipped_says_so_and_why(sweeps):
    s = sweeps["all_skipped"]
    assert (s["summary"]["status"] == "skipped").all()
    words = outcome_text(s["report"])
    assert "Every cell was skipped (1)" in words and "DataParallel" in words, words


def test_a_model_that_cannot_be_allocated_fails_naming_itself(sweeps):
    s = sweeps["one_model_failed"]
    by_model = s["summary"].set_index("model")
    assert by_model.loc["tiny", "status"] == "ok"
    assert by_model.loc["huge", "status"] == "failed"
    assert "model 'huge'" in by_model.loc["huge", "reason"]
    words = outcome_text(s["report"])
    assert "huge · fp32 · sgd: no cell ran" in words and "model 'huge'" in words, words
    assert "tiny · fp32 · sgd: no cell ran" not in words


def test_only_one_device_cells_ran(sweeps):
    s = sweeps["only_single"]
    words = outcome_text(s["report"])
    assert "only one-device cells ran" in words and "DataParallel" in words, words


def test_no_single_means_no_speedup_said_in_words(sweeps):
    s = sweeps["no_single"]
    assert s["summary"]["status"].eq("ok").all()
    assert s["summary"]["speedup"].isna().all()
    words = outcome_text(s["report"])
    assert "no single-device cell in this sweep" in words, words


def test_each_results_directory_keeps_its_own_logs(sweeps):
    for name, s in sweeps.items():
        logs = s["results"] / "logs"
        assert (logs / "aggregate.log").exists() and (logs / "report.log").exists(), name
        assert list((logs / "runs").rglob("*.log")), name
