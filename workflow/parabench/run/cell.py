"""Run one benchmark cell (a strategy at n devices, one repeat) and record it.

Every outcome leaves a record: `ok` with its steps, `skipped` with the reason the
hardware cannot give an honest number, `failed` with the error. Records are written by
rank 0, atomically, meta.json last.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import time
import traceback
import types
from pathlib import Path

import torch
import torch.distributed as dist

from parabench import envinfo, models, records, strategies
from parabench.analyze import anatomy, equivalence, fingerprint
from parabench.models import build
from parabench.models.base import Model
from parabench.process import marks, runtime
from parabench.process.data import LoaderBatches, SyntheticBatches
from parabench.process.flops import model_facts
from parabench.run import faults, profiling
from parabench.run.loop import (
    Silent,
    all_ranks,
    blocks,
    measure,
    run_step,
    step_kinds,
    synchronizer,
)
from parabench.run.peak import gemm_flops_per_s
from parabench.spec import RunSpec
from parabench.strategies.base import Strategy, cpu_params


def run_cell(spec: RunSpec, out: Path) -> int:
    """Run the cell and write its records under `out`. Returns the process exit code.

    Whatever goes wrong from here on (no GPU, a bad launch, an exception on any rank)
    leaves that rank's error-rank<R>.json, and rank 0 writes the `failed` record; a
    rank that dies without Python's help (a signal, os._exit) is named by the guard."""
    out = Path(out)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if rank == 0:
        (out / "params.pt").unlink(missing_ok=True)  # never a stale one beside new results
    t_start = time.perf_counter()
    ctx: runtime.Context | None = None
    common: dict = {"env": envinfo.base(), "world_size": world}
    try:
        ctx = runtime.start(spec)
        common = {
            "env": envinfo.describe(ctx.device.type),
            "world_size": ctx.world_size,
            "threads_per_rank": ctx.threads,
            "device_type": ctx.device.type,
        }
        cls = strategies.get(spec.strategy)
        reason = cls.skip_reason(spec, ctx)
        if reason:
            if ctx.is_main:
                records.write_outcome(out, "skipped", reason, **spec.record_fields(), **common)
            return 0
        check_fits(spec, world, copies=2 if needs_spare(spec, ctx) else 1)
        _run(spec, ctx, out, common, t_start)
        runtime.finish(ctx)
        return 0
    except Exception as caught:
        e = name_the_model(caught, spec)
        tb = traceback.format_exc()
        records.write_rank_error(out, rank, e, tb)
        if rank == 0:
            records.write_outcome(
                out,
                "failed",
                records.describe_error({"type": type(e).__name__, "message": str(e)}, 1),
                **spec.record_fields(),
                traceback=tb,
                rank=rank,
                **common,
            )
        if e is caught:
            raise
        raise e from caught
    finally:
        if ctx is not None:
            runtime.stop(ctx)


class ModelMemoryError(MemoryError):
    """The model does not fit; the message names it and its size."""


