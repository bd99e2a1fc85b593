"""The summary's definitions, checked on known numbers, strong and weak scaling."""

import errno
import io
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import REPO
from parabench import models
from parabench.analyze import fingerprint
from parabench.config import load_config, model_spec
from parabench.report.aggregate import aggregate
from report_fixture import BATCH, CELLS, DDP_OFFSET, TRAVEL, make_results

# config/gpu.yaml's resmlp: 541M parameters
GPU_RESMLP_PARAMS = models.facts(
    model_spec(load_config(REPO / "config" / "gpu.yaml")["models"]["resmlp"])
).n_params
FEW = [("single", 1), ("ddp", 2)]


def summary_of(tmp_path, scaling):
    return summary_of_metas(tmp_path, make_results(tmp_path, scaling=scaling)).set_index(
        ["strategy", "devices"]
    )


def summary_of_metas(tmp_path, metas):
    aggregate(metas, tmp_path / "steps.csv", tmp_path / "summary.csv", tmp_path / "cells.csv")
    return pd.read_csv(tmp_path / "summary.csv")


def test_strong_scaling_speedup_is_the_time_ratio(tmp_path):
    s = summary_of(tmp_path, "strong")
    assert s.loc[("ddp", 4), "global_batch"] == BATCH
    t1, t4 = s.loc[("single", 1), "step_time_s"], s.loc[("ddp", 4), "step_time_s"]
    assert s.loc[("ddp", 4), "speedup"] == pytest.approx(t1 / t4)
    assert s.loc[("ddp", 4), "efficiency"] == pytest.approx(t1 / t4 / 4)
    assert (s["scaling"] == "strong").all()


def test_weak_scaling_speedup_is_the_throughput_ratio(tmp_path):
    s = summary_of(tmp_path, "weak")
    assert s.loc[("ddp", 4), "global_batch"] == 4 * BATCH  # per-device batch fixed
    thr1 = BATCH / s.loc[("single", 1), "step_time_s"]
    thr4 = 4 * BATCH / s.loc[("ddp", 4), "step_time_s"]
    assert s.loc[("ddp", 4), "throughput"] == pytest.approx(thr4)
    assert s.loc[("ddp", 4), "speedup"] == pytest.approx(thr4 / thr1)
    assert s.loc[("ddp", 4), "efficiency"] == pytest.approx(thr4 / (4 * thr1))
    # Different global batches: no claim of identical parameters.
    assert s.loc[("ddp", 4), "max_abs_param_diff"] != s.loc[("ddp", 4), "max_abs_param_diff"]


def test_failed_and_skipped_cells_stay_in_the_summary(tmp_path):
    s = summary_of(tmp_path, "strong")
    assert s.loc[("dp", 2), "status"] == "skipped" and s.loc[("dp", 2), "repeats_ok"] == 0
    assert s.loc[("pipeline", 4), "status"] == "failed"
    assert "rank 3 died" in s.loc[("pipeline", 4), "reason"]


def _state_bytes(offset: float, numel: int) -> bytes:
    """A params.pt of one tensor of `numel` fp32 elements, all 0.5 + offset."""
    buf = io.BytesIO()
    torch.save({"w": torch.full((numel,), 0.5 + offset)}, buf)
    return buf.getvalue()


# Starts argv and prints its peak resident KiB. A child's high-water mark starts at
# what the process it was forked from held (Linux keeps it across exec), so the
# aggregate is started from this small process, not from the test's.
_PEAK_OF_CHILD = (
    "import os, subprocess, sys; p = subprocess.Popen(sys.argv[1:]); "
    "_, status, usage = os.wait4(p.pid, 0); print(usage.ru_maxrss); "
    "sys.exit(os.waitstatus_to_exitcode(status))"
)


# glibc keeps blocks freed in its heap for reuse: tens of MB that level off, which
# could hide a cell held or mimic one; with this threshold every block above it is
# mapped on its own and unmapped when freed, so what is resident is what is live.
LIVE_ONLY = {"MALLOC_MMAP_THRESHOLD_": str(2**17)}


def _aggregate_peak_rss(metas: list, out: Path, env: dict | None = None) -> int:
    """Peak resident bytes of `parabench aggregate` of these cells."""
    argv = [sys.executable, "-m", "parabench", "aggregate", "--meta", *map(str, metas)]
    for table in ("steps", "summary", "cells"):
        argv += [f"--{table}-out", str(out / f"{table}.csv")]
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK_OF_CHILD, *argv],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.split()[-1]) * 1024  # KiB on Linux


