"""Every config we ship plans, at 1, 2, 4 and 8 devices, the three ways a user plans
one: the package (`parabench sweep -n`), Snakemake (`-n`) and Snakemake with the Slurm
profile (submitting nothing). A strategy the model's shape rules out at a device count
is a skipped cell with its reason, never a refusal of the whole config; a mistake in the
config itself is refused in a few lines naming the key. And the preflight
(`parabench doctor`) says in seconds what this host cannot run, before any job."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, TINY_ENTRY, pyproject, snakemake, tiny_config, tiny_spec
from parabench import models
from parabench.catalog import CATALOG
from parabench.config import cells, checked, load_config, problems, skipped, with_devices
from parabench.envinfo import torch_release
from parabench.jobs.launch import cell_argv
from parabench.preflight import doctor
from parabench.spec import ModelSpec, RunSpec

SHIPPED = ["config/config.yaml", "config/gpu.yaml", "config/gpu-check.yaml"]
COUNTS = [1, 2, 4, 8]


def shipped(path: str, devices: list[int]) -> dict:
    """A shipped config at these device counts, as `parabench sweep --devices` runs it."""
    return with_devices(load_config(REPO / path), devices)


@pytest.mark.parametrize("path", SHIPPED)
@pytest.mark.parametrize("n", COUNTS)
def test_every_shipped_config_plans_at_every_device_count(path, n):
    config = shipped(path, [n])
    assert problems(config, REPO) == []
    planned = [c.spec for c in cells(config)]
    assert planned, "a config that plans no cell"
    reasons = skipped(config)
    ruled_out = sum(len(where) for where in reasons.values())
    assert ruled_out < len([s for s in planned if s.repeat == 0]), "nothing would run"


def test_a_width_tensor_parallelism_cannot_split_is_a_skipped_cell_with_its_reason():
    """The README's cluster command was refused: mlp's width 50 does not divide by 4."""
    reasons = skipped(shipped("config/gpu.yaml", [1, 2, 4, 8]))
    tp4 = next(r for r in reasons if "50 do not divide by 4" in r)
    assert tp4.startswith("models.mlp.dims: tensor parallel splits the widths [400, 200, 50]")
    assert reasons[tp4] == ["mlp bf16-adamw-compile tp"]
    stages = next(r for r in reasons if "pipeline at 8 devices needs 8 stages" in r)
    assert "models.mlp has only 6 blocks" in stages


def test_a_config_whose_every_cell_is_skipped_is_refused_saying_why():
    config = checked({**tiny_config(), "strategies": ["tp"], "devices": [5]})
    found = problems(config)
    assert len(found) == 1, found
    assert found[0].startswith("models.tiny.dims: tensor parallel splits the widths")
    assert found[0].endswith("do not divide by 5 (and nothing else this config asks for can run)")


@pytest.mark.parametrize("path", SHIPPED)
@pytest.mark.parametrize("profile", [None, "slurm"])
def test_snakemake_plans_every_shipped_config(tmp_path, path, profile):
    # one repeat: planning does not depend on how many (gpu.yaml's 5 are 5x the jobs)
    config = {**shipped(path, COUNTS), "repeats": 1}
    args = ["-n", "--cores", "1"]
    if profile:  # plans the sbatch jobs, submits none (a dry run)
        args += ["--profile", str(REPO / "profiles" / profile)]
    proc = snakemake(tmp_path, *args, config=config)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "benchmark" in out
    for reason in skipped(config):  # listed when the workflow plans
        assert f"parabench: skipped, {reason}" in out


@pytest.mark.parametrize("path", SHIPPED)
def test_the_sweep_plans_every_shipped_config_without_snakemake(tmp_path, path):
    cmd = [sys.executable, "-m", "parabench", "sweep", "-n", str(REPO / path)]
    proc = subprocess.run(
        [*cmd, "--devices", "1,2,4,8"], capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "cells, each its own launch" in proc.stdout
    assert not (tmp_path / "results").exists(), "a dry run wrote results"


def test_a_config_mistake_is_a_few_lines_naming_the_key(tmp_path):
    """Snakemake's own message prints the whole schema (555 lines) after the line that
    matters."""
    proc = snakemake(tmp_path, "-n", "--cores", "1", config={"device": "cpu"})
    assert proc.returncode != 0
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) <= 6, lines
    assert any("invalid config: (top level): 'models' is a required property" in x for x in lines)


def test_one_gpu_runs_a_distributed_strategy_under_torchrun():
    """On CUDA, ddp at one device starts like ddp at n: torchrun's agent forks its rank,
    which opens an NCCL group bound to its GPU. On the CPU it stays a plain process."""
    model = ModelSpec.of("mlp", dims=TINY_ENTRY["dims"])
    common = {"model_name": "tiny", "model": model, "batch_size": 64}
    on_gpu = RunSpec(strategy="ddp", devices=1, device="cuda", **common)
    argv = cell_argv(on_gpu, Path("out"))
    assert argv[1:3] == ["-m", "parabench.torchrun"] and "--nproc-per-node" in argv
    assert argv[argv.index("--nproc-per-node") + 1] == "1"
    on_cpu = RunSpec(strategy="ddp", devices=1, device="cpu", **common)
    assert "parabench.torchrun" not in cell_argv(on_cpu, Path("out"))
    single = RunSpec(strategy="single", devices=1, device="cuda", **common)
    assert "parabench.torchrun" not in cell_argv(single, Path("out"))
    # and the collectives benchmark runs at one rank there too
    from parabench.config import collective_devices

    assert collective_devices(shipped("config/gpu-check.yaml", [1])) == [1]
    assert 1 not in collective_devices(shipped("config/config.yaml", [1]))  # CPU: no


def run_doctor(*args: str, cwd: Path = REPO, env: dict | None = None):
    cmd = [sys.executable, "-m", "parabench", "doctor", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env)
    return proc, time.perf_counter() - t0


def test_doctor_refuses_a_gpu_config_on_this_cpu_host_in_seconds():
    if doctor.torch_build()[1] is not None:
        pytest.skip("this host's torch is a CUDA build")
    proc, took = run_doctor("config/gpu.yaml")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert took < 5, f"{took:.1f} s"
    lines = proc.stdout.splitlines()
    torch_line = next(x for x in lines if "torch:" in x)
    assert torch_line.split()[0] == "FAIL" and "CPU-only build" in torch_line
    gpus = next(x for x in lines if "gpus:" in x)
    assert gpus.split()[0] == "FAIL" and "0 GPUs usable" in gpus and "up to 4 per node" in gpus


def test_doctor_passes_the_default_cpu_config():
    proc, _ = run_doctor("config/config.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checked = {x.split()[1].rstrip(":"): x.split()[0] for x in proc.stdout.splitlines()}
    assert set(checked) == {"torch", "disk"} and "FAIL" not in checked.values(), checked


def test_the_gpu_sweep_writes_less_than_10_gib():
    """config/gpu.yaml's 370 cells, its resmlp of 541M parameters among them: each large
    model's cell keeps a sketch of its parameters (analyze/fingerprint.py), not 2.2 GB of them."""
    need, unknown = doctor._results_bytes(load_config(REPO / "config/gpu.yaml"))
    assert unknown == [] and need < 10 * 2**30, f"{need / 2**30:.1f} GiB"


