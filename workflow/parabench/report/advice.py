"""The report's "What to run at N GPUs": advise.csv's answer for each model and N, the
on-machine ranking check (advise's prediction against this run's measured cells), and
the check against torchtitan's published runs (advise-torchtitan.csv)."""

from __future__ import annotations

import math

import pandas as pd

from parabench.catalog import record
from parabench.predict.scaling import layout_of
from parabench.report.loading import rows

# The one-dimensional strategies that are a layout of advise's as they stand: DDP over
# dp_replicate, FSDP2 over dp_shard, TP over tp (and every layout record).
PLAIN = ("ddp", "fsdp", "tp")

RUNNERS_UP = 4
# The Ultra-Scale Playbook, "Step 1: fitting a training step in memory" (GPU-rich).
PLAYBOOK = {
    "small": (
        "under 10B parameters: a single technique across 8 GPUs, tensor parallelism or "
        "ZeRO-3/DP with full recompute"
    ),
    "medium": (
        "10B to 100B on more than 8 GPUs: TP 8 with pipeline parallelism, TP 8 with ZeRO-3, "
        "or ZeRO-3 alone"
    ),
    "large": "at 1,024+ GPUs: TP 8 with ZeRO-2 and pipeline parallelism",
}


def _gib(x) -> str:
    """GiB, or MiB below one (as the template's `gib`)."""
    if x is None or pd.isna(x):
        return "?"
    return f"{x / 2**30:,.1f} GiB" if x >= 2**30 else f"{x / 2**20:,.1f} MiB"


def _why(best: dict, usable: float, next_row: dict | None) -> str:
    """The recommendation's reason, in one sentence."""
    acc = (
        f", {best['accumulation']} micro-batches of {best['micro_batch']}"
        if best["accumulation"] > 1
        else f", micro-batch {best['micro_batch']}"
    )
    held = best.get("overhead_bytes")
    if held and not pd.isna(held):  # a GPU: what it would hold, against the card
        total = float(best["reserved_bytes"]) + float(held)
        memory = f"{_gib(total)} of the card's {_gib(float(best['device_memory_bytes']))}"
    else:
        memory = f"{_gib(best['memory_bytes'])} of the {_gib(usable)} usable"
    text = f"{best['layout']}{acc} is the fastest layout that fits: {memory}"
    if next_row:
        slower = next_row["step_s"] / best["step_s"] - 1
        text += f"; the next ({next_row['layout']}) is {slower:.0%} slower"
    return text + f"; its step is bound by {best['binding']}."


