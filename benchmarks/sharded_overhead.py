"""Does parabench's fsdp or tp cost anything over writing them by hand? (a benchmark)

Prints, from one torchrun job of n ranks on this machine:
- parabench's `fsdp` step on the seed MLP at B=2048 over a bare hand-written FSDP2 loop
  of the same model and batch (`fully_shard` per block, then the root), goal <= 1.05;
- parabench's `tp` step over a bare DTensor loop (`parallelize_module` with the Linear
  pairs column- then row-wise, written out by hand), goal <= 1.05.
A step's time is the slowest rank's, as parabench records it. Rounds alternate bare and
parabench so drift on a shared machine hits both alike.

Usage: python benchmarks/sharded_overhead.py [--devices 2] [--device cpu|cuda]
       (it starts torchrun itself when run without it)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from _torchrun import run_as_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from parabench import strategies
from parabench.models import build
from parabench.process import runtime
from parabench.process.data import Shard, SyntheticBatches
from parabench.run.loop import all_ranks, measure, synchronizer
from parabench.spec import ModelSpec, RunSpec

SEED_MLP = ModelSpec.of("mlp")  # 1000-400-300-200-100-50-1


def bare(kind: str, ctx: runtime.Context, batch: int, steps: int, seed: int) -> list[float]:
    """What a user would write for FSDP2 or tensor parallel: no strategy object."""
    model = build(SEED_MLP, seed)
    net, loss_fn = model.module.to(ctx.device), model.loss_fn
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    if kind == "fsdp":
        for block in net:
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        shard = Shard(ctx.rank, ctx.world_size)
    else:
        plan = {}
        for first, second in (("0.0", "1.0"), ("2.0", "3.0"), ("4.0", "5.0")):
            plan[first], plan[second] = ColwiseParallel(), RowwiseParallel()
        parallelize_module(net, mesh, plan)
        shard = Shard(0, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    batches = SyntheticBatches(model, batch, seed, shard, ctx.device)
    sync = synchronizer([ctx.device])
    times = []
    for step in range(steps):
        x, y = batches.batch(step)
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(net(x), y).backward()
        opt.step()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def ours(kind: str, ctx: runtime.Context, batch: int, steps: int, seed: int) -> list[float]:
    spec = RunSpec(kind, ctx.world_size, "mlp", SEED_MLP, batch, steps=steps, warmup=0, seed=seed)
    model = build(spec.model, seed)
    strategy = strategies.build(model, spec, ctx)
    batches = SyntheticBatches(model, batch, seed, strategy.shard, strategy.data_device)
    return measure(strategy, batches, steps).times


def slowest_rank(times: list[float], ctx: runtime.Context) -> list[float]:
    return [max(ts) for ts in zip(*all_ranks(times, ctx), strict=True)]


def worker(args: argparse.Namespace) -> None:
    spec = RunSpec("ddp", args.devices, "mlp", SEED_MLP, args.batch, device=args.device)
    ctx = runtime.start(spec)
    if ctx.is_main:
        print(
            f"{ctx.world_size} ranks on {ctx.device.type}, {ctx.threads} threads each, "
            f"torch {torch.__version__}; seed MLP, global batch {args.batch}, "
            f"{args.rounds} rounds x {args.steps - args.warmup} timed steps"
        )
    for kind in ("fsdp", "tp"):
        timings: dict[str, list[float]] = {"bare": [], "parabench": []}
        for r in range(args.rounds):
            for name, fn in (("bare", bare), ("parabench", ours)):
                times = slowest_rank(fn(kind, ctx, args.batch, args.steps, seed=r), ctx)
                timings[name].extend(times[args.warmup :])
        if ctx.is_main:
            t_bare = statistics.median(timings["bare"])
            t_ours = statistics.median(timings["parabench"])
            label = "FSDP2" if kind == "fsdp" else "DTensor TP"
            print(f"{kind:5s} bare {label:10s} median step {t_bare * 1e3:8.3f} ms")
            print(f"{kind:5s} parabench {kind:13s} median step {t_ours * 1e3:8.3f} ms")
            print(
                f"{kind:5s} ratio parabench / bare          {t_ours / t_bare:8.3f}   (goal <= 1.05)"
            )
    dist.barrier()
    runtime.stop(ctx)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    run_as_ranks(__file__, args.devices, lambda: worker(args))


if __name__ == "__main__":
    main()