def _bytes(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_fits(spec: RunSpec, world: int, copies: int = 1) -> None:
    """Refuse, before allocating, a model whose parameters alone cannot be held by this
    host's processes (every rank builds the whole model on the host first, and copies it
    there, `copies` in all, where the cell needs a spare: Spare). Linux overcommits:
    without this check an absurd size is found by the OOM killer, whose SIGKILL says
    nothing about the model, or not at all."""
    # A custom model was counted on fake tensors when the cell was checked
    # (checks.problems): its factory is not called again; the others are built on the
    # meta device.
    n_params = models.facts(spec.model).n_params if spec.model.arch == "custom" else None
    if n_params is None:
        try:
            with torch.device("meta"):
                module = build(spec.model, spec.seed).module
        except Exception:  # a factory that reads values while building: the real build says
            return
        n_params = sum(p.numel() for p in module.parameters())
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    need = n_params * 4 * local * copies  # fp32 parameters, per process on this host
    free = envinfo.available_memory()
    if free is not None and need > free:
        held = f"{copies} copies in each of" if copies > 1 else "across"
        raise ModelMemoryError(
            f"model '{spec.model_name}' has {n_params:,} parameters: {_bytes(need)} in fp32 "
            f"({held} this host's {local} process(es)) before any gradient or activation, "
            f"and the host has {_bytes(free)} available; reduce models.{spec.model_name}'s "
            "sizes"
        )


def name_the_model(e: Exception, spec: RunSpec) -> Exception:
    """An allocation failure, its message extended to name the model (the allocator's
    own names only bytes); the exception type stays, other exceptions pass unchanged."""
    oom = isinstance(e, torch.OutOfMemoryError | MemoryError) or "can't allocate memory" in str(e)
    if not oom or isinstance(e, ModelMemoryError):
        return e
    where = (
        f"model '{spec.model_name}', {spec.strategy} at {spec.devices} devices, "
        f"batch {spec.batch_size}: reduce models.{spec.model_name}'s sizes or batch_size"
    )
    try:
        return type(e)(f"{e} ({where})")
    except TypeError:  # an exception type with another constructor
        return ModelMemoryError(f"{type(e).__name__}: {e} ({where})")


def step_losses(rows: list[dict], per_rank: list[dict]) -> dict[int, float]:
    """The global loss of every step of the plan: the timed ones' (rows) and the
    profiled ones' (each rank's contribution, summed)."""
    losses = {r["step"]: r["loss"] for r in rows}
    for step in per_rank[0]["untimed_losses"]:
        losses[step] = sum(r["untimed_losses"][step] for r in per_rank)
    return dict(sorted(losses.items()))


def divergence(losses: dict[int, float], spec: RunSpec) -> str | None:
    """Why the run is not a result, if its loss became NaN or inf: at which step, and
    the usual suspects (a learning rate too large; bf16's range). None if it stayed
    finite."""
    bad = next(((s, v) for s, v in losses.items() if not math.isfinite(v)), None)
    if bad is None:
        return None
    why = f"the learning rate ({spec.lr:g} with {spec.optimizer}) may be too large for this model"
    if spec.precision == "bf16":
        why += ", or bf16's range too small for its activations"
    return f"diverged: the loss became {bad[1]} at step {bad[0]}; {why}"


def max_over_ranks(per_rank: list[list[float]]) -> list[float]:
    """Each step's slowest rank (a step's time across ranks)."""
    return [max(ts) for ts in zip(*per_rank, strict=True)]


def timed_window(windows: list) -> list[float] | None:
    """The span of the ranks' timed windows."""
    spans = [w for w in windows if w]
    return [min(w[0] for w in spans), max(w[1] for w in spans)] if spans else None


def batch_source(model: Model, spec: RunSpec, strategy: Strategy):
    """This process's batches: synthetic (default) or through a DataLoader."""
    args = (model, spec.global_batch, spec.seed, strategy.shard, strategy.data_device)
    if spec.data == "dataloader":
        return LoaderBatches(*args, workers=spec.loader_workers)
    return SyntheticBatches(*args)


def _rebound(value, memo: dict):
    """A deep copy of one of a Model's fields that refers to the copied module where the
    original referred to the original: copy.deepcopy copies a function as itself, so a
    loss or batch closure over the module (a user's auxiliary loss read off it) would
    still use the original's parameters. What cannot be copied (a Python module a
    closure imported) is shared, as deepcopy shares a whole function."""
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, types.MethodType):
        out = types.MethodType(_rebound(value.__func__, memo), _rebound(value.__self__, memo))
    elif isinstance(value, types.FunctionType) and value.__closure__:
        cells = tuple(types.CellType() for _ in value.__closure__)
        out = types.FunctionType(
            value.__code__, value.__globals__, value.__name__, value.__defaults__, cells
        )
        out.__kwdefaults__, out.__qualname__ = value.__kwdefaults__, value.__qualname__
        out.__dict__.update(value.__dict__)
        memo[id(value)] = out  # before its cells: a closure may refer to itself
        for new, old in zip(cells, value.__closure__, strict=True):
            try:
                contents = old.cell_contents
            except ValueError:  # an empty cell (a name not yet bound)
                continue
            new.cell_contents = _rebound(contents, memo)
    else:
        try:
            out = copy.deepcopy(value, memo)
        except Exception:
            out = value
    memo[id(value)] = out
    return out


