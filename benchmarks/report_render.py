"""Report rendering time at scale (a benchmark, not a test).

Builds 1,008 synthetic cell records (3 models x 16 cells x 21 repeats, 50 steps each),
aggregates them and renders the report, printing each phase. Goal: rendering under 10 s.
"""

from __future__ import annotations

import io
import random
import tempfile
import time
from pathlib import Path

import torch

from parabench import records
from parabench.catalog import STRATEGIES, device_counts
from parabench.report import render
from parabench.report.aggregate import aggregate

REPO = Path(__file__).resolve().parents[1]
MODELS, REPEATS, STEPS, WARMUP, BATCH = ("a", "b", "c"), 21, 50, 10, 256


def make_cells(root: Path) -> list[Path]:
    rng = random.Random(0)
    buf = io.BytesIO()
    torch.save({"0.0.weight": torch.zeros(16, 32)}, buf)
    params = buf.getvalue()
    metas = []
    for model in MODELS:
        for strategy in STRATEGIES:
            for n in device_counts(strategy, [1, 2, 4]):
                for r in range(REPEATS):
                    out = root / "runs" / model / strategy / f"n{n}" / f"r{r}"
                    ident = {"model": model, "strategy": strategy, "devices": n, "repeat": r}
                    spec = {
                        "batch_size": BATCH,
                        "steps": STEPS,
                        "warmup": WARMUP,
                        "scaling": "strong",
                        "model": {"arch": "mlp", "dims": [32, 16, 1]},
                    }
                    env = {"host": f"node{r % 4}", "torch": "2.13.0", "launch_command": ["x"]}
                    if strategy == "dp" and n > 1:
                        records.write_outcome(
                            out, "skipped", "no GPUs", **ident, spec=spec, env=env
                        )
                    else:
                        base = 0.1 / (n**0.8 if strategy == "ddp" else 1)
                        rows = [
                            {
                                **ident,
                                "step": i,
                                "phase": "warmup" if i < WARMUP else "timed",
                                "step_time_s": base * rng.uniform(0.9, 1.2),
                                "step_time_min_s": base * 0.9,
                                "loss": 0.5,
                                "samples": BATCH,
                            }
                            for i in range(STEPS)
                        ]
                        records.write_ran(
                            out,
                            rows,
                            params,
                            **ident,
                            spec=spec,
                            env=env,
                            device_type="cuda",
                            emulated=False,
                            peak_flops_total=1e12,
                            peak_memory_bytes=2**30,
                        )
                    metas.append(out / "meta.json")
    return metas


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        metas = make_cells(root)
        t1 = time.perf_counter()
        aggregate(metas, root / "steps.csv", root / "summary.csv", root / "cells.csv")
        t2 = time.perf_counter()
        render(
            root,
            REPO / "report",
            {"models": {m: {"arch": "mlp"} for m in MODELS}},
            root / "report.html",
        )
        t3 = time.perf_counter()
        size = (root / "report.html").stat().st_size
    print(f"cells: {len(metas)} ({len(metas) * STEPS:,} steps)")
    print(f"write records  {t1 - t0:6.2f} s")
    print(f"aggregate      {t2 - t1:6.2f} s")
    print(f"render report  {t3 - t2:6.2f} s   (goal < 10 s), {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
