"""Render results/report.html: one self-contained file (CSS inline, plots as data URIs,
no network), from summary.csv, cells.csv and steps.csv only.

Templates, CSS and the per-strategy narratives live under report/ (jinja2, autoescape
on: every string from results or config is escaped). Figures are computed here, named
after the summary columns they come from, so each number traces to a CSV row.
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display; set before pyplot is imported

import jinja2
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
import yaml

from parabench import equivalence
from parabench.catalog import CATALOG, LABELS, STRATEGIES
from parabench.records import VARIANT_KEYS


@dataclass
class Results:
    summary: pd.DataFrame
    cells: pd.DataFrame
    steps: pd.DataFrame

    @classmethod
    def load(cls, results: Path) -> Results:
        tables = [pd.read_csv(results / f"{n}.csv") for n in ("summary", "cells", "steps")]
        for t in tables:  # one label per (model, variant): the plots' panels, the headlines'
            t["panel"] = panel_labels(t)
        return cls(*tables)


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
    )


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _order(df: pd.DataFrame) -> list[str]:
    return [s for s in STRATEGIES if s in set(df["strategy"])]


def repeat_speedups(cells: pd.DataFrame, summary: pd.DataFrame) -> pd.DataFrame:
    """Speedup of each repeat (one point per launch), against single's median."""
    ok = cells[cells["status"] == "ok"].copy()
    ok["throughput"] = ok["global_batch"] / ok["step_time_median_s"]
    base = summary[(summary["strategy"] == "single") & (summary["devices"] == 1)]
    base_thr = base.set_index("panel")["throughput"]
    ok["speedup"] = ok["throughput"] / ok["panel"].map(base_thr)
    ok["efficiency"] = ok["speedup"] / ok["devices"]
    return ok


def plots(r: Results) -> dict[str, str]:
    sns.set_theme(style="whitegrid", context="notebook")
    ok = r.summary[r.summary["status"] == "ok"]
    if ok.empty:
        return {}
    reps = repeat_speedups(r.cells, r.summary)
    order = _order(ok)
    palette = dict(zip(STRATEGIES, sns.color_palette("colorblind", len(STRATEGIES)), strict=True))
    panels = list(dict.fromkeys(ok["panel"]))
    devices = sorted(ok["devices"].unique())
    out: dict[str, str] = {}

    def per_model(title: str, y: str, ylabel: str, ideal=None, logy=False) -> str:
        fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False)
        for ax, panel in zip(axes[0], panels, strict=True):
            sub = ok[ok["panel"] == panel]
            if ideal is not None:
                ax.plot(devices, [ideal(n) for n in devices], "k--", lw=1, label="ideal")
            sns.lineplot(
                data=sub,
                x="devices",
                y=y,
                hue="strategy",
                hue_order=order,
                palette=palette,
                marker="o",
                ax=ax,
                legend=ax is axes[0][0],
            )
            if y in reps:
                sns.stripplot(
                    data=reps[reps["panel"] == panel],
                    x="devices",
                    y=y,
                    hue="strategy",
                    hue_order=order,
                    palette=palette,
                    ax=ax,
                    native_scale=True,
                    legend=False,
                    alpha=0.6,
                    size=4,
                    jitter=0.08,
                )
            ax.set(title=f"{title} — {panel}", xlabel="devices", ylabel=ylabel, xticks=devices)
            if logy:
                ax.set_yscale("log")
        if axes[0][0].get_legend():
            sns.move_legend(
                axes[0][0],
                "upper left",
                bbox_to_anchor=(0, -0.18),
                ncol=4,
                frameon=False,
                title=None,
            )
        return _png(fig)

    out["speedup"] = per_model("Speedup vs one device", "speedup", "speedup (×)", ideal=float)
    out["efficiency"] = per_model(
        "Scaling efficiency", "efficiency", "speedup / devices", ideal=lambda n: 1.0
    )
    out["throughput"] = per_model("Throughput", "throughput", "samples / s")

    timed = r.steps[r.steps["phase"] == "timed"].copy()
    if not timed.empty:
        timed["cell"] = timed["strategy"] + " ×" + timed["devices"].astype(str)
        cell_order = [
            f"{s} ×{n}" for s in order for n in devices if f"{s} ×{n}" in set(timed["cell"])
        ]
        g = sns.catplot(
            data=timed,
            kind="box",
            x="step_time_s",
            y="cell",
            col="panel",
            order=cell_order,
            hue="strategy",
            hue_order=order,
            palette=palette,
            height=0.32 * len(cell_order) + 1.5,
            aspect=1.6,
            legend=False,
            sharex=False,
            fliersize=2,
        )
        g.set_axis_labels("step time (s), every timed step of every repeat", "")
        g.set_titles("Step-time distribution — {col_name}")
        out["step_times"] = _png(g.figure)

    bars = ok.assign(
        cell=ok["strategy"] + " ×" + ok["devices"].astype(str),
        peak_memory_mib=ok["peak_memory_bytes"] / 2**20,
        mfu_pct=100 * ok["mfu"],
    )
    for key, col, label in (
        ("memory", "peak_memory_mib", "peak memory per device (MiB)"),
        ("mfu", "mfu_pct", "MFU (% of measured peak)"),
    ):
        g = sns.catplot(
            data=bars,
            kind="bar",
            x=col,
            y="cell",
            col="panel",
            hue="strategy",
            hue_order=order,
            palette=palette,
            legend=False,
            sharex=False,
            height=0.32 * bars["cell"].nunique() + 1.5,
            aspect=1.6,
        )
        g.set_axis_labels(label, "")
        g.set_titles("{col_name}")
        out[key] = _png(g.figure)
    return out


