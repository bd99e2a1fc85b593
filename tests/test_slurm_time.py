"""Every Slurm job a GPU sweep submits fits its partition's time limit, against a real
local Slurm whose partitions enforce theirs at submission (EnforcePartLimits=ALL): a
24-hour one (`day`, MaxTime of many GPU partitions) and a one-hour one (`test`).

The sweep is config/gpu.yaml's, its models shrunk to run on this CPU (compile off): as
many multi-rank cells (41) and ranks measured alone (53), cell_timeout_s an hour. Its
ranks job once asked for cell_timeout_s x 41 cells: 2,465 minutes, which `day` refuses
(rule aggregate waited on it: no report). Each rank now
has its own limit (rank_timeout_s) and the job asks for their sum; where that passes
max_job_minutes, the ranks are split into jobs that each fit. The preflight reads the
partition's MaxTime and refuses, before any job, a run with a job that asks for more,
naming the key to change."""

from __future__ import annotations

import re
import subprocess
import sys

import pandas as pd
import pytest
import yaml
from slurm_cluster import local_slurm

from conftest import REPO, require_root, require_tool, snakemake
from parabench.config import alone_ranks, checked, load_config

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


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
    """The Slurm profile and test_slurm.py's overlay, on `partition`."""
    return [
        "--profile",
        str(REPO / "profiles/slurm"),
        "--slurm-status-command",
        "squeue",
        "--slurm-init-seconds-before-status-checks",
        "2",
        "--slurm-no-account",
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


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    for tool in ("slurmctld", "slurmd", "munged", "sbatch"):
        require_tool(tool)
    require_root("starting slurmctld/slurmd needs root")
    with local_slurm(tmp_path_factory.mktemp("slurm")) as info:
        yield info


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
