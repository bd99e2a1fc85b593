"""Multi-node launch: a GPU cell needing more devices than one node has runs as one
srun task per node, each a torchrun agent, meeting at a c10d rendezvous on the first
node. No second host here: fake `srun`/`scontrol` (tests/fake_slurm) run both "nodes" on
this machine, so two real torchrun agents rendezvous over TCP into one 4-rank job, with
exactly the command lines the Slurm job would run. What stays unproven: two real hosts
(network, name resolution, per-node GPU binding by Slurm)."""

import json
import os
from pathlib import Path

import pandas as pd
import pytest

from conftest import snakemake

pytestmark = pytest.mark.slow
FAKE = Path(__file__).parent / "fake_slurm"
JOB_ID = 4242

CONFIG = {
    "device": "auto",  # asks for GPUs; the CPU torch then runs on CPU (gloo)
    "gpus_per_node": 2,
    "models": {"tiny": {"arch": "mlp", "dims": [48, 32, 24, 16, 8, 4, 1], "batch_size": 64}},
    "strategies": ["single", "dp", "ddp", "pipeline"],
    "devices": [1, 4],
    "repeats": 1,
    "steps": 5,
    "warmup": 1,
    "timeout_s": 60,
    "cell_timeout_s": 300,
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("multinode")
    log = work / "fake-slurm.log"
    env = {
        "PATH": f"{FAKE}{os.pathsep}{os.environ['PATH']}",
        "FAKE_SLURM_LOG": str(log),
        "SLURM_JOB_ID": str(JOB_ID),
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_NNODES": "2",
    }
    # One fake job id for the whole run means one rendezvous port: --cores 2 (cells take
    # 2 threads) keeps the two multi-node cells from overlapping, as distinct Slurm jobs
    # with distinct ids would anyway.
    proc = snakemake(work, "--cores", "2", config=CONFIG, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return work, log.read_text()


def test_srun_and_torchrun_receive_the_multinode_launch(run):
    _, log = run
    sruns = [line for line in log.splitlines() if line.startswith("srun ")]
    assert len(sruns) == 2  # ddp and pipeline at 4 devices; nothing else spans nodes
    port = 20000 + JOB_ID % 20000
    for line in sruns:
        assert line.startswith(
            "srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 "
            "torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d "
            f"--rdzv-endpoint=localhost:{port} --rdzv-id={JOB_ID} "
            "-m parabench run "
        ), line
    assert "scontrol show hostnames node[1-2]" in log


def test_two_agents_formed_one_job_that_matches_single(run):
    work, _ = run
    for strategy in ("ddp", "pipeline"):
        meta = json.loads((work / f"results/runs/tiny/{strategy}/n4/r0/meta.json").read_text())
        assert meta["status"] == "ok", meta["reason"]
        assert meta["world_size"] == 4 and meta["threads_per_rank"] >= 1
        assert len(meta["peak_memory_per_rank"]) == 4
    summary = pd.read_csv(work / "results/summary.csv").set_index(["strategy", "devices"])
    assert summary.loc[("ddp", 4), "max_abs_param_diff"] <= 1e-6
    assert summary.loc[("pipeline", 4), "max_abs_param_diff"] <= 1e-6


def test_single_process_strategies_cannot_span_nodes(run):
    work, _ = run
    meta = json.loads((work / "results/runs/tiny/dp/n4/r0/meta.json").read_text())
    assert meta["status"] == "skipped"
    assert "cannot span nodes" in meta["reason"]
