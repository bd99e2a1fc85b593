"""A small, hand-made set of cell records with known numbers, aggregated and rendered
by the real code. Hostile strings sit where results carry free text."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import torch

from conftest import REPO, torchtitan_rows
from parabench import records
from parabench.models import build
from parabench.process.flops import model_facts
from parabench.report import render
from parabench.report.aggregate import aggregate
from parabench.spec import ModelSpec, RunSpec

XSS = "<script>alert(1)</script>"
# (strategy, devices) -> (median step seconds, status, reason)
CELLS = {
    ("single", 1): (0.100, "ok", None),
    ("dp", 1): (0.104, "ok", None),
    ("dp", 2): (None, "skipped", "nn.DataParallel needs 2 CUDA devices; 0 visible"),
    ("ddp", 2): (0.055, "ok", None),
    ("ddp", 4): (0.030, "ok", None),
    ("model_parallel", 2): (0.101, "ok", None),
    ("pipeline", 2): (0.070, "ok", None),
    ("pipeline", 4): (None, "failed", f"RuntimeError: {XSS} rank 3 died"),
    ("grad_accum", 2): (0.060, "ok", None),
}
BATCH = 64
DDP_OFFSET = 2.0**-22  # exactly representable near 0.5 in float32
DIMS = [8, 4, 1]


def _params(offset: float) -> bytes:
    buf = io.BytesIO()
    torch.save(
        {"0.0.weight": torch.full((4, 8), 0.5 + offset), "1.0.weight": torch.full((1, 4), 0.25)},
        buf,
    )
    return buf.getvalue()


# single's parameters move this far from their initial values; its reversed-order
# replay lands REORDER_REL of that away (see parabench.analyze.equivalence).
TRAVEL, REORDER_REL = 4.0, 1e-7


def make_results(
    root: Path,
    repeats: int = 2,
    scaling: str = "strong",
    cells: dict = CELLS,
    params: Callable[[str], bytes] | None = None,
) -> list[Path]:
    """The cells' records; `params(strategy)`: an ok cell's params.pt (default: two
    small tensors, ddp's off by DDP_OFFSET)."""
    params = params or (lambda strategy: _params(DDP_OFFSET if strategy == "ddp" else 0.0))
    metas = []
    for (strategy, n), (median, status, reason) in cells.items():
        for r in range(repeats):
            spec = RunSpec(
                strategy=strategy,
                devices=n,
                model_name="m",
                model=ModelSpec.of("mlp", dims=DIMS),
                batch_size=BATCH,
                steps=6,
                warmup=2,
                scaling=scaling,
                repeat=r,
                device="cpu",
            )
            out = root / spec.path
            ident = spec.identity()
            fields = spec.record_fields()
            env = {
                "host": XSS if strategy == "ddp" else "node1",
                "torch": "2.13.0+cpu",
                "launch_command": ["torchrun", "--nproc-per-node", str(n)],
            }
            if status != "ok":
                records.write_outcome(out, status, reason, **fields, env=env, device_type="cpu")
                metas.append(out / "meta.json")
                continue
            # Timed steps around the median; repeat 1 a little slower than repeat 0.
            times = [median * f * (1 + 0.02 * r) for f in (3.0, 2.0, 0.98, 1.0, 1.02, 1.0)]
            rows = [
                {
                    **ident,
                    "step": i,
                    "phase": "warmup" if i < 2 else "timed",
                    "step_time_s": t,
                    "step_time_min_s": t * 0.9,
                    "loss": 0.7 - 0.01 * i,
                    "samples": BATCH * (n if scaling == "weak" else 1),
                }
                for i, t in enumerate(times)
            ]
            ranks = spec.processes
            reference = (
                {"param_travel": TRAVEL, "reorder_rel_diff": REORDER_REL}
                if strategy == "single"
                else {}
            )
            held = {"params": 4000 // n, "grads": 4000 // n, "optimizer": 8000 // n}
            records.write_ran(
                out,
                rows,
                params(strategy),
                **fields,
                **reference,
                # as a cell records its model: what the merge reads instead of building it
                model_facts=model_facts(build(spec.model, 0), spec.global_batch),
                held_bytes_per_rank=[held] * ranks,
                env=env,
                device_type="cpu",
                emulated=strategy == "model_parallel" and n > 1,
                peak_flops_total=1e11 * ranks,
                peak_memory_bytes=100 * 2**20 + n,
            )
            metas.append(out / "meta.json")
    return metas


def advise_results(root: Path) -> None:
    """advise.csv for the fixture's model at 4 and 64 GPUs, and the torchtitan check,
    by the real search (fake tensors: seconds)."""
    from parabench.hardware import gpus
    from parabench.hardware.fabric import PROFILES
    from parabench.predict import advise

    config = {
        "models": {"m": {"arch": "mlp", "dims": DIMS, "batch_size": BATCH}},
        "advise": {"gpus": [4, 64], "gpus_per_node": 8, "precision": "fp32", "optimizer": "sgd"},
    }
    advise.run(
        config, gpus.PROFILES["h100"], PROFILES["h100-nvlink-ndr400"], root, log=lambda _: None
    )
    records.write_rows(
        root / "advise-torchtitan.csv", records.TORCHTITAN_COLUMNS, torchtitan_rows()
    )


def build_report(root: Path, config: dict | None = None, advice: bool = False) -> str:
    metas = make_results(root)
    aggregate(metas, root / "steps.csv", root / "summary.csv", root / "cells.csv")
    if advice:
        advise_results(root)
    ran = {"enabled": advice, "torchtitan": advice}
    render(
        root,
        REPO / "report",
        config or {"models": {"m": {"arch": "mlp"}}, "note": XSS, "advise": ran},
        root / "report.html",
    )
    return (root / "report.html").read_text()
