"""The Slurm profile against a real Slurm: the pipeline runs with
`--profile profiles/slurm` on a single-node cluster started here, every benchmark cell
is an sbatch job that gets exactly the GPUs it asked for, and results and report follow;
and every job a GPU sweep submits fits its partition's time limit (below). One file, so
one test worker starts the one cluster a machine can hold.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import pandas as pd
import pytest
import yaml
from slurm_cluster import local_slurm

from conftest import REPO, require_root, require_tool, snakemake
from parabench.config import alone_ranks, checked, load_config

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
# What a cluster without an accounting database needs: squeue for status, a short first
# status check, no account.
NO_ACCOUNTING = [
    "--slurm-status-command",
    "squeue",
    "--slurm-init-seconds-before-status-checks",
    "2",
    "--slurm-no-account",
]
# The test overlay: what a user sets for their site, on such a cluster.
OVERLAY = [
    *NO_ACCOUNTING,
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
def cluster(tmp_path_factory):
    """One local Slurm for this file's tests (one per machine at a time: slurm_cluster)."""
    for tool in ("slurmctld", "slurmd", "munged", "sbatch"):
        require_tool(tool)
    require_root("starting slurmctld/slurmd needs root")
    with local_slurm(tmp_path_factory.mktemp("slurm")) as info:
        yield info


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory, cluster):
    work = tmp_path_factory.mktemp("slurm-work")
    grouped = tmp_path_factory.mktemp("slurm-grouped")
    overlaid = ["--profile", str(REPO / "profiles/slurm"), *OVERLAY]
    # Both sweeps at once, as two users of one cluster: most of a sweep's wall time
    # is waiting on Slurm's status checks, and they wait side by side.
    with ThreadPoolExecutor(2) as pool:
        cells = pool.submit(snakemake, work, *overlaid, config=CONFIG)
        # the documented switch for sites that forbid whole-node jobs
        shared = ["--config", "exclusive_nodes=False"]
        packed = pool.submit(snakemake, grouped, *overlaid, *GROUPS, *shared, config=GROUPED_CONFIG)
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


# --- Time limits -------------------------------------------------------------------
# Every Slurm job a GPU sweep submits fits its partition's time limit, against a real
# local Slurm whose partitions enforce theirs at submission (EnforcePartLimits=ALL): a
# 24-hour one (`day`, MaxTime of many GPU partitions) and a one-hour one (`test`).
#
# The sweep is config/gpu.yaml's, its models shrunk to run on this CPU (compile off): as
# many multi-rank cells (41) and ranks measured alone (53), cell_timeout_s an hour. Its
# ranks job once asked for cell_timeout_s x 41 cells: 2,465 minutes, which `day` refuses
# (rule aggregate waited on it: no report). Each rank now has its own limit
# (rank_timeout_s) and the job asks for their sum; where that passes max_job_minutes,
# the ranks are split into jobs that each fit. The preflight reads the partition's
# MaxTime and refuses, before any job, a run with a job that asks for more, naming the
# key to change.


def gpu_like(**over) -> dict:
    """config/gpu.yaml on this CPU: its sweep and settings, its models shrunk to what
    skips the same cells (the mlp's last hidden width splits over 2 ranks, not 4), fp32,
    compile off."""
    config = yaml.safe_load((REPO / "config/gpu.yaml").read_text())
    models = config["models"]
    models["mlp"].update(dims=[32, 16, 16, 16, 8, 6, 1])
    models["resmlp"].update(d_in=16, width=32, depth=2, classes=10)
    models["gpt2"].update(vocab=64, seq_len=16, d_model=16, n_layer=2, n_head=4)
    return {**config, "device": "cpu", "compile": [False], "precision": ["fp32"], **over}


def profile(partition: str) -> list[str]:
    """The Slurm profile and the overlay's site settings, on `partition`."""
    return [
        "--profile",
        str(REPO / "profiles/slurm"),
        *NO_ACCOUNTING,
        "--default-resources",
        f"slurm_partition={partition}",
        "mem_mb_per_cpu=200",
    ]


def asked(proc: subprocess.CompletedProcess) -> dict[str, list[int]]:
    """The runtime (minutes) each job of a dry run asks for, by rule."""
    out: dict[str, list[int]] = {}
    rule = None
    for line in proc.stdout.splitlines():
        if m := re.match(r"(?:local)?rule (\w+):", line):
            rule = m.group(1)
        elif rule and (m := re.search(r"\bresources: .*\bruntime=(\d+)", line)):
            out.setdefault(rule, []).append(int(m.group(1)))
    return out


