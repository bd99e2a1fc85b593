"""Where a step's time goes and what it sends, read from real profiler traces of real
torchrun ranks: single sends nothing; DDP's bytes per step are its gradients;
gradient accumulation with no_sync all-reduces once per optimizer step, not k times; a
pipeline sends its boundary activations forward and their gradients back; and the
anatomy of a DDP and a pipeline cell closes on the measured step. Plus the interval
arithmetic and the scaling model on synthetic data with known answers."""

from __future__ import annotations

import json
import statistics

import pandas as pd
import pytest

from conftest import SGD_LR, TINY_MLP, run_cell, tiny_spec
from parabench import anatomy, scaling
from parabench.collectives import bus_factor
from parabench.models import build
from parabench.spec import ModelSpec

F32 = 4
DIMS = [48, 32, 24, 16, 8, 4, 1]
GRAD_BYTES = sum(p.numel() for p in build(TINY_MLP, 0).blocks.parameters()) * F32
# Big enough that a step takes milliseconds, not microseconds of Python: the closure
# check is about attribution, not about the profiler's per-op cost on a toy.
WIDE = ModelSpec.of("mlp", dims=[512, 512, 512, 512, 256, 64, 1])


def ran(tmp_path, strategy: str, devices: int, **kw) -> dict:
    meta, proc = run_cell(tiny_spec(strategy, devices, **kw), tmp_path)
    assert meta["status"] == "ok", f"{meta['reason']}\n{proc.stderr[-2000:]}"
    return meta


def shared(cells, strategy: str, devices: int, **kw) -> dict:
    """The equivalence tests' cell (their spec, one launch for both): for what it sends,
    which the learning rate does not change."""
    meta, proc, _ = cells(tiny_spec(strategy, devices, lr=SGD_LR, **kw))
    assert meta["status"] == "ok", f"{meta['reason']}\n{proc.stderr[-2000:]}"
    return meta


def comm(meta: dict, rank: int = 0) -> dict:
    return meta["comm_per_rank"][rank]


@pytest.mark.slow
def test_single_sends_nothing(tmp_path):
    meta = ran(tmp_path, "single", 1, model=WIDE, batch_size=512)
    parts = anatomy.critical(meta["anatomy_per_rank"])
    assert parts["comm_s"] == 0 and parts["comm_exposed_s"] == 0
    assert comm(meta) == {}
    assert parts["compute_s"] > 0.5 * parts["step_s"], parts


@pytest.mark.slow
def test_ddp_sends_its_gradients_once_per_step(cells):
    meta = shared(cells, "ddp", 2)
    for rank in (0, 1):
        sent = comm(meta, rank)
        assert set(sent) == {"all_reduce"}, sent
        assert sent["all_reduce"]["bytes"] == pytest.approx(GRAD_BYTES, rel=0.01)


@pytest.mark.slow
def test_grad_accum_all_reduces_once_per_optimizer_step_not_k_times(cells):
    meta = shared(cells, "grad_accum", 2, accum_steps=4)
    sent = comm(meta)
    assert sent["all_reduce"]["count"] == 1, sent
    assert sent["all_reduce"]["bytes"] == pytest.approx(GRAD_BYTES, rel=0.01)


@pytest.mark.slow
def test_pipeline_sends_boundary_activations_and_their_gradients(cells):
    meta = shared(cells, "pipeline", 2, microbatches=4)
    (_, cut), _ = meta["stage_cuts"]  # stage 0 holds blocks [0, cut)
    boundary = 64 * DIMS[cut] * F32  # the whole batch's activations at the cut, fp32
    first, last = comm(meta, 0), comm(meta, 1)
    assert first["send"]["bytes"] == pytest.approx(boundary)  # activations forward
    assert first["recv"]["bytes"] == pytest.approx(boundary)  # their gradients back
    assert last["recv"]["bytes"] == pytest.approx(boundary)
    assert last["send"]["bytes"] == pytest.approx(boundary)
    assert first["send"]["count"] == 4  # one per micro-batch


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "pipeline"])
def test_the_anatomy_closes_on_the_measured_step(tmp_path, strategy):
    meta = ran(
        tmp_path, strategy, 2, model=WIDE, batch_size=512, steps=20, warmup=5, profile_steps=5
    )
    crit = anatomy.critical(meta["anatomy_per_rank"])
    parts = sum(crit[k] for k in anatomy.PARTS)
    assert parts == pytest.approx(crit["step_s"], rel=1e-9), "the parts are the profiled step"
    steps = pd.read_csv(tmp_path / "steps.csv")
    measured = statistics.median(steps.loc[steps["phase"] == "timed", "step_time_s"])
    # The profiled step is a typical step, not one with extra work in it (a batch made
    # inside the step mark put it 50% over): within 35% of the timed median. 10% is
    # what the report aims at; on 2 shared cores step-to-step noise alone reaches 15%,
    # and the profiler's own cost on a pipeline's many small ops up to 30%, so a test at
    # 10% would fail on noise, not on attribution. The report shows each cell's closure.
    assert parts == pytest.approx(measured, rel=0.35), (crit, measured)
    if strategy == "pipeline":
        assert crit["bubble_s"] > 0, crit
    else:
        assert crit["comm_s"] > 0, crit


