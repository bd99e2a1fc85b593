"""`parabench rehearse CONFIG`: the whole GPU run, rehearsed on this host before
anything is queued.

A CPU test at toy size proves the CPU path only: on CUDA torch picks other defaults
(foreach optimizers, device indices, bf16 autocast on cuda), and the GPU configs run
other sizes (gigabytes of parameters). So every cell of a config runs here at its real
size and world size, through its own code, on fake tensors of its device: nothing is
allocated, and a 7B model costs what a toy does. For each cell (its first repeat: the
others run the same code) and each of its distinct ranks (the first rank of each
pipeline stage; and the last rank, on its node's highest device index, where the
strategy runs the most ranks for its model: `planned`):

- the rank alone in this process, in a world of the cell's size whose collectives
  return at once (runtime.alone, as the scaling model measures a rank), local rank
  r % (its node's ranks) on cuda:<local rank>, torch.cuda answering as such a node
  would (preflight/fakecuda.py);
- the model built on the meta device, then placed, wrapped and sharded by the cell's
  own strategy (strategies.build, which also makes its optimizer with CUDA's defaults:
  foreach) inside FakeTensorMode, on fake CUDA tensors;
- two steps through loop.run_step on its shard of the global batch (a last rank that
  is no stage's first: one): the first makes the optimizer's state; the second under
  torch's MemTracker (the rank's total peak:
  fakerank.total_tracker_class) and the op counter advise uses (fakerank.Counting: its
  FLOPs, and their time on the GPU profile, an estimate of its compute per step);
- what the cell does after its steps: held_bytes, and full_state, the equivalence
  check's gather.

A rank is ok, failed (its exception), skipped (its strategy's own reason on such a
node: more GPUs than it has), or not rehearsed (UNREHEARSABLE: a strategy whose own
mechanism fake tensors cannot run). Its peak is set against the memory of the GPU named
by rehearse.gpu, with the headroom plan and advise keep (gpus.fits), on torch 2.13 and
later (judge_fit). What no rank can rehearse (LIMITS) and what the rehearsal replaces
because fake tensors hold no data (STAND_INS) are said.

The rehearsal runs in a process of its own (`in_child`): on a CPU-only torch the fake
CUDA device must be loaded before torch is (fakecuda.install).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from parabench import checks
from parabench.config import cells, rank_key
from parabench.records import REHEARSAL_COLUMNS, REHEARSAL_KEY, read_rows, write_rows
from parabench.spec import RunSpec

if TYPE_CHECKING:
    from parabench.hardware.gpus import GPU

OK, FAILED, SKIPPED, NOT_REHEARSED = "ok", "failed", "skipped", "not rehearsed"

# What fake tensors cannot stand in for, said once per rehearsal and per cell it spares.
LIMITS = {
    "nccl": "NCCL itself: collectives return at once here, on this rank's own data",
    "kernels": "CUDA kernels and their times: fake tensors compute shapes, not values",
    "compile": "Inductor's CUDA code generation and Triton: compiled blocks run eager here",
    "dp": "nn.DataParallel's scatter, replicas and threads, which run on real devices only",
    "allocator": "the caching allocator's reserve and fragmentation (gpus.fits keeps headroom "
    "for them)",
}
# Strategies whose own mechanism cannot run on fake tensors, and why.
UNREHEARSABLE = {"dp": LIMITS["dp"]}


def ranks_of(spec: RunSpec, last: bool = True) -> dict[int, bool]:
    """The ranks of a cell that can differ, each with whether it is measured: the first
    rank of each pipeline stage (pp is the mesh's outermost dimension, so stage s begins
    at rank s x n / pp), measured; and, with `last`, the last rank, which drives its
    node's highest device index, its code run without the measurement where it is no
    stage's first."""
    ranks = spec.processes
    firsts = [s * (ranks // spec.stages) for s in range(spec.stages)] if ranks > 1 else [0]
    return {r: r in firsts for r in sorted({*firsts, *([ranks - 1] if last else [])})}


def planned(config: dict) -> list[tuple[RunSpec, int, bool]]:
    """(spec, rank, measured) of every rank the rehearsal runs (see ranks_of): the last
    rank where the strategy runs most ranks for its model and variant (the device index
    is the one thing a last rank changes, the same code at every count)."""
    specs = [cell.spec for cell in cells(config) if cell.spec.repeat == 0]
    most: dict[tuple, int] = {}
    for spec in specs:
        key = (spec.model_name, spec.variant, spec.strategy)
        most[key] = max(most.get(key, 0), spec.processes)
    return [
        (spec, rank, measured)
        for spec in specs
        for rank, measured in ranks_of(
            spec, last=spec.processes == most[(spec.model_name, spec.variant, spec.strategy)]
        ).items()
    ]


def device_type(config: dict) -> str:
    """The device the rehearsal fakes: cuda for a GPU config (`auto` included: where it
    finds GPUs, it runs on them), else cpu."""
    return "cpu" if config["device"] == "cpu" else "cuda"


def code_hash() -> str:
    """What a rehearsal's result depends on besides the cell: the package's code and
    torch's version; a result of other code is rehearsed again."""
    from parabench.envinfo import torch_build

    digest = hashlib.sha256(str(torch_build()[0]).encode())
    package = Path(__file__).parents[1]  # parabench, every subpackage
    for path in sorted([*package.rglob("*.py"), *package.rglob("*.cpp")]):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


# --- one rank -----------------------------------------------------------------------


def rank(
    spec: RunSpec, r: int, gpu: GPU, device: str, gpus_per_node: int, measure: bool = True
) -> dict:
    """Rehearse rank `r` of `spec` (see the module's docstring): its row's figures;
    without `measure`, its code only (built, one step, its state gathered)."""
    import torch

    from parabench import strategies
    from parabench.models import build
    from parabench.models.base import fake_mode, quiet_fake
    from parabench.predict.fakerank import Counting, total_tracker_class
    from parabench.process import runtime
    from parabench.run.cell import batch_source
    from parabench.run.loop import run_step, synchronizer

    if spec.strategy in UNREHEARSABLE:
        return {"status": NOT_REHEARSED, "reason": UNREHEARSABLE[spec.strategy]}
    per_node = node_ranks(spec, device, gpus_per_node)
    local = r % per_node
    dev = torch.device(device, local) if device == "cuda" else torch.device("cpu")
    with runtime.alone(spec, r, dev, 1, per_node) as ctx:
        if reason := strategies.get(spec.strategy).skip_reason(spec, ctx):
            return {"status": SKIPPED, "reason": reason}
        if device == "cuda":  # as runtime.start makes a cell's rank's device current
            torch.cuda.set_device(dev)
        ctx = runtime.with_meshes(ctx, spec)
        _forget_other_ranks()
        with torch.device("meta"):
            model = build(spec.model, spec.seed)
        # The batch is drawn on the CPU and moved (no CUDA generator stands in here).
        model = dataclasses.replace(model, device_batches=False)
        with quiet_fake(), stand_ins(), fake_mode():
            strategy = strategies.build(model, spec, ctx)
            batches = batch_source(model, spec, strategy)
            sync = synchronizer(strategy.devices())
            run_step(strategy, batches, 0, sync)  # the optimizer's state made
            if measure:  # a second step, as every later one, measured
                tracker = total_tracker_class()()
                tracker.track_external(strategy.module, strategy.local_optimizer())
                counting = Counting({})
                with tracker, counting:
                    run_step(strategy, batches, 1, sync)
            held = strategy.held_bytes()
            strategy.full_state()
    got = {"status": OK, "reason": "", "device": str(dev), "held_bytes": sum(held.values())}
    if measure:
        peaks = tracker.get_tracker_snapshot("peak").values()
        got["peak_memory_bytes"] = int(max((s.get("Total", 0) for s in peaks), default=0))
        got["flops_per_step"] = counting.work.flops()
        got["compute_s_estimate"] = counting.work.seconds(gpu)
    return got


def _forget_other_ranks() -> None:
    """Empty DTensor's cache of sharding decisions: its entries hold the local shapes
    of the rank that made them (keyed by global shapes and placements), which differ
    on another rank of an uneven split (a vocabulary of 50,257 over 4: 12,565 rows on
    rank 0, 12,562 on rank 3). A process is one rank in a real run; here it runs
    many. Both caches go: the fast path's (C++) and the Python one, per thread
    (autograd runs backward in one of its own), which a new one replaces."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._sharding_prop import LocalLRUCache

    if clear := getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None):
        clear()
    rules = DTensor._op_dispatcher.sharding_propagator
    rules.propagate_op_sharding = LocalLRUCache(rules.propagate_op_sharding_non_cached)


def node_ranks(spec: RunSpec, device: str, gpus_per_node: int) -> int:
    """How many of the cell's ranks share a node: one per GPU on cuda (local rank
    r % this, on cuda:<local rank>), all of them on the CPU."""
    return max(1, min(spec.processes, gpus_per_node if device == "cuda" else spec.processes))


# What the rehearsal replaces, because fake tensors hold no data to read (each is named
# where it is made, in `stand_ins`):
STAND_INS = {
    "foreach": "torch's choice of foreach kernels sees a fake tensor as the tensor it stands "
    "for (on CUDA, foreach is the optimizers' default)",
    "compile": "torch.compile is the identity: each block runs its eager code",
    "mesh": "a DeviceMesh computes its rank bookkeeping on real tensors",
    "ddp": "DDP skips its check that every rank's parameters have the same shapes, its "
    "broadcast of rank 0's parameters at construction (a rank alone would copy its own), "
    "its runtime statistics (timed with CUDA events) and the rebuild of its buckets in "
    "gradient order",
    "pipeline": "a pipeline's warm-up vote is taken as static shapes, which every stage "
    "parabench builds declares",
    "objects": "a collective of Python objects (all_gather_object) gives this rank's object "
    "to every slot: it pickles values, which fake tensors lack",
}


@contextlib.contextmanager
def stand_ins() -> Iterator[None]:
    """The rehearsal's replacements for what reads tensors' data (STAND_INS), restored
    on exit. Everything else of a cell's code runs as on a GPU."""
    with contextlib.ExitStack() as stack:
        for patch in (
            _foreach_as_cuda,
            _compile_eager,
            _meshes_real,
            _ddp_without_data,
            _static_pipeline,
            _objects_local,
        ):
            stack.enter_context(patch())
        yield


@contextlib.contextmanager
def _patched(owner, name: str, value) -> Iterator[None]:
    """`owner.name` set to `value`, restored on exit; nothing where this torch has no such
    attribute (a version before or after the one the stand-in was written for)."""
    if not hasattr(owner, name):
        yield
        return
    # a class's own attribute as it is (a staticmethod, a property), not as looked up
    saved = (
        vars(owner).get(name, getattr(owner, name))
        if isinstance(owner, type)
        else getattr(owner, name)
    )
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@contextlib.contextmanager
def _foreach_as_cuda() -> Iterator[None]:
    """Fake tensors among the types torch's foreach kernels take: the optimizers' default
    (foreach where every parameter is a supported tensor on CUDA) and clip_grad_norm's
    decide as they would on the real tensors. Without it, a FakeTensor's type keeps every
    optimizer on the per-parameter loop, and what foreach refuses (a mix of DTensors and
    plain tensors) is never seen."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    lists = (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types)
    added = [types for types in lists if FakeTensor not in types]
    for types in added:
        types.append(FakeTensor)
    try:
        yield
    finally:
        for types in added:
            types.remove(FakeTensor)


@contextlib.contextmanager
def _compile_eager() -> Iterator[None]:
    """torch.compile as the identity: Inductor's CUDA code is not rehearsed
    (LIMITS), the blocks' eager code is."""
    import torch

    def identity(fn=None, *args, **kwargs):
        return fn if fn is not None else (lambda f: f)

    with _patched(torch, "compile", identity):
        yield


@contextlib.contextmanager
def _meshes_real() -> Iterator[None]:
    """Every DeviceMesh method outside fake tensors: a mesh's tensors are ranks, never
    device data, and it reads them back (tolist, nonzero), which a fake tensor cannot.
    FSDP2 over a TP mesh makes a mesh inside the step's code (DeviceMesh._concatenate)."""
    import functools

    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    def real(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with unset_fake_temporarily():
                return fn(*args, **kwargs)

        return run

    with contextlib.ExitStack() as stack:
        for name, attr in list(vars(DeviceMesh).items()):
            if isinstance(attr, staticmethod):
                wrapped = staticmethod(real(attr.__func__))
            elif isinstance(attr, property):
                wrapped = property(real(attr.fget), attr.fset, attr.fdel, attr.__doc__)
            elif callable(attr) and not isinstance(attr, type):
                wrapped = real(attr)
            else:
                continue
            stack.enter_context(_patched(DeviceMesh, name, wrapped))
        yield


@contextlib.contextmanager
def _ddp_without_data() -> Iterator[None]:
    """DDP on fake tensors: its C++ reducer, buckets and hooks run as on a GPU, less what
    reads tensors' data or times kernels: the constructor's check that every rank's
    parameters have the same shapes (a rank alone would compare itself with itself),
    its broadcast of rank 0's parameters and buffers to the others (a rank alone would
    copy its own values onto themselves, a flatten and copy per parameter: a fifth of a
    gpt2 rank's rehearsal), the runtime statistics its reducer times with CUDA events
    in the first iterations (prepare_for_forward counts the iteration that turns them
    on) and its logger reports, and the rebuild of its buckets in the order gradients
    arrived in the first step (an order, not a change of what each bucket reduces)."""
    import torch.distributed as dist
    from torch.nn.parallel import distributed

    with contextlib.ExitStack() as stack:
        for name in ("_verify_param_shape_across_processes", "_sync_module_states"):
            stack.enter_context(_patched(distributed, name, lambda *a, **k: None))
        stack.enter_context(_patched(dist.Logger, "set_runtime_stats_and_log", lambda s: None))
        stack.enter_context(_patched(dist.Reducer, "prepare_for_forward", lambda s: None))
        stack.enter_context(_patched(dist.Reducer, "_rebuild_buckets", lambda s: False))
        yield


@contextlib.contextmanager
def _static_pipeline() -> Iterator[None]:
    """A pipeline schedule's warm-up vote on dynamic shapes, taken as static: the vote is
    a value the stages exchange and read back (item), which fake tensors do not carry,
    and every stage parabench builds declares its shapes (strategies/pipeline.py)."""
    from torch.distributed.pipelining import schedules

    warmup = getattr(schedules._PipelineSchedule, "_warmup_p2p", None)

    def static(self, stages, has_backward, p2p_done) -> None:
        from torch.distributed.pipelining._utils import InferenceMode
        from torch.distributed.pipelining.stage import PipelineStage

        if not all(isinstance(stage, PipelineStage) for stage in stages):
            return warmup(self, stages, has_backward, p2p_done)
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    with _patched(schedules._PipelineSchedule, "_warmup_p2p", static):
        yield


@contextlib.contextmanager
def _objects_local() -> Iterator[None]:
    """all_gather_object with this rank's object in every slot, as the rank's collectives
    return its own data (process/nocomm.py): the real one pickles the object's values, which
    fake tensors lack (a pipeline's full_state gathers its stages' parameters so)."""
    import torch.distributed as dist

    def local(object_list: list, obj, group=None) -> None:
        object_list[:] = [obj] * len(object_list)

    with _patched(dist, "all_gather_object", local):
        yield


def _root_cause(e: BaseException) -> str:
    """The exception in a line, where in the package or torch it was raised."""
    frames = traceback.extract_tb(e.__traceback__)
    where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames)), "?")
    text = " ".join(str(e).split())[:400]
    return f"{type(e).__name__}: {text} ({where})"