@pytest.mark.parametrize(
    "spec",
    [tiny_spec("fsdp", 2), tiny_spec("pipeline", 2, microbatches=4)],
    ids=["fsdp-n2", "pipeline-n2"],
)
def test_a_cell_writes_no_more_than_the_doctor_counts_for_it(cells, spec):
    """Its records, parameters and traces (the CPU's; docs/results.md, "Disk", says how
    CUDA's are counted) against doctor.cell_bytes."""
    meta, proc, out = cells(spec)
    assert meta["status"] == "ok", f"{meta['reason']}\n{proc.stderr[-2000:]}"
    wrote = sum(f.stat().st_size for f in out.iterdir())
    facts = models.facts(spec.model)
    assert wrote <= doctor.cell_bytes(spec, facts.n_params, facts.n_blocks)


def fake_torch(tmp_path: Path, version: str) -> dict:
    """An environment whose torch is a CUDA build of `version` that cannot be imported:
    its version.py is all the doctor reads on a planning host."""
    pkg = tmp_path / "site" / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('the doctor imported torch')\n")
    (pkg / "version.py").write_text(f"__version__ = {version!r}\ncuda = '12.8'\n")
    path = os.pathsep.join([str(pkg.parent), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


MAJOR, MINOR = doctor.TORCH_MIN


@pytest.mark.parametrize(
    "version, status",
    [
        (f"{MAJOR}.{MINOR - 1}.0+cu128", "warn"),
        (f"{MAJOR}.{MINOR}.0a0+5228986c39.nv25.06", "ok"),  # an image's build of the release
        ("2.13.0+cpu", "ok"),
    ],
)
def test_doctor_says_when_torch_is_older_than_the_oldest_tested(tmp_path, version, status):
    proc, _ = run_doctor("config/config.yaml", env=fake_torch(tmp_path, version))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if "torch:" in x)
    assert line.split()[0] == status and f"torch {version}, CUDA 12.8" in line, line
    older = f"older than {MAJOR}.{MINOR}, the oldest torch parabench is tested with"
    assert (older in line) == (status == "warn"), line


def test_torch_releases_compare_as_numbers():
    assert torch_release("2.10.0a0+5228986c39.nv25.06") == (2, 10) > (2, 9)
    assert torch_release("2.13.0+cpu") == (2, 13)


def test_the_oldest_torch_is_one_release_in_pyproject_the_makefile_and_the_doctor():
    deps = pyproject()["project"]["dependencies"]
    oldest = ".".join(map(str, doctor.TORCH_MIN))
    assert f"torch>={oldest}" in deps
    pin = re.search(r"^TORCH_MIN\s*\?=\s*torch==(\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert pin and pin[1].startswith(f"{oldest}."), pin


def test_doctor_names_a_missing_compiler_when_compile_is_on(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**tiny_config(), "compile": [True]}))
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # no cc, c++, g++
    env.pop("CXX", None)
    proc, _ = run_doctor(str(cfg), cwd=tmp_path, env=env)
    assert proc.returncode == 1
    line = next(x for x in proc.stdout.splitlines() if "compiler:" in x)
    assert line.split()[0] == "FAIL" and "compile: true needs a C++ compiler" in line


