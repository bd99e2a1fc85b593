"""Every strategy runs from the command line at 1, 2 and 4 devices and writes its CSV
and JSON; what cannot run honestly on this machine is `skipped` with its reason.
(The cells are the equivalence tests' own, launched once for both: `cells`.)"""

import csv

import pytest

from conftest import SGD_LR, run_cell, tiny_spec
from parabench import records
from parabench.loop import PROFILED, plan

pytestmark = pytest.mark.slow

CELLS = [("single", 1)] + [
    (s, n) for s in ("dp", "ddp", "model_parallel", "pipeline", "grad_accum") for n in (1, 2, 4)
]


@pytest.mark.parametrize("strategy, devices", CELLS, ids=[f"{s}-n{n}" for s, n in CELLS])
def test_cell_writes_its_records(cells, strategy, devices):
    spec = tiny_spec(strategy, devices, lr=SGD_LR)
    meta, proc, out = cells(spec)
    records.read_meta(out / "meta.json")  # schema-valid
    with open(out / "steps.csv") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    records.check_step_header(out / "steps.csv", reader.fieldnames)

    if strategy == "dp" and devices > 1:  # CPU: DataParallel would silently run one copy
        assert meta["status"] == "skipped"
        assert "CUDA devices" in meta["reason"]
        assert rows == [] and not (out / "params.pt").exists()
        return
    assert meta["status"] == "ok", f"{meta['reason']}\n{proc.stderr[-2000:]}"
    assert proc.returncode == 0
    # every step of the plan but the profiled ones, in order: warm-up, then timed runs
    # with one warm-up step after each profiler session but the last
    kinds = plan(spec.steps, spec.warmup, spec.profile_steps)
    assert [r["phase"] for r in rows] == [k for k in kinds if k != PROFILED]
    assert [int(r["step"]) for r in rows] == [i for i, k in enumerate(kinds) if k != PROFILED]
    assert sum(r["phase"] == "timed" for r in rows) == spec.steps - spec.warmup
    assert all(float(r["step_time_s"]) >= float(r["step_time_min_s"]) > 0 for r in rows)
    assert {int(r["samples"]) for r in rows} == {spec.global_batch}
    assert meta["emulated"] == (strategy == "model_parallel" and devices > 1)
    assert len(meta["peak_memory_per_rank"]) == meta["world_size"]
    assert meta["peak_flops_total"] > 0 and meta["peak_memory_bytes"] > 0
    assert meta["env"]["torch"] and meta["threads_per_rank"] >= 1
    if strategy in ("model_parallel", "pipeline"):
        assert len(meta["stage_cuts"]) == devices


@pytest.mark.parametrize("strategy, devices", [("single", 1), ("ddp", 2)])
def test_dataloader_mode_times_the_input_pipeline(tmp_path, strategy, devices):
    # A real Dataset read sample by sample through DataLoader + DistributedSampler with a
    # worker process; each rank gets its share, the fetch sits inside the timed step.
    spec = tiny_spec(strategy, devices, steps=12, warmup=2, data="dataloader", loader_workers=1)
    meta, proc = run_cell(spec, tmp_path)
    assert meta["status"] == "ok", f"{meta['reason']}\n{proc.stderr[-2000:]}"
    assert meta["spec"]["data"] == "dataloader"
    with open(tmp_path / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert sum(r["phase"] == "timed" for r in rows) == 10
    assert {int(r["samples"]) for r in rows} == {64}