# --- a config ---------------------------------------------------------------------


def run(
    config: dict, out: Path, gpu_name: str, log=print, workers: int | None = None
) -> list[dict]:
    """Rehearse every rank of `config` and write out/rehearsal.csv as rows come, keeping
    the rows of an earlier rehearsal of the same cells by the same code and torch. This
    process must have installed fakecuda for a cuda config; `workers` processes share
    the ranks (default: this host's cores), forked from it before it imports torch."""
    from parabench.envinfo import usable_cores
    from parabench.hardware import gpus

    gpu = gpus.resolve(gpu_name)
    device = device_type(config)
    gpus_per_node = config.get("gpus_per_node", 8)
    code = code_hash()
    path = out / "rehearsal.csv"
    wanted = planned(config)
    keys = {_key(spec, r): spec for spec, r, _ in wanted}
    kept = {
        key: row
        for row in read_rows(path)
        if row.get("code_hash") == code
        and row.get("gpu") == gpu.name
        and (spec := keys.get(key := tuple(row[k] for k in REHEARSAL_KEY)))
        and row.get("config_hash") == spec.config_hash()
    }
    jobs = [(i, spec, r, m) for i, (spec, r, m) in enumerate(wanted) if _key(spec, r) not in kept]
    # The ranks on each device index together (in plan order within one): a process's
    # fake tensor cache is emptied when its current device changes (fakecuda.node), and
    # a rank after that runs its ops uncached, up to a fifth slower.
    jobs.sort(key=lambda job: job[2] % node_ranks(job[1], device, gpus_per_node))
    setting = (gpu, device, gpus_per_node, code)
    done: dict[int, dict] = {}
    workers = max(1, min(workers or usable_cores(), len(jobs)))
    with _pool(workers, setting) as pool:
        for i, row in pool(_job, jobs):
            done[i] = row
            rows = [done.get(i) or kept.get(_key(s, r)) for i, (s, r, _) in enumerate(wanted)]
            write_rows(path, REHEARSAL_COLUMNS, [row for row in rows if row])
            if row["status"] != SKIPPED:
                spec = wanted[i][0]
                log(f"rehearse {spec.path} rank {row['rank']}: {row['status']} {row['reason']}")
    rows = [done.get(i) or kept[_key(s, r)] for i, (s, r, _) in enumerate(wanted)]
    write_rows(path, REHEARSAL_COLUMNS, rows)
    return rows


