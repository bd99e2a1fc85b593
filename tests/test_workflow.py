"""The real pipeline (Snakemake, real torchrun ranks) on a tiny config in a temp dir.

Checks values, not existence: every cell has the right status, the summary's speedups
are recomputed from the raw steps, a second run does nothing, and growing the config
runs only the new cells.
"""

import pandas as pd
import pytest

from conftest import planned_outputs, snakemake
from parabench.run.loop import step_kinds

pytestmark = pytest.mark.slow

STRATEGIES = ["single", "dp", "ddp", "model_parallel", "pipeline", "grad_accum"]
CONFIG = {
    "device": "cpu",
    "models": {"tiny": {"arch": "mlp", "dims": [48, 32, 24, 16, 8, 4, 1], "batch_size": 64}},
    "strategies": STRATEGIES,
    "devices": [1, 2],
    "repeats": 1,
    "steps": 5,
    "warmup": 1,
    "profile_steps": 4,
    "timeout_s": 60,
    "cell_timeout_s": 240,
    # one planned rank: what a measuring job's reruns are checked on, with the ranks'
    "plan": {"enabled": True, "strategies": ["ddp"], "world_sizes": [8]},
}
# Outputs of the jobs that measure: cells, collectives benchmarks, ranks alone, the plan.
MEASURING = ("/runs/", "/collectives/", "ranks.csv", "plan.csv")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("wf")
    proc = snakemake(workdir, "--cores", "2", config=CONFIG)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return workdir


def test_every_cell_has_a_row_with_the_right_status(run):
    summary = pd.read_csv(run / "results/summary.csv")
    cells = {(s, n) for s in STRATEGIES for n in (1, 2) if not (s == "single" and n == 2)}
    assert set(zip(summary["strategy"], summary["devices"], strict=False)) == cells
    status = summary.set_index(["strategy", "devices"])["status"]
    assert status[("dp", 2)] == "skipped"
    assert (status.drop(("dp", 2)) == "ok").all()
    reason = summary.set_index(["strategy", "devices"]).loc[("dp", 2), "reason"]
    assert "CUDA devices" in reason


def test_speedup_recomputed_from_raw_steps_matches_summary(run):
    steps = pd.read_csv(run / "results/steps.csv")
    summary = pd.read_csv(run / "results/summary.csv").set_index(["strategy", "devices"])
    timed = steps[steps["phase"] == "timed"]
    per_repeat = timed.groupby(["strategy", "devices", "repeat"])["step_time_s"].median()
    t = per_repeat.groupby(["strategy", "devices"]).median()
    batch = CONFIG["models"]["tiny"]["batch_size"]
    for key, median in t.items():
        assert summary.loc[key, "step_time_s"] == pytest.approx(median, rel=1e-12)
        speedup = (batch / median) / (batch / t[("single", 1)])
        assert summary.loc[key, "speedup"] == pytest.approx(speedup, rel=1e-9)
        assert summary.loc[key, "efficiency"] == pytest.approx(speedup / key[1], rel=1e-9)
    # warm-up rows (the leading ones, and one after each profiler session but the last)
    # are kept in steps.csv but excluded from every statistic
    kinds = step_kinds(CONFIG["steps"], CONFIG["warmup"], CONFIG["profile_steps"])
    assert kinds.count("warmup") == CONFIG["warmup"] + 1
    assert (steps["phase"] == "warmup").sum() == len(t) * kinds.count("warmup")


def test_strategies_match_single_in_the_pipeline_too(run):
    summary = pd.read_csv(run / "results/summary.csv")
    ok = summary[summary["status"] == "ok"]
    assert (ok["max_abs_param_diff"] <= 1e-6).all(), ok[
        ["strategy", "devices", "max_abs_param_diff"]
    ]


ANATOMY = [
    "compute_s",
    "comm_s",
    "comm_exposed_s",
    "bubble_s",
    "data_s",
    "other_s",
    "step_nocomm_s",
    "profiler_overhead",
    "comm_bytes_per_step",
    "collectives_per_step",
]


