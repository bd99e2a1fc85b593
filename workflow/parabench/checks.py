"""Which cells make sense: every cross-field rule of a RunSpec, each message naming the
config key at fault, and the skips that the settings alone decide. Torch-free for the
presets (a custom model is loaded from the user's file and checked once, on fake
tensors, by models.facts: nothing of its size is allocated).

The workflow calls `problems` for every cell when it plans, before any job starts;
`parabench run` calls it once more for a cell started by hand.
"""

from __future__ import annotations

import math
import re

from parabench import models
from parabench.catalog import CATALOG, OPTIMIZERS, PRECISIONS, STRATEGIES
from parabench.layout import AC_PATTERN
from parabench.spec import RunSpec

# On device cpu each "device" is a process on one machine: past this, a typo, not a plan.
MAX_CPU_DEVICES = 64


def problems(spec: RunSpec, launching: bool = True) -> list[str]:
    """Every broken rule, each naming the key at fault. Empty means valid. `launching`
    False: a rank planned at a world size (predict/plan.py), whose other ranks never start."""
    out = _settings(spec, launching)
    if out:
        return out
    facts = models.facts(spec.model)
    out += [f"models.{spec.model_name}.{p}" for p in facts.problems]
    if out:
        return out
    return out + _combination(spec)


def _settings(spec: RunSpec, launching: bool) -> list[str]:
    """Each setting on its own."""
    out: list[str] = []
    if spec.strategy not in STRATEGIES:
        return [f"strategies: unknown strategy {spec.strategy!r}; known: {list(STRATEGIES)}"]
    rec = CATALOG[spec.strategy]
    if spec.devices < 1:
        out.append(f"devices: must be >= 1, got {spec.devices}")
    if rec.fixed_devices and spec.devices != rec.fixed_devices:
        out.append(
            f"devices: strategy {spec.strategy!r} runs on exactly {rec.fixed_devices} device"
        )
    if spec.precision not in PRECISIONS:
        out.append(f"precision: must be one of {list(PRECISIONS)}, got {spec.precision!r}")
    if not re.fullmatch(AC_PATTERN, spec.ac):
        out.append(f"ac: must be none, full, selective or every2..every9, got {spec.ac!r}")
    if spec.optimizer not in OPTIMIZERS:
        out.append(f"optimizer: must be one of {list(OPTIMIZERS)}, got {spec.optimizer!r}")
    for key in ("steps", "batch_size", "profile_steps"):
        if getattr(spec, key) < 1:
            out.append(f"{key}: must be >= 1, got {getattr(spec, key)}")
    if not 0 <= spec.warmup < spec.steps:
        out.append(
            f"warmup: must be >= 0 and < steps ({spec.steps}) so some steps are timed, "
            f"got {spec.warmup}"
        )
    # YAML holds .nan and .inf, which pass every bound of a JSON schema.
    for key in ("lr", "timeout_s", "peak_flops"):
        value = getattr(spec, key)
        if value is not None and not math.isfinite(value):
            out.append(f"{key}: must be a finite number, got {value}")
    if spec.timeout_s <= 0:
        out.append(f"timeout_s: must be > 0, got {spec.timeout_s}")
    if launching and spec.device == "cpu" and spec.devices > MAX_CPU_DEVICES:
        out.append(
            f"devices: {spec.devices} on device cpu means {spec.devices} processes on one "
            f"machine; at most {MAX_CPU_DEVICES}"
        )
    if spec.scaling not in ("strong", "weak"):
        out.append(f"scaling: must be 'strong' or 'weak', got {spec.scaling!r}")
    if spec.device not in ("auto", "cpu", "cuda"):
        out.append(f"device: must be auto, cpu or cuda, got {spec.device!r}")
    if spec.data not in ("synthetic", "dataloader"):
        out.append(f"data: must be synthetic or dataloader, got {spec.data!r}")
    for key, value in spec.options:
        where = f"options.{spec.strategy}.{key}"
        if key not in rec.options:
            known = sorted(rec.options) or "none"
            out.append(f"{where}: {spec.strategy} has no setting {key!r} (its settings: {known})")
        elif why := rec.options[key].problem(where, value):
            out.append(why)
    return out


