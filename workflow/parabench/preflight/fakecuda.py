"""A CUDA node made of fake tensors: what the rehearsal (preflight/rehearse.py) runs a GPU cell's
code on, on a host with no GPU (a cluster's login node, a laptop, CI).

FakeTensorMode makes tensors on cuda:i that hold no memory, and every op on them
computes only shapes, dtypes and devices. Two layers stand in for the rest of CUDA, in
the rehearsal's own process only (never a cell's):

- below torch, on a CPU-only torch: a CUDA device guard and CUDA hooks (preflight/fakecuda.cpp,
  compiled once and cached, loaded before torch imports: `install`). Without them the
  first backward on a fake CUDA tensor aborts the process (autograd asks the guard for a
  stream). A CUDA torch has both already: on a GPU node the real ones, without a GPU
  the fake guard FakeTensorMode installs itself.
- in Python (`node`): what torch.cuda answers a cell's code, as on a node of `gpus` GPUs
  of one kind: available, bf16-capable, its device count and names, the current device,
  streams and events that do nothing, NCCL's version for DDP's bf16 hook, seeding as
  a no-op (no CUDA generator exists).

What this cannot stand in for is listed in rehearse.LIMITS.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path

from parabench.envinfo import nvidia_smi_gpus, torch_build

SOURCE = Path(__file__).with_name("fakecuda.cpp")


class Unavailable(RuntimeError):
    """This host cannot stand in for CUDA (no C++ compiler for the shim, say)."""


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise Unavailable("torch is not installed in this python")
    return Path(spec.origin).parent


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and (found := shutil.which(name)):
            return found
    raise Unavailable(
        "a C++ compiler (c++, g++ or clang++; or set CXX) builds the fake CUDA device a "
        "CPU-only torch lacks (preflight/fakecuda.cpp, once, in seconds)"
    )


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "parabench"


def _abi(torch_dir: Path) -> str:
    """torch's C++ ABI flag, read off its build config without importing torch."""
    cmake = torch_dir / "share" / "cmake" / "Caffe2" / "Caffe2Targets.cmake"
    if cmake.exists() and "_GLIBCXX_USE_CXX11_ABI=0" in cmake.read_text():
        return "0"
    return "1"  # torch >= 2.7 builds with the C++11 ABI only


def library(torch_dir: Path | None = None) -> Path:
    """preflight/fakecuda.cpp built against this torch: cached by the source, torch's version file
    and this Python, built once (a few seconds), written atomically."""
    torch_dir = torch_dir or _torch_dir()
    key = hashlib.sha256(
        SOURCE.read_bytes()
        + (torch_dir / "version.py").read_bytes()
        + sysconfig.get_config_var("SOABI").encode()
    ).hexdigest()[:16]
    path = _cache_dir() / f"fakecuda-{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        argv = [
            _compiler(),
            "-O1",
            "-shared",
            "-fPIC",
            "-std=c++17",
            "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={_abi(torch_dir)}",
            f"-I{torch_dir / 'include'}",
            str(SOURCE),
            "-o",
            str(built),
            f"-L{torch_dir / 'lib'}",
            "-lc10",
            "-ltorch_cpu",
        ]
        got = subprocess.run(argv, capture_output=True, text=True)
        if got.returncode != 0:
            why = (got.stderr.strip().splitlines() or ["no output"])[-1]
            raise Unavailable(f"the fake CUDA device did not build against this torch: {why}")
        os.replace(built, path)
    return path


# The shim loaded in this process (install), whose guard `node` registers.
_SHIM: list = []
_INSTALLED: list[str] = []


def install() -> str:
    """Make fake CUDA tensors trainable in this process; call before torch is imported.
    Returns what stands in for CUDA's C++ side (for the rehearsal's record): the shim,
    unless torch is a CUDA build on a host with GPUs, whose own guard and hooks serve."""
    if _INSTALLED:
        return _INSTALLED[0]
    torch_dir = _torch_dir()
    if torch_build()[1] is not None and nvidia_smi_gpus():
        how = "this host's CUDA (its GPUs run nothing: every tensor is fake)"
    else:
        if "torch" in sys.modules:
            raise Unavailable(
                "the fake CUDA device must load before torch does: rehearse in a new "
                "process (`parabench rehearse`)"
            )
        lib = library(torch_dir)
        # torch's libraries first, global, so the shim binds to the ones torch uses
        for name in ("libc10.so", "libtorch_cpu.so"):
            ctypes.CDLL(str(torch_dir / "lib" / name), mode=ctypes.RTLD_GLOBAL)
        _SHIM.append(ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL))
        how = f"a fake CUDA device guard and hooks ({lib.name})"
    _INSTALLED.append(how)
    return how