def test_doctor_under_a_slurm_profile_leaves_gpus_to_the_node(tmp_path):
    prof = tmp_path / "prof"
    prof.mkdir()
    (prof / "config.yaml").write_text("executor: slurm\ndefault-resources:\n  runtime: 60\n")
    proc, _ = run_doctor("config/gpu-check.yaml", "--profile", str(prof))
    lines = {x.split()[1].rstrip(":"): x.split()[0] for x in proc.stdout.splitlines()}
    assert lines["gpus"] == "later" and lines["slurm"] == "warn"


def test_the_preflight_reads_a_partition_s_time_limit_as_sinfo_prints_it():
    """sinfo's %l: [days-]hours:minutes:seconds, minutes:seconds, or none."""
    got = {
        t: doctor.time_limit_minutes(t)
        for t in ("1:00:00", "24:00:00", "1-00:00:00", "2-12:30:00", "45:00", "infinite")
    }
    assert got == {
        "1:00:00": 60,
        "24:00:00": 1440,
        "1-00:00:00": 1440,
        "2-12:30:00": 3630,
        "45:00": 45,
        "infinite": None,
    }


def test_a_local_run_refuses_before_any_job_where_the_doctor_fails(tmp_path):
    """onstart: after planning, before the first job; never on a dry run."""
    if doctor.torch_build()[1] is not None:
        pytest.skip("this host's torch is a CUDA build")
    config = {**tiny_config(), "device": "cuda"}
    proc = snakemake(tmp_path, "--cores", "1", config=config)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "parabench doctor:  FAIL  torch" in out and "nothing was started" in out
    assert not (tmp_path / "results" / "runs").exists()
    assert snakemake(tmp_path, "-n", "--cores", "1", config=config).returncode == 0