def _combination(spec: RunSpec) -> list[str]:
    """Rules that tie the strategy's settings, the devices and the batch together. Where
    the model's shape rules a strategy out at a device count, the cell is skipped instead
    (shape_skip_reason)."""
    out: list[str] = []
    rec, name = spec.record, spec.model_name
    options = dict(spec.options)
    div, what = rec.batch_divisor(spec.devices, options)
    if spec.global_batch % div:
        out.append(
            f"models.{name}.batch_size: global batch {spec.global_batch} is not divisible by {what}"
        )
    if rec.composed and (why := rec.layout.problem(spec.strategy, spec.devices, options)):
        out.append(why)
    if spec.nodes > 1 and spec.devices % spec.nodes:
        out.append(
            f"devices: {spec.devices} devices over {spec.nodes} nodes "
            f"(gpus_per_node {spec.gpus_per_node}) is not the same count on every node"
        )
    if options.get("schedule") == "1f1b" and options["microbatches"] < spec.stages:
        out.append(
            f"options.{spec.strategy}.microbatches: 1F1B needs micro-batches >= stages "
            f"({options['microbatches']} < {spec.stages})"
        )
    return out


def static_skip_reason(spec: RunSpec) -> str | None:
    """A skip knowable from the settings alone, so no process need import torch to
    find out. Runtime checks (CUDA devices visible) live in each strategy."""
    rec = spec.record
    if rec.cuda_only_beyond_one and spec.devices > 1 and spec.device == "cpu":
        return (
            f"{rec.label} needs {spec.devices} CUDA devices; on CPU it silently runs "
            "a single copy, so no honest multi-device number exists"
        )
    if spec.nodes > 1 and spec.processes == 1:
        return (
            f"{spec.strategy} runs in one process, which cannot span nodes: "
            f"{spec.devices} devices > gpus_per_node ({spec.gpus_per_node})"
        )
    if spec.compile and not rec.compiles:
        return f"torch.compile does not compose with {rec.label} (compile: true)"
    if spec.ac != "none" and not rec.takes_ac:
        return (
            f"activation checkpointing does not compose with {rec.label} (ac: {spec.ac}): "
            "it replicates the module every forward"
        )
    if rec.needs_tp_plan or rec.cuts_model or spec.ac != "none":
        return shape_skip_reason(spec, models.facts(spec.model))
    return None


def shape_skip_reason(spec: RunSpec, facts: models.ModelFacts) -> str | None:
    """Why the strategy cannot apply to this model at this device count because of the
    model's shape: a width tensor parallelism cannot split over the ranks, fewer blocks
    than stages. Not a mistake in the config (a sweep of every strategy over several
    models and device counts meets such cells), so the cell is recorded as skipped
    with the reason, as DataParallel on CPU is."""
    rec, name = spec.record, spec.model_name
    if rec.needs_tp_plan:
        if facts.tp_skip:
            return f"{spec.strategy}: {facts.tp_skip}"
        if not facts.has_tp_plan:
            return (
                f"{spec.strategy} needs a tensor-parallel plan, and models.{name} declares "
                "none (a custom factory returns tp_plan)"
            )
        if why := facts.tp_problem(spec.layout.tp):
            return f"models.{name}.{why}"
    if rec.cuts_model:
        if facts.cut_skip:
            return (
                f"{spec.strategy} cuts stages between the blocks of models.{name}: {facts.cut_skip}"
            )
        if spec.stages > facts.n_blocks:
            return (
                f"{spec.strategy} at {spec.devices} devices needs {spec.stages} stages, and "
                f"models.{name} has only {facts.n_blocks} blocks"
            )
    if spec.ac != "none" and not facts.n_blocks:
        return f"ac: {spec.ac} checkpoints blocks, and models.{name} declares none"
    return None