def _fmt_x(v: float) -> str:
    return f"{v:.2f}×"


def headlines(summary: pd.DataFrame) -> list[dict]:
    """Per model, variant and device count: which strategy was fastest and by how much,
    as sentences built from summary.csv (each links the row it comes from). Emulated
    cells (stages stand-ins on one CPU) are not ranked: their speedup is not a real one."""
    out = []
    ok = summary[(summary["status"] == "ok") & summary["speedup"].notna()]
    for panel in dict.fromkeys(summary["panel"]):
        for n in sorted(ok.loc[ok["panel"] == panel, "devices"].unique()):
            if n == 1:
                continue
            at_n = ok[(ok["panel"] == panel) & (ok["devices"] == n)]
            ranked = at_n[~at_n["emulated"].astype(bool)].sort_values("speedup", ascending=False)
            emulated = [LABELS[s] for s in at_n.loc[at_n["emulated"].astype(bool), "strategy"]]
            if ranked.empty:
                continue
            best = ranked.iloc[0]
            name = LABELS.get(best["strategy"], best["strategy"])
            if best["speedup"] >= 1:
                lead = f"{_fmt_x(best['speedup'])} the throughput of one device"
            else:
                lead = (
                    f"only {_fmt_x(best['speedup'])} the throughput of one device, "
                    "slower than not parallelising at all"
                )
            text = (
                f"At {n} devices, the fastest was {name}: {lead} "
                f"({best['efficiency']:.0%} scaling efficiency)"
            )
            others = [
                f"{LABELS.get(r['strategy'], r['strategy'])} {_fmt_x(r['speedup'])}"
                for _, r in ranked.iloc[1:].iterrows()
            ]
            if others:
                text += "; then " + ", ".join(others)
            text += "."
            if emulated:
                text += f" Not ranked: {', '.join(emulated)} (stages emulated on one device)."
            out.append(
                {
                    "panel": panel,
                    "anchor": row_anchor(best),
                    "devices": int(n),
                    "text": text,
                    "strategy": best["strategy"],
                    "speedup": float(best["speedup"]),
                    "efficiency": float(best["efficiency"]),
                }
            )
    return out


def environment(cells: pd.DataFrame) -> list[tuple[str, str]]:
    """Distinct values of each environment column over all cells."""
    cols = [
        ("host", "host"),
        ("device_type", "device type"),
        ("device_names", "devices"),
        ("cpu_model", "CPU"),
        ("torch", "torch"),
        ("cuda", "CUDA"),
        ("nccl", "NCCL"),
        ("python", "Python"),
        ("git_commit", "git commit"),
        ("config_hash", "config hash"),
        ("slurm_job_id", "Slurm job ids"),
        ("gpus_given", "GPUs Slurm gave (SLURM_GPUS_ON_NODE)"),
        ("cuda_visible_devices", "CUDA_VISIBLE_DEVICES"),
    ]
    out = []
    for col, label in cols:
        if col not in cells:
            continue
        vals = [str(v) for v in cells[col].dropna().unique() if str(v) not in ("", "nan")]
        out.append((label, ", ".join(sorted(vals)) or "—"))
    return out


def rows(df: pd.DataFrame) -> list[dict]:
    """Table rows for the templates, missing values as None (not NaN, which is truthy)."""
    return df.astype(object).where(df.notna(), None).to_dict("records")


def build_context(r: Results, config: dict) -> dict:
    s = r.summary
    device_types = set(r.cells["device_type"].dropna().astype(str)) - {""}
    per_strategy = {}
    for strat in STRATEGIES:
        of_strategy = s[s["strategy"] == strat]
        if not of_strategy.empty:
            per_strategy[strat] = rows(of_strategy)
    diffs = s[s["rel_param_diff"].notna()]
    return {
        "headlines": headlines(s),
        "cpu_run": "cuda" not in device_types,
        "scaling": ", ".join(sorted(set(s["scaling"]))),
        "summary": rows(s),
        "per_strategy": per_strategy,
        "labels": LABELS,
        "strategies": [x for x in STRATEGIES if x in per_strategy],
        "equivalence": rows(diffs),
        "tolerance_factor": equivalence.TOLERANCE_FACTOR,
        "tolerance_floor": equivalence.FLOOR,
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
        "plots": plots(r),
    }


def row_anchor(row) -> str:
    """The HTML id of a summary row: every key, so each row has its own."""
    keys = [*VARIANT_KEYS, "strategy", "devices"]
    return "row-" + "-".join(str(row[k]) for k in keys)


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
    env.filters["anchor"] = row_anchor


def render(results: Path, templates: Path, config: dict, out: Path) -> None:
    from parabench.records import atomic_write_bytes

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(templates),
        autoescape=True,  # every string from results or config is escaped
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    _filters(env)
    ctx = build_context(Results.load(results), config)
    html = env.get_template("report.html.j2").render(**ctx)
    atomic_write_bytes(out, html.encode())


def load_config(text: str) -> dict:
    return json.loads(text) if text else {}
