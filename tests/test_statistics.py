"""The intervals, the noise flag and the verdicts, on synthetic data with known answers;
the bootstrap's distribution and its memory on a long run."""

import io
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import peak_memory_run
from parabench import records
from parabench.analyze import stats as st
from parabench.spec import ModelSpec, RunSpec

GIB = 2**30


def test_the_median_interval_covers_the_true_median_about_95_percent_of_the_time():
    """400 simulated cells of 15 timed steps from a skewed distribution whose median is
    known (lognormal: exp(0) = 1): the 95% interval should contain it about 95% of the
    time (percentile bootstrap of a median at n=15: a little under or over)."""
    rng = np.random.default_rng(1)
    hits = 0
    runs = 400
    for i in range(runs):
        steps = rng.lognormal(mean=0.0, sigma=0.2, size=15)
        lo, hi = st.interval(st.draws([steps], resamples=1000, seed=i))
        hits += lo <= 1.0 <= hi
    assert 0.90 <= hits / runs <= 0.99, hits / runs


def test_launch_to_launch_variance_widens_the_interval():
    """Three launches whose levels differ (a shared machine) give a wider interval than
    one launch's steps alone could."""
    rng = np.random.default_rng(2)
    one = [rng.normal(1.0, 0.01, 30)]
    three = [rng.normal(level, 0.01, 30) for level in (0.9, 1.0, 1.1)]
    lo1, hi1 = st.interval(st.draws(one))
    lo3, hi3 = st.interval(st.draws(three))
    assert (hi3 - lo3) > 5 * (hi1 - lo1)


def steps_frame(cells: dict[tuple[str, int], np.ndarray]) -> pd.DataFrame:
    rows = []
    for (strategy, n), times in cells.items():
        for i, t in enumerate(times):
            rows.append(
                {
                    "model": "m",
                    "precision": "fp32",
                    "optimizer": "sgd",
                    "compile": False,
                    "ac": "none",
                    "strategy": strategy,
                    "devices": n,
                    "repeat": 0,
                    "step": i,
                    "phase": "timed",
                    "step_time_s": t,
                    "step_time_min_s": t / 1.05,
                }
            )
    return pd.DataFrame(rows)


KEYS = ["model", "precision", "optimizer", "compile", "ac", "strategy", "devices"]
VARIANT = ["model", "precision", "optimizer", "compile"]


def test_noise_flag_and_rank_spread():
    rng = np.random.default_rng(3)
    steps = steps_frame(
        {("single", 1): rng.normal(1.0, 0.01, 40), ("ddp", 2): rng.uniform(0.5, 1.5, 40)}
    )
    stats = st.step_statistics(steps, KEYS).set_index("strategy")
    assert not stats.loc["single", "noisy"]
    assert stats.loc["ddp", "noisy"]  # IQR/median about 50%
    assert stats.loc["single", "rank_spread"] == pytest.approx(1.05)
    assert stats.loc["ddp", "step_time_p95_s"] > stats.loc["ddp", "step_time_p90_s"]


def test_speedup_interval_contains_the_true_speedup_and_excludes_one():
    rng = np.random.default_rng(4)
    steps = steps_frame(
        {("single", 1): rng.normal(1.0, 0.02, 30), ("ddp", 2): rng.normal(0.5, 0.01, 30)}
    )
    summary = pd.DataFrame(
        [
            {
                **dict(zip(VARIANT, ["m", "fp32", "sgd", False], strict=True)),
                "ac": "none",
                "strategy": s,
                "devices": n,
            }
            for s, n in (("single", 1), ("ddp", 2))
        ]
    ).assign(global_batch=64)
    ci = st.speedup_intervals(summary, steps)
    lo, hi = ci.loc[1, "speedup_ci_low"], ci.loc[1, "speedup_ci_high"]
    assert lo < 2.0 < hi and lo > 1.5
    assert ci.loc[1, "efficiency_ci_low"] == pytest.approx(lo / 2)
    assert ci.loc[1, "efficiency_ci_high"] == pytest.approx(hi / 2)