# The setting of this process's rehearsal: (gpu, device, gpus_per_node, code hash).
_SETTING: list = []


@contextlib.contextmanager
def _pool(workers: int, setting: tuple):
    """A map of _job over jobs as they finish: in `workers` processes forked from this
    one (before it imports torch, which a fork after would share threads with), each
    standing in for its node (fakecuda.node) for good; else in this process."""
    import multiprocessing

    from parabench.preflight import fakecuda

    gpu, device, gpus_per_node, _ = setting
    node = (
        functools.partial(fakecuda.node, gpus_per_node, gpu.name, int(gpu.memory_bytes))
        if device == "cuda"
        else contextlib.nullcontext
    )
    if workers > 1 and "torch" not in sys.modules:
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(workers, _start_worker, (setting, node)) as procs:
            yield lambda fn, jobs: procs.imap_unordered(fn, jobs)
        return
    _SETTING[:] = [setting]
    with node():
        yield lambda fn, jobs: map(fn, jobs)


def _start_worker(setting: tuple, node) -> None:
    stands_in = node()
    stands_in.__enter__()  # for the worker's life (held: its exit on collection restores)
    _SETTING[:] = [setting, stands_in]


def _job(job: tuple) -> tuple[int, dict]:
    """One planned rank's row (this process's _SETTING)."""
    i, spec, r, measure = job
    gpu, device, gpus_per_node, code = _SETTING[0]
    t0 = time.perf_counter()
    row = {
        **rank_key(spec, r),
        "config_hash": spec.config_hash(),
        "code_hash": code,
        "gpu": gpu.name,
        "device_memory_bytes": int(gpu.memory_bytes) if device == "cuda" else "",
    }
    if reason := _static(spec):
        row.update(status=SKIPPED, reason=reason)
    else:
        try:
            row.update(rank(spec, r, gpu, device, gpus_per_node, measure))
        except Exception as e:
            row.update(status=FAILED, reason=_root_cause(e))
    if "peak_memory_bytes" in row and device == "cuda":
        row.update(judge_fit(row["peak_memory_bytes"], gpu))
    row["seconds"] = round(time.perf_counter() - t0, 3)
    return i, row


