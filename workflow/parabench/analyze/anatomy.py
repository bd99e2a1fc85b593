"""Where a step's time goes, and what it sends: read from a rank's profiled steps.

Torch-free: pure functions over what run/profiling.py recorded (Chrome trace events and
marks.Region figures), so a trace kept beside a cell can be read again anywhere.

Each profiled step (`parabench.step`) is split into parts that never overlap and sum to
it, with nothing estimated and nothing subtracted:

- data: batch fetch (`parabench.process.data`, DataLoader mode) and host-to-device copies (on
  CUDA, those no compute kernel ran beside: a prefetched copy is hidden);
- compute: forward, backward and the update;
- comm_exposed: communication the rank waited for (compute did not hide it);
- bubble: for strategies whose stages run on ranks of their own (a pipeline), the
  time a stage waited for its neighbour, its transfers included;
- other: the rest (Python between regions, zero_grad, launch overhead).

On CUDA the critical timeline is the GPU's streams (the host runs ahead): compute is
the kernels that are not communication, exposed communication the NCCL kernels while
no compute kernel ran, bubble (pipelines) a receive no compute overlapped. NCCL's
kernels are named as Holistic Trace Analysis names them (`nccl...Kernel`, every NCCL
generation's), and only they are communication there: the host's calls that launched
them ran before the GPU did the work. A CUDA step with no kernel in its trace (CUPTI
recorded nothing) has no parts, only its length: the CPU formulas would read the host's
launches as compute (NO_KERNEL says why).

On CPU it is the main thread, whose work the regions (process/marks.py) bracket: forward,
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

comm is every collective's and send/recv's own time (union over threads, or on CUDA
over streams), hidden or not. Communication volume is counted from the c10d ops the
counted step records on any host thread, with their tensor shapes: one per collective
issued (on CUDA, autograd runs backward, and the collectives its hooks issue, on a
thread of its own).

A trace from elsewhere (Kineto's, `torch.profiler` with a schedule) marks its steps
`ProfilerStep#N`: `step_mark=PROFILER_STEP` reads those. They are the host's ranges,
so the device's work is read within them: right where each step ends synchronized, as
ours do.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable

from parabench.ops import BY_C10D

STEP_MARK = "parabench.step"
# The steps torch.profiler marks (`prof.step()`), for a trace parabench did not record.
PROFILER_STEP = re.compile(r"ProfilerStep#\d+")
DATA_MARK = "parabench.process.data"
COMPUTE_REGIONS = ("forward", "backward", "optimizer", "schedule")  # marks.COMPUTE
LAUNCH_REGION = "launch"  # marks.LAUNCH: a collective's call, within those
RECOMPUTE_REGION = "recompute"  # marks.RECOMPUTE: a checkpointed block's forward again
NESTED_REGIONS = (LAUNCH_REGION, RECOMPUTE_REGION)  # marks.NESTED
LAUNCH_MARK = "parabench.jobs.launch"

# Communication's own spans on a host thread: gloo's and NCCL's work, c10d's calls,
# functional collectives.
_C10D = r"c10d::|_c10d_functional::|c10d_functional::"
_COMM = re.compile(rf"^(gloo:|nccl:|{_C10D}|record_param_comms)")
# On a GPU: NCCL's kernels, by HTA's rule (hta.utils.utils.is_comm_kernel): it takes
# older NCCL's names too (ncclAllReduceRingLLKernel_sum_f32), beside ncclKernel_* and
# ncclDevKernel_*.
_COMM_KERNEL = re.compile(r"^nccl.*Kernel")
# torch's own ranges around communication on the main thread (FSDP's all-gathers, their
# waits and its reduce-scatters): communication is under way while they last.
_COMM_RANGE = re.compile(r"^(FSDP::all_gather \(|FSDP::post_backward_reduce|FSDP::.*wait)")
# The collectives' own calls on the main thread (not their waits): launching them.
_LAUNCH = re.compile(rf"^({_C10D})(?!.*wait)")
_RECV = re.compile(r"^(ncclDevKernel_SendRecv|ncclKernel_SendRecv)")
_H2D = re.compile(r"Memcpy HtoD|memcpy.*HtoD", re.I)
# Element sizes by the dtype names the profiler writes (compilers spell int64 both ways).
_ELEMENT = {
    "float": 4,
    "c10::BFloat16": 2,
    "c10::Half": 2,
    "double": 8,
    "long int": 8,
    "long": 8,
    "int": 4,
    "short int": 2,
    "short": 2,
    "unsigned char": 1,
    "signed char": 1,
    "bool": 1,
    "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1,
}
PARTS = ("compute_s", "comm_exposed_s", "bubble_s", "data_s", "other_s")
# Why a step has its length but no parts (NaN), the one way that comes about.
NO_KERNEL = "the CUDA trace holds no kernel: CUPTI recorded nothing, so no device-side anatomy"


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


def _is_step(name: object, mark: str | re.Pattern) -> bool:
    if isinstance(mark, re.Pattern):
        return isinstance(name, str) and mark.fullmatch(name) is not None
    return name == mark


def step_windows(
    events: list[dict], step_mark: str | re.Pattern = STEP_MARK
) -> tuple[list[Interval], object]:
    """The profiled steps' spans, and the thread that ran them (the main thread):
    `step_mark` names their range, or is a pattern of its names (PROFILER_STEP)."""
    steps = [e for e in events if e.get("ph") == "X" and _is_step(e.get("name"), step_mark)]
    steps = sorted((e for e in steps if not _is_device(e)), key=lambda e: float(e["ts"]))
    return [_span(e) for e in steps], (steps[0]["tid"] if steps else None)


def anatomy(
    events: list[dict],
    regions: list[list[dict]],
    pipelined: bool = False,
    ranks_per_core: float = 1.0,
    mates: list[float] | None = None,
    device_type: str = "cpu",
    step_mark: str | re.Pattern = STEP_MARK,
) -> list[dict[str, float]]:
    """Seconds of each part of each profiled step, plus `step_s` (their sum: the
    profiled step) and `comm_s`. `regions`: per profiled step, in order, the marked
    regions with the main thread's figures (marks.Region.as_dict); `ranks_per_core`:
    how many ranks take turns on each of this rank's cores; `mates`: per profiled step,
    the seconds the main threads of the ranks sharing them ran (on_core; None: no
    bound but k); `device_type`: the rank's (torch.device.type): on "cuda", or in any
    trace with kernels, the parts are the GPU's, and a step without a kernel has only
    its `step_s`, every other figure NaN (NO_KERNEL); `step_mark`: as step_windows."""
    windows, main = step_windows(events, step_mark)
    if not windows:
        return []
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    device = [e for e in spans if _is_device(e)]
    data = union(
        [_span(e) for e in spans if e["name"] == DATA_MARK]
        + [_span(e) for e in device if _H2D.search(e["name"])]
    )
    kernels = [e for e in device if e.get("cat") == "kernel"]
    if device_type == "cuda" or kernels:  # kernels: a GPU recorded them, whoever asks
        comm = union(_span(e) for e in kernels if _COMM_KERNEL.match(e["name"]))
        busy = union(_span(e) for e in kernels if not _COMM_KERNEL.match(e["name"]))
        recv = union(_span(e) for e in kernels if _RECV.match(e["name"])) if pipelined else []
        return [_on_gpu(busy, comm, recv, data, w) for w in windows]
    comm = union(_span(e) for e in spans if not _is_device(e) and _COMM.match(e["name"]))
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


def _unread(step_s: float) -> dict[str, float]:
    """A step whose parts the trace cannot tell: its length (µs), every other NaN."""
    return {**{k: math.nan for k in (*PARTS, "comm_s")}, "step_s": step_s / 1e6}


def _on_gpu(busy, comm, recv, data, window: Interval) -> dict[str, float]:
    """One step on the GPU's streams: `busy` the compute kernels, `comm` NCCL's,
    `recv` its receives where a pipeline's (else none), `data` the input's spans, all
    unions."""
    lo, hi = window
    if not clip(union(busy + comm), lo, hi):  # CUPTI recorded nothing: no device side
        return _unread(hi - lo)
    # A copy under a compute kernel was hidden by it (a prefetch): compute's time, as
    # HTA counts it; data is what the step spent copying with nothing computing.
    compute = busy
    data = subtract(data, compute)
    taken = union(data + compute)
    bubble = subtract(recv, taken)
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
    outer = [r for r in regions if r is not step and r["name"] not in NESTED_REGIONS]
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


def recompute(regions_per_rank: list[list[list[dict]]], ac: str) -> float:
    """Seconds a step spent recomputing checkpointed forwards in its backward (the
    RECOMPUTE regions' time running or runnable, not blocked): the median over
    profiled steps of the slowest rank's. 0 without activation checkpointing; NaN where
    none was recorded though blocks were checkpointed (backward ran on a thread that
    is not the main one: CUDA's autograd thread)."""
    if ac == "none":
        return 0.0
    per_step = [
        [sum(r["wall_s"] - _blocked(r) for r in s if r["name"] == RECOMPUTE_REGION) for s in rank]
        for rank in regions_per_rank
    ]
    slowest = [max(col) for col in zip(*per_step, strict=False)] if per_step else []
    if not slowest or not any(slowest):
        return math.nan
    slowest.sort()
    return slowest[len(slowest) // 2]


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
    are then a lower bound on the compute the step waited for. Where a rank's parts
    are unknown (NO_KERNEL), so is the straggler: the step keeps its length, its parts
    stay NaN."""
    ranks = [r for r in per_rank if r]
    if not ranks:
        return []
    waiting = "bubble_s" if pipelined else "comm_exposed_s"
    out = []
    for i in range(min(len(r) for r in ranks)):
        at = [r[i] for r in ranks]
        unread = [p for p in at if math.isnan(p["compute_s"])]
        part = dict(unread[0] if unread else max(at, key=lambda p: p["compute_s"] + p["data_s"]))
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


def volume(
    events: list[dict], list_element_bytes: int = 4, step_mark: str | re.Pattern = STEP_MARK
) -> dict[str, dict[str, float]]:
    """Collectives issued and bytes handed to them, per op, per profiled step, each
    once (a functional collective runs its c10d op inside its own span), whichever
    host thread issued them: on CUDA autograd's own thread issues backward's (DDP's
    bucketed all-reduces, FSDP's reduce-scatters, tensor parallel's). The ranges gloo's
    and NCCL's threads record (gloo:*, nccl:*, record_param_comms) are no c10d op: not
    counted again. Sizes follow nccl-tests: the full buffer (for all-gather the
    gathered output, for reduce-scatter the input to reduce). A TensorList's dtype is
    not in the trace: its elements are `list_element_bytes` each (the caller knows
    what it sends). `step_mark`: as step_windows."""
    windows, _ = step_windows(events, step_mark)
    if not windows:
        return {}
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0.0, "bytes": 0.0})
    issued = sorted(
        (
            e
            for e in events
            if e.get("ph") == "X" and not _is_device(e) and e.get("name") in BY_C10D
        ),
        key=lambda e: (float(e["ts"]), -float(e.get("dur", 0))),
    )
    end: dict[tuple, float] = {}  # per host thread, where its last counted op ends
    for e in issued:
        t, thread = float(e["ts"]), (e.get("pid"), e.get("tid"))
        if t < end.get(thread, float("-inf")):  # inside one counted already on its thread
            continue
        end[thread] = t + float(e.get("dur", 0))
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