def test_speedups_are_over_the_reference_that_ran_and_count_the_batch():
    """Weak scaling: ddp at 2 runs twice single's batch in the same time, a speedup of
    2 (throughput, not step time). A failed row, and every row whose reference failed,
    has neither a speedup nor an interval."""
    rng = np.random.default_rng(5)
    steps = steps_frame(
        {
            ("single", 1): rng.normal(1.0, 0.01, 30),
            ("ddp", 2): rng.normal(1.0, 0.01, 30),
            ("fsdp", 2): rng.normal(1.0, 0.01, 30),
        }
    )
    variant = dict(zip(VARIANT, ["m", "fp32", "sgd", False], strict=True))
    rows = [("single", 1, 64, "ok"), ("ddp", 2, 128, "ok"), ("fsdp", 2, 128, "failed")]
    summary = pd.DataFrame(
        [
            {**variant, "ac": "none", "strategy": s, "devices": n, "global_batch": b, "status": ok}
            for s, n, b, ok in rows
        ]
    ).assign(throughput=lambda d: d["global_batch"] / 1.0)
    ci = st.speedup_intervals(summary, steps)
    lo, hi = ci.loc[1, "speedup_ci_low"], ci.loc[1, "speedup_ci_high"]
    assert 1.9 < lo < 2.0 < hi < 2.1
    assert ci.loc[2].isna().all(), "a failed cell is not ranked"
    assert st.speedup(summary, summary).tolist() == [1.0, 2.0, 2.0]
    failed_reference = summary.assign(status=["failed", "ok", "ok"])
    assert st.reference_rows(failed_reference).empty
    assert st.speedup(summary, failed_reference).isna().all()
    assert st.speedup_intervals(failed_reference, steps).isna().all().all()


@pytest.mark.parametrize(
    "lo, hi, expected",
    [
        (0.7, 0.9, "faster"),
        (1.1, 1.4, "slower"),
        (0.95, 1.05, "indistinguishable"),
        # an interval that reaches 1 does not exclude "no change"
        (0.9, 1.0, "indistinguishable"),
        (1.0, 1.1, "indistinguishable"),
    ],
)
def test_verdicts(lo, hi, expected):
    assert st.verdict(lo, hi) == expected


def test_separated_intervals():
    assert st.separated((1.0, 1.2), (1.3, 1.5))
    assert not st.separated((1.0, 1.3), (1.2, 1.5))
    assert st.separated((1.3, 1.5), (1.0, 1.2)), "either order"
    assert not st.separated((1.2, 1.5), (1.0, 1.3)), "either order"
    assert not st.separated((1.0, 2.0), (0.5, 1.5)), "one holds the other's upper end"
    # intervals that touch share a value: not separated
    assert not st.separated((1.0, 1.2), (1.2, 1.5))
    assert not st.separated((1.2, 1.5), (1.0, 1.2))


def exact_median_cdf(n: int, j: np.ndarray) -> np.ndarray:
    """P(a resample's median <= x_(j)) for odd n and distinct x: at least (n + 1) / 2 of
    the n draws fall among the j smallest, each with probability j / n."""
    k = (n + 1) // 2
    p = j / n
    return np.array(
        [sum(math.comb(n, i) * q**i * (1 - q) ** (n - i) for i in range(k, n + 1)) for q in p]
    )


