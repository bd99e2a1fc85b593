"""Render results/report.html: one self-contained file (CSS inline, plots as data URIs,
no network), from summary.csv, cells.csv and steps.csv only.

Templates, CSS and the per-strategy narratives live under report/ at the repository's
top (`TEMPLATES`; jinja2, autoescape on: every string from results or config is
escaped). The code
has one home per concern: loading (the tables), figures (the plots), prose (the
sentences); this module puts them into the template. Figures are named after the
summary columns they come from, so each number traces to a CSV row.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import jinja2
import numpy as np
import yaml

from parabench.analyze import equivalence, fingerprint
from parabench.catalog import CATALOG, LABELS, STRATEGIES
from parabench.hardware.fabric import PROFILES
from parabench.hardware.gpus import HEADROOM
from parabench.predict import scaling
from parabench.predict.published import torchtitan_check
from parabench.report.advice import advice
from parabench.report.answers import answers
from parabench.report.figures import advice_picture, plots
from parabench.report.loading import Results, row_anchor, rows
from parabench.report.prose import comm_words, environment, headlines, outcome, why

__all__ = ["LABELS", "TEMPLATES", "Results", "build_context", "load_config", "render"]

# The templates: report/ at the repository's top, beside workflow/.
TEMPLATES = Path(__file__).resolve().parents[3] / "report"


def build_context(r: Results, config: dict) -> dict:
    s = r.summary
    device_types = set(r.cells["device_type"].dropna().astype(str)) - {""}
    per_strategy = {}
    for strat in STRATEGIES:
        of_strategy = s[s["strategy"] == strat]
        if not of_strategy.empty:
            per_strategy[strat] = rows(of_strategy)
    diffs = s[s["rel_param_diff"].notna()]
    advised, pictures = advice(r.advise, r.torchtitan, s), {}
    for sec in advised["sections"]:  # the recommendation and its runners-up, drawn
        if sec.get("best"):
            sec["picture"] = f"advice-{sec['model']}-n{sec['gpus']}"
            pictures[sec["picture"]] = advice_picture([sec["best"], *sec["runners"]], HEADROOM)
    return {
        "outcome": outcome(s, r.cells),
        "headlines": headlines(s, r.collectives),
        "anatomy": [
            {**row, "why": why(row, r.collectives)} for row in rows(s[s["status"] == "ok"])
        ],
        "checks": _checks(s[s["status"] == "ok"]),
        "layouts": answers(s),
        "model_error": scaling.error_table(s),
        "at_scale": at_scale(r),
        "plan_wanted": bool((config.get("plan") or {}).get("enabled")),
        "torchtitan": torchtitan_check(PROFILES["h100-nvlink-ndr400"]),
        "advice": advised,
        "advise_wanted": bool((config.get("advise") or {}).get("enabled")),
        # the curves at the largest message measured (64 MiB by default)
        "collectives_largest": rows(
            r.collectives[r.collectives["bytes"] == r.collectives["bytes"].max()]
            if not r.collectives.empty
            else r.collectives
        ),
        "cpu_run": "cuda" not in device_types and config.get("device") != "cuda",
        "scaling": ", ".join(sorted(set(s["scaling"]))),
        "summary": rows(s),
        "per_strategy": per_strategy,
        "labels": LABELS,
        "strategies": [x for x in STRATEGIES if x in per_strategy],
        "equivalence": rows(diffs),
        "not_comparable": rows(s[s["status"] == "diverged"]),
        "tolerance_factor": equivalence.TOLERANCE_FACTOR,
        "tolerance_floor": equivalence.FLOOR,
        "kept_whole": fingerprint.EXACT_MAX,
        "sampled": fingerprint.SAMPLE,
        "sketch_error": fingerprint.SKETCH_ERROR,
        "narratives": {name: CATALOG[name].narrative for name in per_strategy},
        "microbatches": config.get("pipeline", {}).get("microbatches"),
        "problems": rows(r.cells[r.cells["status"] != "ok"]),
        "environment": environment(r.cells),
        "config_yaml": yaml.safe_dump(config, sort_keys=False),
        "launches": rows(
            r.cells[["panel", "strategy", "devices", "repeat", "status", "launch_command"]]
        ),
        "n_cells": len(r.cells),
        "n_ok": int((r.cells["status"] == "ok").sum()),
        "timed_steps": int((r.steps["phase"] == "timed").sum()) if len(r.steps) else 0,
        "plots": {**plots(r), **pictures},
    }


def at_scale(r: Results) -> dict | None:
    """The plan (plan.csv): its rows, and where each strategy fits."""
    p = r.plan
    if p.empty:
        return None
    ok = p[p["status"] == "ok"]
    fit = []
    for (model, strat), g in ok.groupby(["model", "strategy"], sort=False):
        g = g.sort_values("world_size")
        yes = g.loc[g["fits"] == True, "world_size"].tolist()  # noqa: E712 (None: unknown)
        no = g.loc[g["fits"] == False, "world_size"].tolist()  # noqa: E712
        name = f"{model}, {LABELS.get(strat, strat)}"
        if not no:
            fit.append(
                f"{name}: fits one device's memory at every planned N ({', '.join(map(str, yes))})"
            )
        elif not yes:
            fit.append(f"{name}: does not fit one device's memory at any planned N")
        else:
            fit.append(
                f"{name}: fits at N = {', '.join(map(str, yes))}; does not at "
                f"N = {', '.join(map(str, no))}"
            )
    fabric = p["fabric"].dropna()
    source = p["fabric_source"].dropna()
    return {
        "rows": rows(p),
        "fit_sentences": fit,
        "scaling": ", ".join(sorted(set(p["scaling"].dropna()))),
        "fabric": fabric.iloc[0] if len(fabric) else "",
        "fabric_source": source.iloc[0] if len(source) else "",
    }


def _checks(ok) -> dict:
    """How many cells' anatomies every check confirms, and how many were profiled at
    most 10% above their timed step."""
    with_anatomy = ok[ok["compute_s"].notna()]
    return {
        "cells": len(with_anatomy),
        "agree": int((~with_anatomy["anatomy_flag"].astype(bool)).sum()),
        "light": int((with_anatomy["profiler_overhead"] <= 1.10).sum()),
    }


def _filters(env: jinja2.Environment) -> None:
    def num(v, fmt="{:.3g}", missing="—"):
        try:
            if v is None or (isinstance(v, float) and np.isnan(v)):
                return missing
        except TypeError:
            return missing
        return fmt.format(v)

    env.filters["num"] = num
    env.filters["x"] = lambda v: num(v, "{:.2f}×")
    env.filters["pct"] = lambda v: num(v, "{:.0%}")
    env.filters["ms"] = lambda v: num(v * 1e3 if isinstance(v, int | float) else v, "{:.2f} ms")
    env.filters["mib"] = lambda v: num(v / 2**20 if isinstance(v, int | float) else v, "{:.0f} MiB")
    env.filters["sci"] = lambda v: num(v, "{:.1e}")
    # GiB, or MiB below one (a CPU run's small models)
    env.filters["gib"] = lambda v: (
        num(v / 2**30, "{:,.1f} GiB")
        if isinstance(v, int | float) and v >= 2**30
        else num(v / 2**20 if isinstance(v, int | float) else v, "{:,.1f} MiB")
    )
    # a step of any length: ms below a second, s above
    env.filters["dur"] = lambda v: (
        num(v, "{:.3g} s")
        if isinstance(v, int | float) and v >= 1
        else num(v * 1e3 if isinstance(v, int | float) else v, "{:.3g} ms")
    )
    env.filters["anchor"] = row_anchor
    env.filters["comm"] = comm_words


def render(
    results: Path, templates: Path, config: dict, out: Path, plots_dir: Path | None = None
) -> None:
    """The report; with `plots_dir`, each plot also as its own PNG (for Snakemake's
    report, which lists files)."""
    from parabench.records import atomic_write_bytes

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(templates),
        autoescape=True,  # every string from results or config is escaped
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    _filters(env)
    ctx = build_context(Results.load(results, config), config)
    html = env.get_template("report.html.j2").render(**ctx)
    if plots_dir is not None:
        Path(plots_dir).mkdir(parents=True, exist_ok=True)
        for name, uri in ctx["plots"].items():
            png = base64.b64decode(uri.split(",", 1)[1])
            atomic_write_bytes(Path(plots_dir) / f"{name}.png", png)
    atomic_write_bytes(out, html.encode())


def load_config(text: str) -> dict:
    return json.loads(text) if text else {}
