"""When a cell cannot give an honest number it says why; what each record knows of its
environment."""

import os
import platform
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from conftest import tiny_spec
from parabench import envinfo
from parabench.checks import static_skip_reason
from parabench.process.runtime import Context
from parabench.strategies import get


def ctx(device: str, rank: int = 0, world: int = 1, local_world: int = 1) -> Context:
    return Context(
        rank=rank,
        world_size=world,
        local_rank=rank,
        device=torch.device(device),
        threads=1,
        distributed=world > 1,
        local_world=local_world,
    )


def test_dataparallel_on_cpu_is_skipped_beyond_one_device_never_timed():
    reason = get("dp").skip_reason(tiny_spec("dp", 2), ctx("cpu"))
    assert reason and "silently runs a single copy" in reason
    assert get("dp").skip_reason(tiny_spec("dp", 1), ctx("cpu")) is None
    # Known from the config alone: recorded without importing torch in the cell.
    assert static_skip_reason(tiny_spec("dp", 4)) == reason.replace("2", "4")
    assert static_skip_reason(tiny_spec("dp", 1)) is None


def test_cuda_paths_skip_when_too_few_gpus_are_visible():
    have = torch.cuda.device_count()
    n = have + 1
    for name in ("dp", "model_parallel"):
        reason = get(name).skip_reason(tiny_spec(name, n, device="cuda"), ctx("cuda:0"))
        assert reason is not None and f"{have} visible" in reason, name
    # A rank needs one device per rank on its host: n ranks of one host here (a rank
    # measured alone, local_world 1, needs only its own: test_gpu_accounting.py).
    reason = get("pipeline").skip_reason(
        tiny_spec("pipeline", n, device="cuda"), ctx("cuda:0", rank=have, world=n, local_world=n)
    )
    assert reason is not None and f"{have} visible" in reason


def test_cpu_model_parallel_runs_and_is_emulated():
    from parabench.models import build

    spec = tiny_spec("model_parallel", 2)
    assert get("model_parallel").skip_reason(spec, ctx("cpu")) is None
    strategy = get("model_parallel")(build(spec.model, 0), spec, ctx("cpu"))
    assert strategy.emulated and len(strategy.stage_cuts) == 2


def test_environment_record(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    env = envinfo.describe("cpu")
    assert env["torch"] == torch.__version__
    assert env["slurm"] == {"SLURM_JOB_ID": "4242", "SLURM_GPUS_ON_NODE": "2"}
    assert env["cuda_visible_devices"] == "0,1"
    assert env["usable_cores"] == len(os.sched_getaffinity(0))
    # The checkout parabench runs from, whatever the working directory.
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True
    ).stdout.strip()
    assert env["git_commit"].removesuffix("-dirty") == head
    # each value against its own reading of this process and host, not just its key
    assert env["host"] == socket.gethostname()
    model = [x for x in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in x]
    assert env["cpu_model"] == (model[0].split(":", 1)[1].strip() if model else env["cpu_model"])
    assert env["cpu_model"]
    assert env["python"] == platform.python_version()
    assert env["gloo"] is torch.distributed.is_gloo_available() is True  # the CPU backend
    assert env["cuda"] == torch.version.cuda  # None on a CPU build
    if not torch.cuda.is_available():  # what a GPU machine records, test_cuda_paths fakes
        assert env["nccl"] is None and env["device_names"] == []
        assert env["cuda_device_count"] == 0
    assert env["device_type"] == "cpu" and env["gpu_topology"] is None
    assert env["launch_command"] == sys.orig_argv
    started = datetime.fromisoformat(env["start_time"])
    assert abs((datetime.now(timezone.utc) - started).total_seconds()) < 60
    assert env["torch_threads"] == torch.get_num_threads() >= 1
    assert env["tf32"]["float32_matmul_precision"] == torch.get_float32_matmul_precision()


def test_launch_command_under_torchrun_is_the_agents(tmp_path):
    # torchrun's ranks see the agent's command line, the one a user would rerun.
    code = "from parabench.envinfo import launch_command; print(launch_command())"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "1",
            "--no-python",
            sys.executable,
            "-c",
            code,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "torch.distributed.run" in out and "--nproc-per-node" in out


def test_gpu_topology_is_recorded_as_text(tmp_path, monkeypatch):
    """`nvidia-smi topo -m` as the H200's driver (580) printed it: its header underlined
    with terminal escapes, which the record drops."""
    seen = Path(__file__).parent / "data" / "h200-nvidia-smi-topo.txt"
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat '{seen}'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    topo = envinfo.gpu_topology()
    assert "\x1b" in seen.read_text() and "\x1b" not in topo
    assert topo.startswith("\tGPU0\tCPU Affinity") and "NV#" in topo  # columns kept
