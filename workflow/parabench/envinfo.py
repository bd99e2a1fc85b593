"""The environment a cell ran in: enough to reproduce it or to explain its numbers."""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

SLURM_VARS = (
    "SLURM_JOB_ID",
    "SLURM_JOB_NAME",
    "SLURM_JOB_PARTITION",
    "SLURM_JOB_NODELIST",
    "SLURM_NNODES",
    "SLURM_NTASKS",
    "SLURM_GPUS_ON_NODE",
    "SLURM_GPUS",
    "SLURM_GPUS_PER_NODE",
    "SLURM_CPUS_PER_TASK",
    "SLURM_CPUS_ON_NODE",
    "SLURM_MEM_PER_NODE",
    "SLURM_CLUSTER_NAME",
)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit(cwd: Path | None = None) -> str | None:
    """Commit of the parabench checkout that ran (not of the working directory, which is
    often elsewhere), with -dirty for uncommitted changes; None outside a checkout."""
    cwd = cwd or Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=5,
    ).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "")


# Set in the environment of a launch forked from the run's warm process, which its ranks
# inherit (parabench.forkserver): how the cell's processes started.
STARTED = "PARABENCH_STARTED"


def launch_command() -> list[str]:
    """The command that started this cell. Under torchrun that is the agent (our parent
    process), whose command line Linux exposes; otherwise our own."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        try:
            raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
        except OSError:
            return list(getattr(sys, "orig_argv", sys.argv))
        argv = [a.decode() for a in raw.split(b"\0") if a]
        # an agent forked warm shows its command as one quoted title (parabench.jobs.warm)
        return shlex.split(argv[0]) if len(argv) == 1 else argv
    return list(getattr(sys, "orig_argv", sys.argv))


def slurm_sharing() -> str | None:
    """Whether Slurm let other jobs onto this job's nodes: `OverSubscribe` of `scontrol
    show job` (NO: the nodes are the job's alone, sbatch --exclusive; OK, YES, USER,
    MCS: others may run beside it). None outside a Slurm job or without scontrol."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        out = subprocess.run(
            ["scontrol", "show", "job", job], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"OverSubscribe=(\S+)", out)
    return found[1] if found else None


def usable_cores() -> int:
    """Cores this process may run on: the Slurm/cgroup allocation, not the machine."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def available_memory() -> int | None:
    """Bytes the host can still give (MemAvailable, Linux), or None where unknown. A
    cgroup limit (Slurm's --mem) is lower, and honoured when it is."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            found.append(int(limit) - used)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def resident_memory() -> int | None:
    """Bytes this process holds in memory (VmRSS, Linux), or None where unknown."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def base() -> dict:
    """What is known without importing torch."""
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "usable_cores": usable_cores(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "slurm": {k: os.environ[k] for k in SLURM_VARS if k in os.environ},
        "slurm_oversubscribe": slurm_sharing(),
        "git_commit": git_commit(),
        "launch_command": launch_command(),
        # forked from the run's warm process, or started as a new Python (parabench.jobs.warm)
        "started": os.environ.get(STARTED, "cold"),
        "start_time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def gpu_topology() -> str | None:
    """`nvidia-smi topo -m`: how the GPUs connect (NVLink, PCIe switch, socket), which
    decides what collectives can reach. None without nvidia-smi."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    # nvidia-smi underlines the header with terminal escapes (seen on an H200's driver
    # 580): the record is read as text. Blank lines trimmed, not the header's leading
    # tab, which keeps its columns over the rows'.
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.stdout or out.stderr)
    return text.strip("\n") or None


def nvidia_smi_gpus() -> int | None:
    """The GPUs the driver lists (`nvidia-smi -L`), without starting CUDA in this
    process; None without nvidia-smi, or where it does not answer (a wedged driver)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        got = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sum(line.startswith("GPU ") for line in got.stdout.splitlines())


def describe(device_type: str) -> dict:
    import torch  # here, not at the top: base() serves torch-free callers
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    return {
        **base(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "gloo": dist.is_gloo_available(),
        "device_type": device_type,
        "cuda_device_count": torch.cuda.device_count() if cuda else 0,
        "device_names": (
            [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if cuda
            else []
        ),
        "torch_threads": torch.get_num_threads(),
        # fp32 matmuls on tensor cores (TF32) change both speed and rounding: recorded
        # with every cell, since fp32 numbers mean different things with it on or off.
        "tf32": {
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        },
        "gpu_topology": gpu_topology() if device_type == "cuda" else None,
    }


def runs_on_cuda(device: str) -> bool:
    """Whether a config's `device` means CUDA on this host: cuda, or auto where torch is
    a GPU build (CUDA or ROCm), which finds the GPUs where the cells run."""
    return device == "cuda" or (device == "auto" and _build()[1] is not None)


@functools.cache
def _build() -> tuple[str | None, str | None]:
    return torch_build()


def torch_release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version: '2.13.0+cpu', or an image's own build of a
    release ('2.10.0a0+5228986c39.nv25.06' is 2.10)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m[1]), int(m[2])) if m else None


def torch_build() -> tuple[str | None, str | None]:
    """(torch's version, its CUDA (or ROCm) version or None for a CPU build), read from
    the installed torch/version.py without importing torch (seconds on a login node)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None, None
    values: dict[str, object] = {}
    source = (Path(spec.origin).parent / "version.py").read_text()
    for node in ast.parse(source).body:
        target = getattr(node, "target", None) or (getattr(node, "targets", None) or [None])[0]
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
            values[target.id] = node.value.value
    # ROCm's torch is a GPU build too, driven through torch.cuda
    gpu = values.get("cuda") or (f"ROCm {values['hip']}" if values.get("hip") else None)
    return values.get("__version__"), gpu  # type: ignore[return-value]
