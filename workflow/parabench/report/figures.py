"""The report's plots, from the summary and the cells, as inline PNG data URIs."""

from __future__ import annotations

import base64
import io

import matplotlib

matplotlib.use("Agg")  # no display; set before pyplot is imported

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from parabench.analyze import stats
from parabench.catalog import STRATEGIES
from parabench.report.loading import Results

DPI = 110
# Panels side by side before the next row: a row of one panel per (model, variant) was
# wider than Agg can draw (2^16 pixels) past about 115 panels.
COLUMNS = 3
# Catplot panels side by side: each is a list of cells, read across; two fit a page's
# width at a legible size (three made each a thumbnail).
FACETS = 2
PANEL_WIDTH = 6.5  # inches: two panels span the page at about the text's size
# Agg's limit on either side of an image, in pixels, with a margin for the tight bbox.
MAX_PIXELS = 60_000


def _png(fig) -> str:
    """The figure as a PNG data URI; one past Agg's size limit (a sweep of hundreds of
    panels, stacked) is drawn at a lower resolution rather than not at all."""
    dpi = min(DPI, MAX_PIXELS / max(fig.get_size_inches()))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _order(df: pd.DataFrame) -> list[str]:
    return [s for s in STRATEGIES if s in set(df["strategy"])]


def repeat_speedups(cells: pd.DataFrame, summary: pd.DataFrame) -> pd.DataFrame:
    """Speedup of each repeat (one point per launch), against the reference's median."""
    ok = cells[cells["status"] == "ok"].copy()
    ok["throughput"] = ok["global_batch"] / ok["step_time_median_s"]
    ok["speedup"] = stats.speedup(ok, summary)
    ok["efficiency"] = ok["speedup"] / ok["devices"]
    return ok


