"""The report's sentences, built from summary.csv and cells.csv: what happened, which
strategy was fastest and why. Each sentence links the row it comes from."""

from __future__ import annotations

import json
import re

import pandas as pd

from parabench.analyze import stats
from parabench.catalog import LABELS
from parabench.ops import OPS
from parabench.report.loading import row_anchor


def _fmt_x(v: float) -> str:
    return f"{v:.2f}×"


def _ci(row) -> tuple[float, float]:
    """A row's speedup interval (the point itself where none was computed)."""
    lo, hi = row.get("speedup_ci_low"), row.get("speedup_ci_high")
    if lo is None or pd.isna(lo):
        return (row["speedup"], row["speedup"])
    return (lo, hi)


def _ci_text(row) -> str:
    lo, hi = _ci(row)
    return "" if lo == hi else f" (95% CI {lo:.2f}–{hi:.2f})"


def headlines(summary: pd.DataFrame, curves: pd.DataFrame | None = None) -> list[dict]:
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
            # Claimed fastest only where its interval clears the runner-up's.
            ties = [
                LABELS.get(r["strategy"], r["strategy"])
                for _, r in ranked.iloc[1:].iterrows()
                if not stats.separated(_ci(best), _ci(r))
            ]
            if best["speedup"] >= 1:
                lead = f"{_fmt_x(best['speedup'])}{_ci_text(best)} the throughput of one device"
            else:
                lead = (
                    f"only {_fmt_x(best['speedup'])}{_ci_text(best)} the throughput of one "
                    "device, slower than not parallelising at all"
                )
            if ties:
                text = (
                    f"At {n} devices, {name} and {', '.join(ties)} are indistinguishable at "
                    f"this noise (their 95% intervals overlap); {name}'s median is {lead}"
                )
            else:
                text = f"At {n} devices, the fastest was {name}: {lead}"
            text += f" ({best['efficiency']:.0%} scaling efficiency)"
            others = [
                f"{LABELS.get(r['strategy'], r['strategy'])} {_fmt_x(r['speedup'])}{_ci_text(r)}"
                for _, r in ranked.iloc[1:].iterrows()
            ]
            if others:
                text += "; then " + ", ".join(others)
            text += "."
            if emulated:
                text += f" Not ranked: {', '.join(emulated)} (stages emulated on one device)."
            because = why(best, curves if curves is not None else pd.DataFrame())
            out.append(
                {
                    "panel": panel,
                    "anchor": row_anchor(best),
                    "devices": int(n),
                    "text": text,
                    "why": because,
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


def _cause(reason: str) -> str:
    """A reason without the rank that raised it, so the same cause on every rank and
    every cell counts once."""
    return re.sub(r"^rank \d+: ", "", str(reason)).strip()


def _causes(rows: pd.DataFrame, limit: int = 2) -> str:
    """The commonest causes among `rows`, with how many cells each explains."""
    counts = rows["reason"].fillna("").map(_cause).value_counts()
    if len(counts) == 1:
        return counts.index[0] or "no reason recorded"
    parts = [f"{why or 'no reason recorded'} ({k} of {len(rows)})" for why, k in counts.items()]
    more = f"; {len(parts) - limit} other causes in the table below" if len(parts) > limit else ""
    return "; ".join(parts[:limit]) + more


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def outcome(summary: pd.DataFrame, cells: pd.DataFrame) -> dict:
    """What happened in this sweep, in words, before any figure: every cell failed or
    was skipped (and why), a model or variant that did not run at all, one that ran
    only at one device, one without `single` (so without speedups). `level` is 'bad'
    when nothing ran, 'warn' when something is missing, '' when all ran."""
    failed = cells[cells["status"] == "failed"]
    skipped = cells[cells["status"] == "skipped"]
    n_ok = len(cells) - len(failed) - len(skipped)
    if n_ok == 0:
        if len(failed) and len(skipped):
            lines = [
                f"No cell ran: {_count(len(failed), 'cell')} failed and {len(skipped)} "
                f"{'was' if len(skipped) == 1 else 'were'} skipped.",
                f"Failed: {_causes(failed)}.",
                f"Skipped: {_causes(skipped)}.",
            ]
        elif len(failed):
            lines = [f"Every cell failed ({len(failed)} of {len(cells)}): {_causes(failed)}."]
        else:
            lines = [f"Every cell was skipped ({len(skipped)}): {_causes(skipped)}."]
        return {"level": "bad", "lines": lines}

    lines = []
    for panel in dict.fromkeys(summary["panel"]):
        rows = summary[summary["panel"] == panel]
        ok = rows[rows["status"] == "ok"]
        if ok.empty:
            lines.append(f"{panel}: no cell ran. {_causes(rows)}.")
            continue
        single = stats.reference_rows(rows)
        if single.empty:
            lines.append(
                f"{panel}: no single-device cell in this sweep, so there is no speedup "
                "(it is measured against single at one device); step times and "
                "throughput are shown."
            )
        elif single.iloc[0]["status"] != "ok":
            lines.append(
                f"{panel}: single at one device {single.iloc[0]['status']} "
                f"({_cause(single.iloc[0]['reason'])}), so speedups are left empty; step "
                "times and throughput are shown."
            )
        multi = rows[rows["devices"] > 1]
        if len(multi) and (multi["status"] != "ok").all():
            lines.append(
                f"{panel}: only one-device cells ran; every multi-device cell failed or "
                f"was skipped: {_causes(multi)}."
            )
    lines += _diverged(summary) + _overlapped(summary)
    if len(failed) or len(skipped):
        lines.append(
            f"{n_ok} of {len(cells)} cells ran; {len(failed)} failed and {len(skipped)} "
            f"{'was' if len(skipped) == 1 else 'were'} skipped (see the table of skipped and "
            "failed cells for each reason)."
        )
    return {"level": "warn" if lines else "", "lines": lines}


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def comm_words(comm_by_op: str) -> str:
    """'all-reduce of 2.4 MB (1 call) and broadcast of 2.4 MB (12 calls)', biggest first."""
    ops = json.loads(comm_by_op) if isinstance(comm_by_op, str) and comm_by_op else {}
    parts = []
    for op, v in sorted(ops.items(), key=lambda kv: -kv[1]["bytes"]):
        calls = round(v["count"])
        plural = "s" if calls != 1 else ""
        parts.append(f"{OPS[op].words} of {_size(v['bytes'])} ({calls} call{plural})")
    return " and ".join(parts[:2]) + (f" and {len(parts) - 2} more" if len(parts) > 2 else "")


def busbw_at(curves: pd.DataFrame, op: str, devices: int, nbytes: float) -> float | None:
    """The benchmark's bus bandwidth for `op` at the measured size nearest `nbytes`."""
    if curves.empty:
        return None
    c = curves[(curves["op"] == OPS[op].curve) & (curves["devices"] == devices)]
    if c.empty:
        return None
    return float(c.iloc[(c["bytes"] - nbytes).abs().argmin()]["busbw_GBps"])


def why(row, curves: pd.DataFrame) -> str:
    """One sentence from the cell's anatomy: where its step went, and, where
    communication shows, what it sent and at what bandwidth."""
    step = row.get("profiled_step_s")
    if step is None or pd.isna(step) or not step:
        return ""
    label, n = LABELS.get(row["strategy"], row["strategy"]), int(row["devices"])
    if row.get("anatomy_flag") is True:  # no confident sentence from unconfirmed parts
        return (
            f"{label} at {n} device{'s' if n != 1 else ''}: its anatomy and the checks "
            f"disagree, so no part is claimed: {row['anatomy_disagreement']}."
        )
    share = {
        k: (row.get(k) or 0) / step
        for k in ("compute_s", "comm_exposed_s", "bubble_s", "data_s", "other_s")
    }
    text = f"{label} at {n} device{'s' if n != 1 else ''}: "
    pieces = [f"{share['compute_s']:.0%} of the step is compute"]
    if share["comm_exposed_s"] >= 0.02 and row.get("comm_by_op"):
        ops = json.loads(row["comm_by_op"])
        top = max(ops, key=lambda k: ops[k]["bytes"]) if ops else None
        said = f"{share['comm_exposed_s']:.0%} is waiting: {comm_words(row['comm_by_op'])} per rank"
        if top and (bw := busbw_at(curves, top, n, ops[top]["bytes"] / max(1, ops[top]["count"]))):
            said += f" at {bw:.2g} GB/s bus bandwidth"
        pieces.append(said + " that compute did not hide, and slower ranks")
    if share["bubble_s"] >= 0.02:
        pieces.append(f"{share['bubble_s']:.0%} is pipeline bubble (stages waiting on a neighbour)")
    if share["data_s"] >= 0.02:
        pieces.append(f"{share['data_s']:.0%} is fetching data")
    if share["other_s"] >= 0.05:
        pieces.append(f"{share['other_s']:.0%} is Python and launch overhead")
    text += ", ".join(pieces[:-1]) + (" and " if len(pieces) > 1 else "") + pieces[-1] + "."
    if row.get("prediction_flag") is True and row.get("prediction_miss"):
        text += (
            f" The scaling model predicted {row['predicted_step_s'] * 1e3:.1f} ms against "
            f"{row['step_time_s'] * 1e3:.1f} ms measured; it misses {row['prediction_miss']}."
        )
    return text


def _cells_named(rows: pd.DataFrame) -> str:
    return ", ".join(
        f"{r['panel']}: {LABELS.get(r['strategy'], r['strategy'])} ×{r['devices']}"
        for _, r in rows.iterrows()
    )


def _diverged(summary: pd.DataFrame) -> list[str]:
    """Cells whose loss became NaN or inf: named, with the first one's reason."""
    rows = summary[summary["status"] == "diverged"]
    if rows.empty:
        return []
    return [
        f"Diverged: {_count(len(rows), 'cell')} ({_cells_named(rows)}): "
        f"{_cause(rows.iloc[0]['reason'])}. Their step times are shown but not ranked, and "
        "their parameters are not comparable with single's."
    ]


def _overlapped(summary: pd.DataFrame) -> list[str]:
    """Cells timed while another timed job ran on the same host: contaminated."""
    rows = summary[summary["overlapped"].fillna(False).astype(bool)]
    if rows.empty:
        return []
    return [
        f"Timed side by side: {_count(len(rows), 'cell')} ({_cells_named(rows)}) ran its "
        "timed steps while another timed job ran on the same host, so each slowed the "
        f"other and their times do not compare (first: with {rows.iloc[0]['overlapped_with']}). "
        "Run them one at a time (the default `timed_cells: 1`) before reading them."
    ]
