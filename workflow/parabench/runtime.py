"""Where this process sits: rank, device, threads and the process group.

Ranks are read from the environment torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE), as in
nanoGPT; nothing is passed by hand.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from parabench.envinfo import usable_cores
from parabench.spec import RunSpec


class LaunchError(RuntimeError):
    """The cell was started the wrong way (e.g. ddp at n=2 without torchrun)."""


@dataclass
class Context:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device  # this process's own device (cuda:LOCAL_RANK or cpu)
    threads: int
    distributed: bool  # a process group exists
    local_world: int = 1  # processes on this host (LOCAL_WORLD_SIZE)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device_type(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def start(spec: RunSpec) -> Context:
    """Set device and threads, and open a process group when the strategy has ranks."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    wants_ranks = spec.ranks > 1
    if wants_ranks and world != spec.devices:
        raise LaunchError(
            f"{spec.strategy} at {spec.devices} devices runs as {spec.devices} ranks: launch with "
            f"`torchrun --nproc-per-node {spec.devices} -m parabench run ...` (WORLD_SIZE={world})"
        )
    if not wants_ranks and world != 1:
        raise LaunchError(f"{spec.strategy} runs in one process; got WORLD_SIZE={world}")

    device_type = resolve_device_type(spec.device)
    if device_type == "cuda" and not torch.cuda.is_available():
        build = (
            f"torch {torch.__version__} is a CPU-only build"
            if torch.version.cuda is None
            else f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}"
        )
        raise LaunchError(
            "device: 'cuda' requested but torch sees no CUDA device on "
            f"{socket.gethostname()} ({build}): run on a GPU node (did the job ask for "
            "GPUs?), or set device: cpu or auto"
        )
    if device_type == "cuda" and local_rank < torch.cuda.device_count():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device(device_type)

    # Ranks on one node share its cores: cores // ranks each, set explicitly (torchrun
    # only sets OMP_NUM_THREADS=1, and only when it starts more than one rank).
    threads = max(1, usable_cores() // max(1, local_world))
    torch.set_num_threads(threads)

    distributed = False
    if spec.record.process_group(spec.devices):
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=spec.timeout_s)
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(
                backend, timeout=timeout, device_id=device if device.type == "cuda" else None
            )
        else:  # one rank, started without torchrun: an in-memory store suffices
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        distributed = True
    return Context(rank, world, local_rank, device, threads, distributed, local_world)


def finish(ctx: Context) -> None:
    """After a cell's work, before tearing down: ranks leave together. A rank that
    destroys its process group and exits while a peer's gloo threads still talk to it
    can die in C++ teardown ("terminate called without an active exception", about one
    run in thirty here). Only on success: after a failure a barrier would just wait out
    the timeout."""
    if ctx.distributed and ctx.world_size > 1:
        dist.barrier()


def stop(ctx: Context) -> None:
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()