def _by_cell(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with one panel per model and variant whatever its activation checkpointing,
    and each cell named by its strategy, devices and AC level ("ddp ×2 AC full"): an AC
    cell sits beside the cell it is compared with."""
    ac = df["ac"].astype(str).map(lambda a: "" if a in ("none", "nan") else f" AC {a}")
    return df.assign(
        panel=df["panel"].str.replace(r" · AC \S+$", "", regex=True),
        cell=df["strategy"] + " ×" + df["devices"].astype(str) + ac,
    )


def _panel_height(df: pd.DataFrame) -> float:
    """Inches for a panel of cells: the most cells any one panel holds."""
    return 0.32 * df.groupby("panel")["cell"].nunique().max() + 1.5


def plots(r: Results) -> dict[str, str]:
    sns.set_theme(style="whitegrid", context="notebook")
    ok = r.summary[r.summary["status"] == "ok"]
    if ok.empty:
        return {}
    reps = repeat_speedups(r.cells, r.summary)
    order = _order(ok)
    # one colour per strategy: the colour-blind palette's ten, then its darker shades
    colours = sns.color_palette("colorblind") + sns.color_palette("dark")
    palette = dict(zip(STRATEGIES, colours, strict=False))
    panels = list(dict.fromkeys(ok["panel"]))
    devices = sorted(ok["devices"].unique())
    out: dict[str, str] = {}

    def per_model(title: str, y: str, ylabel: str, ideal=None, logy=False) -> str:
        cols = min(COLUMNS, len(panels))
        rows = -(-len(panels) // cols)
        fig, grid = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
        axes = grid.reshape(1, -1)  # row-major: the first panel's axes carry the legend
        for ax in axes[0][len(panels) :]:
            ax.set_visible(False)
        for ax, panel in zip(axes[0], panels, strict=False):
            sub = ok[ok["panel"] == panel]
            if ideal is not None:
                ax.plot(
                    devices,
                    [ideal(n) for n in devices],
                    "k--",
                    lw=1,
                    label="ideal on this hardware",
                )
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
            lo, hi = f"{y}_ci_low", f"{y}_ci_high"
            if lo in sub and sub[lo].notna().any():  # the 95% bootstrap intervals
                for strategy, g in sub.groupby("strategy"):
                    ax.errorbar(
                        g["devices"],
                        g[y],
                        # a percentile interval may sit off the point estimate
                        yerr=[(g[y] - g[lo]).clip(lower=0), (g[hi] - g[y]).clip(lower=0)],
                        fmt="none",
                        ecolor=palette.get(strategy, "k"),
                        capsize=3,
                        lw=1,
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
            # below a single row; above the first of several, where a row follows below
            where = ("upper left", (0, -0.18)) if rows == 1 else ("lower left", (0, 1.1))
            sns.move_legend(
                axes[0][0],
                where[0],
                bbox_to_anchor=where[1],
                ncol=4,
                frameon=False,
                title=None,
            )
        return _png(fig)

    # A curve against devices needs two counts: at one (a GPU check on one GPU) the
    # repeats' jitter spread over an axis of one tick, and the bars below compare.
    if len(devices) > 1:
        # The hardware's ideal, not n: on CPU the ranks share the cores single used.
        ideal = ok.groupby("devices")["ideal_speedup"].max().to_dict()
        out["speedup"] = per_model(
            "Speedup vs one device", "speedup", "speedup (×)", ideal=lambda n: ideal.get(n, n)
        )
        out["efficiency"] = per_model(
            "Scaling efficiency",
            "efficiency",
            "speedup / devices",
            ideal=lambda n: ideal.get(n, n) / n,
        )
        out["throughput"] = per_model("Throughput", "throughput", "samples / s")

    timed = r.steps[r.steps["phase"] == "timed"]
    if not timed.empty:
        timed = _by_cell(timed)
        rank = {s: i for i, s in enumerate(order)}
        timed = timed.sort_values(
            ["strategy", "devices", "cell"],
            key=lambda c: c.map(rank) if c.name == "strategy" else c,
        )
        g = sns.catplot(
            data=timed,
            kind="box",
            x="step_time_s",
            y="cell",
            col="panel",
            col_wrap=min(FACETS, timed["panel"].nunique()),
            hue="strategy",
            hue_order=order,
            palette=palette,
            sharey=False,  # each panel its own cells, in the order sorted above
            height=_panel_height(timed),
            aspect=PANEL_WIDTH / _panel_height(timed),
            legend=False,
            sharex=False,
            fliersize=2,
        )
        g.set_axis_labels("step time (s), every timed step of every repeat", "")
        g.set_titles("Step-time distribution — {col_name}")
        out["step_times"] = _png(g.figure)

    bars = _by_cell(ok).assign(
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
            col_wrap=min(FACETS, bars["panel"].nunique()),
            hue="strategy",
            hue_order=order,
            palette=palette,
            legend=False,
            sharex=False,
            sharey=False,  # each panel its own cells: a panel of two is not one of twenty
            height=_panel_height(bars),
            aspect=PANEL_WIDTH / _panel_height(bars),
        )
        g.set_axis_labels(label, "")
        g.set_titles("{col_name}")
        out[key] = _png(g.figure)
    out.update(anatomy_plots(ok, palette, order))
    between = r.collectives[r.collectives["devices"] > 1] if not r.collectives.empty else None
    if between is not None and not between.empty:  # one rank's rows: no bus bandwidth
        out["collectives"] = collective_curves(between)
    if not r.plan.empty and (plan := plan_plots(r.plan)):
        out["plan"] = plan
    return out


PART_COLORS = {
    "compute_s": "#4c72b0",
    "comm_exposed_s": "#c44e52",
    "bubble_s": "#dd8452",
    "data_s": "#55a868",
    "other_s": "#a0a0a0",
}
PART_LABELS = {
    "compute_s": "compute",
    "comm_exposed_s": "communication not hidden",
    "bubble_s": "pipeline bubble",
    "data_s": "data",
    "other_s": "other (Python, launch)",
}


def anatomy_plots(ok: pd.DataFrame, palette: dict, order: list[str]) -> dict[str, str]:
    """Stacked bars of each cell's step anatomy (with the measured step as a tick), and
    the scaling model's prediction against the measurement."""
    cells = ok[ok["profiled_step_s"].notna()]
    if cells.empty:
        return {}
    out = {}
    panels = list(dict.fromkeys(cells["panel"]))
    heights = [cells[cells["panel"] == p].shape[0] for p in panels]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(8.5, 0.34 * sum(heights) + 1.4 * len(panels)), squeeze=False
    )
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        sub = cells[cells["panel"] == panel].copy()
        sub["rank"] = sub["strategy"].map({s: i for i, s in enumerate(order)})
        sub = sub.sort_values(["rank", "devices"], ascending=False)
        labels = sub["strategy"] + " ×" + sub["devices"].astype(str)
        left = np.zeros(len(sub))
        for part, color in PART_COLORS.items():
            values = sub[part].fillna(0).to_numpy() * 1e3
            ax.barh(labels, values, left=left, color=color, label=PART_LABELS[part])
            left += values
        ax.plot(sub["step_time_s"] * 1e3, labels, "k|", markersize=14, label="measured step")
        ax.set(title=f"Anatomy of a step — {panel}", xlabel="milliseconds per step")
    axes[0, 0].legend(loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    out["anatomy"] = _png(fig)

    pred = cells[cells["predicted_step_s"].notna()]
    if not pred.empty:
        fig, ax = plt.subplots(figsize=(5.6, 4.6))
        lo = min(pred["predicted_step_s"].min(), pred["step_time_s"].min()) * 0.7
        hi = max(pred["predicted_step_s"].max(), pred["step_time_s"].max()) * 1.4
        line = np.array([lo, hi])
        ax.fill_between(line, line * 0.75, line * 1.25, color="0.9", label="within 25%")
        ax.plot(line, line, "k--", lw=1)
        sns.scatterplot(
            data=pred.assign(devices=pred["devices"].astype(str)),
            x="step_time_s",
            y="predicted_step_s",
            hue="strategy",
            hue_order=[s for s in order if s in set(pred["strategy"])],
            palette=palette,
            style="devices",
            s=60,
            ax=ax,
        )
        ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi))
        ax.set(xlabel="measured step (s)", ylabel="predicted step (s)")
        ax.set_title("Scaling model: predicted against measured")
        sns.move_legend(ax, "upper left", bbox_to_anchor=(1.01, 1), frameon=False)
        out["predicted"] = _png(fig)
    return out