def copy_model(model: Model) -> Model | None:
    """A copy of a model as built, every parameter and buffer equal to the original's,
    or None where it cannot be deep-copied (a user's module holding a lock, a
    generator, an open file)."""
    memo: dict = {}
    try:
        module = copy.deepcopy(model.module, memo)
        fields = {
            f.name: _rebound(getattr(model, f.name), memo)
            for f in dataclasses.fields(model)
            if f.name != "module"
        }
        return dataclasses.replace(model, module=module, **fields)
    except Exception:
        return None


class Spare:
    """The second copy of the model a cell needs: the no-communication check's (a cell
    with a process group) or the reference's reorder run (`single`), never both. A copy
    of the one model the cell built, taken before its strategy wrapped, sharded, placed
    or compiled it, held on the CPU until handed over once (`take`): a 7B model takes
    minutes to build, seconds to copy. Where the model cannot be copied, `take` builds
    one from the factory, as the copy would be."""

    def __init__(self, spec: RunSpec, model: Model) -> None:
        self.spec = spec
        self.rng = torch.get_rng_state()  # where the build's draws left the generator
        self._model = copy_model(model)

    def take(self) -> Model:
        """The copy, and torch's generators as the build left them (a build seeds them,
        then draws its weights); nothing here keeps the copy alive afterwards."""
        model, self._model = self._model, None
        if model is None:
            return build(self.spec.model, self.spec.seed)
        torch.manual_seed(self.spec.seed)  # every device's generator, as build seeds it
        torch.set_rng_state(self.rng)
        return model


def needs_spare(spec: RunSpec, ctx: runtime.Context) -> bool:
    """Whether the cell runs a second copy of its model (Spare)."""
    return ctx.distributed or spec.is_reference


def reorder_spread(spec: RunSpec, ctx: runtime.Context, reference: dict, spare: Spare) -> dict:
    """Train `single` once more from the same weights on the same batches, each batch's
    samples in reverse order: the same maths summed in another order. Its distance from
    the timed run is the rounding floor the equivalence tolerance is built on (see
    analyze/equivalence.py). Eager even when the cell compiles, to spare a second compilation."""
    model = spare.take()
    initial = cpu_params(model.module)
    replica = strategies.get(spec.strategy)(model, spec, ctx)
    batches = batch_source(model, spec, replica)
    for step in range(len(step_kinds(spec.steps, spec.warmup, spec.profile_steps))):
        x, y = batches.batch(step)
        replica.step(x.flip(0), y.flip(0))
    state = replica.full_state()
    travel = equivalence.l2_diff(reference, initial)
    return {
        "param_travel": travel,
        "reorder_max_abs_diff": equivalence.max_abs_diff(state, reference),
        "reorder_rel_diff": equivalence.l2_diff(state, reference) / travel if travel else 0.0,
    }


# The no-communication check: steps of the same strategy over a group whose collectives
# return at once (process/nocomm.py), in blocks between the cell's steps (loop.Silent): this many
# timed in all, each block's first step untimed.
NOCOMM_STEPS = 12


