"""CUDA-only paths, checked on a CPU build: what a CUDA run does differently is
reproduced here by hand (a world bound to a CUDA device, a device count NVML cannot
give, a worker thread's own autocast dtype, the GPU this-machine measures), so that
each test fails if its fix regresses, with no GPU.

Process groups and torchrun's agent run in subprocesses: none is opened in pytest's
own process."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import REPO, cell_argv, tiny_config, tiny_spec
from parabench.models import build
from parabench.process.runtime import Context
from parabench.strategies import get

TESTS = Path(__file__).resolve().parent


def _python(script: str, *args: str, env: dict | None = None, timeout: float = 180):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


# --- 1. The no-communication group under a world bound to a CUDA device --------------

# One rank of a ddp cell: runtime.start's own group set-up, with the world bound to
# cuda:LOCAL_RANK as init_process_group(device_id=...) binds it on CUDA (this CPU build
# refuses a CUDA device_id, so the binding is set by hand, right after the real call),
# then collectives over the no-communication group on CPU tensors.
RANK_SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
sys.path.insert(0, {tests!r})
from conftest import tiny_spec
from parabench import cli
from parabench.process import runtime

real_init = dist.init_process_group

def bound_init(*args, device_id=None, **kwargs):
    real_init(*args, **kwargs)
    dist.group.WORLD.bound_device_id = torch.device("cuda", int(os.environ["LOCAL_RANK"]))

dist.init_process_group = bound_init
n = int(os.environ["WORLD_SIZE"])
ctx = runtime.start(tiny_spec("ddp", n))
assert dist.group.WORLD.bound_device_id == torch.device("cuda", ctx.local_rank)
group, r = ctx.local, ctx.rank
# Asked for its backend on CUDA, as torch does of a device-bound group: itself, with
# nothing to split or allocate.
backend = group._get_backend(torch.device("cuda", ctx.local_rank))
assert backend is group and not backend.supports_splitting
assert not backend.supports_tensor_alloc(torch.device("cuda", ctx.local_rank))

t = torch.full((3,), float(r + 1))
dist.all_reduce(t, group=group)  # this rank's values stand for the sum
assert t.tolist() == [r + 1.0] * 3, t
gathered = torch.zeros(2 * n)
dist.all_gather_into_tensor(gathered, torch.tensor([r, 10.0 + r]), group=group)
assert gathered.tolist() == [r, 10.0 + r] * n, gathered  # its shard in every slot
chunk = torch.zeros(2)
dist.reduce_scatter_tensor(chunk, torch.arange(2.0 * n) + 100 * r, group=group)
assert chunk.tolist() == [100.0 * r + 2 * r, 100.0 * r + 2 * r + 1], chunk  # its own chunk

t = torch.ones(1)
dist.all_reduce(t, group=ctx.group)  # the real group still communicates
assert t.item() == n, t
# A barrier over a bound world allocates on its device, which this build has not.
dist.group.WORLD.bound_device_id = None
runtime.finish(ctx)
runtime.stop(ctx)
print(f"rank {{r}} ok")
# As a rank of a cell ends (cli.main): an interpreter's teardown after a Python process
# group can die in C++ ("terminate called without an active exception").
cli.exit_now(0)
"""


@pytest.mark.parametrize("ranks", [1, 2])
def test_nocomm_group_works_in_a_world_bound_to_a_cuda_device(tmp_path, ranks):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.format(tests=str(TESTS)))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(ranks),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    # Each rank's exception, not the agent's report of it (torchrun prefixes [rankN]:).
    causes = [ln for ln in proc.stderr.splitlines() if re.match(r"\[rank\d+\]: \w+Error", ln)]
    assert proc.returncode == 0, "\n".join(causes) or proc.stderr[-3000:]
    for r in range(ranks):
        assert f"rank {r} ok" in proc.stdout


# --- 2. Our torchrun where NVML cannot count the GPUs ---------------------------------

# The agent: `parabench.torchrun` of a 2-rank ddp cell on CPU, on a host where NVML
# cannot count the devices (a MIG UUID in CUDA_VISIBLE_DEVICES) and the CUDA runtime
# counts DEVICES. The runtime's count is a spy: it records each call with its pid, as
# os.fork records each fork of the agent. Setting torch._C._cuda_getDeviceCount makes
# torch.cuda._is_compiled() true, and some modules then import other torch._C._cuda_*
# functions, which this build lacks: what the ranks import is imported first, as the
# CPU build it is (the agent's preload then finds it done). A forked rank drops the spy:
# there a CUDA build's runtime would refuse to start, which the test reads from the
# agent's record instead, and a rank that believed in a device would call CUDA
# functions this build does not have.
AGENT_SCRIPT = """
import os, sys
import torch
import torch._dynamo
from parabench import strategies
from parabench.run import cell
strategies.get("ddp")

log, devices, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

def note(event):
    with open(log, "a") as f:
        f.write(f"{event} {os.getpid()}\\n")

def spy():
    note("count")
    return devices

note("agent")
torch._C._cuda_getDeviceCount = spy
os.register_at_fork(
    before=lambda: note("fork"),
    after_in_child=lambda: delattr(torch._C, "_cuda_getDeviceCount"),
)
from parabench import torchrun
torchrun.main(argv)
"""

