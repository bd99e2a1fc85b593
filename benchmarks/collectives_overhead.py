"""Are parabench's collective curves honest? (a benchmark)

Prints, from one torchrun job of n ranks on this machine, parabench's all-reduce time
at 16 MiB (`collectives.time_op`, what collectives.csv holds) over a bare hand-written
`dist.all_reduce` timing loop of the same tensor, goal within 5%. Rounds interleave the
two sides, each first in every other round, so drift on a shared machine and the order
they run in hit both alike. (What profiling costs a step: benchmarks/profiler_overhead.py.)

Usage: python benchmarks/collectives_overhead.py [--devices 2] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from _torchrun import run_as_ranks

from parabench.process import runtime
from parabench.run.collectives import time_op
from parabench.spec import ModelSpec, RunSpec

SIZE = 16 * 2**20


def bare_all_reduce(device: torch.device, iters: int) -> float:
    """What a user would write: one tensor, a barrier, a loop, the slowest rank."""
    t = torch.ones(SIZE // 4, device=device)
    dist.all_reduce(t)
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    took = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def worker(args: argparse.Namespace) -> None:
    spec = RunSpec("ddp", args.devices, "mlp", ModelSpec.of("mlp"), 2048, device=args.device)
    ctx = runtime.start(spec)
    if ctx.is_main:
        print(
            f"{ctx.world_size} ranks on {ctx.device.type} ({dist.get_backend()}), "
            f"{ctx.threads} threads each, torch {torch.__version__}; {args.rounds} rounds"
        )
    # Each round runs both sides, which one first alternating: the one that runs second
    # finds the buffers, caches and the peer's timing the first left behind.
    ours, bare = [], []
    iters = time_op("all_reduce", SIZE, ctx.device, min_time_s=0.2)[1]
    for r in range(args.rounds):
        if r % 2:
            bare.append(bare_all_reduce(ctx.device, iters))
        t, iters = time_op("all_reduce", SIZE, ctx.device, min_time_s=0.2)
        ours.append(t)
        if not r % 2:
            bare.append(bare_all_reduce(ctx.device, iters))
    if ctx.is_main:
        o, b = statistics.median(ours), statistics.median(bare)
        print(f"all_reduce 16 MiB  parabench collectives  {o * 1e3:8.3f} ms")
        print(f"all_reduce 16 MiB  bare dist.all_reduce   {b * 1e3:8.3f} ms")
        print(f"ratio parabench / bare                    {o / b:8.3f}   (goal within 5%)")
    dist.barrier()
    runtime.stop(ctx)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    run_as_ranks(__file__, args.devices, lambda: worker(args))


if __name__ == "__main__":
    main()
