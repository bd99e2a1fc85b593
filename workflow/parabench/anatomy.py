"""Where a step's time goes, and what it sends: read from a rank's profiled steps.

Torch-free: pure functions over what profiling.py recorded (Chrome trace events and
marks.Region figures), so a trace kept beside a cell can be read again anywhere.

Each profiled step (`parabench.step`) is split into parts that never overlap and sum to
it, with nothing estimated and nothing subtracted:

- data: batch fetch (`parabench.data`, DataLoader mode) and host-to-device copies;
- compute: forward, backward and the update;
- comm_exposed: communication the rank waited for (compute did not hide it);
- bubble: for strategies whose stages run on ranks of their own (a pipeline), the
  time a stage waited for its neighbour, its transfers included;
- other: the rest (Python between regions, zero_grad, launch overhead).

On CUDA the critical timeline is the GPU's streams (the host runs ahead): compute is
the kernels that are not communication, exposed communication the NCCL kernels while
no compute kernel ran, bubble (pipelines) a receive no compute overlapped.

On CPU it is the main thread, whose work the regions (marks.py) bracket: forward,
backward, optimizer (a pipeline's schedule). Within them, by the kernel's accounting
(perf's task clock, schedstat's run delay), the thread ran on a core, waited for a core
(runq), or was blocked. Blocked,
it waited for a collective or a neighbour. Waiting for a core, it took turns with the
other threads bound there: with the k - 1 ranks that share its core (k = ranks per core,
from the binding), which is compute's own cost on this machine, up to (k - 1) times its
own time on the core and never more than those ranks' main threads ran on it in the
step (`sharing`, gathered from them: a pipeline stage's neighbour on its core idles in
its bubble); beyond that, with communication's threads (gloo's), which is
communication's cost. What the rank waited for communication is that, blocked plus
contention, plus its time on its core in the collectives' own calls (launching a
collective; on gloo, the copies and bookkeeping before gloo's threads take over; the
no-communication group's calls copy into their outputs too, time its step keeps): the
`launch` regions a strategy marks around them (FSDP's), or, in a trace of every op,
c10d's ops on the main thread. A collective called where no mark reaches it (DDP's
reducer, in C++) is compute's. Never more than the time communication was under way
(collectives' spans, and torch's own ranges around them: FSDP's gathers and
reductions); blocked beyond it, the thread waited for its own intra-op threads. Compute
is the regions' time less that wait: work the main thread does around communication
(FSDP's copies into and out of its buffers) is compute, as it is in the
no-communication step it is checked against.

comm is every collective's and send/recv's own time (union over threads or streams),
hidden or not. Communication volume is counted from the c10d ops the counted step
records, with their tensor shapes: one per collective issued.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

from parabench.ops import BY_C10D

STEP_MARK = "parabench.step"
DATA_MARK = "parabench.data"
COMPUTE_REGIONS = ("forward", "backward", "optimizer", "schedule")  # marks.COMPUTE
LAUNCH_REGION = "launch"  # marks.LAUNCH: a collective's call, within those
LAUNCH_MARK = "parabench.launch"

# Communication's own spans, on the thread or stream that ran it: gloo's and NCCL's
# work, functional collectives, NCCL kernels.
_C10D = r"c10d::|_c10d_functional::|c10d_functional::"
_COMM = re.compile(rf"^(gloo:|nccl:|{_C10D}|record_param_comms|ncclDevKernel|ncclKernel)")
# torch's own ranges around communication on the main thread (FSDP's all-gathers, their
# waits and its reduce-scatters): communication is under way while they last.
_COMM_RANGE = re.compile(r"^(FSDP::all_gather \(|FSDP::post_backward_reduce|FSDP::.*wait)")
# The collectives' own calls on the main thread (not their waits): launching them.
_LAUNCH = re.compile(rf"^({_C10D})(?!.*wait)")
_RECV = re.compile(r"^(ncclDevKernel_SendRecv|ncclKernel_SendRecv)")
_H2D = re.compile(r"Memcpy HtoD|memcpy.*HtoD", re.I)
_ELEMENT = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4}
PARTS = ("compute_s", "comm_exposed_s", "bubble_s", "data_s", "other_s")


Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def subtract(xs: list[Interval], ys: list[Interval]) -> list[Interval]:
    """xs minus ys, both unions (sorted, disjoint)."""
    out, j = [], 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k, start = j, a
        while k < len(ys) and ys[k][0] < b:
            if ys[k][0] > start:
                out.append((start, ys[k][0]))
            start = max(start, ys[k][1])
            k += 1
        if start < b:
            out.append((start, b))
    return out


def clip(xs: list[Interval], lo: float, hi: float) -> list[Interval]:
    return [(max(a, lo), min(b, hi)) for a, b in xs if b > lo and a < hi]


def length(xs: list[Interval]) -> float:
    return sum(b - a for a, b in xs)


def _span(e: dict) -> Interval:
    return (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))


def _is_device(e: dict) -> bool:
    return e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")


def step_windows(events: list[dict]) -> tuple[list[Interval], object]:
    """The profiled steps' spans, and the thread that ran them (the main thread)."""
    steps = [e for e in events if e.get("ph") == "X" and e.get("name") == STEP_MARK]
    steps = [e for e in steps if e.get("cat") != "gpu_user_annotation"]
    return [_span(e) for e in steps], (steps[0]["tid"] if steps else None)


