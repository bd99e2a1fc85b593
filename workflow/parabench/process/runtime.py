"""Where this process sits: rank, device, cores, threads and the process groups.

Ranks are read from the environment torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE), as in
nanoGPT; nothing is passed by hand. Ranks that share a host are bound to their share of
its cores, as srun and mpirun bind them, so that what each rank gets is decided, not
left to the scheduler. Strategies communicate over `Context.group`; the same strategy
built over `Context.without_comm()` runs its real work with every collective returning
at once (process/nocomm.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from parabench.envinfo import usable_cores
from parabench.layout import Layout
from parabench.process import nocomm
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
    cores: tuple[int, ...] = ()  # the cores this rank is bound to (its share of the host's)
    host_cores: int = 1  # the cores this host's ranks share (the allocation's)
    group: dist.ProcessGroup | None = None  # what the strategy communicates over
    local: dist.ProcessGroup | None = None  # the no-communication group (process/nocomm.py)
    # A layout's named meshes (several mesh dimensions): the real one and the one
    # without communication, the pair as group and local are.
    meshes: tuple[NamedMesh, NamedMesh] | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def communicates(self) -> bool:
        """False for a context whose collectives return at once (without_comm)."""
        return not nocomm.used(self.group)

    @property
    def ranks_per_core(self) -> float:
        """How many of this host's ranks share each of this rank's cores (1 when each
        has cores of its own): time-slicing, when it is above 1."""
        return max(1.0, self.local_world * self.threads / max(1, self.host_cores))

    def without_comm(self) -> Context:
        """This context with every collective returning at once, on this rank's data."""
        return dataclasses.replace(self, group=self.local)

    def named_mesh(self) -> NamedMesh:
        """The layout's named mesh over this context's groups (real, or without
        communication)."""
        assert self.meshes, "a layout's context has meshes (runtime.start)"
        return self.meshes[0] if self.communicates else self.meshes[1]

    def mesh(self):
        """A 1-D device mesh over this context's group. Named after the group: DTensor
        caches sharding plans by mesh, and two meshes of the same ranks compare equal,
        so an unnamed no-communication mesh would reuse the real one's collectives."""
        from torch.distributed.device_mesh import DeviceMesh

        name = "world" if self.communicates else "nocomm"
        return DeviceMesh.from_group(self.group, self.device.type, mesh_dim_names=(name,))


class NamedMesh:
    """A layout's device mesh, named by layout.MESH_DIMS, with the dimensions of degree
    1 left out (torchtitan's ParallelDims.build_mesh). The no-communication mesh's
    names carry a suffix: DeviceMesh compares equal by layout and names, never by its
    groups, and DTensor caches by mesh, so one named like the real one would reuse the
    real one's collectives."""

    def __init__(self, mesh, layout: Layout, suffix: str = "") -> None:
        self.mesh, self.layout, self.suffix = mesh, layout, suffix

    def get(self, *dims: str):
        """The (sub)mesh over these dimensions, all of degree > 1."""
        names = tuple(d + self.suffix for d in dims)
        return self.mesh[names[0]] if len(names) == 1 else self.mesh[names]

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.get(dim).get_group()

    def coordinate(self, dim: str) -> int:
        """This rank's index along `dim` (0 along a dimension of degree 1)."""
        if self.layout.degrees[dim] == 1:
            return 0
        return self.get(dim).get_local_rank()

    def groups(self) -> dict[str, dist.ProcessGroup]:
        """Each dimension of degree > 1 and this rank's group along it."""
        return {d: self.group(d) for d in self.layout.declared()}