def ev(name, ts, dur, tid=1, cat="cpu_op", **args) -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "cat": cat, "args": args}


def test_attribution_on_a_synthetic_trace():
    """A 100 µs step: compute 0-40 and 60-80 on the main thread; an all-reduce on
    gloo's thread 30-70, so 40-60 of it is exposed; nothing else."""
    events = [
        ev(anatomy.STEP_MARK, 0, 100, cat="user_annotation"),
        ev("aten::addmm", 0, 40),
        ev("aten::addmm", 60, 20),
        ev("gloo:all_reduce", 30, 40, tid=2, cat="user_annotation"),
    ]
    (a,) = anatomy.anatomy(events)
    assert a["compute_s"] == pytest.approx(60e-6)
    assert a["comm_s"] == pytest.approx(40e-6)
    assert a["comm_exposed_s"] == pytest.approx(20e-6)
    assert a["other_s"] == pytest.approx(20e-6)
    assert a["bubble_s"] == 0


def test_the_profilers_cost_comes_out_of_the_gaps_and_the_outer_ops():
    """A 100 µs step: linear 0-40 holding addmm 5-35 (inner), relu 50-60 (outer), so
    compute 50, other 50. 6 µs of profiler over 3 events: the 2 outer events' share (4)
    leaves the gaps, the inner one's (2) leaves compute; the parts still sum to the step
    less it."""
    events = [
        ev(anatomy.STEP_MARK, 0, 100, cat="user_annotation"),
        ev("aten::linear", 0, 40),
        ev("aten::addmm", 5, 30),
        ev("aten::relu", 50, 10),
    ]
    (bare,) = anatomy.anatomy(events)
    assert bare["profiler_s"] == 0 and bare["step_s"] == pytest.approx(100e-6)
    (a,) = anatomy.anatomy(events, profiler_s=6e-6)
    assert a["profiler_s"] == pytest.approx(6e-6)
    assert a["other_s"] == pytest.approx(46e-6)
    assert a["compute_s"] == pytest.approx(48e-6)
    assert a["step_s"] == pytest.approx(94e-6) == pytest.approx(sum(a[k] for k in anatomy.PARTS))
    # a cost larger than the gaps hold: what they cannot hold comes out of compute
    (big,) = anatomy.anatomy(events, profiler_s=90e-6)
    assert big["other_s"] == 0 and big["compute_s"] == pytest.approx(10e-6)
    assert big["step_s"] == pytest.approx(10e-6) and big["profiler_s"] == pytest.approx(90e-6)


def test_the_profilers_cost_is_the_cpu_it_adds_times_the_cores_oversubscription():
    from parabench.profiling import profiler_cost

    profiled, timed = [3.1e-3, 2.9e-3, 3.0e-3], [2.0e-3, 2.2e-3, 1.9e-3, 2.0e-3]
    assert profiler_cost(profiled, timed, share=1.0) == pytest.approx(1.0e-3)
    # four ranks on two cores: each rank's extra work also waits for a core
    assert profiler_cost(profiled, timed, share=2.0) == pytest.approx(2.0e-3)
    assert profiler_cost(profiled, timed, share=0.5) == pytest.approx(1.0e-3)
    assert profiler_cost(timed, profiled, share=1.0) == 0  # noise, not a negative cost
    assert profiler_cost([], timed, share=1.0) == 0


def test_a_stage_waiting_to_receive_is_bubble_only_in_a_pipeline():
    events = [
        ev(anatomy.STEP_MARK, 0, 100, cat="user_annotation"),
        ev("aten::mm", 0, 50),
        ev("gloo:recv", 50, 40, cat="user_annotation"),
    ]
    assert anatomy.anatomy(events, cuts_model=True)[0]["bubble_s"] == pytest.approx(40e-6)
    (plain,) = anatomy.anatomy(events, cuts_model=False)
    assert plain["bubble_s"] == 0 and plain["comm_exposed_s"] == pytest.approx(40e-6)


def test_the_critical_step_is_the_median_of_each_steps_slowest_rank():
    def step(t):
        return {"step_s": t, "compute_s": t}

    fast, slow = [step(1), step(5), step(3)], [step(2), step(4), step(9)]
    # per step the slowest rank: 2, 5, 9 -> the median step is rank 0's second
    assert anatomy.critical([fast, slow]) == step(5)
    # of an even number, the middle two averaged part by part: still a whole step
    even = [step(1), step(5), step(3), step(7)]
    assert anatomy.critical([even]) == {"step_s": 4, "compute_s": 4}