def anatomy(
    events: list[dict],
    regions: list[list[dict]],
    pipelined: bool = False,
    ranks_per_core: float = 1.0,
    mates: list[float] | None = None,
) -> list[dict[str, float]]:
    """Seconds of each part of each profiled step, plus `step_s` (their sum: the
    profiled step) and `comm_s`. `regions`: per profiled step, in order, the marked
    regions with the main thread's figures (marks.Region.as_dict); `ranks_per_core`:
    how many ranks take turns on each of this rank's cores; `mates`: per profiled step,
    the seconds the main threads of the ranks sharing them ran (on_core; None: no
    bound but k)."""
    windows, main = step_windows(events)
    if not windows:
        return []
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    device = [e for e in spans if _is_device(e)]
    comm = union(_span(e) for e in spans if _COMM.match(e["name"]))
    data = union(
        [_span(e) for e in spans if e["name"] == DATA_MARK]
        + [_span(e) for e in device if _H2D.search(e["name"])]
    )
    if any(e.get("cat") == "kernel" for e in device):
        return [_on_gpu(device, comm, data, pipelined, w) for w in windows]
    mine = [e for e in spans if e.get("tid") == main]
    ranges = union(_span(e) for e in mine if _COMM_RANGE.match(e["name"]))
    # c10d's calls a full trace records, less those inside a marked launch (counted by
    # the region's own figures)
    marked = union(_span(e) for e in mine if e["name"] == LAUNCH_MARK)
    launch = subtract(union(_span(e) for e in mine if _LAUNCH.match(e["name"])), marked)
    mates = mates if mates is not None else [float("inf")] * len(regions)
    return [
        _on_cpu(step_regions, comm, data, ranges, launch, pipelined, ranks_per_core, mate, w)
        for step_regions, mate, w in zip(regions, mates, windows, strict=False)
    ]


def _parts(step_s: float, **parts: float) -> dict[str, float]:
    """The parts in seconds (trace times are µs), `other_s` what they leave."""
    out = {k: parts.get(k, 0.0) / 1e6 for k in (*PARTS, "comm_s") if k != "other_s"}
    out["step_s"] = step_s / 1e6
    out["other_s"] = max(0.0, out["step_s"] - sum(out[k] for k in PARTS if k != "other_s"))
    return out


def _on_gpu(device, comm, data, pipelined: bool, window: Interval) -> dict[str, float]:
    lo, hi = window
    busy = union(
        _span(e) for e in device if e.get("cat") == "kernel" and not _COMM.match(e["name"])
    )
    compute = subtract(busy, data)
    taken = union(data + compute)
    recv = [_span(e) for e in device if _RECV.match(e["name"])]
    bubble = subtract(union(recv), taken) if pipelined else []
    exposed = subtract(comm, union(taken + bubble))
    return _parts(
        hi - lo,
        data_s=length(clip(data, lo, hi)),
        compute_s=length(clip(compute, lo, hi)),
        bubble_s=length(clip(bubble, lo, hi)),
        comm_exposed_s=length(clip(exposed, lo, hi)),
        comm_s=length(clip(comm, lo, hi)),
    )


