"""A layout: how one training run lays its ranks on the devices and its model on the
ranks, as one value (torchtitan's ParallelDims, without context and expert parallelism).

Everything that lays out a run reads this one type: a strategy's catalog record
declares its Layout (degrees that may be an option's name or REST), a cell's RunSpec
resolves it at its device count and options (`RunSpec.layout`), runtime builds the
named mesh of it, strategies.parallelize applies it to the model in torchtitan's
order, and advise's candidates, and the fake-tensor rank they are measured on, are
Layouts with a micro-batch. So a benchmark cell and advise's price of the same layout
cannot drift apart.

Torch-free: the Snakefile imports the catalog, hence this, at parse time.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

# The named device mesh, outermost dimension first, as torchtitan's ParallelDims builds
# it: tp innermost, so a tensor-parallel group is adjacent ranks (one node's NVLink);
# pp outermost, so stages talk across the slowest links, the least often.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
# A degree that takes the devices the others leave (at most one per layout).
REST = "rest"
# Activation checkpointing levels: none; full (every repeated block recomputed in
# backward); selective (torchtitan's per-op policy: matmuls, attention and collectives
# saved, the cheap elementwise ops recomputed); every<k> (every k-th block in full).
AC_PATTERN = r"none|full|selective|every[2-9]"
# A pipeline's schedule, as torch.distributed.pipelining names it: ScheduleGPipe,
# Schedule1F1B, ScheduleInterleaved1F1B (virtual stages: advise prices it; the cells
# run one stage a rank, pipeline.SCHEDULES)
SCHEDULES = ("gpipe", "1f1b", "interleaved")
_SCHEDULE_LABELS = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved 1F1B"}
# what `parse` reads as a schedule: its name, or its label
_SCHEDULE_READ = {
    **{s: s for s in SCHEDULES},
    **{v.lower(): k for k, v in _SCHEDULE_LABELS.items()},
}


@dataclass(frozen=True)
class Layout:
    """Each mesh dimension's degree, and how the model is laid on them:

    - `zero`, the ZeRO level of the data-parallel sharding, its one name here:
      3, FSDP frees the gathered parameters after forward and gathers them again in
      backward (the config's `reshard_after_forward: true`); 2, it keeps them to
      backward; 0, nothing sharded (DDP, or no data parallelism);
    - `ac`, activation checkpointing of each repeated block (AC_PATTERN);
    - `sequence_parallel`, TP's activations between blocks sharded over tp on the
      sequence, with the head split on the vocabulary (where the model declares how);
    - `schedule`, a pipeline's.

    A settled layout's degrees are integers, and the settings its degrees make moot
    are normalised (zero 0 without dp_shard, no schedule without pp), so two layouts
    that run alike compare equal. Sequence parallelism stays as asked: at tp 1 its
    plan still runs, over a mesh of one (a one-GPU rehearsal of TP's code path). A
    record's declaration may name an option (fsdp_tp's `tp`) or REST for a degree;
    `at` settles it."""

    pp: int | str = 1
    dp_replicate: int | str = 1
    dp_shard: int | str = 1
    tp: int | str = 1
    zero: int = 3
    ac: str = "none"
    sequence_parallel: bool = True
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        if not self.settled:
            return
        moot = {}
        if self.dp_shard == 1 and self.zero > 1:
            moot["zero"] = 0
        if self.pp == 1:
            moot["schedule"] = ""
        for k, v in moot.items():
            object.__setattr__(self, k, v)

    # --- the degrees ------------------------------------------------------------------

    @property
    def settled(self) -> bool:
        """Every degree an integer (not a record's declaration)."""
        return all(isinstance(getattr(self, d), int) for d in MESH_DIMS)

    @property
    def degrees(self) -> dict[str, int]:
        """Each mesh dimension's degree, outermost first."""
        return {d: getattr(self, d) for d in MESH_DIMS}

    def declared(self) -> tuple[str, ...]:
        """The dimensions this layout uses (those not fixed at 1), outermost first: the
        named mesh's, as torchtitan's ParallelDims.build_mesh leaves out degree 1."""
        return tuple(d for d in MESH_DIMS if getattr(self, d) != 1)

    @property
    def world(self) -> int:
        return math.prod(self.degrees.values())

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each takes its own slice of the batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def stage(self) -> Layout:
        """One pipeline stage's layout: what a rank of it holds and does, whatever the
        number of stages (advise measures a stage as a model of its blocks)."""
        return dataclasses.replace(self, pp=1, schedule="")

    def replace(self, **changes) -> Layout:
        return dataclasses.replace(self, **changes)

    # --- a record's declaration, settled ------------------------------------------------

    def at(self, devices: int, options: dict, **settings) -> Layout:
        """This declaration's degrees at `devices` (an option's name read from `options`,
        REST the devices the others leave, rounded down: `problem` says when they do not
        divide), with `settings` (zero, ac, sequence_parallel, schedule)."""
        out = {}
        for d in MESH_DIMS:
            v = getattr(self, d)
            out[d] = int(options[v]) if isinstance(v, str) and v != REST else v
        fixed = math.prod(v for v in out.values() if v != REST)
        out = {d: (max(1, devices // fixed) if v == REST else v) for d, v in out.items()}
        return dataclasses.replace(self, **out, **settings)

    def problem(self, name: str, devices: int, options: dict) -> str | None:
        """Why this declaration cannot lay out `devices`, naming the option at fault
        (options.<strategy>.<key>)."""
        given = {d: getattr(self, d) for d in self.declared() if getattr(self, d) != REST}
        fixed = math.prod(int(options[v]) if isinstance(v, str) else v for v in given.values())
        keys = " x ".join(
            f"options.{name}.{v} ({options[v]})" if isinstance(v, str) else str(v)
            for v in given.values()
        )
        rest = [d for d in MESH_DIMS if getattr(self, d) == REST]
        if devices % fixed:
            return f"{keys} does not divide {devices} devices"
        if rest and devices // fixed < 2:
            return f"{keys} leaves {rest[0]} {devices // fixed} at {devices} devices (needs >= 2)"
        if not rest and devices != fixed:
            return f"{keys} lays out {fixed} devices, not {devices}"
        return None

    def problems(self, key: str = "layout") -> list[str]:
        """What is wrong with a settled layout, each naming `key`'s field."""
        out = []
        for d in MESH_DIMS:
            v = getattr(self, d)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                out.append(f"{key}.{d}: must be an integer >= 1, got {v!r}")
        if self.zero not in (0, 2, 3):
            out.append(f"{key}.zero: must be 3, 2 or 0, got {self.zero!r}")
        if self.settled and self.dp_shard > 1 and self.zero == 0:
            out.append(f"{key}.zero: FSDP over dp_shard {self.dp_shard} shards (2 or 3), got 0")
        if not re.fullmatch(AC_PATTERN, str(self.ac)):
            out.append(f"{key}.ac: must match {AC_PATTERN}, got {self.ac!r}")
        if self.settled and self.pp > 1 and self.dp_shard > 1 and self.zero == 3:
            out.append(
                f"{key}.zero: a pipeline's FSDP keeps its parameters to backward (ZeRO-2, as "
                "the cells and torchtitan run it), got 3"
            )
        if self.settled and self.pp > 1 and self.schedule not in SCHEDULES:
            out.append(f"{key}.schedule: must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        return out

    # --- how people name it ---------------------------------------------------------------

    @classmethod
    def parse(cls, text: str, key: str = "layout") -> Layout:
        """A layout as people write it, and as `label` writes it: its parts separated by
        commas, its degrees by "x" or "×" ("FSDP 32 x TP 8, full AC", "HSDP 4x8 x PP 2,
        1F1B, ZeRO-2", "DDP 64, no SP"); a ValueError naming `key` and the part it cannot
        read. SP is on unless "no SP" says otherwise, as in the cells; a pipeline's FSDP
        is ZeRO-2, as the cells run it."""
        degrees: dict[str, int] = {}
        settings: dict = {}

        def once(table: dict, name: str, value, what: str) -> None:
            """A dimension or a setting said once: twice is a contradiction or a slip
            ("TP 8 x TP 2", "selective AC, full AC"), never the last one silently."""
            if name in table:
                raise ValueError(f"{key}: {what} given twice in {text!r}")
            table[name] = value

        for part in (p.strip() for p in text.split(",")):
            low = part.lower()
            if not part:
                continue
            if m := re.fullmatch(r"(\S+) ac|ac (\S+)", low):  # the level checked below
                once(settings, "ac", m.group(1) or m.group(2), "checkpointing")
            elif low in ("sp", "no sp"):
                once(settings, "sequence_parallel", low == "sp", "sequence parallelism")
            elif m := re.fullmatch(r"zero-?([023])", low):
                once(settings, "zero", int(m.group(1)), "the ZeRO stage")
            elif low in _SCHEDULE_READ:
                once(settings, "schedule", _SCHEDULE_READ[low], "the schedule")
            elif low == "one device":
                continue
            else:
                for term in re.split(r"\s*[x×]\s*(?=[a-z])", low):
                    m = re.fullmatch(r"(fsdp|ddp|tp|pp) (\d+)|hsdp (\d+)\s*[x×]\s*(\d+)", term)
                    if not m:
                        raise ValueError(
                            f"{key}: cannot read {part!r} in {text!r} (as in "
                            f"'FSDP 32 x TP 8, full AC')"
                        )
                    if m.group(1):
                        dim = {"fsdp": "dp_shard", "ddp": "dp_replicate"}.get(
                            m.group(1), m.group(1)
                        )
                        once(degrees, dim, int(m.group(2)), term.split()[0].upper())
                    else:
                        once(degrees, "dp_replicate", int(m.group(3)), "data parallelism")
                        once(degrees, "dp_shard", int(m.group(4)), "data parallelism")
        if "schedule" in settings and degrees.get("pp", 1) == 1:
            raise ValueError(f"{key}: a schedule without a pipeline (PP) in {text!r}")
        if degrees.get("pp", 1) > 1:  # a pipeline's FSDP: ZeRO-2 unless said otherwise
            settings.setdefault("zero", 2)
        layout = cls(**degrees, **settings)
        if found := layout.problems(key):
            raise ValueError("; ".join(found))
        return layout

    @property
    def parallelism(self) -> str:
        """Its degrees as torchtitan's tables name them: FSDP 32 × TP 8, HSDP 4×8 ×
        PP 2, DDP 64; "one device" for none."""
        parts = []
        if self.dp_shard > 1 and self.dp_replicate > 1:
            parts.append(f"HSDP {self.dp_replicate}×{self.dp_shard}")
        elif self.dp_shard > 1:
            parts.append(f"FSDP {self.dp_shard}")
        elif self.dp_replicate > 1:
            parts.append(f"DDP {self.dp_replicate}")
        if self.tp > 1:
            parts.append(f"TP {self.tp}")
        if self.pp > 1:
            parts.append(f"PP {self.pp}")
        return " × ".join(parts) or "one device"

    @property
    def label(self) -> str:
        """The whole layout in a line: "FSDP 32 × TP 8, SP, full AC", "FSDP 8, ZeRO-2",
        "DDP 4 × PP 2, 1F1B"."""
        parts = [self.parallelism]
        if self.tp > 1:
            parts.append("SP" if self.sequence_parallel else "no SP")
        if self.dp_shard > 1 and self.zero == 2:
            parts.append("ZeRO-2")
        if self.pp > 1:
            parts.append(_SCHEDULE_LABELS.get(self.schedule, self.schedule))
        if self.ac != "none":
            parts.append(f"{self.ac} AC")
        return ", ".join(parts)
