"""A fabric: what one collective of S bytes costs at N ranks, for planning past the
devices at hand (predict/plan.py). Torch-free.

Every source speaks nccl-tests' bus bandwidth: busbw = algbw x the op's factor (ops.py:
2(N-1)/N for all-reduce, (N-1)/N for all-gather and reduce-scatter, 1 for point to
point), the figure nccl-tests defines to reflect the links' speed whatever the op and
the rank count. One call of `op` then takes

    t(op, N, S) = latency + S x factor(op, N) / busbw(S)

Three sources, each named with where its numbers come from:
- `curves`: this machine's collectives benchmark (collectives.csv). At a measured rank
  count the measured time itself; beyond it, the largest measured count's busbw.
- an nccl-tests output file: the text `all_reduce_perf` (or any `*_perf`) prints, as it
  stands: its out-of-place busbw per size (each row's time, latency included).
- a named profile (PROFILES): two levels, within a node and across nodes, from
  published figures, for N beyond one node.

A named profile's latency is NCCL's own cost model (`nccl_time`): for each algorithm
NCCL can run the op with (a ring, or for an all-reduce a tree) and each protocol (LL,
LL128, Simple), a latency that grows with the ring's steps or the tree's depth over the
group's ranks and nodes, plus the bytes over that protocol's share of the busbw; the
fastest is what NCCL picks. So data parallelism over 1,024 ranks is not free: a ring
all-gather over them waits on about a thousand steps. The measured sources carry their
latency at the counts they measured, and keep it beyond.

What none of them models: NVLS and CollNet (switch-side reduction), PAT, and contention
between jobs.
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from parabench.ops import OPS

if TYPE_CHECKING:  # numpy and pandas stay out of planning a workflow (config imports us)
    import pandas as pd


class FabricError(ValueError):
    """A fabric that cannot be used, with why (and where, for a file)."""


def factor(op: str, n: int) -> float:
    """nccl-tests' bus factor of `op` at n ranks (ops.py: 1 for point to point)."""
    return OPS[op].bus_factor(n)


@dataclass(frozen=True)
class BusbwTable:
    """busbw by message size (log-log between sizes, flat beyond them), and a latency."""

    sizes: tuple[float, ...]
    busbw: tuple[float, ...]  # bytes/s
    latency_s: float

    def at(self, nbytes: float) -> float:
        """busbw at `nbytes`: log-log between the sizes, flat beyond them."""
        s = self.sizes
        if nbytes <= s[0]:
            return self.busbw[0]
        if nbytes >= s[-1]:
            return self.busbw[-1]
        i = bisect.bisect_right(s, nbytes)
        f = math.log(nbytes / s[i - 1]) / math.log(s[i] / s[i - 1])
        return math.exp((1 - f) * math.log(self.busbw[i - 1]) + f * math.log(self.busbw[i]))

    def time(self, op: str, n: int, nbytes: float) -> float:
        if n < 2 or not nbytes:
            return 0.0
        size = max(nbytes, self.sizes[0])  # below the smallest size: its time (latency)
        return self.latency_s + size * factor(op, n) / self.at(size)


# NCCL's latency model, as NCCL itself prices an algorithm and protocol when it picks
# one (NVIDIA/nccl src/graph/tuning.cc, ncclTopoTuneModel, at b6475625: baseLat and
# hwLat, microseconds): a call's base latency, and each step's on NVLink within a node
# and over the network between nodes. By (algorithm, protocol).
_NCCL_BASE_US = {
    ("tree", "LL"): 6.8,
    ("tree", "LL128"): 14.0,
    ("tree", "Simple"): 0.0,
    ("ring", "LL"): 6.6,
    ("ring", "LL128"): 14.0,
    ("ring", "Simple"): 8.4,
}
_NCCL_NVLINK_US = {
    ("tree", "LL"): 0.6,
    ("tree", "LL128"): 1.25,
    ("tree", "Simple"): 28.0,
    ("ring", "LL"): 0.6,
    ("ring", "LL128"): 1.9,
    ("ring", "Simple"): 3.4,
}
_NCCL_NET_US = {
    ("tree", "LL"): 5.0,
    ("tree", "LL128"): 8.5,
    ("tree", "Simple"): 28.0,
    ("ring", "LL"): 2.7,
    ("ring", "LL128"): 4.0,
    ("ring", "Simple"): 14.0,
}
_NCCL_NET_OVERHEAD_US = 1.0  # a network post, each step of a ring across nodes (x3 Simple)