MIG = "MIG-8c2f1b3e-5d4a-5e6f-9a0b-1c2d3e4f5a6b"


def _agent(tmp_path: Path, devices: int) -> tuple[subprocess.CompletedProcess, list, Path]:
    spec = tiny_spec("ddp", 2)
    out = tmp_path / "cell"
    argv = cell_argv(spec, out)
    assert argv[1:3] == ["-m", "parabench.torchrun"]
    log = tmp_path / "events.txt"
    proc = _python(
        AGENT_SCRIPT,
        str(log),
        str(devices),
        *argv[3:],
        env={"CUDA_VISIBLE_DEVICES": MIG},
    )
    events = [tuple(line.split()) for line in log.read_text().splitlines()]
    return proc, events, out


def _cell_ok(proc: subprocess.CompletedProcess, out: Path) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["status"] == "ok", meta


def test_torchrun_does_not_fork_after_the_cuda_runtime_counted_devices(tmp_path):
    proc, events, out = _agent(tmp_path, devices=1)
    _cell_ok(proc, out)
    agent = events[0][1]
    mine = [event for event, pid in events if pid == agent]
    assert "count" in mine  # NVML could not count: torchrun asked the runtime
    # Forked only if the runtime was never asked before: here, started as new Pythons.
    forks = [i for i, event in enumerate(mine) if event == "fork"]
    assert not forks or "count" not in mine[: forks[0]], f"agent's events: {mine}"
    assert "each rank starts as a new Python" in proc.stderr


def test_torchrun_still_forks_when_the_cuda_runtime_found_no_device(tmp_path):
    # A CUDA build of torch on a host without GPUs (or driver): the runtime's count
    # poisons fork, but a rank with no device never starts CUDA. The fast start stays.
    proc, events, out = _agent(tmp_path, devices=0)
    _cell_ok(proc, out)
    agent = events[0][1]
    assert [event for event, pid in events if pid == agent].count("fork") == 2
    assert "new Python" not in proc.stderr


# --- 3. DataParallel's replicas under bf16 --------------------------------------------


def test_dataparallel_replicas_compute_in_bf16_in_their_own_threads():
    spec = tiny_spec("dp", 1, precision="bf16")
    ctx = Context(0, 1, 0, torch.device("cpu"), 1, False)
    strategy = get("dp")(build(spec.model, 0), spec, ctx)
    replica = strategy.module.module  # what parallel_apply runs in each worker thread
    first = next(m for m in replica.modules() if isinstance(m, nn.Linear))
    dtypes: list[torch.dtype] = []
    first.register_forward_hook(lambda m, inputs, output: dtypes.append(output.dtype))
    x = torch.randn(4, 48)

    def worker() -> None:
        # parallel_apply's worker on CUDA: a new thread, whose autocast dtype is the
        # device's default (fp16 for CUDA; set here for the CPU standing in for it),
        # enters autocast with the caller's enabled flag and no dtype.
        torch.set_autocast_dtype("cpu", torch.float16)
        with torch.amp.autocast("cpu", enabled=True):
            replica(x)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert dtypes == [torch.bfloat16]
    # Parameter names as in the unwrapped model, which the equivalence check compares.
    names = set(strategy.full_state())
    assert names == {k for k, _ in build(spec.model, 0).module.named_parameters()}


# --- 4. A host with fewer GPUs than the cell's ranks there ----------------------------

# One rank of a 2-rank ddp cell on CUDA, on a host where torch sees one GPU. The script
# stands in for CUDA's answers (one device, available) on this torch, a CPU build or a
# CUDA build with no GPU (make test-torch-min), and init_process_group answers as
# torch does on CUDA: a device_id without an index is refused ("Please use a
# device_id with index"), a bound one gets a gloo group here (no NCCL in this build).
PAST_SCRIPT = """
import json, os, sys
from pathlib import Path
import torch
import torch.distributed as dist
from parabench import cli
from parabench.run import cell
from parabench.spec import RunSpec

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.set_device = lambda device: None
torch.cuda.get_device_name = lambda *a: "stand-in"
torch.cuda.nccl.version = lambda: (2, 21, 5)
torch.backends.cudnn.version = lambda: None  # a CUDA build would open the driver
real_init = dist.init_process_group

def init(backend=None, *args, device_id=None, **kwargs):
    if device_id is not None and device_id.index is None:
        raise ValueError("Please use a device_id with index")
    return real_init("gloo", *args, **kwargs)

dist.init_process_group = init
code = cell.run_cell(RunSpec.from_dict(json.loads(sys.argv[1])), Path(sys.argv[2]))
cli.exit_now(code)
"""