class _Node:
    """The current device of this process (torch.cuda.set_device / current_device)."""

    index = 0


@contextlib.contextmanager
def node(gpus: int, name: str, memory_bytes: int) -> Iterator[None]:
    """torch.cuda as a node of `gpus` GPUs named `name` with `memory_bytes` each would
    answer, for fake tensors, restored on exit. The GPU is one that runs bf16 (sm_90).
    Where `install` loaded the shim, its guard stands for CUDA's; where this host has
    GPUs, its own do, and the node has as many as it has (a cell needing more is
    skipped, as it would be here)."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    if _SHIM:  # over the guard a CUDA torch registered as it loaded, if any
        _SHIM[0].parabench_fake_cuda()
    elif torch_build()[1] is not None:
        gpus = min(gpus, torch.cuda.device_count())

    def stream_class():
        class Stream(torch.Stream):
            def __new__(cls, device=None, priority=0, **kwargs):
                return super().__new__(cls, device=_device(device), priority=priority)

        return Stream

    def event_class():
        class Event(torch.Event):
            def __new__(cls, enable_timing=False, blocking=False, interprocess=False):
                return super().__new__(cls, device=_device(None), enable_timing=enable_timing)

        return Event

    def _device(device) -> torch.device:
        if device is None:
            return torch.device("cuda", _Node.index)
        if isinstance(device, int):
            return torch.device("cuda", device)
        device = torch.device(device)
        return device if device.index is not None else torch.device("cuda", _Node.index)

    def set_device(device) -> None:
        # the C++ guard's current device too: a factory on "cuda" resolves it there
        index = _device(device).index
        if index != _Node.index:
            # FakeTensorMode's dispatch cache keys a factory's device as it was given
            # ("cuda") and keeps the device that resolved to: another current device
            # makes its entries wrong
            FakeTensorMode.cache_clear()
        _Node.index = index
        torch.accelerator.set_device_index(index)

    def current_stream(device=None):
        return torch.accelerator.current_stream(_device(device).index)

    def stream(s):
        return s if s is not None else contextlib.nullcontext()

    def properties(device=None):
        return types.SimpleNamespace(
            name=name,
            total_memory=memory_bytes,
            major=9,
            minor=0,
            multi_processor_count=132,
            is_integrated=False,
        )

    cuda = torch.cuda
    answers = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "_lazy_init": lambda: None,
        "device_count": lambda: gpus,
        "set_device": set_device,
        "current_device": lambda: _Node.index,
        "get_device_name": lambda device=None: name,
        "get_device_properties": properties,
        "get_device_capability": lambda device=None: (9, 0),
        "is_bf16_supported": lambda including_emulation=True: True,
        "synchronize": lambda device=None: None,
        "is_current_stream_capturing": lambda: False,  # no CUDA graph is being captured
        "Stream": stream_class(),
        "Event": event_class(),
        "current_stream": current_stream,
        "default_stream": current_stream,
        "stream": stream,
        "set_stream": lambda s: torch.accelerator.set_stream(s),
        # no CUDA generator exists: seeding is the CPU generator's alone
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda state, device="cuda": None,
    }
    saved = {k: getattr(cuda, k) for k in answers if hasattr(cuda, k)}
    # FakeTensorMode makes what a constructor makes on a device (torch.tensor(...,
    # device="cuda")) for real and lifts it, where CUDA is available, and makes a real
    # tensor on each device it meets first (init_gpu_context): not on these devices.
    from torch._subclasses import fake_tensor

    avoid = FakeTensorMode.__dict__["avoid_device_init"]
    warm = fake_tensor.init_gpu_context
    saved_nccl = cuda.nccl.version
    saved_version = torch.version.cuda
    saved_available = dist.is_nccl_available
    try:
        for k, v in answers.items():
            setattr(cuda, k, v)
        cuda.nccl.version = lambda: (2, 21, 5)  # DDP's bf16 hook asks for 2.10 or later
        torch.version.cuda = saved_version or "12.4"
        dist.is_nccl_available = lambda: True
        FakeTensorMode.avoid_device_init = property(lambda self: True)
        fake_tensor.init_gpu_context = lambda device: None
        yield
    finally:
        for k in answers:
            if k in saved:
                setattr(cuda, k, saved[k])
            else:
                delattr(cuda, k)
        cuda.nccl.version = saved_nccl
        torch.version.cuda = saved_version
        dist.is_nccl_available = saved_available
        FakeTensorMode.avoid_device_init = avoid
        fake_tensor.init_gpu_context = warm
        _Node.index = 0
