"""How sure is each number: bootstrap intervals, noise and straggler flags, verdicts.

The headline step time of a cell is the median over repeats of each repeat's median
timed step. Its 95% interval comes from a two-level bootstrap that follows how the data
were made: resample the repeats (separate launches: launch-to-launch variance), then
within each the timed steps (step-to-step variance), and take the same statistic.
With one repeat only the steps are resampled, so the interval covers step noise only,
not the launch-to-launch variance a shared machine adds; docs/results.md says so.

Bounded memory, whatever the step count: a resample's median is drawn from the order
statistics of the sorted steps (`median_draws`), never by building the resample, so a
repeat of n steps costs one sorted copy and O(resamples), not a (resamples, n) index
(2000 x 200,000 steps once took 9.8 GB).

Speedup is defined here, once (`speedup`): a cell's throughput over the reference
strategy's (`single`, catalog.REFERENCE) at one device, in the same model and variant.
Under strong scaling (same global batch) that equals T(single) / T(cell); under weak
scaling it is the throughput ratio. Its interval is the percentile interval of the
ratio of the two cells' independent bootstrap draws.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from parabench.catalog import REFERENCE
from parabench.records import VARIANT_KEYS

RESAMPLES = 2000
LEVEL = 0.95
NOISY = 0.10  # IQR / median above this: the cell's steps vary too much to rank closely
SEED = 20261122  # fixed, so the same tables give the same intervals
STEP_COLUMNS = (
    "step_time_ci_low_s",
    "step_time_ci_high_s",
    "step_time_p50_s",
    "step_time_p90_s",
    "step_time_p95_s",
    "step_time_iqr_s",
    "noisy",
    "rank_spread",
)


def median_draws(steps: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """`resamples` bootstrap medians of `steps` (each the median of len(steps) draws with
    replacement), in O(n log n) time and O(n + resamples) memory.

    Exact in distribution, not an approximation: with the steps sorted, x_(1) <= ... <=
    x_(n), a draw with replacement is x_(ceil(n U)) for U uniform on (0, 1), and that is
    non-decreasing in U, so the k-th smallest of a resample is x_(ceil(n U_(k))), where
    U_(k), the k-th smallest of n uniforms, is Beta(k, n + 1 - k). An even n's median
    also needs U_(k+1): U_(k) plus (1 - U_(k)) times the smallest of the n - k uniforms
    above it, Beta(1, n - k). The same seed gives the same draws; they are not the
    numbers the former (resamples, n) index gave, but the same distribution
    (tests/test_statistics.py checks it against the exact one and against resampling)."""
    x = np.sort(np.asarray(steps, dtype=float))
    n = len(x)
    k = (n + 1) // 2  # the median's (lower) middle order statistic, counted from 1

    def at(u: np.ndarray) -> np.ndarray:
        return x[np.clip(np.ceil(u * n).astype(np.int64) - 1, 0, n - 1)]

    u = rng.beta(k, n + 1 - k, size=resamples)
    if n % 2:
        return at(u)
    return (at(u) + at(u + (1 - u) * rng.beta(1, n - k, size=resamples))) / 2


def draws(repeats: list[np.ndarray], resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """Bootstrap draws of median-over-repeats of each repeat's median step (statistically
    equivalent to resampling every step: see `median_draws`)."""
    rng = np.random.default_rng(seed)
    # each repeat's median, under resampled steps
    m = np.stack([median_draws(steps, resamples, rng) for steps in repeats])  # repeats x draws
    if len(repeats) == 1:
        return m[0]
    pick = rng.integers(0, len(repeats), size=(resamples, len(repeats)))
    return np.median(m[pick, np.arange(resamples)[:, None]], axis=1)


def interval(samples: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    lo, hi = np.quantile(samples, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def verdict(lo: float, hi: float, better_below: float = 1.0) -> str:
    """Of a ratio new/old of step times: 'faster' when the whole interval is below 1,
    'slower' when above, else 'indistinguishable' (at this noise)."""
    if hi < better_below:
        return "faster"
    if lo > better_below:
        return "slower"
    return "indistinguishable"


def separated(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two intervals do not overlap."""
    return a[0] > b[1] or b[0] > a[1]