# The oldest torch whose peaks under fake tensors the tests check, to MemTracker as advise
# runs it and to the sizes: make test's pin (a test holds the two together). On 2.10,
# FSDP over 8 of a 4.3B model came out at 48 GiB against 2.13's under 20: an older
# torch's peak is said, not judged.
PEAKS_CHECKED_FROM = (2, 13)


def judge_fit(peak: int, gpu: GPU, release: tuple[int, int] | None = None) -> dict:
    """A measured rank's `fits` and `reason` against `gpu` (gpus.fits), judged only on a
    torch from PEAKS_CHECKED_FROM (`release`, default this one's). Before it, `fits` is
    empty, so nothing is refused for memory, and the reason says the peak and why."""
    import torch

    from parabench.envinfo import torch_release
    from parabench.hardware.gpus import fits

    release = release or torch_release(torch.__version__)
    size = f"peak {peak / 2**30:.1f} GiB"
    if release is None or release < PEAKS_CHECKED_FROM:
        this = f"torch {'.'.join(map(str, release))}" if release else "this torch"
        checked = ".".join(map(str, PEAKS_CHECKED_FROM))
        return {
            "fits": "",
            "reason": f"{size} not set against {gpu.name}: {this}'s fake tensors' peaks "
            f"are checked on torch {checked} and later only",
        }
    if fits(peak, gpu.memory_bytes):
        return {"fits": True, "reason": ""}
    limit = f"{gpu.name}'s {gpu.memory_bytes / 2**30:.1f} GiB"
    return {"fits": False, "reason": f"{size} does not fit {limit} with headroom"}