@pytest.mark.parametrize("kind", ["whole", "sketch"])
def test_aggregate_holds_about_one_pair_of_cells_whatever_their_number(tmp_path, kind):
    """Each params.pt at its largest (whole: fingerprint.EXACT_MAX fp32 elements, 16
    MiB; sketch: what a model of any larger size keeps, config/gpu.yaml's 541M-parameter
    resmlp included), 2 cells then 21: the merge's peak memory may not grow by a cell's
    file per cell (it held every one, 2.6 GB at 12 cells of 128 MiB), and stays under
    1 GiB."""
    numel = fingerprint.EXACT_MAX + (fingerprint.SAMPLE if kind == "sketch" else 0)
    if kind == "whole":
        data = {
            s: _state_bytes(DDP_OFFSET if s == "ddp" else 0.0, numel) for s in ("single", "ddp")
        }
    else:
        state = {"w": torch.randn(numel, generator=torch.Generator().manual_seed(0))}
        data = {"single": fingerprint.encode(state)}
        data["ddp"] = fingerprint.encode({"w": state["w"] + DDP_OFFSET})
        assert len(data["single"]) < fingerprint.stored_bytes(GPU_RESMLP_PARAMS) + 2**16
    size = len(data["single"])
    peaks = {}
    for label, (cells, repeats) in {
        "few": ({k: CELLS[k] for k in FEW}, 1),
        "many": (CELLS, 3),
    }.items():
        root = tmp_path / label
        metas = make_results(
            root, repeats, cells=cells, params=lambda s: data.get(s, data["single"])
        )
        peaks[label] = _aggregate_peak_rss(metas, root, LIVE_ONLY)
        summary = pd.read_csv(root / "summary.csv").set_index(["strategy", "devices"])
        exact = numel**0.5 * DDP_OFFSET / TRAVEL  # every element off by DDP_OFFSET
        rel = summary.loc[("ddp", 2), "rel_param_diff"]
        assert rel == pytest.approx(
            exact, rel=fingerprint.SKETCH_ERROR if kind == "sketch" else 1e-9
        )
    peaks["as run"] = _aggregate_peak_rss(metas, root)  # glibc's default
    ok_many = 3 * sum(status == "ok" for _, status, _ in CELLS.values())
    mib = {k: f"{v / 2**20:.0f} MiB" for k, v in peaks.items()}
    print(f"\n{kind}, {size / 2**20:.1f} MiB a cell: 2 and {ok_many} cells {mib}")
    assert peaks["many"] - peaks["few"] < 4 * size, peaks
    assert peaks["as run"] < 2**30, peaks


def test_the_four_tables_are_replaced_together(tmp_path, monkeypatch):
    """A merge that fails while writing its tables (here the disk fills up at the last
    one) leaves the previous merge's four tables, never new steps and cells beside an
    old summary; and no temporary file."""
    out = tmp_path / "out"
    paths = {t: out / f"{t}.csv" for t in ("steps", "cells", "summary", "collectives")}

    def merge(metas: list) -> None:
        aggregate(metas, paths["steps"], paths["summary"], paths["cells"], (), paths["collectives"])

    merge(make_results(tmp_path / "before", 1))
    before = {t: p.read_bytes() for t, p in paths.items()}
    metas = make_results(tmp_path / "after", 2)  # more repeats: other steps, cells, summary
    synced, fsync = [], os.fsync

    def disk_full_at_the_fourth(fd: int) -> None:
        synced.append(fd)
        if len(synced) == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", disk_full_at_the_fourth)
    with pytest.raises(OSError, match="No space left"):
        merge(metas)
    assert {t: p.read_bytes() for t, p in paths.items()} == before
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in paths.values())
    monkeypatch.setattr(os, "fsync", fsync)
    merge(metas)
    assert all(paths[t].read_bytes() != before[t] for t in ("steps", "cells", "summary"))


def test_a_one_rank_benchmark_from_the_gpu_merges(tmp_path):
    """The first GPU run (an H200, one GPU): its one-rank NCCL benchmark has no bus
    bandwidth (`nan` in the CSV), and the merge died on that string. Its records, as
    they came back, merge: bandwidths numeric, the one-rank bus bandwidth empty."""
    bench = REPO / "tests" / "data" / "h200-collectives-n1" / "meta.json"
    metas = make_results(tmp_path)
    out = tmp_path / "collectives.csv"
    aggregate(
        metas, tmp_path / "steps.csv", tmp_path / "summary.csv", tmp_path / "cells.csv",
        [bench], out,
    )  # fmt: skip
    curves = pd.read_csv(out)
    assert len(curves) == 36 and set(curves["op"]) >= {"all_reduce"}
    assert (curves["devices"] == 1).all() and curves["busbw_GBps"].isna().all()
    assert (curves["algbw_GBps"] > 0).all() and curves["time_s"].dtype == float


def test_records_copied_without_their_parameters_merge_uncompared(tmp_path):
    """Records copied from a cluster without their params.pt (the GPU check's copy
    leaves them out): the cells merge, not compared; a params.pt that is there but
    unreadable is still refused (test_fingerprint)."""
    metas = make_results(tmp_path, repeats=1)
    for meta in metas:
        (meta.parent / "params.pt").unlink(missing_ok=True)
    s = summary_of_metas(tmp_path, metas)
    ok = s[s["status"] == "ok"]
    assert len(ok) >= 2 and ok["equivalent"].isna().all()
    assert ok["rel_param_diff"].isna().all() and (ok["step_time_s"] > 0).all()
    assert ok["likely_cause"].str.contains("params.pt absent").all()  # said, not silent