def accepted(partition: str, minutes: int) -> subprocess.CompletedProcess:
    """sbatch's answer to a job of `minutes` on `partition`, submitting nothing."""
    return subprocess.run(
        ["sbatch", "--test-only", "-p", partition, "-t", str(minutes), "--wrap", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_sweep_is_gpu_yaml_s_ranks_and_cells():
    shipped, here = (
        alone_ranks(load_config(REPO / "config/gpu.yaml")),
        alone_ranks(checked(gpu_like())),
    )
    assert len(here) == len(shipped) == 53
    assert len({s for s, _ in here}) == len({s for s, _ in shipped}) == 41


def test_every_job_of_the_gpu_sweep_fits_a_24_hour_partition(cluster, tmp_path):
    limit = cluster["partitions"]["day"]
    # the partition enforces its limit: a job of the ranks' old size is refused
    old = accepted("day", 3600 * 41 // 60 + 5)
    assert old.returncode != 0 and "time limit" in old.stderr.lower(), old.stderr
    print(f"2465 min on day: {old.stderr.strip()}")
    dry = snakemake(tmp_path, "-n", *profile("day"), config=gpu_like())
    assert dry.returncode == 0, dry.stderr[-3000:]
    jobs = asked(dry)
    assert {"benchmark", "collectives", "ranks"} <= set(jobs), jobs
    print({rule: sorted(set(m)) for rule, m in jobs.items()})  # the figures, in the log
    assert max(max(m) for m in jobs.values()) <= limit, jobs
    for rule, minutes in jobs.items():
        for m in set(minutes):
            got = accepted("day", m)
            assert got.returncode == 0, (rule, m, got.stderr)
    # submitted for real: the ranks job measures its 53 ranks in one job on `day`
    run = snakemake(
        tmp_path, "--jobs", "4", "results/ranks.csv", *profile("day"), config=gpu_like()
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "slurm time: partition 'day' allows 1440 min" in run.stdout + run.stderr
    ranks = pd.read_csv(tmp_path / "results/ranks.csv")
    assert len(ranks) == 53 and (ranks["status"] == "ok").all(), ranks[["strategy", "reason"]]
    logs = list((tmp_path / "logs/slurm/rule_ranks").rglob("*.log"))
    assert len(logs) == 1, "one Slurm job measured them"
    job = subprocess.run(
        ["scontrol", "-o", "show", "job", logs[0].stem], capture_output=True, text=True
    ).stdout
    print(job[job.index("TimeLimit") :].split()[0], job[job.index("JobState") :].split()[0])
    assert "TimeLimit=08:55:00" in job and "JobState=COMPLETED" in job, job


def test_a_run_with_a_job_past_the_partition_s_limit_is_refused_before_any_job(cluster, tmp_path):
    """On the one-hour partition the sweep's cells (an hour and 5 minutes) and its
    ranks job cannot run: the preflight says which, naming the key to change, and
    nothing is submitted. Set as it says, every job fits: the ranks split into jobs
    of at most an hour."""
    limit = cluster["partitions"]["test"]
    run = snakemake(tmp_path, *profile("test"), config=gpu_like())
    said = run.stdout + run.stderr
    assert run.returncode != 0, said[-3000:]
    assert "FAIL  slurm time: partition 'test' allows 60 min" in said, said[-3000:]
    assert "benchmark 65 min: lower cell_timeout_s" in said
    assert "ranks 535 min: set max_job_minutes: 60" in said
    assert not (tmp_path / "logs/slurm").exists(), "a job was submitted"
    fitted = gpu_like(cell_timeout_s=3000, max_job_minutes=limit)
    dry = snakemake(tmp_path, "-n", *profile("test"), config=fitted)
    assert dry.returncode == 0, dry.stderr[-3000:]
    jobs = asked(dry)
    print({rule: sorted(set(m)) for rule, m in jobs.items()})
    assert len(jobs["ranks_part"]) == -(-53 // ((limit - 5) * 60 // 600)), jobs
    for rule, minutes in jobs.items():
        for m in set(minutes):
            assert m <= limit, (rule, m)
            got = accepted("test", m)
            assert got.returncode == 0, (rule, m, got.stderr)


def test_without_a_partition_the_preflight_checks_slurm_s_default_one(cluster, tmp_path):
    """A profile that names no slurm_partition submits to Slurm's default partition
    (`test` here, an hour): its MaxTime is the one checked."""
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(gpu_like()))
    (tmp_path / "prof").mkdir()
    (tmp_path / "prof/config.yaml").write_text("executor: slurm\n")
    cmd = [sys.executable, "-m", "parabench", "doctor", "config.yaml", "--profile", "prof"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    line = next(x for x in proc.stdout.splitlines() if "slurm time:" in x)
    assert line.split()[0] == "FAIL" and "partition 'test' allows 60 min" in line, line
    assert "benchmark 65 min: lower cell_timeout_s" in line