def cell_draws(steps: pd.DataFrame, keys: list[str]) -> dict[tuple, np.ndarray]:
    """Bootstrap draws of the headline step time of every cell in `steps` (timed rows)."""
    out = {}
    timed = steps[steps["phase"] == "timed"]
    for key, g in timed.groupby(keys, sort=False):
        repeats = [r["step_time_s"].to_numpy(float) for _, r in g.groupby("repeat")]
        out[key if isinstance(key, tuple) else (key,)] = draws(repeats)
    return out


def step_statistics(steps: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Per cell: the step-time interval, p50/p90/p95/IQR over all timed steps, the noise
    flag, and the rank spread (the slowest rank over the fastest, median over steps:
    above 1.1 a straggler or an unbalanced split)."""
    timed = steps[steps["phase"] == "timed"]
    rows = []
    for key, g in timed.groupby(keys, sort=False):
        t = g["step_time_s"].to_numpy(float)
        lo, hi = interval(draws([r["step_time_s"].to_numpy(float) for _, r in g.groupby("repeat")]))
        q25, q50, q75, q90, q95 = np.quantile(t, [0.25, 0.5, 0.75, 0.9, 0.95])
        spread = (g["step_time_s"] / g["step_time_min_s"]).median()
        rows.append(
            {
                **dict(zip(keys, key if isinstance(key, tuple) else (key,), strict=True)),
                "step_time_ci_low_s": lo,
                "step_time_ci_high_s": hi,
                "step_time_p50_s": q50,
                "step_time_p90_s": q90,
                "step_time_p95_s": q95,
                "step_time_iqr_s": q75 - q25,
                "noisy": bool((q75 - q25) / q50 > NOISY),
                "rank_spread": spread,
            }
        )
    return pd.DataFrame(rows)


def reference_rows(summary: pd.DataFrame) -> pd.DataFrame:
    """The rows speedups are measured against: the reference strategy at one device,
    where it ran with a finite loss (a diverged run's times are not a baseline)."""
    ran = summary["status"] == "ok" if "status" in summary else True
    ref = (summary["strategy"] == REFERENCE) & (summary["devices"] == 1) & (summary["ac"] == "none")
    return summary[ref & ran]


def speedup(rows: pd.DataFrame, summary: pd.DataFrame) -> pd.Series:
    """Each row's throughput over the reference's in the same variant (NaN without one).
    `rows` need a `throughput` column and the variant keys; `summary`, its reference rows'
    throughput."""
    keys = list(VARIANT_KEYS)
    base = reference_rows(summary).set_index(keys)["throughput"].rename("_reference")
    return rows["throughput"] / rows.join(base, on=keys)["_reference"]


def speedup_intervals(summary: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """speedup_ci_low/high and efficiency_ci_low/high of every row with a reference to
    compare with: the interval of T_ref / T_cell x (B_cell / B_ref), which is the
    throughput ratio under both strong and weak scaling (see `speedup`)."""
    variant_keys = list(VARIANT_KEYS)
    keys = [*variant_keys, "ac", "strategy", "devices"]
    boot = cell_draws(steps, keys)
    out = pd.DataFrame(
        np.nan,
        index=summary.index,
        columns=["speedup_ci_low", "speedup_ci_high", "efficiency_ci_low", "efficiency_ci_high"],
    )
    base_batch = reference_rows(summary).set_index(variant_keys)["global_batch"]
    for i, row in summary.iterrows():
        key = tuple(row[k] for k in keys)
        variant = tuple(row[k] for k in variant_keys)
        base_key = (*variant, "none", REFERENCE, 1)
        ranked = row.get("status", "ok") == "ok" and variant in base_batch.index
        if not ranked or key not in boot or base_key not in boot:
            continue
        batch_ratio = row["global_batch"] / base_batch.loc[variant]
        lo, hi = interval(boot[base_key] / boot[key] * batch_ratio)
        out.loc[i] = [lo, hi, lo / row["devices"], hi / row["devices"]]
    return out
