"""The intervals, the noise flag and the verdicts, on synthetic data with known answers."""

import numpy as np
import pandas as pd
import pytest

from parabench import stats as st


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


KEYS = ["model", "precision", "optimizer", "compile", "strategy", "devices"]
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


@pytest.mark.parametrize(
    "lo, hi, expected",
    [(0.7, 0.9, "faster"), (1.1, 1.4, "slower"), (0.95, 1.05, "indistinguishable")],
)
def test_verdicts(lo, hi, expected):
    assert st.verdict(lo, hi) == expected


def test_separated_intervals():
    assert st.separated((1.0, 1.2), (1.3, 1.5))
    assert not st.separated((1.0, 1.3), (1.2, 1.5))