def _on_cpu(
    regions,
    comm,
    data,
    ranges,
    launch,
    pipelined: bool,
    ranks_per_core: float,
    mates: float,
    window: Interval,
) -> dict[str, float]:
    """One step on the main thread (see the module's docstring); region figures are
    seconds, the trace's µs."""
    lo, hi = window
    step = _step_region(regions)
    if step is None:  # a step recorded without its figures: wall only
        return _parts(hi - lo, data_s=length(clip(data, lo, hi)), comm_s=length(clip(comm, lo, hi)))
    work = [r for r in regions if r["name"] in COMPUTE_REGIONS]
    wall = sum(r["wall_s"] for r in work)
    on_core = sum(r["cpu_s"] for r in work)
    runq = sum(r["runq_s"] for r in work)
    blocked = sum(_blocked(r) for r in work)
    turns = min((ranks_per_core - 1) * on_core, mates)  # the ranks sharing its cores
    contention = max(0.0, runq - turns)  # communication's threads
    # blocked outside the regions (between them) is waiting too; launches are within
    # them, already counted
    outer = [r for r in regions if r is not step and r["name"] != LAUNCH_REGION]
    outside = max(0.0, _blocked(step) - sum(_blocked(r) for r in outer))
    # Only while communication was under way can the thread have waited for it (or for
    # a neighbour's send): blocked beyond that, it waited for its own intra-op threads,
    # which is part of computing.
    during = length(clip(union(comm + ranges), lo, hi)) / 1e6
    # In the collectives' own calls it communicated: the marked ones' time on its core
    # (blocked or kept from it there is already counted), and any other c10d call a
    # full trace has (what it was blocked there is then counted twice: microseconds a
    # call).
    marked = sum(r["cpu_s"] for r in regions if r["name"] == LAUNCH_REGION)
    calls = marked + length(clip(launch, lo, hi)) / 1e6
    waited = min(wall, blocked + contention + calls, during)
    wait = (waited + min(outside, during - waited)) * 1e6
    compute = (wall - waited) * 1e6
    wall = step["wall_s"] * 1e6
    return _parts(
        wall,
        data_s=length(clip(data, lo, hi)),
        compute_s=compute,
        bubble_s=wait if pipelined else 0.0,
        comm_exposed_s=0.0 if pipelined else wait,
        comm_s=length(clip(comm, lo, hi)),
    )


def _step_region(regions: list[dict]) -> dict | None:
    """A profiled step's own region (the whole step), the last recorded."""
    return next((r for r in reversed(regions) if r["name"] == "step"), None)


def on_core(regions: list[list[dict]]) -> list[float]:
    """Per profiled step, the seconds the main thread ran on a core in its step."""
    steps = [_step_region(s) for s in regions]
    return [step["cpu_s"] if step else 0.0 for step in steps]


def work(parts) -> float:
    """What a step's anatomy says was not waiting: compute + data + other."""
    return parts["compute_s"] + parts["data_s"] + parts["other_s"]


def sharing(me: int, cores: list[list], ran: list[list[float]]) -> tuple[int, list[float]]:
    """The ranks taking turns on rank `me`'s cores, itself included (its own k: a host's
    ranks may share unevenly), and per profiled step how long the main threads of the
    others ran (`cores`: every rank's, as (host, core); `ran`: every rank's on_core)."""
    mine = set(cores[me])
    others = [r for r in range(len(cores)) if r != me and mine & set(cores[r])]
    steps = range(min(len(x) for x in ran))
    return 1 + len(others), [sum(ran[r][i] for r in others) for i in steps]


def _blocked(region: dict) -> float:
    return max(0.0, region["wall_s"] - region["cpu_s"] - region["runq_s"])