def _without_comm(
    spec: RunSpec,
    ctx: runtime.Context,
    kinds: list[str],
    physical: list[torch.device],
    spare: Spare | None,
) -> Silent | None:
    """The no-communication check of a cell, on the cell's spare copy of its model; none
    for a cell with no process group (no communication to switch off)."""
    if not ctx.distributed:
        return None

    def build_silent() -> tuple[Strategy, object]:
        # CUDA's high-water mark so far is the real strategy's alone
        check.peak_before = profiling.high_water(physical)
        model = spare.take()
        silent = strategies.build(model, spec, ctx.without_comm())
        return silent, batch_source(model, spec, silent)

    barrier = dist.barrier if ctx.world_size > 1 else lambda: None
    per_block = -(-NOCOMM_STEPS // len(blocks(kinds)))
    check = Silent(build_silent, barrier, per_block, physical)
    return check


def _drop_silent(silent: Silent, physical: list[torch.device]) -> int | None:
    """Drop the no-communication check's copy of the model and free it now, so that the
    high-water mark reset next starts without it; the mark from before it was built."""
    silent.pair = None
    profiling.release(physical)
    return silent.peak_before


def _timed(spec: RunSpec, ctx: runtime.Context, out: Path, t_start: float, host: str) -> dict:
    """The cell's steps (warm-up, timed, profiled: loop.step_kinds) with the no-communication blocks
    between them, then the counted step: this rank's figures, and the cell's parameters
    after every step; the reference's spare copy of its model, for
    reorder_spread."""
    # The cell's one build (check_fits' on the meta device aside): a second copy, where
    # the cell needs one, is copied from it before the strategy changes it.
    model = build(spec.model, spec.seed)
    # What the steps after the cell need of the model, read off it before its strategy
    # wraps it (on a copy without storage: process/flops.py), so that they never build it.
    facts = model_facts(model, spec.global_batch) if ctx.is_main else None
    spare = Spare(spec, model) if needs_spare(spec, ctx) else None
    strategy = strategies.build(model, spec, ctx)
    batches = batch_source(model, spec, strategy)

    physical = strategy.devices()  # distinct devices: one for emulated stages
    peak_device = spec.peak_flops or gemm_flops_per_s(physical[0], precision=spec.precision)
    profiling.reset_high_water(physical)
    setup_s = time.perf_counter() - t_start

    fault = faults.for_cell(spec.model_name, spec.strategy, spec.devices, spec.repeat, ctx.rank)
    steps = step_kinds(spec.steps, spec.warmup, spec.profile_steps)
    profiler = profiling.StepProfiler(ctx)
    silent = _without_comm(spec, ctx, steps, physical, spare)
    measured = measure(strategy, batches, steps, fault, profiler, silent)
    earlier = None
    if silent is not None:
        # The check's copy of the model goes: the counted step's memory is the real
        # strategy's alone, with the high-water mark from before the copy existed.
        earlier = _drop_silent(silent, physical)
        profiling.reset_high_water(physical)

    held = strategy.held_bytes()  # between steps: what the rank keeps, not transients
    state = strategy.full_state()  # after every step of the plan, before the counted one
    # Gathering the whole parameters is not the strategy's step: its memory is not the
    # cell's peak (the high-water mark from before the copy was dropped is `earlier`).
    profiling.reset_high_water(physical)
    sync = synchronizer(physical)
    counted = profiler.count(lambda: run_step(strategy, batches, len(steps), sync))
    # the ranks sharing this rank's cores (on its host), and how long they ran in each
    # profiled step; without a binding, the host's average and no bound
    k, mates = ctx.ranks_per_core, None
    if ctx.cores:
        ran = all_ranks(([(host, c) for c in ctx.cores], anatomy.on_core(profiler.regions)), ctx)
        k, mates = anatomy.sharing(ctx.rank, [c for c, _ in ran], [r for _, r in ran])
    return {
        "measured": measured,
        "state": state,
        "emulated": strategy.emulated,
        "stage_cuts": strategy.stage_cuts,
        "model_facts": facts,
        "peak_device": peak_device,
        "setup_s": setup_s,
        "spare": spare if spec.is_reference else None,
        "rank": {
            "peak_memory": profiling.peak_memory(physical, held, counted, earlier),
            "peak_flops": peak_device * len(physical),
            "held_bytes": held,
            "trace": profiler.save(out, counted),
            "anatomy": anatomy.anatomy(
                profiler.events,
                profiler.regions,
                spec.record.pipelined,
                k,
                mates,
                device_type=ctx.device.type,  # a CUDA trace without kernels is flagged
            ),
            "regions": profiler.regions,
            "comm": anatomy.volume(counted, spec.record.wire_bytes(spec.precision)),
            "nocomm_times": measured.nocomm_times,
        },
    }


def _run(spec: RunSpec, ctx: runtime.Context, out: Path, common: dict, t_start: float) -> None:
    timed = _timed(spec, ctx, out, t_start, common["env"]["host"])
    measured = timed["measured"]
    per_rank = all_ranks(
        {
            **timed["rank"],
            "times": measured.times,
            "profiled_times": measured.profiled_times,
            "losses": measured.losses,
            "window": measured.window,
            "untimed_losses": measured.untimed_losses,
            "host": common["env"]["host"],
            "cores": list(ctx.cores),
            "clock": marks.on_core_clock(),
        },
        ctx,
    )
    state = timed["state"]
    if not ctx.is_main:
        return
    reference = {}
    if spec.is_reference:
        reference = reorder_spread(spec, ctx, state, timed.pop("spare"))

    rows = []  # the timed steps (warm-up included), by their place in the plan
    for i, (step, phase) in enumerate(zip(measured.steps, measured.phases, strict=True)):
        ts = [r["times"][i] for r in per_rank]
        rows.append(
            {
                **spec.identity(),
                "step": step,
                "phase": phase,
                "step_time_s": max(ts),
                "step_time_min_s": min(ts),
                "loss": sum(r["losses"][i] for r in per_rank),
                "samples": spec.global_batch,
            }
        )
    records.write_ran(
        out,
        rows,
        # what the equivalence check needs of the whole parameters, computed here, the
        # one place they exist: themselves for a small model, else their sketch
        fingerprint.encode(state, ctx.device),
        diverged=divergence(step_losses(rows, per_rank), spec),
        **{
            **spec.record_fields(),
            **common,
            "emulated": timed["emulated"],
            "stage_cuts": timed["stage_cuts"],
            # what aggregate, the report and compare read instead of building the model
            "model_facts": timed["model_facts"],
            "peak_flops_per_device": timed["peak_device"],
            "peak_flops_total": sum(r["peak_flops"] for r in per_rank),
            "peak_flops_source": "config" if spec.peak_flops else "measured GEMM",
            # every step of the plan that was profiled, timed like the others (max over
            # ranks): profiled / timed is what profiling cost
            "profiled_step_times": max_over_ranks([r["profiled_times"] for r in per_rank]),
            # steps of the same strategy with every collective returning at once, in
            # blocks between the plan's (max over ranks)
            "nocomm_step_times": (
                max_over_ranks([r["nocomm_times"] for r in per_rank])
                if per_rank[0]["nocomm_times"] is not None
                else None
            ),
            "cpu_binding": [r["cores"] for r in per_rank],
            "ranks_per_core": ctx.ranks_per_core,
            # what the regions' cpu_s was read from, per rank (marks.on_core_clock)
            "on_core_clock": [r["clock"] for r in per_rank],
            "peak_memory_bytes": max(r["peak_memory"] for r in per_rank),
            "peak_memory_per_rank": [r["peak_memory"] for r in per_rank],
            "held_bytes_per_rank": [r["held_bytes"] for r in per_rank],
            "traces": [r["trace"] for r in per_rank],
            "anatomy_per_rank": [r["anatomy"] for r in per_rank],
            # the raw figures the anatomy read: per rank, per profiled step, each region
            "regions_per_rank": [r["regions"] for r in per_rank],
            "comm_per_rank": [r["comm"] for r in per_rank],
            **reference,
            "hosts": sorted({r["host"] for r in per_rank}),
            # when the cell was timed, every rank's window together (Unix seconds)
            "timed_window": timed_window([r["window"] for r in per_rank]),
            "setup_s": timed["setup_s"],
            "wall_s": time.perf_counter() - t_start,
            "params_file": "params.pt",
        },
    )
