"""`parabench compare A B`: two runs side by side, each change with its uncertainty.

For every cell that ran in both (same model, variant, strategy and devices), the ratio
of B's headline step time to A's, with a 95% bootstrap interval (both runs' repeats
and steps resampled independently, as for the report's intervals), and a verdict:
`faster` (B's whole interval below A's), `slower`, or `indistinguishable` at this
noise. Speedups of both runs are shown beside it.

Runs on different hardware, or whose cells were set differently (batch, steps, model
size), are refused with what differs, unless forced: then the differences head the
comparison. A different torch or driver is not refused: that is what one compares.
Its outputs never land inside either run (`refuse_outputs_inside`).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from parabench.analyze import stats
from parabench.records import SUMMARY_KEYS

HARDWARE = ("device_type", "device_names", "cpu_model")
SETTINGS = ("global_batch", "scaling", "steps", "warmup", "options")
SETTINGS_SUMMARY = ("flops_per_step",)  # the model's size, as FLOPs per step
COLUMNS = (
    *SUMMARY_KEYS,
    "step_time_a_s",
    "step_time_b_s",
    "ratio",
    "ratio_ci_low",
    "ratio_ci_high",
    "verdict",
    "speedup_a",
    "speedup_b",
)


class CompareError(ValueError):
    """The runs cannot be compared as they are; the message says what differs."""


def refuse_outputs_inside(a_dir: Path, b_dir: Path, outputs: dict[str, Path]) -> None:
    """CompareError when an output (`outputs`: option -> path) would land inside run A
    or run B, or two outputs are one file. A results directory is its run's record:
    compare reads its summary, cells and steps tables, and the rest (report.html,
    runs/...) is the run's too, so no file under it is compare's to write, new or not
    (the CSV, beside --out by default, once replaced runB/summary.csv). Symbolic links
    are followed, so another spelling of a path inside a run is refused alike."""
    runs = {"A": Path(a_dir).resolve(), "B": Path(b_dir).resolve()}
    seen: dict[Path, str] = {}
    for option, path in outputs.items():
        where = Path(path).resolve()
        for name, run in runs.items():
            if where.is_relative_to(run):
                raise CompareError(
                    f"{option} {path} lies inside run {name} ({run}): a comparison "
                    "never writes into the runs it reads; name a path outside both"
                )
        if where in seen:
            raise CompareError(f"{seen[where]} and {option} are one file: {path}")
        seen[where] = option


def _load(results: Path) -> dict[str, pd.DataFrame]:
    try:
        return {
            n: pd.read_csv(Path(results) / f"{n}.csv", keep_default_na=True)
            for n in ("summary", "cells", "steps")
        }
    except OSError as e:
        raise CompareError(f"{results}: not a results directory ({e})") from None


def _values(df: pd.DataFrame, col: str) -> set[str]:
    if col not in df:
        return set()
    return {str(v) for v in df[col].dropna() if str(v) not in ("", "nan")}


def differences(a: dict, b: dict) -> list[str]:
    """What makes the two runs not comparable: hardware, or a cell's settings."""
    out = []
    for col in HARDWARE:
        va, vb = _values(a["cells"], col), _values(b["cells"], col)
        if va != vb:
            out.append(f"hardware: {col} is {sorted(va)} in A, {sorted(vb)} in B")
    keys = list(SUMMARY_KEYS)
    for name, cols in (("cells", SETTINGS), ("summary", SETTINGS_SUMMARY)):
        ta = a[name].drop_duplicates(keys).set_index(keys)
        tb = b[name].drop_duplicates(keys).set_index(keys)
        for key in ta.index.intersection(tb.index):
            for col in cols:
                if col not in ta or col not in tb:
                    continue
                x, y = ta.loc[key, col], tb.loc[key, col]
                if pd.isna(x) and pd.isna(y):
                    continue
                if str(x) != str(y):
                    cell = "/".join(map(str, key))
                    out.append(f"settings: {cell}: {col} is {x} in A, {y} in B")
    return out


def compare(a_dir: Path, b_dir: Path, force: bool = False) -> tuple[pd.DataFrame, list[str]]:
    a, b = _load(a_dir), _load(b_dir)
    diffs = differences(a, b)
    if diffs and not force:
        raise CompareError(
            "the runs differ, so their numbers do not compare (--force to compare anyway):\n  - "
            + "\n  - ".join(diffs)
        )
    keys = list(SUMMARY_KEYS)
    draws_a = stats.cell_draws(a["steps"], keys)
    draws_b = stats.cell_draws(b["steps"], keys)
    sa, sb = (x["summary"].set_index(keys) for x in (a, b))
    rows = []
    for key in sa.index.intersection(sb.index):
        if key not in draws_a or key not in draws_b:
            continue
        ratio = draws_b[key] / draws_a[key]
        lo, hi = stats.interval(ratio)
        ta, tb = sa.loc[key, "step_time_s"], sb.loc[key, "step_time_s"]
        rows.append(
            {
                **dict(zip(keys, key, strict=True)),
                "step_time_a_s": ta,
                "step_time_b_s": tb,
                "ratio": tb / ta,
                "ratio_ci_low": lo,
                "ratio_ci_high": hi,
                "verdict": stats.verdict(lo, hi),
                "speedup_a": sa.loc[key, "speedup"],
                "speedup_b": sb.loc[key, "speedup"],
            }
        )
    return pd.DataFrame(rows, columns=list(COLUMNS)), diffs


def render(table: pd.DataFrame, diffs: list[str], a: Path, b: Path, templates: Path, out: Path):
    import jinja2

    from parabench.records import atomic_write_bytes
    from parabench.report import _filters
    from parabench.report.loading import rows

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(templates),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    _filters(env)
    counts = table["verdict"].value_counts().to_dict()
    html = env.get_template("compare.html.j2").render(
        a=str(a), b=str(b), rows=rows(table), diffs=diffs, counts=counts
    )
    atomic_write_bytes(out, html.encode())