def test_volume_reads_sizes_the_nccl_tests_way():
    events = [
        ev(anatomy.STEP_MARK, 0, 100, cat="user_annotation"),
        ev(
            "c10d::allreduce_",
            1,
            1,
            **{"Input Dims": [[[10, 10]], []], "Input type": ["TensorList", ""]},
        ),
        ev(
            "c10d::_allgather_base_",
            2,
            1,
            **{"Input Dims": [[400], [200]], "Input type": ["float", "float"]},
        ),
        ev("c10d::send", 3, 1, **{"Input Dims": [[[8, 4]], []], "Input type": ["TensorList", ""]}),
    ]
    v = anatomy.volume(events, list_element_bytes=2)
    assert v["all_reduce"] == {"count": 1, "bytes": 200}
    assert v["all_gather"] == {"count": 1, "bytes": 1600}  # the gathered output, fp32
    assert v["send"] == {"count": 1, "bytes": 64}


def test_bus_bandwidth_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert bus_factor("reduce_scatter", 2) == pytest.approx(0.5)
    assert bus_factor("broadcast", 8) == bus_factor("send_recv", 2) == 1


CURVES = pd.DataFrame(
    {
        "op": ["all_reduce"] * 3,
        "devices": [2] * 3,
        "bytes": [1e3, 1e6, 1e9],
        "time_s": [1e-5, 1e-3, 1.0],
    }
)


def test_curve_time_interpolates_and_extrapolates_by_bandwidth():
    assert scaling.curve_time(CURVES, "all_reduce", 2, 1e6) == pytest.approx(1e-3)
    assert scaling.curve_time(CURVES, "all_reduce", 2, 1e7) == pytest.approx(1e-2, rel=1e-6)
    assert scaling.curve_time(CURVES, "all_reduce", 2, 2e9) == pytest.approx(2.0)
    assert scaling.curve_time(CURVES, "all_reduce", 2, 10) == pytest.approx(1e-5)
    assert pd.isna(scaling.curve_time(CURVES, "all_reduce", 4, 1e6))


def summary_row(strategy, devices, step, **kw) -> dict:
    row = {
        "model": "m",
        "precision": "fp32",
        "optimizer": "sgd",
        "compile": False,
        "strategy": strategy,
        "devices": devices,
        "status": "ok",
        "step_time_s": step,
        "profiled_step_s": step,
        "compute_s": 0.0,
        "comm_exposed_s": 0.0,
        "bubble_s": 0.0,
        "data_s": 0.0,
        "other_s": 0.001,
        "comm_by_op": "",
        "device_type": "cuda",
        "processes": devices,
        "threads_per_rank": 1,
        "usable_cores": 16,
        "options": "",
    }
    return {**row, **kw}


def test_the_model_predicts_ddp_from_single_and_the_curve():
    summary = pd.DataFrame(
        [
            summary_row("single", 1, 0.101, compute_s=0.100),
            # 0.050 compute + one 1 MB all-reduce (1 ms) + 1 ms overhead = 52 ms
            summary_row(
                "ddp",
                2,
                0.052,
                compute_s=0.05,
                comm_exposed_s=0.001,
                comm_by_op=json.dumps({"all_reduce": {"count": 1, "bytes": 1e6}}),
            ),
            # a pipeline: 50 ms per stage, bubble (2-1)/4 of it
            summary_row(
                "pipeline",
                2,
                0.200,
                compute_s=0.05,
                bubble_s=0.0125,
                options=json.dumps({"microbatches": 4}),
            ),
        ]
    )
    out = summary.join(
        scaling.predict(summary, CURVES, ["model", "precision", "optimizer", "compile"])
    )
    ddp = out[out["strategy"] == "ddp"].iloc[0]
    assert ddp["predicted_step_s"] == pytest.approx(0.052)
    assert not ddp["prediction_flag"]
    pipe = out[out["strategy"] == "pipeline"].iloc[0]
    assert pipe["predicted_bubble_s"] == pytest.approx(0.0125)
    assert pipe["prediction_flag"], "63.5 ms predicted against 200 ms measured"
    assert pipe["prediction_miss"].startswith("compute") or pipe["prediction_miss"].startswith(
        "overhead"
    ), pipe["prediction_miss"]


def test_the_profiled_steps_interleave_with_the_timed_ones():
    from parabench.loop import PROFILED, TIMED, WARMUP, plan

    kinds = plan(steps=28, warmup=4, profile_steps=18)
    assert kinds[:4] == [WARMUP] * 4
    assert kinds.count(TIMED) == 24 and kinds.count(PROFILED) == 18
    # six sessions of three, one after each run of timed steps, the runs equal
    runs = "".join(k[0] for k in kinds[4:]).split("ppp")
    assert [r.strip("w") for r in runs] == ["tttt"] * 6 + [""]
    # a warm-up step after every session but the last, so none starts a timed run skewed
    assert kinds.count(WARMUP) == 4 + 5 and kinds[-1] == PROFILED
    assert plan(5, 2, 0) == [WARMUP, WARMUP, TIMED, TIMED, TIMED]
    assert plan(4, 1, 1) == [WARMUP, TIMED, TIMED, TIMED, PROFILED]