def build_meshes(layout: Layout, device_type: str, tag: str = "") -> tuple[NamedMesh, NamedMesh]:
    """The layout's real mesh over the default group's backend, and the same mesh
    without communication (nocomm.BACKEND on every dimension). Every rank calls it, in
    the same order: each dimension's groups are made collectively. Where the default
    group is itself without communication (predict/rank_alone.py's rank alone), both are local.
    `tag` ends every name: a process that builds meshes of one shape again, over new
    groups (predict/rank_alone.py, a rank after another), must not meet DTensor's plans cached for
    the last ones, which compare equal by shape and names."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = layout.declared()
    shape = tuple(layout.degrees[d] for d in dims)
    names = tuple(d + tag for d in dims)
    local_names = tuple(f"{d}_nocomm{tag}" for d in dims)
    real = NamedMesh(init_device_mesh(device_type, shape, mesh_dim_names=names), layout, tag)
    local = init_device_mesh(
        device_type,
        shape,
        mesh_dim_names=local_names,
        backend_override={d: nocomm.BACKEND for d in local_names},
    )
    local = NamedMesh(local, layout, "_nocomm" + tag)
    if nocomm.used(dist.group.WORLD):  # a rank alone: no peer will ever send
        for mesh in (real, local):
            for group in mesh.groups().values():
                group.alone = True
    return real, local


# Meshes built in this process by ranks alone: each rank's are named apart, or the next
# rank's DTensors would find plans cached for the last one's meshes, which compare equal
# (DeviceMesh equality ignores its groups), and run their collectives over groups
# destroyed by then ("Could not resolve the process group").
_BUILT = itertools.count()


def forget_meshes() -> None:
    """Drop DTensor's plans made on the meshes of a world now destroyed, which they keep
    alive."""
    from torch.distributed.tensor import DTensor, _redistribute

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    _redistribute._planner_cache.clear()


@contextlib.contextmanager
def alone(
    spec: RunSpec,
    rank: int,
    device: torch.device,
    threads: int,
    local_world: int = 1,
) -> Iterator[Context]:
    """Rank `rank` of the cell's world, alone in this process: its collectives return at
    once on its own data (process/nocomm.py; `alone`: no peer ever sends), as the
    scaling model measures a rank (predict/rank_alone.py) and the rehearsal runs one
    (preflight/rehearse.py). It is local rank rank % local_world of `local_world`
    processes on its host (they decide the GPUs it
    needs: Strategy.skip_reason). A strategy of one process gets no process group. A
    layout's meshes are made by `with_meshes`, once the rank knows it runs."""
    grouped = spec.record.process_group(spec.devices)
    # init_process_group wraps sys.excepthook to prefix "[rank<r>]:", again at each
    # call: a process running ranks one after another would prefix a traceback once per
    # rank it ran.
    hook = sys.excepthook
    if grouped:
        dist.init_process_group(
            nocomm.BACKEND, store=dist.HashStore(), rank=rank, world_size=spec.devices
        )
    try:
        group = dist.group.WORLD if grouped else None
        if group is not None:
            group.alone = True  # no peer will ever send (process/nocomm.py)
        world = spec.devices if grouped else 1
        yield Context(
            rank,
            world,
            rank % local_world,
            device,
            threads,
            grouped,
            local_world,
            (),
            usable_cores(),
            group,
            group,
        )
    finally:
        if grouped:
            dist.destroy_process_group()
            forget_meshes()
        sys.excepthook = hook


def with_meshes(ctx: Context, spec: RunSpec) -> Context:
    """`ctx` with its layout's meshes (build_meshes), named apart from every earlier
    rank's in this process; `ctx` as it is for a strategy that is no layout."""
    if not spec.record.composed:
        return ctx
    meshes = build_meshes(spec.layout, ctx.device.type, f"_{next(_BUILT)}")
    return dataclasses.replace(ctx, meshes=meshes)


def resolve_device_type(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def share(local_rank: int, local_world: int, cores: list[int]) -> list[int]:
    """A rank's share of its host's cores: local_world consecutive slices of them
    (srun --cpu-bind=cores), or, with more ranks than cores, the core its rank falls
    on (ranks then take turns on it)."""
    if local_world <= 1:
        return list(cores)
    if local_world >= len(cores):
        return [cores[local_rank * len(cores) // local_world]]
    lo = local_rank * len(cores) // local_world
    hi = (local_rank + 1) * len(cores) // local_world
    return cores[lo:hi]


def bind(local_rank: int, local_world: int) -> tuple[int, ...]:
    """Bind this process to its share of the host's cores. Everything the process
    starts afterwards (gloo's threads, intra-op threads) inherits the binding."""
    cores = sorted(os.sched_getaffinity(0))
    if local_world <= 1:
        return tuple(cores)
    mine = share(local_rank, local_world, cores)
    os.sched_setaffinity(0, mine)
    return tuple(mine)


def start(spec: RunSpec) -> Context:
    """Bind to cores, set device and threads, and open the process groups when the
    strategy has ranks."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    wants_ranks = spec.processes > 1
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
    # A host with fewer GPUs than its processes drive opens no process group: the cell
    # is skipped (Strategy.skip_reason says so), and NCCL refuses a rank without a GPU
    # of its own. Every process of the host decides alike (need counts them all).
    placed = device_type != "cuda"
    device = torch.device(device_type)
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        placed = torch.cuda.device_count() >= spec.cuda_devices_per_host(local_world)
        if placed:
            torch.cuda.set_device(device)

    # Ranks on one host share its cores: each is bound to its share, and runs that many
    # threads (at least one: with more ranks than cores, they take turns on a core).
    # torchrun only sets OMP_NUM_THREADS=1, and only when it starts several ranks.
    host_cores = usable_cores()
    cores = bind(local_rank, local_world)
    threads = len(cores)
    torch.set_num_threads(threads)

    distributed, group, local = False, None, None
    if spec.record.process_group(spec.devices) and placed:
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
        distributed, group, local = True, dist.group.WORLD, nocomm.local_group()
    meshes = (
        build_meshes(spec.layout, device.type) if spec.record.composed and distributed else None
    )
    return Context(
        rank,
        world,
        local_rank,
        device,
        threads,
        distributed,
        local_world,
        cores,
        host_cores,
        group,
        local,
        meshes,
    )


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