def _sections(adv: pd.DataFrame) -> list[dict]:
    out = []
    for (model, n), group in adv.groupby(["model", "gpus"], sort=False):
        ok = group[group["status"] == "ok"]
        failed = group[group["status"] == "failed"]
        # a search that failed partway (a row of no layout: advise._advise_model) left
        # the rows it decided unranked: no answer to give, only why
        cut = failed[failed["layout"].isna()] if "layout" in failed else failed.iloc[:0]
        if (ok.empty and len(failed)) or len(cut):
            out.append(
                {
                    "model": model,
                    "gpus": int(n),
                    "failed": rows((cut if len(cut) else failed).drop_duplicates("reason").head(3)),
                }
            )
            continue
        fits = ok[ok["fits"].astype(str).str.lower() == "true"].sort_values("step_s")
        usable = None
        if len(ok):
            from parabench.hardware.gpus import usable as usable_bytes

            usable = usable_bytes(float(ok["device_memory_bytes"].iloc[0]))
        # what the fit rule sets against the memory (gpus.fits): on a GPU, the reserved
        # peak, the CUDA context and NCCL's buffers against the card; on a CPU profile,
        # every rank's peak on the one host against its memory less a tenth
        on_gpu = bool(len(ok)) and ok.get("overhead_bytes", pd.Series(dtype=float)).gt(0).any()
        need = (
            ok["reserved_bytes"] + ok["overhead_bytes"]
            if on_gpu
            else ok["memory_bytes"] * ok["gpus"]
        )
        # one row per layout, schedule, checkpointing and micro-batch
        same = ["pp", "dp_replicate", "dp_shard", "tp", "ac", "micro_batch", "zero", "schedule"]
        distinct = fits.drop_duplicates(same)
        top = rows(distinct.head(1 + RUNNERS_UP))
        best = top[0] if top else None
        section = {
            "failed": [],
            "model": model,
            "gpus": int(n),
            "gpu": ok["gpu"].iloc[0] if len(ok) else "",
            "fabric": ok["fabric"].iloc[0] if len(ok) else "",
            "best": best,
            "why": _why(best, usable, top[1] if len(top) > 1 else None) if best else "",
            "runners": [{**r, "slower": r["step_s"] / best["step_s"] - 1} for r in top[1:]],
            "candidates": len(group),
            "measured": len(ok),
            "fitting": int((group["fits"].astype(str).str.lower() == "true").sum()),
            "skipped": rows(
                group[group["status"].isin(["skipped", "failed"])].drop_duplicates("reason")
            ),
            "closest": rows(ok.assign(need_bytes=need).sort_values("need_bytes").head(1))
            if best is None
            else [],
            "usable": usable,
            "on_gpu": on_gpu,
            "card": float(ok["device_memory_bytes"].iloc[0]) if len(ok) else None,
            "playbook": playbook(model, int(n), group, best),
        }
        out.append(section)
    return out


def playbook(model: str, n: int, group: pd.DataFrame, best: dict | None) -> dict | None:
    """The Playbook's guidance for this model's size at n GPUs, beside the answer."""
    params = group["params"].dropna() if "params" in group else pd.Series(dtype=float)
    if params.empty or best is None:
        return None
    p = float(params.iloc[0])
    size = "small" if p < 10e9 else "medium" if p <= 100e9 else None
    if n >= 1024:
        size = "large"
    if size is None or (size == "small" and n != 8) or (size == "medium" and n <= 8):
        return None
    return {"params": p, "guidance": PLAYBOOK[size]}


