"""Every communication op, once: its name in the tables, in words, the collectives
benchmark's curve that times it, its bus-bandwidth factor, and the c10d ops the
profiler records for it. Torch-free.

Bus bandwidth follows nccl-tests: busbw = algbw x factor, with factor 2(n-1)/n for
all-reduce (a ring sends each byte twice, less the rank's own share), (n-1)/n for
all-gather, reduce-scatter and all-to-all, 1 for broadcast and point-to-point.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    name: str  # in summary.csv's comm_by_op and collectives.csv's `op`
    words: str  # in the report's sentences
    curve: str  # the collectives benchmark's curve that times one call
    c10d: tuple[str, ...]  # the dispatcher ops the profiler records for it

    def bus_factor(self, n: int) -> float:
        if self.name == "all_reduce":
            return 2 * (n - 1) / n
        if self.name in ("all_gather", "reduce_scatter", "all_to_all"):
            return (n - 1) / n
        return 1.0


_OPS = (
    Op(
        "all_reduce",
        "all-reduce",
        "all_reduce",
        ("c10d::allreduce_", "c10d::allreduce_coalesced_", "_c10d_functional::all_reduce"),
    ),
    Op(
        "all_gather",
        "all-gather",
        "all_gather",
        (
            "c10d::_allgather_base_",
            "c10d::allgather_",
            "c10d::allgather_into_tensor_coalesced_",
            "_c10d_functional::all_gather_into_tensor",
        ),
    ),
    Op(
        "reduce_scatter",
        "reduce-scatter",
        "reduce_scatter",
        (
            "c10d::_reduce_scatter_base_",
            "c10d::reduce_scatter_",
            "c10d::reduce_scatter_tensor_coalesced_",
            "_c10d_functional::reduce_scatter_tensor",
        ),
    ),
    Op("broadcast", "broadcast", "broadcast", ("c10d::broadcast_", "_c10d_functional::broadcast")),
    Op("send", "send", "send_recv", ("c10d::send",)),
    Op("recv", "receive", "send_recv", ("c10d::recv_",)),
    # No all-to-all curve is measured: an all-gather moves the same bytes per rank.
    Op("all_to_all", "all-to-all", "all_gather", ("c10d::alltoall_base_", "c10d::alltoall_")),
)

OPS: dict[str, Op] = {op.name: op for op in _OPS}
# The c10d op the profiler records -> our op.
BY_C10D: dict[str, Op] = {c: op for op in _OPS for c in op.c10d}
# The ops the collectives benchmark times, each a curve (send_recv: a pair of ranks).
CURVES: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")


def bus_factor(curve: str, n: int) -> float:
    """The bus-bandwidth factor of a benchmark curve at n ranks."""
    return 1.0 if curve == "send_recv" else OPS[curve].bus_factor(n)
