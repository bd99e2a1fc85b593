"""The Slurm profile against a real Slurm: the pipeline runs with
`--profile profiles/slurm` on a single-node cluster started here, every benchmark cell
is an sbatch job that gets exactly the GPUs it asked for, and results and report follow.
"""

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import pandas as pd
import pytest
from slurm_cluster import local_slurm

from conftest import REPO, require_root, require_tool, snakemake

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

CONFIG = {
    # auto: jobs ask Slurm for GPUs (fake ones here); the CPU torch then runs on CPU.
    "device": "auto",
    "models": {"tiny": {"arch": "mlp", "dims": [48, 32, 24, 16, 8, 4, 1], "batch_size": 64}},
    "strategies": ["single", "ddp"],
    "devices": [1, 2],
    "repeats": 1,
    "steps": 5,
    "warmup": 1,
    "timeout_s": 30,
    "cell_timeout_s": 300,
}
# The test overlay: what a user sets for their site, plus two settings for a cluster
# without an accounting database (squeue for status, a short first status check).
OVERLAY = [
    "--slurm-status-command",
    "squeue",
    "--slurm-init-seconds-before-status-checks",
    "2",
    "--slurm-no-account",
    "--default-resources",
    "slurm_partition=test",
    "mem_mb_per_cpu=200",
    "runtime=10",
    "--set-resources",
    "benchmark:cpus_per_gpu=1",
]


# Job groups, as profiles/slurm documents them: the cells of one model, variant and
# device count in one allocation. Two one-device cells, so no collectives job.
GROUPED_CONFIG = {**CONFIG, "devices": [1]}
GROUP = "{model}_{variant}_n{devices}"
GROUPS = ["--groups", f"benchmark={GROUP}", "--group-components", f"{GROUP}=16"]


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    for tool in ("slurmctld", "slurmd", "munged", "sbatch"):
        require_tool(tool)
    require_root("starting slurmctld/slurmd needs root")
    work = tmp_path_factory.mktemp("slurm-work")
    grouped = tmp_path_factory.mktemp("slurm-grouped")
    profile = ["--profile", str(REPO / "profiles/slurm"), *OVERLAY]
    with local_slurm(tmp_path_factory.mktemp("slurm")) as cluster:
        # Both sweeps at once, as two users of one cluster: most of a sweep's wall time
        # is waiting on Slurm's status checks, and they wait side by side.
        with ThreadPoolExecutor(2) as pool:
            cells = pool.submit(snakemake, work, *profile, config=CONFIG)
            # the documented switch for sites that forbid whole-node jobs
            shared = ["--config", "exclusive_nodes=False"]
            packed = pool.submit(
                snakemake, grouped, *profile, *GROUPS, *shared, config=GROUPED_CONFIG
            )
            procs = {"cells": cells.result(), "grouped": packed.result()}
        log = "\n".join(p.read_text()[-2000:] for p in cluster["logs"] if p.exists())
        # Slurm's own record of the jobs (kept MinJobAge after they end).
        jobs = subprocess.run(
            ["scontrol", "-o", "show", "job"], capture_output=True, text=True, check=True
        ).stdout
    slurm = {}
    for line in jobs.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        slurm[fields["JobId"]] = fields
    return {"cells": work, "grouped": grouped, "slurm": slurm, "procs": procs, "log": log}


def _ran(sweeps, which: str) -> Path:
    proc = sweeps["procs"][which]
    assert proc.returncode == 0, f"{proc.stderr[-4000:]}\n--- slurm logs ---\n{sweeps['log']}"
    return sweeps[which]


@pytest.fixture(scope="module")
def sweep(sweeps):
    return _ran(sweeps, "cells"), sweeps["slurm"]