def test_a_host_with_fewer_gpus_than_ranks_skips_the_cell(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(PAST_SCRIPT)
    out = tmp_path / "cell"
    spec = tiny_spec("ddp", 2, device="cuda")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
            json.dumps(spec.to_dict()),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    meta = json.loads((out / "meta.json").read_text())
    assert meta["status"] == "skipped", (meta.get("reason"), proc.stderr[-2000:])
    assert "needs 2 CUDA devices on this host" in meta["reason"]
    assert "1 visible" in meta["reason"]
    assert proc.returncode == 0, proc.stderr[-2000:]


# --- 5. device: auto is CUDA where torch is a CUDA build ------------------------------


def test_auto_on_a_cuda_build_takes_the_cuda_launch_path(monkeypatch):
    from parabench import envinfo

    one = tiny_spec("ddp", 1, device="auto")
    monkeypatch.setattr(envinfo, "_build", lambda: ("2.13.0", "12.8"))
    assert one.torchrun  # the one rank starts as n ranks do: agent, fork, NCCL bound
    monkeypatch.setattr(envinfo, "_build", lambda: ("2.13.0", None))
    assert not one.torchrun  # a CPU build: a plain process, as device: cpu
    assert tiny_spec("ddp", 1, device="cuda").torchrun


# --- 6. this-machine: the device and precision the cells run with --------------------

# What fakerank measures on a GPU, faked: an H100's rates by precision (fp32 without
# TF32, with it, bf16), a copy's bandwidth; and a CPU's GEMM.
RATES = {
    ("cuda", "fp32", False): 51e12,
    ("cuda", "fp32", True): 378e12,
    ("cuda", "bf16", False): 700e12,
}
RATES[("cuda", "bf16", True)] = RATES[("cuda", "bf16", False)]
CPU_GEMM = 40e9


@pytest.fixture
def cuda_host(monkeypatch):
    """A host whose torch sees one GPU, of the name `gemms.name` (an H100 SXM unless a
    test renames it): its name and memory, and the GEMM and copy rates fakerank measures,
    faked; `gemms` records each GEMM measured as (device type, precision, TF32 on)."""
    from parabench.predict import fakerank
    from parabench.run import peak

    class Gemms(list):
        name = "NVIDIA H100 80GB HBM3"

    gemms = Gemms()

    class Props:  # what torch.cuda.get_device_properties gives
        total_memory = 81559 * 2**20

        @property
        def name(self) -> str:
            return gemms.name

    def gemm(device, size=None, seconds=0.1, sync=None, precision="fp32"):
        tf32 = torch.backends.cuda.matmul.allow_tf32
        gemms.append((device.type, precision, tf32))
        return CPU_GEMM if device.type == "cpu" else RATES[(device.type, precision, tf32)]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gemms.name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Props())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(peak, "gemm_flops_per_s", gemm)
    monkeypatch.setattr(fakerank, "_copy_rate", lambda device: 2.9e12)
    return gemms


@contextlib.contextmanager
def _tf32(on: bool) -> Iterator[None]:
    """cuBLAS's TF32 switch, set for a block (monkeypatch cannot undo an attribute that
    torch's cuBLAS module computes)."""
    was = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was


def test_this_machine_prices_a_cpu_run_on_the_cpu_where_torch_sees_a_gpu(cuda_host):
    from parabench import envinfo
    from parabench.predict.fakerank import this_machine

    got = this_machine("cpu", "fp32")
    # the cells ran on the CPU: its GEMM, its cores shared by the ranks, not the GPU's
    assert [g[:2] for g in cuda_host] == [("cpu", "fp32")]
    assert got.achievable_flops == got.peak_flops == CPU_GEMM
    assert got.cores == envinfo.usable_cores() > 0
    # each rank a process: this one's resident memory, torch imported
    assert 2**26 < got.process_bytes == pytest.approx(envinfo.resident_memory(), rel=0.5)
    assert got.source.startswith("this host's CPU")
    # device auto resolves as the cells resolve it: here, to the GPU, whose ranks each
    # have one (no cores shared)
    assert this_machine("auto", "bf16").cores == 0
    assert cuda_host[-1][:2] == ("cuda", "bf16")


