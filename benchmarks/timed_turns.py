"""Does advise time a rank as a cell's ranks run here? (a benchmark, not a test)

`parabench advise` on `this-machine` as a CPU times one rank of a layout with its
N - 1 others stepping beside it, each process bound to its share of the cores
(`fakerank.timed`), so that ranks sharing a core take turns as a cell's do. Prints, for
1, 2 and 4 ranks a core on this machine's cores, that timed step (the sum of its
phases) beside a bare hand-written reference: as many plain processes, each bound to
one core and one thread, stepping the same model in a loop, the mean of their steps
over the same window; and each side's step over its own at one rank a core (goal:
within 15% of each other, the turns priced alike). Rounds alternate the two sides, so
drift on a shared machine hits both alike.

The bare side trains the model itself (no DDP, its collectives or parabench's
process group), so its steps are shorter; the ratios are what must agree. Run it on a
quiet machine: a neighbour's load takes turns too.

Usage: python benchmarks/timed_turns.py [--per-core 1 2 4] [--rounds 3] [--micro 64]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

import torch

from parabench.layout import Layout
from parabench.models import build
from parabench.predict import fakerank
from parabench.spec import ModelSpec

# the tests' GPT (tests/test_layouts.py), on micro-batches whose steps take milliseconds
GPT = {"arch": "gpt", "vocab": 128, "seq_len": 16, "n_layer": 2, "n_head": 4, "d_model": 32}
WINDOW_S = 1.0  # each bare process steps at least this long


def bare_rank(spec: ModelSpec, micro: int, core: int, start, out) -> None:
    """What a user would write: one process on one core, one thread, a loop."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    model = build(spec, 0)
    net = model.module
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    x, y = model.batch(micro, torch.Generator().manual_seed(0))

    def step() -> None:
        model.loss_fn(net(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    start.wait()  # every process warm before any is timed
    times, t_end = [], time.perf_counter() + WINDOW_S
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    out.put(statistics.fmean(times))


def bare(spec: ModelSpec, micro: int, ranks: int, cores: list[int]) -> float:
    """The mean step of `ranks` bare processes, rank i on core i's share (as
    runtime.share places ranks on more ranks than cores)."""
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(ranks), ctx.Queue()
    procs = [
        ctx.Process(
            target=bare_rank, args=(spec, micro, cores[i * len(cores) // ranks], start, out)
        )
        for i in range(ranks)
    ]
    for p in procs:
        p.start()
    got = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join()
    return statistics.fmean(got)


def ours(spec: ModelSpec, micro: int, ranks: int) -> float:
    probe = fakerank.Probe(Layout(dp_replicate=2), micro=micro, precision="fp32", optimizer="sgd")
    return sum(fakerank.timed(spec, probe, ranks=ranks).values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-core", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--micro", type=int, default=64)
    args = ap.parse_args()
    spec = ModelSpec.of(**GPT)
    cores = sorted(os.sched_getaffinity(0))
    print(
        f"{len(cores)} cores, torch {torch.__version__}; gpt micro-batch {args.micro}, "
        f"DDP over parabench's no-communication group; {args.rounds} rounds, the least of each"
    )
    ours(spec, args.micro, len(cores))  # this process's first steps and forks, untimed
    rows = {}
    for k in args.per_core:
        n = k * len(cores)
        a, b = [], []
        for r in range(args.rounds):  # which side first alternates
            for side in ("ours", "bare") if r % 2 == 0 else ("bare", "ours"):
                if side == "ours":
                    a.append(ours(spec, args.micro, n))
                else:
                    b.append(bare(spec, args.micro, n, cores))
        rows[k] = (min(a), min(b))
    one = rows[min(rows)]
    print(
        f"{'ranks a core':>12} {'ranks':>6} {'timed, ms':>10} {'bare, ms':>9} "
        f"{'timed ×':>8} {'bare ×':>7} {'ratio':>6}"
    )
    for k, (a, b) in rows.items():
        ta, tb = a / one[0], b / one[1]
        flag = "" if abs(ta / tb - 1) <= 0.15 else "  (off by more than 15%)"
        print(
            f"{k:>12} {k * len(cores):>6} {a * 1e3:>10.2f} {b * 1e3:>9.2f} "
            f"{ta:>8.2f} {tb:>7.2f} {ta / tb:>6.2f}{flag}"
        )


if __name__ == "__main__":
    main()
