"""The questions layouts and activation checkpointing answer, from summary.csv alone:

- HSDP against FSDP at the same device count;
- each activation-checkpointing level against none (time, memory, what recompute cost);
- the best layout at a device count against the best one-dimensional strategy there;
- DDP against FSDP, with the anatomy's reason (exposed communication, bytes sent).

Each compares two summary rows by their step time's 95% intervals: "faster" only where
the intervals do not overlap, "no difference measured" where they do. Each sentence
names the rows it read, so every figure traces to a CSV row.
"""

from __future__ import annotations

import json
import math

import pandas as pd

from parabench.catalog import CATALOG, LABELS
from parabench.layout import MESH_DIMS

_CELL = ["model", "precision", "optimizer", "compile"]


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f} MiB"


def _interval(row) -> str:
    lo, hi = row.get("step_time_ci_low_s"), row.get("step_time_ci_high_s")
    if lo is None or hi is None or _nan(lo) or _nan(hi):
        return _ms(row["step_time_s"])
    return f"{_ms(row['step_time_s'])} (95% {lo * 1e3:.2f}–{hi * 1e3:.2f})"


def _nan(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def verdict(a, b) -> str:
    """How row a's step compares with row b's: by their intervals."""
    if _nan(a.get("step_time_ci_high_s")) or _nan(b.get("step_time_ci_low_s")):
        return "no interval to compare"
    if a["step_time_ci_high_s"] < b["step_time_ci_low_s"]:
        return f"faster, {b['step_time_s'] / a['step_time_s']:.2f}×"
    if b["step_time_ci_high_s"] < a["step_time_ci_low_s"]:
        return f"slower, {a['step_time_s'] / b['step_time_s']:.2f}×"
    return "no difference measured (the intervals overlap)"


def _name(row) -> str:
    ac = f", AC {row['ac']}" if row.get("ac", "none") != "none" else ""
    return f"{LABELS.get(row['strategy'], row['strategy'])} ×{int(row['devices'])}{ac}"


def _ok(summary: pd.DataFrame) -> pd.DataFrame:
    return summary[summary["status"] == "ok"]


def _pairs(summary: pd.DataFrame, a: str, b: str):
    """(row of a, row of b) at the same model, variant and device count (more than
    one: at one there is nothing to communicate), AC none."""
    ok = _ok(summary)
    ok = ok[(ok["ac"] == "none") & (ok["devices"] > 1)]
    for key, g in ok.groupby([*_CELL, "devices"], sort=False):
        ra, rb = g[g["strategy"] == a], g[g["strategy"] == b]
        if len(ra) and len(rb):
            yield key, ra.iloc[0], rb.iloc[0]


def by_dim(row) -> dict[str, float]:
    """Bytes per step by mesh dimension (comm_by_dim), {} where none was counted."""
    text = row.get("comm_by_dim")
    if not isinstance(text, str) or not text:
        return {}
    return {d: sum(v["bytes"] for v in ops.values()) for d, ops in json.loads(text).items()}


def _bytes_text(row) -> str:
    dims = by_dim(row)
    if not dims:
        return "bytes per dimension not counted"
    return ", ".join(f"{d} {_mib(b)}" for d, b in dims.items())


def hsdp_vs_fsdp(summary: pd.DataFrame) -> list[str]:
    out = []
    for key, h, f in _pairs(summary, "hsdp", "fsdp"):
        out.append(
            f"{key[0]} at {int(h['devices'])}: HSDP {_interval(h)} against FSDP "
            f"{_interval(f)}: HSDP is {verdict(h, f)}. Per step HSDP sends {_bytes_text(h)}; "
            f"FSDP {_bytes_text(f)}. HSDP keeps its all-gathers inside a shard group and "
            "all-reduces only the 1/shard gradient across replicas: on a cluster that is "
            "what crosses the slow links; on one host every link is the same."
        )
    return out


def ac_vs_none(summary: pd.DataFrame) -> list[str]:
    ok = _ok(summary)
    out = []
    for _, row in ok[ok["ac"] != "none"].iterrows():
        same = ok[
            (ok["ac"] == "none")
            & (ok["strategy"] == row["strategy"])
            & (ok["devices"] == row["devices"])
        ]
        for k in _CELL:
            same = same[same[k] == row[k]]
        if same.empty:
            out.append(f"{row['model']}, {_name(row)}: no cell without AC to compare with")
            continue
        base = same.iloc[0]
        extra = row["step_time_s"] - base["step_time_s"]
        saved = _saved_check(row, base)
        recompute = (
            f"The anatomy measured {_ms(row['recompute_s'])} of recompute in the step, "
            f"against {_ms(extra)} more step time."
            if not _nan(row.get("recompute_s"))
            else "Recompute was not measured (backward ran off the main thread)."
        )
        out.append(
            f"{row['model']}, {_name(row)}: {_interval(row)} against {_interval(base)} "
            f"without ({verdict(row, base)}). Peak memory "
            f"{_mib(row['peak_memory_bytes'])} against {_mib(base['peak_memory_bytes'])}."
            f"{saved} {recompute}"
        )
    return out


def _saved_check(row, base) -> str:
    """The peak's drop against what torch's MemTracker says AC no longer saves: a bound,
    not a point. The peak can fall by at most the saved bytes' drop; it falls by less,
    as one checkpointed block's activations live again while backward recomputes it and
    the gradients grow through backward. The one-block share, (1 - 1/k) of the drop,
    matched at k = 2 and overshot by 21-26% at 4 and 6 blocks (#47): no point estimate
    is claimed, the measured share is stated."""
    s_ac, s_none = row.get("saved_activation_bytes"), base.get("saved_activation_bytes")
    if _nan(s_ac) or _nan(s_none):
        return ""
    text = (
        f" Activations saved for backward (torch's MemTracker, one rank alone): "
        f"{_mib(s_none)} without, {_mib(s_ac)} with."
    )
    unsaved = s_none - s_ac
    measured = base["peak_memory_bytes"] - row["peak_memory_bytes"]
    if unsaved <= 0:
        return text
    if measured <= 0:
        return text + (
            f" The peak did not fall ({_mib(-measured)} higher with AC): it lies where "
            "the saved activations are not: the optimizer's step, say."
        )
    if measured > unsaved:
        return text + (
            f" The peak fell by {_mib(measured)}, more than the {_mib(unsaved)} AC stopped "
            "saving: the two cells' peaks differ by more than AC (a check failed)."
        )
    return text + (
        f" The peak can fall by at most the {_mib(unsaved)} AC stopped saving; it fell by "
        f"{_mib(measured)} ({measured / unsaved:.0%} of it): the recomputed block's "
        "activations and the gradients of backward take the rest."
    )


def best_layout(summary: pd.DataFrame) -> list[str]:
    ok = _ok(summary)
    ok = ok[(ok["ac"] == "none") & (ok["devices"] > 1)]
    out = []
    for key, g in ok.groupby([*_CELL, "devices"], sort=False):
        g = g[~g["emulated"].astype(bool)]  # stand-in devices are not ranked
        layout = g[[CATALOG[s].composed for s in g["strategy"]]]
        flat = g[[not CATALOG[s].composed for s in g["strategy"]]]
        if layout.empty or flat.empty:
            continue
        a = layout.loc[layout["step_time_s"].idxmin()]
        b = flat.loc[flat["step_time_s"].idxmin()]
        out.append(
            f"{key[0]} at {int(key[-1])}: the fastest layout, {_name(a)} {_interval(a)}, "
            f"against the fastest one-dimensional strategy, {_name(b)} {_interval(b)}: "
            f"the layout is {verdict(a, b)}."
        )
    return out


def ddp_vs_fsdp(summary: pd.DataFrame) -> list[str]:
    out = []
    for key, d, f in _pairs(summary, "ddp", "fsdp"):
        gathers = "twice (forward, and again in backward)" if _reshards(f) else "once"
        reason = (
            f"exposed communication {_ms(d['comm_exposed_s'])} (DDP) against "
            f"{_ms(f['comm_exposed_s'])} (FSDP); bytes per step {_mib(d['comm_bytes_per_step'])} "
            f"against {_mib(f['comm_bytes_per_step'])}, in nccl-tests' sizes: DDP's one "
            f"all-reduce counts the gradients once, FSDP gathers every parameter {gathers} "
            "and reduce-scatters the gradients, and a collective's own time is what the "
            "step waited for where compute did not hide it"
        )
        out.append(
            f"{key[0]} at {int(d['devices'])}: FSDP {_interval(f)} against DDP "
            f"{_interval(d)}: FSDP is {verdict(f, d)}. The anatomy's reason: {reason}."
        )
    return out


def _reshards(row) -> bool:
    """FSDP's reshard_after_forward in this row (its default: true)."""
    text = row.get("options")
    opts = json.loads(text) if isinstance(text, str) and text else {}
    return bool(opts.get("reshard_after_forward", True))


def dims_table(summary: pd.DataFrame) -> list[dict]:
    """Per multi-rank row: its degrees and each dimension's calls and bytes per step."""
    out = []
    for _, row in _ok(summary).iterrows():
        text = row.get("comm_by_dim")
        if not isinstance(text, str) or not text:
            continue
        for dim, ops in json.loads(text).items():
            for op, v in ops.items():
                out.append(
                    {
                        "model": row["model"],
                        "cell": _name(row),
                        "degrees": " × ".join(
                            f"{d} {int(row[d])}" for d in MESH_DIMS if int(row[d]) > 1
                        ),
                        "dim": dim,
                        "op": op,
                        "count": v["count"],
                        "bytes": v["bytes"],
                    }
                )
    return out


def answers(summary: pd.DataFrame) -> dict:
    return {
        "hsdp_vs_fsdp": hsdp_vs_fsdp(summary),
        "ac_vs_none": ac_vs_none(summary),
        "best_layout": best_layout(summary),
        "ddp_vs_fsdp": ddp_vs_fsdp(summary),
        "dims": dims_table(summary),
    }