def collective_curves(curves: pd.DataFrame) -> str:
    """Bus bandwidth against message size, one line per op and device count."""
    data = curves.assign(
        devices=curves["devices"].astype(int).astype(str) + " ranks",
        MiB=curves["bytes"] / 2**20,
    )
    g = sns.relplot(
        data=data,
        kind="line",
        x="MiB",
        y="busbw_GBps",
        hue="op",
        col="devices",
        col_wrap=min(COLUMNS, curves["devices"].nunique()),
        marker="o",
        height=3.6,
        aspect=1.3,
    )
    g.set(xscale="log")
    g.set_axis_labels("message size (MiB)", "bus bandwidth (GB/s)")
    g.set_titles("Collectives — {col_name} (" + str(curves["backend"].iloc[0]) + ")")
    return _png(g.figure)


def plan_plots(plan: pd.DataFrame) -> str:
    """The planned worlds: predicted step and memory per rank against N, per strategy
    (log-log); memory measured, time predicted."""
    ok = plan[plan["status"] == "ok"]
    if ok.empty:
        return ""
    data = ok.assign(peak_MiB=ok["peak_memory_bytes"] / 2**20, step_ms=ok["predicted_step_s"] * 1e3)
    fig, axes = plt.subplots(1, 2, figsize=(10.4, 3.8))
    for ax, (y, label) in zip(
        axes,
        (("step_ms", "predicted step (ms)"), ("peak_MiB", "measured peak per rank (MiB)")),
        strict=True,
    ):
        sns.lineplot(
            data=data, x="world_size", y=y, hue="strategy", style="model", marker="o", ax=ax
        )
        ax.set(xscale="log", yscale="log", xlabel="world size N", ylabel=label)
    axes[0].get_legend().remove()
    sns.move_legend(axes[1], "upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.suptitle(f"At scale — fabric: {ok['fabric'].iloc[0]}")
    return _png(fig)


# advise.csv's memory at a rank's peak, by the tracker's categories (memory_bytes less
# their sum, the model's buffers or an earlier advise.csv's pipeline micro-batches in
# flight, drawn as activations)
MEMORY_KINDS = {
    "parameters": "param_bytes",
    "gradients": "grad_bytes",
    "optimizer state": "opt_bytes",
    "activations": "act_bytes",
    "temporaries": "temp_bytes",
}


def advice_picture(rows: list[dict], headroom: float) -> str:
    """The recommendation and its runners-up at a glance (advise.csv's rows, best
    first): memory per GPU by kind, measured, with the reserve the fit rule keeps free
    (on a GPU, the allocator's reserve, the CUDA context and NCCL's buffers; else
    `headroom` of the card), against the card; and the predicted step by part."""
    labels = [f"{int(r['rank'])}. {r['layout']}, micro {int(r['micro_batch'])}" for r in rows]
    gib = 2**30
    mem = pd.DataFrame(
        {kind: [float(r.get(col) or 0) / gib for r in rows] for kind, col in MEMORY_KINDS.items()},
        index=labels,
    )
    in_flight = [float(r["memory_bytes"]) / gib for r in rows] - mem.sum(axis=1)
    mem["activations"] += in_flight.clip(lower=0)
    card = float(rows[0]["device_memory_bytes"]) / gib
    held = [float(r.get("overhead_bytes") or 0) for r in rows]
    if all(held):  # a GPU: what the fit rule adds, as advise predicts it
        mem["allocator's reserve"] = [
            max(float(r["reserved_bytes"]) - float(r["memory_bytes"]), 0) / gib for r in rows
        ]
        mem["CUDA context, NCCL"] = [h / gib for h in held]
        what = "measured; the allocator's reserve and CUDA's and NCCL's predicted"
    else:  # a CPU profile, or rows from before: a tenth of the card kept free
        mem["reserve (kept free)"] = card * headroom
        what = "measured, the reserve a tenth"
    step = pd.DataFrame(
        {
            "compute": [r["compute_s"] - r["recompute_s"] for r in rows],
            "recompute": [r["recompute_s"] for r in rows],
            "exposed communication": [r["comm_s"] for r in rows],
            "bubble": [r["bubble_s"] for r in rows],
        },
        index=labels,
    )
    unit = "s" if step.sum(axis=1).max() >= 1 else "ms"  # legible ticks at either size
    step *= 1 if unit == "s" else 1e3
    c = sns.color_palette("colorblind")
    fig, axes = plt.subplots(1, 2, figsize=(12, 1.2 + 0.45 * len(rows)), sharey=True)
    greys = ["#d0d0d0", "#a0a0a0"][: len(mem.columns) - 5]
    mem.plot.barh(stacked=True, ax=axes[0], color=[*c[:5], *greys], width=0.7)
    axes[0].axvline(card, color="black", linewidth=1.2)
    axes[0].text(card, -0.6, " the card", va="top", fontsize=9)
    axes[0].set(xlabel=f"memory per GPU (GiB; {what})", ylabel="")
    step.plot.barh(stacked=True, ax=axes[1], color=[c[5], c[6], c[9], c[8]], width=0.7)
    axes[1].set(xlabel=f"step ({unit}; predicted)")
    axes[0].invert_yaxis()
    for ax in axes:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3, frameon=False)
    return _png(fig)
