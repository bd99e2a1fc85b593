"""What a multi-rank cell's launch costs, forked ranks against torchrun's own, and a
warm start against both (a benchmark, not a test).

Launches the same cell of the default config, in turn, as `python -m
torch.distributed.run ...` (each rank a new Python importing torch), as `python -m
parabench.torchrun ...` (the same agent, ranks forked once it has imported what they
run), and as that command forked from a warm process (parabench.jobs.warm: the agent too is
forked, from a process that imported torch once for the whole run), `--repeats` times
each, and prints per launch: its wall time, the ranks' own setup (start of `run_cell`
to the first step) and the cell's median timed step, which must not move: the fork
changes how a rank starts, not what it measures.

    python benchmarks/launch_overhead.py [--strategy ddp] [--devices 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from parabench.config import load_config, spec_for
from parabench.jobs import warm
from parabench.jobs.launch import cell_argv

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = load_config(REPO / "config/config.yaml")
    spec = spec_for(config, "mlp", args.strategy, args.devices, 0)
    forked = cell_argv(spec, "OUT", sys.executable)
    # as `parabench launch` starts them (cli.main): no working directory on sys.path
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    cold = {**env, warm.ENV: "0"}
    plain = [sys.executable, "-m", "torch.distributed.run", *forked[3:]]
    found: dict[str, list[tuple[float, float, float]]] = {"torchrun": [], "forked": [], "warm": []}
    with tempfile.TemporaryDirectory() as tmp, warm.warm_process():
        for i in range(args.repeats):
            for name, argv in (("torchrun", plain), ("forked", forked), ("warm", forked)):
                out = Path(tmp) / f"{name}{i}"
                out.mkdir()
                argv = [str(out) if a == "OUT" else a for a in argv]
                t0 = time.perf_counter()
                if name == "warm":
                    proc = warm.spawn(argv, env)
                    assert isinstance(proc, warm.WarmProcess), proc
                    proc.stdout.read()
                    assert proc.wait() == 0
                else:
                    subprocess.run(argv, check=True, capture_output=True, env=cold)
                wall = time.perf_counter() - t0
                meta = json.loads((out / "meta.json").read_text())
                steps = pd.read_csv(out / "steps.csv")
                step = steps.loc[steps.phase == "timed", "step_time_s"].median()
                found[name].append((wall, meta["setup_s"], step))
    print(f"mlp {args.strategy} at {args.devices} ranks, {args.repeats} launches each, in turn")
    print(f"{'launch':<10}{'wall s':>9}{'setup s':>9}{'step ms':>9}")
    for name, rows in found.items():
        wall, setup, step = (statistics.median(col) for col in zip(*rows, strict=True))
        print(f"{name:<10}{wall:>9.2f}{setup:>9.2f}{step * 1e3:>9.1f}")


if __name__ == "__main__":
    main()