def test_this_machine_measures_the_gemm_in_the_runs_precision(cuda_host):
    from parabench.predict.fakerank import this_machine

    with _tf32(False):
        fp32 = this_machine("cuda", "fp32")
    # fp32 without TF32 (torch's default, and the cells'): an fp32 GEMM, not a bf16 one,
    # and no BF16 datasheet peak or fused-attention rate to go with it
    assert cuda_host == [("cuda", "fp32", False)]
    assert fp32.achievable_flops == fp32.peak_flops == RATES[("cuda", "fp32", False)]
    assert fp32.attention_flops == 0.0
    assert "fp32 (TF32 off" in fp32.source
    # TF32 on, as the cells would run with it: measured under it, and said
    with _tf32(True):
        tf32 = this_machine("cuda", "fp32")
    assert cuda_host[-1] == ("cuda", "fp32", True)
    assert tf32.achievable_flops == RATES[("cuda", "fp32", True)]
    assert "fp32 (TF32 on" in tf32.source
    # bf16: a bf16 GEMM, and the datasheet's dense BF16 peak and attention rate
    bf16 = this_machine("cuda", "bf16")
    assert cuda_host[-1][:2] == ("cuda", "bf16")
    assert bf16.achievable_flops == RATES[("cuda", "bf16", False)]
    assert bf16.peak_flops == 989e12 and bf16.attention_flops == 0.35 * 989e12
    assert bf16.cores == 0 and bf16.memory_bytes == 81559 * 2**20


def test_this_machine_on_a_cuda_run_without_a_gpu_says_so(monkeypatch):
    from parabench.hardware.gpus import GPUError
    from parabench.predict.fakerank import this_machine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(GPUError, match=r"advise\.gpu: this-machine .* device is cuda"):
        this_machine("cuda", "bf16")


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756.5e12),
        ("NVIDIA H100 NVL", 835.5e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100-SXM4-40GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA A100-PCIE-40GB", 312e12),
        # not a device of the table, though its name holds one's: the measured rate
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", None),
        ("NVIDIA GH200 480GB", None),
        ("NVIDIA H200 NVL", None),
    ],
)
def test_this_machine_knows_a_gpu_by_its_whole_name(cuda_host, name, peak):
    from parabench.hardware import gpus
    from parabench.predict.fakerank import this_machine

    cuda_host.name = name
    got = this_machine("cuda", "bf16")
    measured = RATES[("cuda", "bf16", False)]
    assert got.achievable_flops == measured
    if peak is None:
        assert got.peak_flops == measured and got.attention_flops == 0.0
        assert f"the measured rate: {name!r} is not in gpus.DEVICES" in got.source
        return
    sheet = gpus.DEVICES[name]
    assert got.peak_flops == sheet.peak_flops == peak
    assert 0 < got.attention_flops < peak
    # each figure cited, and the dense rate where the datasheet states the sparse one
    assert "dense BF16" in sheet.source or "with sparsity" in sheet.source
    assert sheet.source in got.source


def test_auto_on_a_cuda_build_gets_the_doctors_gpu_checks(monkeypatch, tmp_path):
    # device: auto on a host whose torch is a CUDA build means the GPUs: the doctor
    # checks them (here it finds none, which a CUDA build with no GPU is), as for cuda.
    from parabench import envinfo
    from parabench.config import checked
    from parabench.preflight import doctor

    monkeypatch.setattr(envinfo, "_build", lambda: ("2.13.0", "12.8"))
    monkeypatch.setattr(doctor, "torch_build", lambda: ("2.13.0", "12.8"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # on a GPU host too
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # the checks set it: undone
    config = checked({**tiny_config(), "device": "auto", "rehearse": {"enabled": False}})
    found = {c.name: c for c in doctor.run_checks(config, tmp_path, gpus=True)}
    assert "gpus" in found, sorted(found)
    assert found["gpus"].status == doctor.FAIL and "0 visible" in found["gpus"].detail


def test_the_nocomm_gather_fills_every_slot_with_its_shard_in_one_copy():
    """The no-communication group's all-gather puts this rank's shard in every slot
    with one copy, not one a peer: the rank's step counts the group's copies as its
    compute, and on a GPU each is a kernel launch (the H200's plan.csv grew FSDP's
    step 29% from world 8 to 64 with a copy a peer). An output that is not contiguous
    (no view of it by slot) is filled slot by slot."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from parabench.process.nocomm import LocalGroup

    class Copies(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Copies.n += func is torch.ops.aten.copy_.default
            return func(*args, **(kwargs or {}))

    group, shard = LocalGroup(1, 64), torch.arange(6.0).reshape(2, 3)
    out = torch.full((128, 3), float("nan"))
    with Copies():
        group._allgather_base(out, shard).wait()
    assert Copies.n == 1 and torch.equal(out, shard.repeat(64, 1))
    transposed = torch.full((3, 128), float("nan")).t()
    group._allgather_base(transposed, shard).wait()
    assert torch.equal(transposed, shard.repeat(64, 1))
