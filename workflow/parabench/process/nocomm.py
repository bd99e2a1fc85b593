"""A process group whose collectives complete at once, on this rank's own data: the
no-communication check (`step_nocomm_s`, "this step on an infinitely fast
interconnect").

A strategy built over it runs its real code and its real compute, rank by rank, at the
same time as the other ranks (so they share the host's cores as in the timed steps),
and every collective returns immediately. torch.distributed's own `fake` backend does
the same but leaves outputs it did not fill uninitialised: FSDP's gathered parameters,
tensor parallel's scattered shards and a pipeline stage's received activations would
then hold garbage (NaN, denormals that slow a CPU down, losses that refuse them). Here
this rank's values stand in for its peers': an all-gather copies its own shard into
every slot, a reduce-scatter keeps its own chunk, a reduction keeps its own values, a
receive keeps what its buffer held (by then, data a real peer sent), a scatter from
another rank gives zeros. The maths is not the strategy's; the work and the shapes are.

A rank with no peers at all (`alone`: predict/rank_alone.py plays one rank of a world) has never
received real data: its receives give ones instead, finite values of the right shape.
That is also the answer a pipeline stage's warm-up vote expects from its neighbours
(1: their shapes are static, as every stage parabench builds declares them), so the
stage skips the shape exchange no peer is there to answer.

c10d calls a Python group's methods directly, past the dispatcher, so the profiler sees
none of these collectives: the group counts them itself while `counting` is on (what a
planned rank would send, predict/plan.py), in the anatomy's units (anatomy.volume: calls, and
bytes as nccl-tests sizes them: the gathered output, the input to reduce).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

BACKEND = "parabench_local"


def _done(result) -> dist.Work:
    fut: Future = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class LocalGroup(dist.ProcessGroup):
    """The backend of a `parabench_local` group (dist.new_group(backend=BACKEND)).
    Method names are those c10d calls on a Python backend, old and new."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self.tally: dict[str, dict[str, float]] | None = None  # on while `counting`
        self.alone = False  # no peer has ever sent: receives give ones

    def _count(self, op: str, tensors: list[torch.Tensor]) -> None:
        if self.tally is not None:
            entry = self.tally.setdefault(op, {"count": 0.0, "bytes": 0.0})
            entry["count"] += 1
            entry["bytes"] += float(sum(t.numel() * t.element_size() for t in tensors))

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:
        return dist.distributed_c10d._world.pg_names[self]

    # The backend torch asks a group for, on any device: this group itself. c10d
    # registers no backend on a Python group, so the inherited `_get_backend` raises
    # ("No backend type associated with device type cuda"), and torch asks on CUDA:
    # new_group under a default group bound to a device (init_process_group's
    # device_id=, as runtime.start on CUDA) reads `supports_splitting` off it, FSDP2's
    # allocate-from-group reads `supports_tensor_alloc`. The flags below are those torch
    # reads off a backend, each answered as a plain backend does: nothing to split,
    # coalesce, estimate, shrink or allocate from, so torch takes its ordinary path.
    def _get_backend(self, device: torch.device | str) -> LocalGroup:
        return self

    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False
    supports_shrinking = False

    def supports_tensor_alloc(self, device: torch.device) -> bool:
        return False

    # Reductions and broadcasts: this rank's values stand for the result.
    def allreduce(self, tensors, opts=None):
        self._count("all_reduce", tensors)
        return _done(tensors)

    allreduce_coalesced = allreduce

    def broadcast(self, tensors, opts=None):
        self._count("broadcast", tensors)
        return _done(tensors)

    def barrier(self, opts=None):
        return _done(None)

    # Gathers: this rank's piece in every slot.
    def allgather(self, outputs, inputs, opts=None):
        self._count("all_gather", [o for outs in outputs for o in outs])
        for outs, inp in zip(outputs, inputs, strict=True):
            for o in outs:
                o.copy_(inp)
        return _done(outputs)

    def _gather_into(self, output, input) -> None:
        # One copy, not one a peer: a rank's step counts this group's copies as its
        # compute, and on a GPU each copy is a kernel launch (the H200's plan.csv:
        # FSDP's rank 25.9 ms a step at world 8, 33.4 at 64, its 12 gathers a step then
        # 768 copies). FSDP2's input is a view of its own slot of the output, which is
        # written with what it holds (copy_ allows an expanded source that overlaps).
        if output.is_contiguous():
            output.view(self._size, -1).copy_(input.reshape(1, -1).expand(self._size, -1))
            return
        for o in output.chunk(self._size):
            o.copy_(input.view_as(o))

    def _allgather_base(self, output, input, opts=None):
        self._count("all_gather", [output])
        self._gather_into(output, input)
        return _done(output)

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        self._count("all_gather", outputs)
        for o, i in zip(outputs, inputs, strict=True):
            self._gather_into(o, i)
        return _done(outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    # Scatters: this rank's chunk; from another rank, zeros (finite, of the right shape).
    def reduce_scatter(self, outputs, inputs, opts=None):
        self._count("reduce_scatter", [i for ins in inputs for i in ins])
        for o, ins in zip(outputs, inputs, strict=True):
            o.copy_(ins[self._rank])
        return _done(outputs)

    def _scatter_from(self, output, input) -> None:
        output.copy_(input.chunk(self._size)[self._rank].view_as(output))

    def _reduce_scatter_base(self, output, input, opts=None):
        self._count("reduce_scatter", [input])
        self._scatter_from(output, input)
        return _done(output)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        self._count("reduce_scatter", inputs)
        for o, i in zip(outputs, inputs, strict=True):
            self._scatter_from(o, i)
        return _done(outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def scatter(self, outputs, inputs, opts=None):
        for o in outputs:
            o.copy_(inputs[0][self._rank]) if inputs else o.zero_()
        return _done(outputs)

    def alltoall_base(self, output, input, out_splits, in_splits, opts=None):
        self._count("all_to_all", [input])
        output.copy_(input)
        return _done(output)

    all_to_all_single = alltoall_base

    # Point to point: nothing sent; a receive keeps what its buffer held.
    def send(self, tensors, dst, tag):
        self._count("send", tensors)
        return _done(None)

    def recv(self, tensors, src, tag):
        self._count("recv", tensors)
        if self.alone:
            with torch.no_grad():  # a stage's input buffer requires grad
                for t in tensors:
                    t.fill_(1)
        return _done(tensors)


def _create(store, rank: int, size: int, timeout) -> LocalGroup:
    return LocalGroup(rank, size)


dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


def local_group() -> dist.ProcessGroup:
    """A group of every rank over this backend. Collective: every rank calls it."""
    return dist.new_group(backend=BACKEND)


def used(group: dist.ProcessGroup | None) -> bool:
    """Whether `group` is a no-communication group."""
    return group is not None and dist.get_backend(group) == BACKEND


@contextlib.contextmanager
def counting_each(
    groups: dict[str, dist.ProcessGroup],
) -> Iterator[dict[str, dict[str, dict[str, float]]]]:
    """`counting` over several groups at once (a layout's mesh dimensions), by name."""
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(counting(g)) for name, g in groups.items()}


def merged(tallies: dict[str, dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Several groups' tallies as one: per op, calls and bytes summed."""
    out: dict[str, dict[str, float]] = {}
    for tally in tallies.values():
        for op, v in tally.items():
            entry = out.setdefault(op, {"count": 0.0, "bytes": 0.0})
            entry["count"] += v["count"]
            entry["bytes"] += v["bytes"]
    return out


@contextlib.contextmanager
def counting(group: dist.ProcessGroup) -> Iterator[dict[str, dict[str, float]]]:
    """The collectives issued over `group` (a LocalGroup) inside the block: per op,
    calls and bytes."""
    assert isinstance(group, LocalGroup), f"{group} is not a {BACKEND} group"
    group.tally = {}
    try:
        yield group.tally
    finally:
        group.tally = None
