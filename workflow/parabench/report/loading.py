"""The three tables the report reads (summary.csv, cells.csv, steps.csv), loaded once,
each row labelled with its panel: a model and the variant it ran in."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from parabench.records import VARIANT_KEYS
from parabench.run import collectives


@dataclass
class Results:
    summary: pd.DataFrame
    cells: pd.DataFrame
    steps: pd.DataFrame
    collectives: pd.DataFrame  # empty when no benchmark ran (no multi-rank cell)
    plan: pd.DataFrame  # empty when no plan ran (plan.enabled false)
    advise: pd.DataFrame  # empty when advise did not run (advise.enabled false)
    torchtitan: pd.DataFrame  # advise's check against torchtitan's runs, where it ran

    @classmethod
    def load(cls, results: Path, config: dict) -> Results:
        """The tables in `results`; plan.csv and advise's only where `config` runs
        them (the rules' inputs say the same): one left by an earlier run, before
        plan.enabled or advise.enabled was turned off, is no part of this one."""
        tables = [pd.read_csv(results / f"{n}.csv") for n in ("summary", "cells", "steps")]
        for t in tables:  # one label per (model, variant): the plots' panels, the headlines'
            t["panel"] = panel_labels(t)
        path = results / "collectives.csv"
        # the curves over whole worlds: a group's (a layout's dimension) is advise's
        curves = collectives.whole(pd.read_csv(path)) if path.exists() else pd.DataFrame()
        plan, advise = config.get("plan") or {}, config.get("advise") or {}
        ran = {
            "plan.csv": plan.get("enabled"),
            "advise.csv": advise.get("enabled"),
            "advise-torchtitan.csv": advise.get("enabled") and advise.get("torchtitan"),
        }
        extra = [
            pd.read_csv(path) if wanted and (path := results / name).exists() else pd.DataFrame()
            for name, wanted in ran.items()
        ]
        return cls(*tables, curves, *extra)


def panel_labels(df: pd.DataFrame) -> pd.Series:
    """'mlp · bf16 · adamw · compiled': a model and the variant it ran in."""
    if df.empty:
        return pd.Series(dtype=str)
    compiled = df["compile"].astype(str).str.lower() == "true"
    return (
        df["model"].astype(str)
        + " · "
        + df["precision"].astype(str)
        + " · "
        + df["optimizer"].astype(str)
        + compiled.map({True: " · compiled", False: ""})
        + df["ac"].astype(str).map(lambda ac: "" if ac in ("none", "nan") else f" · AC {ac}")
    )


def rows(df: pd.DataFrame) -> list[dict]:
    """Table rows for the templates, missing values as None (not NaN, which is truthy)."""
    return df.astype(object).where(df.notna(), None).to_dict("records")


def row_anchor(row) -> str:
    """The HTML id of a summary row: every key, so each row has its own."""
    keys = [*VARIANT_KEYS, "ac", "strategy", "devices"]
    return "row-" + "-".join(str(row[k]) for k in keys)
