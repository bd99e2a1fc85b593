"""Does parabench's measurement cost anything? (a benchmark, not a test)

Prints, in one process on this machine:
- parabench's `single` step time over a bare hand-written loop of the same model and
  global batch (goal <= 1.03): the strategy interface, synchronization and bookkeeping
  must not slow the step;
- achieved FLOP/s of that step over a square float32 GEMM measured in the same run (goal
  >= 0.80 on the seed MLP at B=2048): how close a real training step gets to the device.

Rounds alternate bare and parabench so drift on a shared machine hits both alike.
Usage: python benchmarks/single_overhead.py [--device cpu|cuda] [--steps 60] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from parabench.models import build
from parabench.process.data import Shard, SyntheticBatches
from parabench.process.flops import step_flops
from parabench.process.runtime import Context
from parabench.run.loop import measure, synchronizer
from parabench.run.peak import gemm_flops_per_s
from parabench.spec import ModelSpec, RunSpec
from parabench.strategies import get


def bare_loop(device: torch.device, batch: int, steps: int, seed: int) -> list[float]:
    """What a user would write: no strategy object, no records."""
    model = build(ModelSpec.of("mlp"), seed)
    net, loss_fn = model.module.to(device), model.loss_fn
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    sync = synchronizer([device])
    batches = SyntheticBatches(model, batch, seed, Shard(0, 1), device)
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


def parabench_single(device: torch.device, batch: int, steps: int, seed: int) -> list[float]:
    spec = RunSpec(
        strategy="single",
        devices=1,
        model_name="mlp",
        model=ModelSpec.of("mlp"),
        batch_size=batch,
        steps=steps,
        warmup=0,
        seed=seed,
        device=device.type,
    )
    ctx = Context(0, 1, 0, device, torch.get_num_threads(), distributed=False)
    model = build(spec.model, seed)
    strategy = get("single")(model, spec, ctx)
    batches = SyntheticBatches(model, batch, seed, strategy.shard, strategy.data_device)
    return measure(strategy, batches, steps).times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    device = torch.device(args.device)

    bare, ours = [], []
    for r in range(args.rounds):
        for fn, acc in ((bare_loop, bare), (parabench_single, ours)):
            acc.extend(fn(device, args.batch, args.steps, seed=r)[args.warmup :])
    t_bare, t_ours = statistics.median(bare), statistics.median(ours)
    flops = step_flops(build(ModelSpec.of("mlp"), 0), args.batch)
    gemm = gemm_flops_per_s(device, seconds=1.0)
    achieved = flops / t_ours

    print(f"device: {device} ({torch.get_num_threads()} threads), torch {torch.__version__}")
    print(
        f"model: seed MLP 1000-400-300-200-100-50-1, batch {args.batch}, "
        f"{args.rounds} rounds x {args.steps - args.warmup} timed steps each"
    )
    print(f"bare loop median step      {t_bare * 1e3:8.3f} ms")
    print(f"parabench single median    {t_ours * 1e3:8.3f} ms")
    print(f"ratio single / bare        {t_ours / t_bare:8.3f}   (goal <= 1.03)")
    print(f"FLOPs per step             {flops / 1e9:8.3f} GFLOP (FlopCounterMode)")
    print(f"achieved                   {achieved / 1e9:8.1f} GFLOP/s")
    print(f"GEMM float32 peak          {gemm / 1e9:8.1f} GFLOP/s (same process, same threads)")
    print(f"achieved / GEMM            {achieved / gemm:8.3f}   (goal >= 0.80)")
    # What the usual estimate would claim: it counts an input gradient for the first
    # layer, which autograd never computes.
    params = sum(p.numel() for p in build(ModelSpec.of("mlp"), 0).module.parameters())
    naive = 6 * params * args.batch
    print(
        f"6*params*batch would claim {naive / 1e9:8.3f} GFLOP, {naive / flops - 1:+.0%}, "
        f"i.e. achieved / GEMM {naive / t_ours / gemm:.3f}"
    )


if __name__ == "__main__":
    main()