def ranking(adv: pd.DataFrame, summary: pd.DataFrame) -> list[dict]:
    """For each (model, N) advise ran at where this run measured layouts at N: advise's
    predicted step beside the measured one, per layout, and whether the two rank them
    alike (the fastest; Spearman's rank correlation)."""
    out = []
    ok = adv[adv["status"] == "ok"]
    measured = summary[(summary["status"] == "ok") & (summary["ac"] == "none")]
    for (model, n), group in ok.groupby(["model", "gpus"]):
        mine = measured[(measured["model"] == model) & (measured["devices"] == n)]
        # the same step: variant, and the global batch (weak scaling's differs)
        mine = mine[
            (mine["precision"] == group["precision"].iloc[0])
            & (mine["optimizer"] == group["optimizer"].iloc[0])
            & (mine["global_batch"] == group["global_batch"].iloc[0])
        ]
        if "compile" in mine:  # advise prices an eager step
            mine = mine[mine["compile"].astype(str).str.lower() != "true"]
        pairs = []
        for _, row in mine.iterrows():
            rec = record(row["strategy"])
            if not (rec.composed or row["strategy"] in PLAIN):
                continue  # its own machinery (ZeRO-1, compression, accumulation): no layout
            deg = layout_of(row).degrees
            if sum(v > 1 for v in deg.values()) == 0:
                continue  # one process, no layout
            zero = 3 if deg["dp_shard"] > 1 else 0
            if _options(row).get("reshard_after_forward") is False:
                zero = 2
            match = group[
                (group["ac"] == "none")
                & (group["accumulation"] == 1)
                & (group["zero"] == zero)
                & (group["pp"] == deg["pp"])
                & (group["tp"] == deg["tp"])
                & (group["dp_shard"] == deg["dp_shard"])
                & (group["dp_replicate"] == deg["dp_replicate"])
            ]
            if deg["pp"] > 1 or match.empty:
                continue  # a pipeline's micro-batches are the cell's own: not one of advise's
            p = match.iloc[0]
            pairs.append(
                {
                    "strategy": row["strategy"],
                    "layout": p["layout"],
                    "predicted_s": float(p["step_s"]),
                    "measured_s": float(row["step_time_s"]),
                    "error": float(p["step_s"]) / float(row["step_time_s"]) - 1,
                    # the step's compute as advise took it (timed here, or priced) and as
                    # the roofline prices it
                    "compute_s": float(p["compute_s"]),
                    "roofline_compute_s": float(p.get("roofline_compute_s", p["compute_s"])),
                    "timed": str(p.get("compute_source", "")).startswith("timed"),
                    # the overlap model against the anatomy: the share of communication
                    # that ran under compute, predicted and measured. Measured, at least:
                    # comm_exposed_s also holds the slowest rank's wait for the straggler,
                    # which can make communication less it fall below 0
                    "predicted_hidden": _share(
                        p.get("comm_hidden_s"), p.get("comm_s", 0) + p.get("comm_hidden_s", 0)
                    ),
                    "measured_hidden": _share(
                        max(row.get("comm_s", 0) - row.get("comm_exposed_s", 0), 0.0),
                        row.get("comm_s"),
                    ),
                }
            )
        if len(pairs) < 2:
            continue
        df = pd.DataFrame(pairs)
        rho = df["predicted_s"].rank().corr(df["measured_s"].rank())
        both = df.dropna(subset=["predicted_hidden", "measured_hidden"])
        out.append(
            {
                "model": model,
                "gpus": int(n),
                "gpu": group["gpu"].iloc[0],
                "rows": rows(df.sort_values("measured_s")),
                "top1": df.loc[df["predicted_s"].idxmin(), "strategy"]
                == df.loc[df["measured_s"].idxmin(), "strategy"],
                "predicted_best": df.loc[df["predicted_s"].idxmin(), "strategy"],
                "measured_best": df.loc[df["measured_s"].idxmin(), "strategy"],
                # two layouts rank alike or opposite whatever their figures: no measure
                "spearman": None if math.isnan(rho) or len(df) < 3 else rho,
                # each layout's compute timed on this host (else priced on the roofline)
                "timed": bool(df["timed"].all()),
                "mape": float(df["error"].abs().mean()),
                # how far the predicted hidden share is from the measured, on average
                "hidden_gap": float(
                    (both["predicted_hidden"] - both["measured_hidden"]).abs().mean()
                )
                if len(both)
                else None,
            }
        )
    return out


def _share(part, whole) -> float | None:
    """part / whole where both are numbers and whole is positive (None otherwise)."""
    try:
        part, whole = float(part), float(whole)
    except (TypeError, ValueError):
        return None
    return part / whole if whole > 0 and math.isfinite(part) else None


def _options(row) -> dict:
    from parabench.predict.scaling import options

    return options(row)


# advise.csv's counts: integers, read as floats where a row leaves them empty (a layout
# skipped before its micro-batch was chosen), which the report would print as 8.0
COUNTS = ("gpus", "pp", "dp_replicate", "dp_shard", "tp", "zero", "micro_batch", "accumulation")


def advice(adv: pd.DataFrame, check: pd.DataFrame, summary: pd.DataFrame) -> dict:
    """What the report's "What to run" section reads."""
    adv = adv.astype({c: "Int64" for c in COUNTS if c in adv})
    failed = adv[(adv["status"] == "failed") & adv["model"].isna()] if not adv.empty else adv
    return {
        "failed": list(failed["reason"]) if not failed.empty else [],
        "sections": _sections(adv) if not adv.empty else [],
        "ranking": ranking(adv, summary) if not adv.empty else [],
        "torchtitan": rows(check) if not check.empty else [],
    }