def test_the_sweep_runs_the_doctor_before_its_first_cell(tmp_path):
    if doctor.torch_build()[1] is not None:
        pytest.skip("this host's torch is a CUDA build")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**tiny_config(), "device": "cuda"}))
    cmd = [sys.executable, "-m", "parabench", "sweep", str(cfg)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert "doctor:  FAIL  torch" in proc.stdout
    assert not (tmp_path / "results" / "runs").exists()


def test_the_gpu_check_ends_listing_the_cuda_paths_it_ran(tmp_path):
    """What one GPU ran and what needs more, read from the sweep's own tables."""
    import pandas as pd

    from parabench.jobs.sweep import cuda_paths

    row = {"status": "ok", "device_type": "cuda", "precision": "bf16", "compile": False}
    agent = "python -m parabench.torchrun --standalone --nproc-per-node 1 -m parabench run"
    cells_csv = pd.DataFrame(
        [
            {**row, "strategy": "single", "devices": 1, "launch_command": "python -m parabench"},
            {**row, "strategy": "ddp", "devices": 1, "launch_command": agent},
            {**row, "strategy": "dp", "devices": 2, "status": "skipped"},
        ]
    )
    cells_csv.to_csv(tmp_path / "cells.csv", index=False)
    pd.DataFrame([{"op": "all_reduce", "devices": 1}]).to_csv(
        tmp_path / "collectives.csv", index=False
    )
    pd.DataFrame([{"status": "ok"}]).to_csv(tmp_path / "ranks.csv", index=False)
    lines = cuda_paths(tmp_path)

    def status(what: str) -> str:
        return next(x for x in lines if what in x)[2:9].strip()

    assert status("torchrun agent, forked rank, NCCL group bound to its GPU") == "ran"
    assert status("bf16 autocast on CUDA") == "ran"
    assert status("collectives benchmark (NCCL) at [1] ranks") == "ran"
    assert status("NCCL between GPUs: DDP, ZeRO-1, FSDP2, TP, pipeline") == "not run"
    assert "needs 2 GPUs" in next(x for x in lines if "between GPUs" in x)
    assert status("torch.compile on CUDA (Triton)") == "not run"
    # A rank that ran in a process group without the agent (device: auto, one rank, as
    # it once started) did not run the agent's path, whatever its group was.
    cells_csv.loc[1, "launch_command"] = "python -m parabench run"
    cells_csv.to_csv(tmp_path / "cells.csv", index=False)
    lines = cuda_paths(tmp_path)
    assert status("torchrun agent, forked rank, NCCL group bound to its GPU") == "not run"
    # a plan.csv of an earlier run, the plan disabled now: no rank it ran counts
    (tmp_path / "ranks.csv").unlink()
    pd.DataFrame([{"status": "ok"}]).to_csv(tmp_path / "plan.csv", index=False)
    lines = cuda_paths(tmp_path, planned=False)
    assert status("ranks measured alone on CUDA (ranks.csv, plan.csv)") == "not run"
    lines = cuda_paths(tmp_path, planned=True)
    assert status("ranks measured alone on CUDA (ranks.csv, plan.csv)") == "ran"


def test_the_collectives_benchmark_at_one_rank_claims_no_bus_bandwidth(tmp_path):
    """One GPU runs NCCL's path through the benchmark (here gloo, the same launch): its
    rows say what a call costs, and no bandwidth between devices nor a send/recv pair
    that cannot exist; the fabric and the figure leave them out."""
    import pandas as pd

    from parabench.hardware.fabric import FabricError, from_curves
    from parabench.jobs.launch import collectives_argv

    argv = collectives_argv(1, [4096, 65536], "cpu", 30, tmp_path, python=sys.executable)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = pd.read_csv(tmp_path / "collectives.csv")
    assert set(rows["devices"]) == {1} and "send_recv" not in set(rows["op"])
    assert rows["busbw_GBps"].isna().all() and (rows["time_s"] > 0).all()
    with pytest.raises(FabricError, match="no collective curves"):
        from_curves(rows)


def test_the_gpu_check_on_one_gpu_is_the_18_cells_its_docs_time():
    """config/gpu-check.yaml, docs/design/gpu-check.md and the README time 18 cells on
    one GPU: every one-dimensional strategy in bf16, fp32 only on its six `also` cells."""
    specs = [c.spec for c in cells(shipped("config/gpu-check.yaml", [1]))]
    assert len(specs) == 18 and {s.devices for s in specs} == {1}
    fp32 = sorted((s.model_name, s.strategy) for s in specs if s.precision == "fp32")
    assert fp32 == sorted(
        [("mlp", "single"), ("mlp", "ddp")]
        + [("resmlp", s) for s in ("single", "ddp", "fsdp", "tp")]
    )
    one_dim = {r.name for r in CATALOG.values() if not r.composed}
    assert {s.strategy for s in specs if s.model_name == "resmlp"} == one_dim
