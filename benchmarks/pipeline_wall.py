"""Wall time of the default pipeline from empty results (a benchmark, not a test).

Runs `snakemake --cores 1` on config/config.yaml in a fresh temporary directory, exactly
as `make run` does, and prints the wall time and where it went:
- measured training: the sum of every recorded step (warm-up included) of every cell;
- launch and import: the launches' wall time (the last line `parabench guard` writes
  to each cell's log) minus the training inside them: interpreter start, `import
  torch`, torchrun's agent and rendezvous, model build, the GEMM peak, writing records;
- Snakemake: everything else (DAG, scheduling, aggregate and report jobs).
Goal: <= 180 s wall on a 2-core machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
LAUNCH = re.compile(r"parabench guard: launch took ([0-9.]+) s")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        }
        t0 = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "snakemake",
                "-s",
                str(REPO / "Snakefile"),
                "--directory",
                str(work),
                "--configfile",
                str(REPO / "config/config.yaml"),
                "--cores",
                "1",
                "--quiet",
            ],
            check=True,
            env=env,
        )
        wall = time.perf_counter() - t0
        steps = pd.read_csv(work / "results/steps.csv")
        summary = pd.read_csv(work / "results/summary.csv")
        launches = [
            float(m.group(1))
            for log in (work / "results/logs/runs").rglob("*.log")
            if (m := LAUNCH.search(log.read_text(errors="replace")))
        ]
        job_walls, jobs = sum(launches), len(launches)

    training = steps["step_time_s"].sum()
    launch = job_walls - training
    other = wall - job_walls
    print(f"cells: {jobs} launches, {len(summary)} summary rows, {os.cpu_count()} cores")
    print(f"wall time                 {wall:7.1f} s   (goal <= 180 s)")
    print(f"  measured training       {training:7.1f} s   {training / wall:6.1%}")
    print(
        f"  launch + import         {launch:7.1f} s   {launch / wall:6.1%}   "
        f"({launch / jobs:.2f} s per launch)"
    )
    print(f"  Snakemake + aggregate + report {other:5.1f} s   {other / wall:6.1%}")
    print(f"outside measured training: {1 - training / wall:.1%}")


if __name__ == "__main__":
    main()
