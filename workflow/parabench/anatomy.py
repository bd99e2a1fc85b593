"""Where a step's time goes, and what it sends: read from a rank's profiler trace.

Torch-free: pure functions over Chrome trace events (what `torch.profiler` exports), so
a trace kept beside a cell can be read again anywhere.

The critical timeline is where the step's work waits on itself: the main thread on CPU
(gloo runs collectives on its own threads, so the main thread idles while it waits for
one), the GPU streams on CUDA (the host runs ahead). Within each profiled step
(`parabench.step`) time is attributed, in this order, each part taking only time no
earlier part took, so the parts never overlap and sum to the profiled step:

- data: batch fetch (`parabench.data`, DataLoader mode) and host-to-device copies;
- compute: forward, backward and optimizer (every op on the critical timeline that is
  not communication or a wait for it);
- bubble: a pipeline stage idle, waiting to receive from a neighbour (for strategies
  that cut the model; elsewhere a wait on a receive is communication);
- comm_exposed: communication that compute did not hide (any collective or send/recv,
  on any thread or stream, while the critical timeline did nothing else);
- other: the rest (Python, launch overhead, waits on nothing we can name).

The profiler's own cost is not the step's. `profiler_s`, what it adds to a step, is
measured by the caller (profiling.profiler_cost) and taken out of the parts where the
profiler's work lands, shared by the events it records there: an event inside another
op's span lengthens that op (compute); the others lengthen the gaps between ops (other).
On GPU the host's work only stretches the streams' idle gaps (other). The parts then sum
to the profiled step less `profiler_s`: what the step takes when nobody watches.

comm is every collective's and send/recv's own time (union over threads or streams),
hidden or not. Communication volume is counted from the c10d ops the trace records,
with their tensor shapes: one per collective issued.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

from parabench.ops import BY_C10D

STEP_MARK = "parabench.step"
DATA_MARK = "parabench.data"

# Communication and waits for it, on any thread: gloo's own ops, the c10d dispatcher
# ops, functional collectives (DTensor), FSDP2's waits for its gathers and reductions,
# NCCL kernels.
_COMM = re.compile(
    r"^(gloo:|c10d::|_c10d_functional::|c10d_functional::|record_param_comms|"
    r"FSDP::all_gather \(|FSDP::.*wait|nccl|ncclDevKernel|ncclKernel)"
)
_RECV = re.compile(r"^(gloo:recv|c10d::recv|ncclDevKernel_SendRecv|ncclKernel_SendRecv)")
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
    events: list[dict], cuts_model: bool = False, profiler_s: float = 0.0
) -> list[dict[str, float]]:
    """Seconds of each part of each profiled step, plus `step_s` (their sum: the
    profiled step less `profiler_s`, what the profiler added to it) and `comm_s`."""
    windows, main = step_windows(events)
    if not windows:
        return []
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    device = [e for e in spans if _is_device(e)]
    on_gpu = any(e.get("cat") == "kernel" for e in device)
    comm = union(_span(e) for e in spans if _COMM.match(e["name"]))
    data = union(
        [_span(e) for e in spans if e["name"] == DATA_MARK]
        + [_span(e) for e in device if _H2D.search(e["name"])]
    )
    if on_gpu:  # the streams are the critical timeline; the host queues ahead
        busy = [_span(e) for e in device if e.get("cat") == "kernel" and not _COMM.match(e["name"])]
        recv = [_span(e) for e in device if _RECV.match(e["name"])]
    else:
        main_ops = [e for e in spans if e.get("tid") == main and e.get("cat") == "cpu_op"]
        busy = [_span(e) for e in main_ops if not _COMM.match(e["name"])]
        recv = [_span(e) for e in spans if e.get("tid") == main and _RECV.match(e["name"])]
        # an op that merely waits on communication is not compute
        busy = subtract(union(busy), comm_on_main(spans, main))
    compute = subtract(union(busy), data)
    taken = union(data + compute)
    bubble = subtract(union(recv), taken) if cuts_model else []
    taken = union(taken + bubble)
    exposed = subtract(comm, taken)
    # the main thread's recorded events, outermost first where two start together
    recorded_main = sorted(
        (_span(e) for e in spans if e.get("tid") == main and e["name"] != STEP_MARK),
        key=lambda s: (s[0], -s[1]),
    )
    per_step = []
    for lo, hi in windows:
        parts = {
            "data_s": length(clip(data, lo, hi)),
            "compute_s": length(clip(compute, lo, hi)),
            "bubble_s": length(clip(bubble, lo, hi)),
            "comm_exposed_s": length(clip(exposed, lo, hi)),
            "comm_s": length(clip(comm, lo, hi)),
        }
        parts["other_s"] = max(0.0, (hi - lo) - sum(parts[k] for k in PARTS if k != "other_s"))
        parts["step_s"] = hi - lo
        outer, inner = nesting(recorded_main, lo, hi)
        cost = profiler_s * 1e6  # µs, as the trace
        in_ops = 0.0 if on_gpu or not outer + inner else cost * inner / (outer + inner)
        within = min(parts["compute_s"], in_ops)
        gaps = min(parts["other_s"], cost - within)
        if not on_gpu:  # what the gaps could not hold lengthened the ops
            within = min(parts["compute_s"], cost - gaps)
        parts["other_s"] -= gaps
        parts["compute_s"] -= within
        parts["profiler_s"] = gaps + within
        parts["step_s"] -= gaps + within  # the parts' sum: the step, unwatched
        per_step.append({k: v / 1e6 for k, v in parts.items()})  # trace times are µs
    return per_step


def nesting(events: list[Interval], lo: float, hi: float) -> tuple[int, int]:
    """Of the events (sorted by start, outermost first) starting within [lo, hi]: those
    not inside another (outer) and those inside one (inner)."""
    outer = inner = 0
    end = float("-inf")
    for a, b in events:
        if not lo <= a <= hi:
            continue
        if a < end:
            inner += 1
        else:
            outer += 1
            end = b
    return outer, inner


def critical(per_rank: list[list[dict]]) -> dict:
    """The anatomy to set beside the recorded step: per profiled step the slowest rank
    (a step's time is the max over ranks, as in steps.csv), then the median of those
    steps, whole: robust to one step a neighbour slowed, and its parts still sum to it
    (a median of each part would not). Of an even number, the mean of the middle two,
    part by part, as pandas' median of the timed steps: the lower one alone read ~1%
    low."""
    # (a rank's record before per-step lists held one step: read as a list of one)
    ranks = [[r] if isinstance(r, dict) else r for r in per_rank if r]
    if not ranks:
        return {}
    steps = min(len(r) for r in ranks)
    slowest = [max((r[i] for r in ranks), key=lambda p: p["step_s"]) for i in range(steps)]
    ordered = sorted(slowest, key=lambda p: p["step_s"])
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    a, b = ordered[mid - 1], ordered[mid]
    return {k: (a[k] + b[k]) / 2 for k in a.keys() & b.keys()}


def comm_on_main(spans: list[dict], main) -> list[Interval]:
    return union(_span(e) for e in spans if e.get("tid") == main and _COMM.match(e["name"]))


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
    """Collectives issued and bytes handed to them, per op, per profiled step. Sizes
    follow nccl-tests: the full buffer (for all-gather the gathered output, for
    reduce-scatter the input to reduce). A TensorList's dtype is not in the trace:
    its elements are `list_element_bytes` each (the caller knows what it sends)."""
    windows, main = step_windows(events)
    if not windows:
        return {}
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0.0, "bytes": 0.0})
    for e in events:
        op = BY_C10D.get(e.get("name", ""))
        if op is None or e.get("ph") != "X" or e.get("tid") != main:
            continue
        t = float(e["ts"])
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