def test_the_bootstrap_medians_have_the_distribution_of_resampling_every_step():
    """Drawn from order statistics (bounded memory), a bootstrap median has the same
    distribution as the median of a real resample: against the exact one (odd n) and
    against resampling itself (even n), 100,000 draws each, fixed seeds."""
    rng = np.random.default_rng(5)
    odd = np.sort(rng.lognormal(0.0, 0.3, 15))
    got = st.median_draws(odd, 100_000, np.random.default_rng(6))
    resampled = np.median(odd[rng.integers(0, 15, size=(100_000, 15))], axis=1)
    exact = exact_median_cdf(15, np.arange(1, 16))
    for sample in (got, resampled):
        empirical = np.searchsorted(np.sort(sample), odd, side="right") / len(sample)
        assert np.abs(empirical - exact).max() < 0.01  # 6 standard errors of an ECDF
    even = rng.lognormal(0.0, 0.3, 16)
    got = np.sort(st.median_draws(even, 100_000, np.random.default_rng(7)))
    resampled = np.sort(np.median(even[rng.integers(0, 16, size=(100_000, 16))], axis=1))
    grid = np.sort(np.concatenate([got, resampled]))
    ks = np.abs(
        np.searchsorted(got, grid, side="right") - np.searchsorted(resampled, grid, side="right")
    ).max() / len(got)
    assert ks < 0.015, ks  # two-sample KS at 100,000 each: 0.012 is p = 1e-6
    assert (st.draws([even]) == st.draws([even])).all(), "one seed, one set of draws"


def write_long_cell(root: Path, steps: int) -> Path:
    """One `single` cell whose record holds `steps` timed steps (records' own writer)."""
    spec = RunSpec(
        strategy="single",
        devices=1,
        model_name="m",
        model=ModelSpec.of("mlp", dims=[8, 4, 1]),
        batch_size=64,
        steps=steps,
        warmup=2,
        device="cpu",
    )
    out = root / spec.path
    times = np.random.default_rng(8).lognormal(np.log(0.01), 0.1, steps + 2)
    ident = spec.identity()
    rows = [
        {
            **ident,
            "step": i,
            "phase": "warmup" if i < 2 else "timed",
            "step_time_s": t,
            "step_time_min_s": t * 0.95,
            "loss": 0.5,
            "samples": 64,
        }
        for i, t in enumerate(times)
    ]
    buf = io.BytesIO()
    torch.save({"0.0.weight": torch.zeros(4, 8)}, buf)
    records.write_ran(
        out,
        rows,
        buf.getvalue(),
        **spec.record_fields(),
        held_bytes_per_rank=[{"params": 1, "grads": 1, "optimizer": 0}],
        env={"host": "node1", "torch": torch.__version__},
        device_type="cpu",
        peak_flops_total=1e11,
        peak_memory_bytes=2**20,
    )
    return out / "meta.json"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and wait4")
def test_aggregating_300k_steps_stays_under_one_gib(tmp_path):
    """The login node's side of a long run: `parabench aggregate` of one cell of
    300,000 timed steps, the real command in its own process. A (2000, steps) bootstrap
    index once took 9.8 GB at 200,000 steps."""
    meta = write_long_cell(tmp_path, 300_000)
    tables = [f"--{t}-out={tmp_path / f'{t}.csv'}" for t in ("steps", "summary", "cells")]
    argv = [sys.executable, "-m", "parabench", "aggregate", "--meta", str(meta), *tables]
    code, peak, _ = peak_memory_run(argv, tmp_path / "aggregate.log", kill_above=3 * GIB)
    log = (tmp_path / "aggregate.log").read_text()[-3000:]
    assert code == 0 and peak < GIB, (
        f"parabench aggregate of 300,000 steps: peak RSS {peak / GIB:.2f} GiB "
        f"(exit {code}; killed above 3 GiB), limit 1 GiB\n{log}"
    )
    summary = pd.read_csv(tmp_path / "summary.csv")
    lo, hi = summary.loc[0, ["step_time_ci_low_s", "step_time_ci_high_s"]]
    assert lo < summary.loc[0, "step_time_s"] < hi, "the interval holds its median"
    print(f"peak RSS of parabench aggregate, 300,000 steps: {peak / 2**20:.0f} MiB")
