"""What does profiling a step cost, per strategy? (a benchmark)

Prints, from one torchrun job of n ranks (default 2) on this machine, for every
strategy that runs as ranks: the median step (slowest rank) three ways, in the same
run, in rounds that rotate which goes first (a shared machine drifts, and the order
things run in favours the later):
- bare: a hand-written loop, `strategy.step(x, y)` between a synchronize and a timer;
- timed: parabench's measurement loop (`loop.run_step`), as the cells' timed steps;
- profiled: the same under the anatomy's profiler session (`StepProfiler.watch`), as
  the cells' profiled steps.
profiled / timed is what profiling costs a step (a cell's `profiler_overhead`: goal at
most 1.10); timed / bare is what parabench's loop costs (goal 1.00).

Usage: python benchmarks/profiler_overhead.py [--devices 2] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from _torchrun import run_as_ranks

from parabench import strategies
from parabench.catalog import CATALOG
from parabench.models import build
from parabench.process import runtime
from parabench.run.cell import batch_source
from parabench.run.loop import run_step, synchronizer
from parabench.run.profiling import StepProfiler
from parabench.spec import ModelSpec, RunSpec

MODEL = ModelSpec.of("mlp", dims=[1024, 512, 384, 256, 128, 64, 1])  # the default run's
STEPS = 3  # per mode and round: one profiler session's worth


def slowest(t: float, device: torch.device) -> float:
    """A step's time is the slowest rank's."""
    v = torch.tensor([t], dtype=torch.float64, device=device)
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    return v.item()


def measure(strategy_name: str, ctx, device: str, rounds: int) -> dict[str, float]:
    spec = RunSpec(
        strategy=strategy_name,
        devices=ctx.world_size,
        model_name="mlp",
        model=MODEL,
        batch_size=512,
        device=device,
    )
    model = build(spec.model, spec.seed)
    strategy = strategies.build(model, spec, ctx)
    batches = batch_source(model, spec, strategy)
    sync = synchronizer(strategy.devices())
    profiler = StepProfiler(ctx)
    step = 0

    def bare() -> float:
        x, y = batches.batch(step)
        sync()
        t0 = time.perf_counter()
        strategy.step(x, y)
        sync()
        return time.perf_counter() - t0

    def timed() -> float:
        return run_step(strategy, batches, step, sync)[0]

    def profiled(last: bool) -> float:
        with profiler.watch(last):
            return run_step(strategy, batches, step, sync)[0]

    for _ in range(3):  # warm-up
        bare()
        step += 1
    times: dict[str, list[float]] = {"bare": [], "timed": [], "profiled": []}
    modes = list(times)
    for r in range(rounds):
        for mode in modes[r % 3 :] + modes[: r % 3]:
            for i in range(STEPS):
                if mode == "bare":
                    took = bare()
                elif mode == "timed":
                    took = timed()
                else:
                    took = profiled(last=i == STEPS - 1)
                times[mode].append(slowest(took, ctx.device))
                step += 1
    return {mode: statistics.median(v) for mode, v in times.items()}


def worker(args) -> None:
    first = RunSpec(
        strategy="ddp",
        devices=args.devices,
        model_name="mlp",
        model=MODEL,
        batch_size=512,
        device=args.device,
    )
    ctx = runtime.start(first)
    names = [n for n, r in CATALOG.items() if r.processes(args.devices) > 1]
    rows = [(n, measure(n, ctx, args.device, args.rounds)) for n in names]
    if ctx.is_main:
        print(f"{args.devices} ranks on {args.device}, seed-MLP-shaped model, batch 512")
        print(
            f"{'strategy':14s} {'bare':>9s} {'timed':>9s} {'profiled':>9s}  "
            f"{'profiled/timed':>14s} {'timed/bare':>10s}"
        )
        for name, m in rows:
            print(
                f"{name:14s} {m['bare'] * 1e3:7.2f}ms {m['timed'] * 1e3:7.2f}ms "
                f"{m['profiled'] * 1e3:7.2f}ms  {m['profiled'] / m['timed']:14.3f} "
                f"{m['timed'] / m['bare']:10.3f}"
            )
    runtime.finish(ctx)
    runtime.stop(ctx)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    run_as_ranks(__file__, args.devices, lambda: worker(args))


if __name__ == "__main__":
    main()