def test_every_cell_ran_as_its_own_slurm_job(sweep):
    work, slurm = sweep
    cells = pd.read_csv(work / "results/cells.csv", dtype=str, keep_default_na=False)
    assert len(cells) == 3
    assert (cells["status"] == "ok").all(), cells[["strategy", "devices", "reason"]]
    ids = cells["slurm_job_id"]
    assert (ids != "").all(), "a cell ran outside Slurm"
    assert ids.is_unique, "one sbatch job per cell"
    for _, c in cells.iterrows():  # Slurm itself knows the job, and it completed
        job = slurm[c["slurm_job_id"]]
        assert job["JobState"] == "COMPLETED", job
        # --gpus=N is recorded per job as TresPerJob=gres:gpu:N
        assert job.get("TresPerJob") == f"gres:gpu:{c['devices']}", job
        # a readable comment (the plugin's): the cell, as squeue and sacct show it
        cell = f"rule_benchmark_wildcards_tiny_fp32-sgd_{c['strategy']}_{c['devices']}_0"
        assert job.get("Comment") == cell, job
        # a timed cell had its node to itself (sbatch --exclusive), and it recorded so
        assert job["OverSubscribe"] == "NO", job
        assert c["slurm_oversubscribe"] == "NO", c.to_dict()
    logs = work / "logs/slurm"
    assert len(list((logs / "rule_benchmark").rglob("*.log"))) == 3, "the plugin's job logs"
    # the collectives benchmark (ddp at 2 ranks needs curves at n=2) is a job of its own
    assert len(list((logs / "rule_collectives").rglob("*.log"))) == 1


def test_each_job_got_the_gpus_it_asked_for(sweep):
    work, _ = sweep
    cells = pd.read_csv(work / "results/cells.csv", dtype=str, keep_default_na=False)
    for _, c in cells.iterrows():
        n = int(c["devices"])
        assert c["gpus_given"] == str(n), c.to_dict()
        assert len(c["cuda_visible_devices"].split(",")) == n, c.to_dict()


def test_report_shows_the_slurm_jobs(sweep):
    work, _ = sweep
    cells = pd.read_csv(work / "results/cells.csv", dtype=str, keep_default_na=False)
    html = (work / "results/report.html").read_text()
    env_section = html.split('id="reproduce"')[1]
    assert "Slurm job ids" in env_section
    for job in cells["slurm_job_id"]:
        assert job in env_section


def test_grouped_cells_share_one_allocation_in_series(sweeps):
    work = _ran(sweeps, "grouped")
    cells = pd.read_csv(work / "results/cells.csv", dtype=str, keep_default_na=False)
    assert len(cells) == 2 and (cells["status"] == "ok").all(), cells
    assert cells["slurm_job_id"].nunique() == 1 and cells["slurm_job_id"].iloc[0] != ""
    job = sweeps["slurm"][cells["slurm_job_id"].iloc[0]]
    assert job["JobState"] == "COMPLETED", job
    # the largest cell's GPUs, not their sum: the cells ran one after another ...
    assert job.get("TresPerJob") == "gres:gpu:1", job
    # ... so the allocation lasts the sum of their runtimes (10 min each)
    assert job["TimeLimit"] == "00:20:00", job
    assert job["Comment"] == "rule_tiny_fp32-sgd_n1_benchmark", job  # readable in squeue
    # exclusive_nodes=False: the node could be shared, and the cells recorded so
    assert job["OverSubscribe"] != "NO", job
    assert (cells["slurm_oversubscribe"] == job["OverSubscribe"]).all(), cells
    starts, ends = [], []
    for d in cells["dir"]:  # (Snakemake touches a group's outputs: mtimes tell nothing)
        meta = json.loads((work / d / "meta.json").read_text())
        starts.append(datetime.fromisoformat(meta["env"]["start_time"]).timestamp())
        ends.append(starts[-1] + meta["wall_s"])
    first, second = sorted(range(2), key=starts.__getitem__)
    # start_time has whole seconds: the second cell began after the first had ended
    assert ends[first] <= starts[second] + 1, (starts, ends)
    logs = work / "logs/slurm"
    assert len(list((logs / "group_tiny_fp32-sgd_n1_benchmark").rglob("*.log"))) == 1


SLURM_COMMANDS = {
    "sbatch",
    "srun",
    "salloc",
    "squeue",
    "sacct",
    "sinfo",
    "scontrol",
    "scancel",
    "sacctmgr",
    "sshare",
    "sstat",
    "sprio",
    "sreport",
    "sdiag",
}


def test_profile_plans_without_slurm(tmp_path):
    # A machine without Slurm still gets a plan: hide every Slurm command from PATH.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in Path("/usr/bin").iterdir():
        if tool.name not in SLURM_COMMANDS:
            (bin_dir / tool.name).symlink_to(tool)
    path = f"{Path(sys.executable).parent}{os.pathsep}{bin_dir}"
    assert shutil.which("sbatch", path=path) is None
    work = tmp_path / "work"
    work.mkdir()
    proc = snakemake(
        work, "--profile", str(REPO / "profiles/slurm"), "-n", config=CONFIG, env={"PATH": path}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "benchmark" in proc.stdout and "This was a dry-run" in proc.stdout