def test_every_ok_cell_has_its_anatomy_and_a_prediction(run):
    summary = pd.read_csv(run / "results/summary.csv")
    ok = summary[summary["status"] == "ok"]
    assert ok[ANATOMY].notna().all().all(), ok[ANATOMY]
    # the scaling model predicts the multi-device cells, out of sample
    multi = ok["devices"] > 1
    assert ok.loc[multi, "predicted_step_s"].notna().all()
    assert ok.loc[~multi, "predicted_step_s"].isna().all()
    by = ok.set_index(["strategy", "devices"])
    assert by.loc[("single", 1), "comm_s"] == 0
    # no_sync: one all-reduce of the gradients per optimizer step, as DDP
    assert (
        by.loc[("grad_accum", 2), "comm_bytes_per_step"]
        == by.loc[("ddp", 2), "comm_bytes_per_step"]
    )


def test_the_model_reads_one_rank_of_each_multi_process_cell_alone(run):
    ranks = pd.read_csv(run / "results/ranks.csv")
    # rank 0 of each multi-process cell; every stage of the pipeline's; none of the
    # one-process strategies (dp, model_parallel) nor of one-rank cells
    got = sorted(zip(ranks["strategy"], ranks["devices"], ranks["rank"], strict=True))
    assert got == [("ddp", 2, 0), ("grad_accum", 2, 0), ("pipeline", 2, 0), ("pipeline", 2, 1)]
    assert (ranks["status"] == "ok").all() and (ranks["compute_s"] > 0).all()
    assert (ranks["threads"] == 1).all()  # 2 cores, 2 ranks: what a rank of the cell gets
    # the rank alone issues what the cell's ranks issued, counted another way (by its
    # group, against the profiler's record of the real collectives)
    summary = pd.read_csv(run / "results/summary.csv").set_index(["strategy", "devices"])
    alone = ranks.set_index(["strategy", "devices", "rank"])
    for strategy in ("ddp", "grad_accum"):
        assert (
            alone.loc[(strategy, 2, 0), "comm_bytes_per_step"]
            == summary.loc[(strategy, 2), "comm_bytes_per_step"]
        )
    # the prediction's compute is the rank alone's (1 rank per core), the pipeline's
    # its slowest stage
    ddp = summary.loc[("ddp", 2)]
    assert ddp["predicted_compute_s"] == pytest.approx(alone.loc[("ddp", 2, 0), "compute_s"])
    slowest = ranks.loc[ranks["strategy"] == "pipeline", "compute_s"].max()
    assert summary.loc[("pipeline", 2), "predicted_compute_s"] == pytest.approx(slowest)


def test_collective_curves_span_4kib_to_64mib_at_every_multi_rank_count(run):
    curves = pd.read_csv(run / "results/collectives.csv")
    ar = curves[(curves["op"] == "all_reduce") & (curves["devices"] == 2)]
    assert ar["bytes"].min() <= 4096 and ar["bytes"].max() >= 64 * 2**20
    assert (ar["busbw_GBps"] > 0).all()
    assert set(curves["devices"]) == {2}
    assert set(curves["op"]) == {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "broadcast",
        "send_recv",
    }


def test_report_and_logs_exist_per_cell(run):
    assert (run / "results/report.html").stat().st_size > 10_000
    assert len(list((run / "results/logs/runs").rglob("*.log"))) == 11


def test_snakemake_report_packs_the_report_plots_and_tables(run):
    import zipfile

    proc = snakemake(run, "--report", "report.zip", config=CONFIG)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = zipfile.ZipFile(run / "report.zip").namelist()
    for item in ("report.html", "summary.csv", "collectives.csv", "speedup.png", "anatomy.png"):
        assert any(n.endswith(item) for n in names), (item, names)


def test_second_run_does_nothing(run):
    proc = snakemake(run, "-n", config=CONFIG)
    assert proc.returncode == 0, proc.stderr
    assert "Nothing to be done" in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "change",
    [
        {"cell_timeout_s": 999},
        {"rank_timeout_s": 99},
        {"max_job_minutes": 600},
        {"exclusive_nodes": False},
    ],
)
def test_a_setting_that_changes_no_measurement_reruns_no_measuring_job(run, change):
    """Raising cell_timeout_s after a cell timed out: no finished measurement is redone
    (the report, which shows the config, is rendered again). Nor is one for the time
    limits of the ranks measured alone, while they still fit in one job."""
    proc = snakemake(run, "-n", config={**CONFIG, **change})
    assert proc.returncode == 0, proc.stderr
    redone = [p for p in planned_outputs(proc) if any(m in p for m in MEASURING)]
    assert not redone, redone