def critical_steps(per_rank: list[list[dict]], pipelined: bool = False) -> list[dict]:
    """Per profiled step, the straggler's parts stretched to the slowest rank's step:
    the rank that computed most (compute + data; in a pipeline, the bottleneck stage),
    the one every other rank waits for, over the slowest rank's step (a step lasts as
    long as its slowest rank, as in steps.csv). Where the straggler's own step is
    shorter, it started later or ended sooner than the slowest rank, who waited: the
    difference is waiting, for other ranks at a collective (comm_exposed_s) or, in a
    pipeline, for a neighbour (bubble_s). The slowest rank's own parts would say its
    compute is the step's: but it is often the one that started first and waited
    longest. With several points where ranks meet (FSDP's gathers, tensor parallel's
    reductions), a different rank may be the last to arrive at each: one rank's parts
    are then a lower bound on the compute the step waited for."""
    ranks = [r for r in per_rank if r]
    if not ranks:
        return []
    waiting = "bubble_s" if pipelined else "comm_exposed_s"
    out = []
    for i in range(min(len(r) for r in ranks)):
        at = [r[i] for r in ranks]
        part = dict(max(at, key=lambda p: p["compute_s"] + p["data_s"]))
        slowest = max(p["step_s"] for p in at)
        part[waiting] = part.get(waiting, 0.0) + slowest - part["step_s"]
        part["step_s"] = slowest
        out.append(part)
    return out


def critical(per_rank: list[list[dict]], pipelined: bool = False) -> dict:
    """The anatomy to set beside the recorded step: the central half of the critical
    steps (critical_steps) by step time, averaged part by part (the interquartile
    mean), so the parts still sum to its step (a median of each part would not) and
    one step a neighbour slowed, or an odd one, moves it little. Of fewer than four
    steps, the median step (of two, both averaged)."""
    ordered = sorted(critical_steps(per_rank, pipelined), key=lambda p: p["step_s"])
    if not ordered:
        return {}
    cut = len(ordered) // 4 if len(ordered) >= 4 else (len(ordered) - 1) // 2
    middle = ordered[cut : len(ordered) - cut]
    return {k: sum(p[k] for p in middle) / len(middle) for k in middle[0]}


def _numel(dims) -> int:
    if not dims:
        return 0
    if isinstance(dims[0], list):  # a TensorList: its tensors' sizes
        return sum(_numel(d) for d in dims)
    n = 1
    for d in dims:
        n *= int(d)
    return n


def volume(events: list[dict], list_element_bytes: int = 4) -> dict[str, dict[str, float]]:
    """Collectives issued and bytes handed to them, per op, per profiled step, each
    once (a functional collective runs its c10d op inside its own span). Sizes
    follow nccl-tests: the full buffer (for all-gather the gathered output, for
    reduce-scatter the input to reduce). A TensorList's dtype is not in the trace:
    its elements are `list_element_bytes` each (the caller knows what it sends)."""
    windows, main = step_windows(events)
    if not windows:
        return {}
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0.0, "bytes": 0.0})
    issued = sorted(
        (
            e
            for e in events
            if e.get("ph") == "X" and e.get("tid") == main and e.get("name") in BY_C10D
        ),
        key=lambda e: (float(e["ts"]), -float(e.get("dur", 0))),
    )
    end = float("-inf")
    for e in issued:
        t = float(e["ts"])
        if t < end:  # inside one counted already (a functional collective's c10d op)
            continue
        end = t + float(e.get("dur", 0))
        op = BY_C10D[e["name"]]
        if not any(lo <= t <= hi for lo, hi in windows):
            continue
        args = e.get("args", {})
        dims, types = args.get("Input Dims", []), args.get("Input type", [])
        tensors = [(d, ty) for d, ty in zip(dims, types, strict=False) if ty and ty != "Scalar"]
        if not tensors:
            continue
        sizes = []
        for d, ty in tensors[:2]:  # (output, input) or (tensors,): the buffers it moves
            each = list_element_bytes if ty == "TensorList" else _ELEMENT.get(ty, 4)
            sizes.append(_numel(d) * each)
        out[op.name]["count"] += 1 / len(windows)
        out[op.name]["bytes"] += max(sizes) / len(windows)
    return {k: dict(v) for k, v in out.items()}
