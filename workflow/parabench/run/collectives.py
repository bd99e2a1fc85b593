"""What the interconnect can carry: collective curves over message sizes, per device count.

Run as n torchrun ranks (`parabench collectives --devices n --out DIR`; n = 1 on CUDA, so
that one GPU runs NCCL's path, its rows no curve between devices), on the same
backend and devices as the cells (NCCL on GPUs, gloo on CPU). For each op and size it
times a loop of back-to-back calls after a warm-up, as nccl-tests does, TRIALS times,
and reports the median loop's mean time per call (slowest rank) and:

    algbw = bytes / time,  busbw = algbw x the op's factor (ops.py)

`bytes` is nccl-tests' size: the whole buffer (all-gather: the gathered output;
reduce-scatter: the input reduced). send/recv pairs rank 2i with 2i+1, each pair moving
`bytes` one way. The scaling model reads these curves at the sizes each strategy
really sends.

A layout's mesh dimension is a group of fewer ranks than the world, every group of it
at once, and where it sits matters (on CPU, a cell's 4 ranks on 2 cores put a TP
pair on one core, which a benchmark of 2 ranks on 2 cores never sees). So on CPU at 4
ranks and more, each group size g that divides the world is also timed as each mesh
dimension of degree g places it: g ranks `stride` apart (1: consecutive, a mesh's
innermost dimension), the world's W / g groups calling together; their rows say
`world` W and `stride` (the world's own: world = devices, stride 1).
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from parabench import records
from parabench.ops import CURVES, bus_factor

COLUMNS = (
    "op",
    "devices",
    "bytes",
    "time_s",
    "algbw_GBps",
    "busbw_GBps",
    "backend",
    "iters",
    "dtype",
    "trials",
    "world",
    "stride",
)


def _call(
    op: str, numel: int, device: torch.device, group: dist.ProcessGroup | None = None
) -> Callable[[], None]:
    """One call of `op` moving `numel` fp32 elements over `group` (None: the world),
    buffers allocated once."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    full = torch.ones(numel, device=device)
    part = torch.ones(numel // n, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "all_gather":
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        return lambda: gather(full, part, group=group)
    if op == "reduce_scatter":  # torch 2.13 renames reduce_scatter_tensor
        scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        return lambda: scatter(part, full, group=group)
    if op == "broadcast":
        return lambda: dist.broadcast(full, group=group, group_src=0)
    peer = rank ^ 1  # pairs (0,1), (2,3), ... of the group; an odd rank out waits
    if peer >= n:
        return lambda: None
    if rank % 2 == 0:
        return lambda: dist.send(full, group=group, group_dst=peer)
    return lambda: dist.recv(full, group=group, group_src=peer)


TRIALS = 5  # timed loops per op and size: the median loop's mean is reported


def time_op(
    op: str,
    nbytes: int,
    device: torch.device,
    min_time_s: float = 0.03,
    max_iters: int = 50,
    trials: int = TRIALS,
    group: dist.ProcessGroup | None = None,
) -> tuple[float, int]:
    """Seconds per call of `op` at `nbytes` over `group` (None: the world; else every
    rank calls over its own group, all groups at once): the mean over a loop of
    back-to-back calls (the slowest rank's), the median over `trials` loops; and the
    calls each loop times. Every rank runs the same number of calls: decided from the
    slowest warm-up. Why the median of loops: on a host whose cores the ranks share,
    one loop's mean moves 2-5x from run to run at small sizes (a descheduled thread
    costs a loop milliseconds), where nccl-tests' one loop on a GPU is steady."""
    n = dist.get_world_size(group)
    numel = max(n, nbytes // 4 // n * n)  # fp32, divisible by n
    call = _call(op, numel, device, group)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    call()  # warm-up: connections, buffers
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    call()
    sync()
    warm = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    dist.all_reduce(warm, op=dist.ReduceOp.MAX)
    iters = int(min(max_iters, max(3, min_time_s / max(warm.item(), 1e-7))))
    loops = []
    for _ in range(trials):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        sync()
        took = torch.tensor(
            [(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device
        )
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        loops.append(took.item())
    return statistics.median(loops), iters


def placements(world: int) -> list[tuple[int, int]]:
    """(g, stride) of every group a mesh dimension of degree g can be in a world of
    `world` ranks, 1 < g < world: g ranks `stride` apart, stride times g dividing the
    world (the degrees inside it)."""
    return [
        (g, stride)
        for g in range(2, world)
        if world % g == 0
        for stride in range(1, world // g + 1)
        if (world // g) % stride == 0
    ]


def groups_of(world: int, g: int, stride: int) -> list[list[int]]:
    """The world's ranks as groups of g, `stride` apart: blocks of g x stride ranks,
    each holding `stride` groups."""
    return [
        [start + offset + i * stride for i in range(g)]
        for start in range(0, world, g * stride)
        for offset in range(stride)
    ]


def curves(sizes: list[int], device: torch.device, ops=CURVES) -> list[dict]:
    """Every op at every size over the world, then, on CPU at 4 ranks and more, over
    each group placement (`placements`). At one rank (one GPU running NCCL's path)
    nothing moves between devices: no send/recv pair exists, and a bus bandwidth has
    no meaning (NaN); the times are what a call costs there."""
    world = dist.get_world_size()
    rows = _curves(sizes, device, ops, None, world, 1)
    # on CPU only: where ranks share cores, a group's placement decides a small
    # collective's cost; a GPU node's NVSwitch links every pair alike
    for g, stride in placements(world) if world >= 4 and device.type == "cpu" else []:
        mine = None
        for ranks in groups_of(world, g, stride):  # every rank makes every group
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
        rows += _curves(sizes, device, ops, mine, world, stride)
    return rows


def _curves(
    sizes: list[int], device: torch.device, ops, group, world: int, stride: int
) -> list[dict]:
    n = dist.get_world_size(group)
    rows = []
    for op in ops if n > 1 else [op for op in ops if op != "send_recv"]:
        for nbytes in sizes:
            t, iters = time_op(op, nbytes, device, group=group)
            numel = max(n, nbytes // 4 // n * n)
            size = numel * 4
            algbw = size / t / 1e9
            rows.append(
                {
                    "op": op,
                    "devices": n,
                    "bytes": size,
                    "time_s": t,
                    "algbw_GBps": algbw,
                    "busbw_GBps": algbw * bus_factor(op, n) if n > 1 else float("nan"),
                    "backend": dist.get_backend(),
                    "iters": iters,
                    "dtype": "float32",
                    "trials": TRIALS,
                    "world": world,
                    "stride": stride,
                }
            )
    return rows


def whole(curves):
    """The rows measured over the whole world (world = devices), which every figure and
    the cells' model read; an earlier run's table, without `world`, is all of them."""
    if "world" not in curves or curves.empty:
        return curves
    world = curves["world"].fillna(curves["devices"])
    return curves[world == curves["devices"]].reset_index(drop=True)


def write_csv(path: Path, rows: list[dict]) -> None:
    import csv
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(COLUMNS), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    records.atomic_write_bytes(path, buf.getvalue().encode())


def run(devices: int, sizes: list[int], device: str, timeout_s: float, out: Path) -> int:
    """The benchmark cell: curves to out/collectives.csv, then meta.json (the marker)."""
    import os
    import traceback
    from datetime import timedelta

    from parabench import envinfo
    from parabench.process.runtime import resolve_device_type

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    fields = {"kind": "collectives", "devices": devices}
    try:
        if world != devices:
            raise RuntimeError(
                f"collectives at {devices} devices runs as {devices} torchrun ranks "
                f"(WORLD_SIZE={world})"
            )
        kind = resolve_device_type(device)
        if kind == "cuda":
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(dev)
        else:
            dev = torch.device("cpu")
            # bound to its share of the cores as a cell's rank is (runtime.bind), its
            # gloo threads with it: unbound, the ranks and their threads migrate, and a
            # loop's time moved 2-5x from run to run
            from parabench.process.runtime import bind

            torch.set_num_threads(len(bind(int(os.environ.get("LOCAL_RANK", "0")), devices)))
        dist.init_process_group(
            "nccl" if kind == "cuda" else "gloo",
            timeout=timedelta(seconds=timeout_s),
            device_id=dev if kind == "cuda" else None,
        )
        started = time.time()
        rows = curves(sizes, dev)
        window = [started, time.time()]
        hosts: list = [None] * world
        dist.all_gather_object(hosts, socket.gethostname())
        if rank == 0:
            write_csv(out / "collectives.csv", rows)
            meta = {"status": "ok", "reason": None, **fields, "env": envinfo.describe(kind)}
            # when it was timed, and where: a cell timed beside it is flagged
            meta.update(timed_window=window, hosts=sorted(set(hosts)))
            records.write_meta(out / "meta.json", meta)
        dist.barrier()
        return 0
    except Exception as e:
        records.write_rank_error(out, rank, e, traceback.format_exc())
        if rank == 0:
            reason = records.describe_error({"type": type(e).__name__, "message": str(e)}, 1)
            records.write_meta(
                out / "meta.json",
                {"status": "failed", "reason": reason, **fields, "env": envinfo.base()},
            )
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def load(paths: list[Path]) -> tuple[list[dict], list[dict], list[dict]]:
    """Rows of every benchmark that ran, (devices, status, reason) of those that did
    not, and when and where each ran ({label, hosts, window}): read loosely, so a
    failed benchmark never stops the aggregate."""
    import contextlib
    import json

    import pandas as pd

    rows, failed, windows = [], [], []
    for meta_path in paths:
        meta_path = Path(meta_path)
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            failed.append({"devices": None, "status": "failed", "reason": f"{meta_path}: {e}"})
            continue
        if meta.get("status") != "ok":
            failed.append(
                {"devices": meta.get("devices"), "status": "failed", "reason": meta.get("reason")}
            )
            continue
        # pandas, not csv: a one-rank benchmark's bus bandwidth is written `nan`, which
        # pd.to_numeric refuses as a string (the first GPU run's aggregate died on it).
        # An empty table is no rows, as csv read it; its window still counts.
        with contextlib.suppress(pd.errors.EmptyDataError):
            rows += pd.read_csv(meta_path.parent / "collectives.csv").to_dict("records")
        if meta.get("timed_window"):
            label = f"collectives at {meta.get('devices')} ranks"
            windows.append({"label": label, "hosts": meta["hosts"], "window": meta["timed_window"]})
    return rows, failed, windows
