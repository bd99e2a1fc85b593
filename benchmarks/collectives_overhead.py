"""Are parabench's collective curves and step anatomy honest? (a benchmark)

Prints, from one torchrun job of n ranks on this machine:
- parabench's all-reduce time at 16 MiB (`collectives.time_op`, what collectives.csv
  holds) over a bare hand-written `dist.all_reduce` timing loop of the same tensor,
  goal within 5%;
- a DDP step under the profiler as parabench runs it for the anatomy (CPU activity, no
  shapes or memory) over the same step unprofiled: what profiling costs, and why it
  stays out of the timed steps; beside it, what the anatomy takes out of the parts as
  the profiler's cost (`profiling.profiler_cost`: the main thread's extra CPU time per
  step, times the cores' oversubscription).
Rounds interleave the two sides, each first in every other round, so drift on a
shared machine and the order they run in hit both alike.

Usage: python benchmarks/collectives_overhead.py [--devices 2] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.distributed as dist
from _torchrun import run_as_ranks
from torch.profiler import ProfilerActivity, profile, record_function

from parabench import runtime, strategies
from parabench.anatomy import STEP_MARK
from parabench.collectives import time_op
from parabench.data import SyntheticBatches
from parabench.loop import synchronizer
from parabench.models import build
from parabench.profiling import oversubscription, profiler_cost
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


def ddp_steps(ctx, spec: RunSpec, steps: int, profiled: bool) -> tuple[float, float]:
    """Median DDP step (slowest rank), plain or under the anatomy's profiler settings,
    and this rank's median main-thread CPU time per step."""
    model = build(spec.model, spec.seed)
    strategy = strategies.build(model, spec, ctx)
    batches = SyntheticBatches(model, spec.global_batch, 0, strategy.shard, strategy.data_device)
    sync = synchronizer(strategy.devices())
    for s in range(3):
        strategy.step(*batches.batch(s))
    times, cpu = [], []
    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if ctx.device.type == "cuda" else []
    )
    with profile(activities=activities) if profiled else contextlib.nullcontext():
        for s in range(steps):
            x, y = batches.batch(s)
            sync()
            c0, t0 = time.thread_time(), time.perf_counter()
            with record_function(STEP_MARK):
                strategy.step(x, y)
                sync()
            times.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item(), statistics.median(cpu)


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
    plain, prof, plain_cpu, prof_cpu = [], [], [], []
    for r in range(args.rounds):
        for profiled in (False, True) if r % 2 == 0 else (True, False):
            t, c = ddp_steps(ctx, spec, args.steps, profiled=profiled)
            (prof if profiled else plain).append(t)
            (prof_cpu if profiled else plain_cpu).append(c)
    share = oversubscription(ctx)
    estimate = profiler_cost(prof_cpu, plain_cpu, share)
    if ctx.is_main:
        o, b = statistics.median(ours), statistics.median(bare)
        print(f"all_reduce 16 MiB  parabench collectives  {o * 1e3:8.3f} ms")
        print(f"all_reduce 16 MiB  bare dist.all_reduce   {b * 1e3:8.3f} ms")
        print(f"ratio parabench / bare                    {o / b:8.3f}   (goal within 5%)")
        p, u = statistics.median(prof), statistics.median(plain)
        print(f"DDP step (seed MLP, B=2048) unprofiled    {u * 1e3:8.3f} ms")
        print(f"DDP step under the anatomy's profiler     {p * 1e3:8.3f} ms")
        print(
            f"what profiling costs                      {p / u - 1:+8.1%}   (never in timed steps)"
        )
        print(
            f"anatomy's estimate (extra CPU x {max(1.0, share):.1f})      "
            f"{estimate / u:+8.1%}   (profiler_s, taken out of the parts)"
        )
    dist.barrier()
    runtime.stop(ctx)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    run_as_ranks(__file__, args.devices, lambda: worker(args))


if __name__ == "__main__":
    main()