def _key(spec: RunSpec, r: int) -> tuple[str, ...]:
    return tuple(str(v) for v in rank_key(spec, r).values())


def _static(spec: RunSpec) -> str | None:
    """Why the cell is recorded as skipped or failed without running (its settings)."""
    problems = checks.problems(spec, launching=False)
    if problems:
        return "; ".join(problems)
    return checks.static_skip_reason(spec)


def refused(rows: list[dict]) -> list[dict]:
    """The ranks whose cell cannot run on that GPU: failed, or not fitting."""
    return [r for r in rows if r["status"] == FAILED or str(r.get("fits")) == "False"]


def summary(rows: list[dict]) -> list[str]:
    """The rehearsal in a few lines: counts by outcome, the peaks not judged (an older
    torch), then each refused rank."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    lines = [", ".join(f"{n} {status}" for status, n in sorted(counts.items()))]
    # a GPU's rank measured on an older torch (judge_fit): said here, where the preflight
    # shows it
    measured = ("peak_memory_bytes", "device_memory_bytes")
    unjudged = [
        r for r in rows if all(r.get(k) not in (None, "") for k in measured) and r["fits"] == ""
    ]
    if unjudged:
        lines.append(f"{len(unjudged)} peaks not judged: {unjudged[0]['reason']}")
    for row in refused(rows):
        where = f"{row['model']} {row['strategy']} x{row['devices']} rank {row['rank']}"
        lines.append(f"{where}: {row['reason']}")
    return lines


def in_child(
    config: dict,
    out: Path,
    gpu: str = "h100",
    python: str | None = None,
    timeout: float = 900,
    cwd: Path | None = None,
) -> tuple[list[dict], str | None]:
    """`parabench rehearse` in a process of its own (fakecuda loads before torch there):
    the rows, and why none came back where the child could not rehearse."""
    argv = [python or sys.executable, "-m", "parabench", "rehearse"]
    argv += ["--config-json", json.dumps(config, sort_keys=True), "--gpu", gpu, "--out", str(out)]
    try:
        got = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"the rehearsal did not finish: {e}"
    if got.returncode not in (0, 1):
        why = (got.stderr.strip().splitlines() or ["no output"])[-1]
        return [], f"the rehearsal could not run: {why}"
    return read_rows(out / "rehearsal.csv"), None
