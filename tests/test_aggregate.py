"""The summary's definitions, checked on known numbers, strong and weak scaling."""

import errno
import os

import pandas as pd
import pytest

from parabench.aggregate import aggregate
from report_fixture import BATCH, make_results


def summary_of(tmp_path, scaling):
    metas = make_results(tmp_path, scaling=scaling)
    aggregate(metas, tmp_path / "steps.csv", tmp_path / "summary.csv", tmp_path / "cells.csv")
    return pd.read_csv(tmp_path / "summary.csv").set_index(["strategy", "devices"])


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
