"""Strategies run from the command line at 1, 2 and 4 devices and write their CSV and
JSON; what cannot run honestly on this machine is `skipped` with its reason. The same
check (conftest.assert_cell_records) reads every cell the equivalence tests launch
(zero1, fsdp, tp, ddp_compress) and every layout's cell in test_layouts' sweep: each
strategy and layout of the catalog, without a launch of its own here."""

import csv

import pytest

from conftest import SGD_LR, assert_cell_records, run_cell, tiny_spec

pytestmark = pytest.mark.slow

CELLS = [("single", 1)] + [
    (s, n) for s in ("dp", "ddp", "model_parallel", "pipeline", "grad_accum") for n in (1, 2, 4)
]


@pytest.mark.parametrize("strategy, devices", CELLS, ids=[f"{s}-n{n}" for s, n in CELLS])
def test_cell_writes_its_records(cells, strategy, devices):
    spec = tiny_spec(strategy, devices, lr=SGD_LR)
    meta, proc, out = cells(spec)
    assert_cell_records(spec, meta, proc, out)


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