def _nccl_busbw_share(algo: str, proto: str, op: str, n: int, nodes: int) -> float:
    """The share of the links' busbw a protocol reaches (tuning.cc's refinements: LL
    sends half its bytes as flags, LL128 8 in 128, 0.7 with one rank per node; a tree
    reaches 92% of a ring)."""
    if algo == "ring":
        if proto == "LL":
            return 1 / 4 if nodes > 1 or op == "all_reduce" else 1 / 3
        if proto == "LL128":
            return 0.7 if n / nodes < 2 else 0.92
        return 1.0
    tree = 0.92
    if proto == "LL":
        return tree / 3.8
    if proto == "LL128":
        return tree * (7 / 9 if nodes == 1 else 120 / 128)
    return tree


def nccl_latency_s(op: str, n: int, nodes: int, algo: str, proto: str) -> float:
    """NCCL's latency of one call of `op` over n ranks on `nodes` nodes, by `algo` (ring
    or tree) and `proto` (LL, LL128, Simple): tuning.cc's model."""
    key = (algo, proto)
    intra, inter = _NCCL_NVLINK_US[key], _NCCL_NET_US[key]
    if algo == "tree":  # all-reduce: up and down a tree of nodes, a chain within each
        depth = int(math.log2(nodes)) if nodes > 1 else 0
        return (_NCCL_BASE_US[key] + 2 * ((n // nodes - 1) * intra + depth * inter)) * 1e-6
    if op == "all_reduce":
        steps, across = 2 * (n - 1), (2 * nodes if nodes > 1 else 0)
    elif op in ("all_gather", "reduce_scatter", "all_to_all"):
        steps, across = n - 1, nodes - 1
    elif op in ("send", "recv"):
        steps, across = 1, 1 if nodes > 1 else 0
    else:  # broadcast
        steps, across = n, nodes if nodes > 1 else 0
    if nodes > 1:
        intra = max(intra, _NCCL_NET_OVERHEAD_US * (3 if proto == "Simple" else 1))
    return (_NCCL_BASE_US[key] + (steps - across) * intra + across * inter) * 1e-6


def nccl_time(op: str, n: int, nodes: int, nbytes: float, table: BusbwTable) -> float:
    """Seconds of one call as NCCL would run it: the fastest algorithm and protocol, each
    its latency (nccl_latency_s) plus the bytes over its share of `table`'s busbw (a
    ring's bytes by nccl-tests' bus factor; a tree's all-reduce moves 2x the bytes at
    its busbw, tuning.cc's ratio of 0.5). Left out of tuning.cc: the trees' correction
    factors at medium sizes and the ring's latency plateau across nodes."""
    size = max(nbytes, table.sizes[0])
    busbw = table.at(size)
    algos = ("ring", "tree") if op == "all_reduce" else ("ring",)
    return min(
        nccl_latency_s(op, n, nodes, a, p)
        + size
        * (factor(op, n) if a == "ring" else 2.0)
        / (busbw * _nccl_busbw_share(a, p, op, n, nodes))
        for a in algos
        for p in ("LL", "LL128", "Simple")
    )


@dataclass(frozen=True)
class Fabric:
    """A source of collective times: `time(op, n, nbytes)` seconds per call."""

    name: str
    source: str  # where the numbers come from, for the report
    tables: dict  # level, (op curve, n), or a group's (op curve, n, world, stride) -> BusbwTable
    gpus_per_node: int = 0  # two-level profiles: ranks within a node
    # a two-level profile's latency: NCCL's model (nccl_time), or its tables' own
    nccl_latency: bool = False

    def of_nodes(self, gpus_per_node: int) -> Fabric:
        """This two-level profile with nodes of `gpus_per_node` GPUs: its links, a NIC
        a GPU as its nodes have, so a node's share of the network scales with its GPUs
        (its `inter` table is a whole node's)."""
        if not self.gpus_per_node or gpus_per_node == self.gpus_per_node:
            return self
        k = gpus_per_node / self.gpus_per_node
        t = self.tables["inter"]
        inter = BusbwTable(t.sizes, tuple(b * k for b in t.busbw), t.latency_s)
        return replace(
            self,
            name=f"{self.name} ({gpus_per_node} GPUs a node)",
            source=f"{self.source}; nodes of {gpus_per_node} GPUs, a NIC each",
            tables={**self.tables, "inter": inter},
            gpus_per_node=gpus_per_node,
        )

    def time(
        self, op: str, n: int, nbytes: float, span: int | None = None, world: int | None = None
    ) -> float:
        """Seconds of one call of `op` over `n` ranks; `span`: the consecutive ranks
        the group covers (n, unless a mesh dimension inside it spreads it: tp 8 inside
        puts a dp group of 8 on eight nodes), which decides a two-level profile's level;
        `world`: the ranks of the layout, whose groups of n call at once, placed span / n
        apart, as curves measured so are read (the collectives benchmark's groups)."""
        if n < 2 or not nbytes:
            return 0.0
        if self.gpus_per_node:
            span = span or n
            if span <= self.gpus_per_node:
                return self._level(op, n, 1, nbytes, self.tables["intra"])
            # The inter-node level is a whole node's: every GPU's NIC carries its share.
            # A group with fewer ranks per node (one, with tp 8 inside) drives only its
            # own ranks' NICs: that share of the bandwidth.
            per_node = min(self.gpus_per_node, max(1, n // math.ceil(span / self.gpus_per_node)))
            t = self.tables["inter"]
            share = per_node / self.gpus_per_node
            if share < 1:
                t = BusbwTable(t.sizes, tuple(b * share for b in t.busbw), t.latency_s)
            return self._level(op, n, max(1, n // per_node), nbytes, t)
        if "any" in self.tables:  # one table for every op (nccl-tests)
            return self.tables["any"].time(op, n, nbytes)
        curve = OPS[op].curve if op in OPS else "send_recv"
        placed = (curve, n, world, max(1, (span or n) // n))
        if world and world > n and placed in self.tables:
            return self.tables[placed].time(op, n, nbytes)
        counts = sorted(k[1] for k in self.tables if k[0] == curve and len(k) == 2)
        if not counts:
            return float("nan")
        # the measured count itself, or the largest one below n (else the smallest)
        below = [c for c in counts if c <= n]
        return self.tables[(curve, below[-1] if below else counts[0])].time(op, n, nbytes)

    def _level(self, op: str, n: int, nodes: int, nbytes: float, table: BusbwTable) -> float:
        if self.nccl_latency:
            return nccl_time(op, n, nodes, nbytes, table)
        return table.time(op, n, nbytes)


def from_curves(curves: pd.DataFrame, label: str = "this machine") -> Fabric:
    """The collectives benchmark's curves (collectives.csv's columns), those between
    ranks: a one-rank benchmark (one GPU's NCCL path) moves nothing between devices."""
    if not curves.empty:
        curves = curves[curves["devices"] > 1]
    if curves.empty:
        raise FabricError("no collective curves were measured (collectives.csv is empty)")
    tables = {}
    curves = curves.assign(  # an earlier run's, without groups: whole worlds
        world=curves["world"].fillna(curves["devices"]) if "world" in curves else curves["devices"],
        stride=curves["stride"].fillna(1) if "stride" in curves else 1,
    )
    for (op, n, world, stride), c in curves.groupby(["op", "devices", "world", "stride"]):
        c = c.sort_values("bytes")
        busbw = [float(b) * 1e9 for b in c["busbw_GBps"]]
        if min(busbw) <= 0:
            continue
        # the measured times at this n, exactly: latency folded into busbw, none added
        sizes = tuple(float(b) for b in c["bytes"])
        # a group's curve (run.collectives' placements) apart from the whole world's
        key = (op, int(n)) if world == n else (op, int(n), int(world), int(stride))
        tables[key] = BusbwTable(sizes, tuple(busbw), 0.0)
    if not tables:
        raise FabricError("collectives.csv has no curve with a positive bus bandwidth")
    backend = ", ".join(sorted({str(b) for b in curves["backend"]})) if "backend" in curves else "?"
    # the whole worlds measured (a group's pairs inside a world of 4 are not a world of 2)
    whole = curves[curves["world"] == curves["devices"]]
    counts = sorted({int(n) for n in (whole if not whole.empty else curves)["devices"]})
    groups = any(len(k) == 4 for k in tables)
    return Fabric(
        "curves",
        f"{label}'s collectives benchmark ({backend}, measured at n = "
        f"{', '.join(map(str, counts))}; beyond {counts[-1]} its busbw, held constant"
        + ("; a layout's groups as its ranks are placed, where measured" if groups else "")
        + ")",
        tables,
    )


_ROW = re.compile(r"^\s*\d+\s+\d+\s+\S+\s+\S+\s+-?\d+\s")
_RANK = re.compile(r"^#\s+Rank\s+\d+")
# The test's name, e.g. all_reduce_perf: a word ending in _perf. It starts where a word
# starts (the lookbehind) and ends at its first _perf (lazy), so the search is linear in
# the line: a greedy `(\w+)_perf` retries every start inside a long word, its square.
_TEST = re.compile(r"(?<!\w)(\w+?)_perf")
# nccl-tests' lines are under 200 characters; a longer one is read only this far.
MAX_LINE = 4096


def _lines(path: Path):
    """(number, text, whole) of each line of a file, read in pieces of at most
    MAX_LINE characters: `text` is the line's first MAX_LINE characters, `whole` whether
    that is all of it. The rest of a longer line is read and dropped, so a file costs
    its length once, in time and never in memory, whatever its lines."""
    with open(path, errors="replace") as f:
        for number, head in enumerate(iter(lambda: f.readline(MAX_LINE), ""), 1):
            whole = head.endswith("\n") or len(head) < MAX_LINE
            tail = head
            while not tail.endswith("\n") and len(tail) == MAX_LINE:
                tail = f.readline(MAX_LINE)
            yield number, head.rstrip("\r\n"), whole


def parse_nccl_tests(path: Path) -> Fabric:
    """An nccl-tests output file (the text `all_reduce_perf -b 8 -e 8G -f 2` prints).
    Its rows are `size count type redop root time algbw busbw #wrong` out of place,
    then the same in place; the ranks are its `#  Rank` lines. Refused, with the line,
    when a row does not read, a busbw is not positive, or a size repeats. Read line by
    line in time linear in the file's size, whatever its content (`_lines`)."""
    ranks, test = 0, None
    sizes, busbw = [], []
    for i, line, whole in _lines(path):
        if test is None and (found := _TEST.search(line)):
            test = found.group(1)
        if line.lstrip().startswith("#"):
            ranks += bool(_RANK.match(line))
            continue
        if not line.strip() or "NCCL INFO" in line:
            continue
        if not whole or not _ROW.match(line):
            raise FabricError(
                f"{path}:{i}: not an nccl-tests result row (size count type redop root "
                f"time algbw busbw #wrong ...): {line.strip()[:80]!r}"
            )
        cols = line.split()
        try:
            size, bw = int(cols[0]), float(cols[7])
            float(cols[5])  # the time: a row whose time is not a number is not a row
        except (ValueError, IndexError):
            raise FabricError(f"{path}:{i}: size, time or busbw is not a number") from None
        if sizes and size <= sizes[-1]:
            raise FabricError(f"{path}:{i}: size {size} after {sizes[-1]}: sizes must grow")
        if bw > 0:  # the smallest sizes round to 0.00 GB/s: their time still counts
            sizes.append(size)
            busbw.append(bw * 1e9)
    if len(sizes) < 2:
        raise FabricError(
            f"{path}: fewer than two result rows with a positive busbw: not the output of "
            "an nccl-tests *_perf run (e.g. all_reduce_perf -b 8 -e 1G -f 2)"
        )
    if ranks < 2:
        raise FabricError(
            f"{path}: {ranks} '#  Rank' line(s): a bandwidth needs at least two ranks "
            "(nccl-tests lists each under '# Using devices')"
        )
    what = f"{test}_perf" if test else "nccl-tests"
    return Fabric(
        "nccl-tests",
        f"{Path(path).name}: {what} at {ranks} ranks, busbw {min(busbw) / 1e9:.1f} to "
        f"{max(busbw) / 1e9:.1f} GB/s",
        # latency is in every row's time already (busbw = size x factor / time): none added
        {"any": BusbwTable(tuple(sizes), tuple(busbw), 0.0)},
    )


def level(busbw_gbps: float) -> BusbwTable:
    """One level of a profile: a bus bandwidth (GB/s) at every size; its latency is
    NCCL's model's (nccl_time)."""
    return BusbwTable((1.0, 2.0), (busbw_gbps * 1e9,) * 2, 0.0)


# Named profiles: two levels, each from published figures (the sources say which).
PROFILES: dict[str, Fabric] = {
    "h100-nvlink-ndr400": Fabric(
        "h100-nvlink-ndr400",
        "8x H100 SXM per node over NVLink 4, nodes over InfiniBand NDR 400 Gb/s per GPU: "
        "busbw 460 GB/s within a node (nccl-tests all_reduce_perf on 8x H100 SXM5: "
        "460-480 GB/s at large sizes), 400 GB/s across nodes for a group of whole nodes "
        "(eight NICs of 400 Gb/s = 50 GB/s each; H100 SXM with NVLink and IB NDR: "
        "400-450 GB/s), a group with k ranks per node k x 50 GB/s; latency by NCCL's own "
        "model (tuning.cc: ring and tree, per step over NVLink and the network)",
        {"intra": level(460), "inter": level(400)},
        gpus_per_node=8,
        nccl_latency=True,
    ),
    "a100-nvlink-hdr200": Fabric(
        "a100-nvlink-hdr200",
        "8x A100 SXM4 per node over NVLink 3, nodes over InfiniBand HDR 200 Gb/s per GPU: "
        "busbw 230 GB/s within a node (nccl-tests: 230-250 GB/s), 185 GB/s across nodes "
        "(about 8 x 25 GB/s less protocol overhead; a group with k ranks per node k/8 of it), "
        "latency by NCCL's own model (tuning.cc)",
        {"intra": level(230), "inter": level(185)},
        gpus_per_node=8,
        nccl_latency=True,
    ),
}


# HGX H200 has H100 SXM's links (NVIDIA's H200 datasheet: NVLink 900 GB/s, as H100
# SXM's; a 400 Gb/s ConnectX-7 per GPU): the same figures, not measured on H200.
PROFILES["h200-nvlink-ndr400"] = replace(
    PROFILES["h100-nvlink-ndr400"],
    name="h200-nvlink-ndr400",
    source="8x H200 SXM per node (HGX H200): the links and figures of h100-nvlink-ndr400 "
    "(NVLink 4 at 900 GB/s, InfiniBand NDR 400 Gb/s per GPU), not measured on H200. "
    + PROFILES["h100-nvlink-ndr400"].source,
)


def resolve(name_or_file: str, curves: pd.DataFrame | None = None) -> Fabric:
    """`curves`, a profile's name, or an nccl-tests output file."""
    if name_or_file == "curves":
        if curves is None:
            raise FabricError("fabric 'curves' needs the collectives benchmark's curves")
        return from_curves(curves)
    if name_or_file in PROFILES:
        return PROFILES[name_or_file]
    path = Path(name_or_file)
    if path.is_file():
        return parse_nccl_tests(path)
    raise FabricError(
        f"fabric {name_or_file!r}: neither 'curves', a named profile "
        f"({', '.join(PROFILES)}) nor an nccl-tests output file"
    )
