"""Multi-node launch: a GPU cell needing more devices than one node has runs as one
srun task per node, each a torchrun agent, meeting at a c10d rendezvous on the first
node. Stand-in `srun`/`scontrol` (tests/fake_slurm) run the "nodes" on this machine with
exactly the command lines the Slurm job would run: first as processes side by side, then
as two hosts, each in its own network namespace with its own address and hostname,
joined by a veth pair, so the rendezvous and gloo really cross between two addresses.
What stays unproven: two physical hosts and a real multi-node Slurm (per-node GPU
binding, the cluster's network)."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from conftest import require_root, require_tool, snakemake

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
    # One fake job id for the whole run means one rendezvous id: --cores 2 (cells take
    # 2 threads) keeps the two multi-node cells from overlapping, as distinct Slurm jobs
    # with distinct ids would anyway.
    proc = snakemake(work, "--cores", "2", config=CONFIG, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return work, log.read_text()


def test_srun_and_torchrun_receive_the_multinode_launch(run):
    _, log = run
    sruns = [line for line in log.splitlines() if line.startswith("srun ")]
    assert len(sruns) == 2  # ddp and pipeline at 4 devices; nothing else spans nodes
    for line in sruns:
        srun, _, rest = line.partition(" --kill-on-bad-exit=1 ")
        assert srun == "srun --nodes=2 --ntasks-per-node=1", line
        python, _, torchrun = rest.partition(" -m parabench.torchrun ")
        assert python.endswith("python"), line
        # the port is chosen at launch (launch.rendezvous_port: tests/test_rendezvous_port.py)
        assert re.match(
            "--nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d "
            rf"--rdzv-endpoint=localhost:\d+ --rdzv-id={JOB_ID} "
            "-m parabench run ",
            torchrun,
        ), line
    assert "scontrol show hostnames node[1-2]" in log


def test_two_agents_formed_one_job_that_matches_single(run):
    work, _ = run
    for strategy in ("ddp", "pipeline"):
        meta = json.loads(
            (work / f"results/runs/tiny/fp32-sgd/{strategy}/n4/r0/meta.json").read_text()
        )
        assert meta["status"] == "ok", meta["reason"]
        assert meta["world_size"] == 4 and meta["threads_per_rank"] >= 1
        assert len(meta["peak_memory_per_rank"]) == 4
    summary = pd.read_csv(work / "results/summary.csv").set_index(["strategy", "devices"])
    assert summary.loc[("ddp", 4), "max_abs_param_diff"] <= 1e-6
    assert summary.loc[("pipeline", 4), "max_abs_param_diff"] <= 1e-6


def test_single_process_strategies_cannot_span_nodes(run):
    work, _ = run
    meta = json.loads((work / "results/runs/tiny/fp32-sgd/dp/n4/r0/meta.json").read_text())
    assert meta["status"] == "skipped"
    assert "cannot span nodes" in meta["reason"]


@pytest.fixture
def two_hosts():
    """Two network namespaces, node0 (10.77.0.1) and node1 (10.77.0.2), joined by veth;
    each resolves both names through /etc/netns/NAME/hosts (ip netns exec mounts it)."""
    require_tool("ip")
    require_root("network namespaces need root")
    names = [f"pb{os.getpid() % 100000}n{i}" for i in range(2)]
    veth = [f"pbv{os.getpid() % 100000}{i}" for i in range(2)]

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    try:
        ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for i, ns in enumerate(names):
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("link", "set", veth[i], "netns", ns)
            ip("-n", ns, "addr", "add", f"10.77.0.{i + 1}/24", "dev", veth[i])
            ip("-n", ns, "link", "set", veth[i], "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("127.0.0.1 localhost\n10.77.0.1 node0\n10.77.0.2 node1\n")
        yield names
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


def test_ddp_across_two_network_hosts(tmp_path, two_hosts):
    log = tmp_path / "fake-slurm.log"
    config = {**CONFIG, "strategies": ["single", "ddp"]}
    env = {
        "PATH": f"{FAKE}{os.pathsep}{os.environ['PATH']}",
        "FAKE_SLURM_LOG": str(log),
        "FAKE_SLURM_NETNS": " ".join(two_hosts),
        "FAKE_SLURM_HOSTS": "node0 node1",
        "SLURM_JOB_ID": str(JOB_ID),
        "SLURM_JOB_NODELIST": "node[0-1]",
        "SLURM_NNODES": "2",
    }
    proc = snakemake(tmp_path, "--cores", "2", config=config, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert re.search(r"--rdzv-endpoint=node0:\d+ ", log.read_text())
    meta = json.loads((tmp_path / "results/runs/tiny/fp32-sgd/ddp/n4/r0/meta.json").read_text())
    assert meta["status"] == "ok", meta["reason"]
    assert meta["world_size"] == 4
    assert meta["hosts"] == ["node0", "node1"], "ranks ran on both hosts"
    summary = pd.read_csv(tmp_path / "results/summary.csv").set_index(["strategy", "devices"])
    assert summary.loc[("ddp", 4), "max_abs_param_diff"] <= 1e-6