def test_a_plan_setting_reruns_the_plan_and_no_other_measuring_job(run):
    plan = {**CONFIG["plan"], "world_sizes": [8, 16]}
    proc = snakemake(run, "-n", config={**CONFIG, "plan": plan})
    assert proc.returncode == 0, proc.stderr
    redone = [p for p in planned_outputs(proc) if any(m in p for m in MEASURING)]
    assert redone == ["results/plan.csv"], redone


def test_a_measuring_setting_reruns_every_cell_it_changes(run):
    """steps changes what each cell measures: every cell is planned again (as the sweep
    reruns a cell whose record's settings hash differs), never kept stale."""
    proc = snakemake(run, "-n", config={**CONFIG, "steps": CONFIG["steps"] + 1})
    assert proc.returncode == 0, proc.stderr
    cells = [p for p in planned_outputs(proc) if "/runs/" in p]  # one line a job
    assert len(cells) == len(list((run / "results/runs").rglob("meta.json")))


def test_a_rerun_cell_remeasures_no_other_measuring_job(run):
    """Retrying one cell rewrites the merged tables (collectives.csv among them): the plan,
    which reads the curves, is not measured again for it (they are the same curves)."""
    cell = next((run / "results/runs").rglob("meta.json")).relative_to(run)
    proc = snakemake(run, "-n", "--forcerun", str(cell), config=CONFIG)
    assert proc.returncode == 0, proc.stderr
    redone = [p for p in planned_outputs(proc) if any(m in p for m in MEASURING)]
    assert len(redone) == 1 and str(cell) in redone[0], redone  # the cell, and only it


def test_growing_the_config_plans_only_the_new_cells(run):
    bigger = {**CONFIG, "devices": [1, 2, 4], "repeats": 2}
    proc = snakemake(run, "-n", config=bigger)
    assert proc.returncode == 0, proc.stderr
    new = [p for p in planned_outputs(proc) if "/runs/" in p]
    # 5 strategies gain n=4 (repeats 0 and 1), and every old cell gains repeat 1.
    assert len(new) == 5 * 2 + 11
    assert not any("/r0/" in p and "/n4/" not in p for p in new), new


def test_cores_2_times_one_cell_at_a_time(run):
    """--cores 2 on two cores would start two cells at once; the default profile gives
    one `timed_cells`, so no two timed windows (cells, the collectives benchmark) meet."""
    cells = pd.read_csv(run / "results/cells.csv")
    ran = cells[cells["status"] == "ok"].sort_values("timed_from")
    assert len(ran) > 5
    starts, ends = ran["timed_from"].to_numpy(), ran["timed_to"].to_numpy()
    assert (starts[1:] >= ends[:-1]).all(), "two cells were timed at the same time"
    summary = pd.read_csv(run / "results/summary.csv")
    assert not summary["overlapped"].any()


def test_ranks_past_max_job_minutes_are_measured_in_parts_merged_in_order(tmp_path):
    """Four ranks of two minutes each do not fit in a ten-minute job (5 minutes of it a
    margin): two jobs of two ranks, each its own process, and ranks.csv has every row
    in the order one job writes them."""
    config = {
        **CONFIG,
        "strategies": ["ddp", "grad_accum", "pipeline"],
        "devices": [2],
        "plan": {"enabled": False},
        "rank_timeout_s": 120,
        "max_job_minutes": 10,
    }
    proc = snakemake(tmp_path, "--cores", "1", "results/ranks.csv", config=config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = sorted((tmp_path / "results/ranks").glob("part*of2/ranks.csv"))
    assert len(parts) == 2, parts
    ranks = pd.read_csv(tmp_path / "results/ranks.csv")
    assert list(zip(ranks["strategy"], ranks["rank"], strict=True)) == [
        ("ddp", 0),
        ("grad_accum", 0),
        ("pipeline", 0),
        ("pipeline", 1),
    ]
    assert (ranks["status"] == "ok").all(), ranks["reason"]
    assert [len(pd.read_csv(p)) for p in parts] == [2, 2]
