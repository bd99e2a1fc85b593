"""How many GPUs a process asks for, and what a peak reading counts: CUDA-only logic
checked on the CPU (torch.cuda patched where the CPU build has no answer)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import tiny_spec
from parabench import strategies
from parabench.predict import rank_alone
from parabench.process.runtime import Context
from parabench.run.loop import ALONE_STEPS, ALONE_WARMUP


def cuda_ctx(world: int, local_world: int) -> Context:
    """Rank 0 of a world on cuda:0 (a device object only: nothing is allocated)."""
    return Context(
        rank=0,
        world_size=world,
        local_rank=0,
        device=torch.device("cuda", 0),
        threads=1,
        distributed=True,
        local_world=local_world,
    )


def one_gpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


def test_a_rank_measured_alone_needs_only_the_gpu_it_drives(monkeypatch):
    # The `ranks` job and `parabench plan` get one GPU and measure one rank of a world
    # of 4 on it: that rank drives one device, so it must not be skipped.
    one_gpu(monkeypatch)
    for name in ("ddp", "fsdp", "pipeline"):
        spec = tiny_spec(name, 4, device="cuda")
        assert strategies.get(name).skip_reason(spec, cuda_ctx(4, local_world=1)) is None, name
        # A real cell of 4 ranks on this host with one GPU visible cannot run.
        reason = strategies.get(name).skip_reason(spec, cuda_ctx(4, local_world=4))
        assert reason is not None and "1 visible" in reason, name


def test_one_process_driving_n_gpus_needs_all_n(monkeypatch):
    one_gpu(monkeypatch)
    for name in ("dp", "model_parallel"):
        spec = tiny_spec(name, 4, device="cuda")
        ctx = Context(0, 1, 0, torch.device("cuda", 0), 1, False)
        reason = strategies.get(name).skip_reason(spec, ctx)
        assert reason is not None and "1 visible" in reason, name
        assert spec.cuda_devices_per_host(ctx.local_world) == 4, name
    single = tiny_spec("single", 1, device="cuda")
    assert strategies.get("single").skip_reason(single, cuda_ctx(1, local_world=1)) is None


def test_rank_of_drives_cuda_0_and_is_not_skipped_with_one_gpu(monkeypatch):
    # rank_of on a one-GPU host: rank 3 of 4 is measured on cuda:0, made current before
    # a device mesh could pick cuda:3. The strategy is stopped at its skip check (this
    # CPU build cannot run it), after recording what the real check said.
    one_gpu(monkeypatch)
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    cls = strategies.get("fsdp")
    real_check, seen = cls.skip_reason, {}

    def spy(spec, ctx):
        seen["device"], seen["reason"] = ctx.device, real_check(spec, ctx)
        return "stopped by the test"

    monkeypatch.setattr(cls, "skip_reason", spy)
    got = rank_alone.rank_of(tiny_spec("fsdp", 4, device="cuda"), threads=1, rank=3)
    assert got == {"status": "skipped", "reason": "stopped by the test"}
    assert seen["reason"] is None
    assert seen["device"] == torch.device("cuda", 0)
    assert current == [torch.device("cuda", 0)]


# One rank of a cell, in a process of its own (runtime.start opens a one-rank group
# without torchrun): weak references to every module and parameter of the
# no-communication check's copy, read each time the CUDA high-water mark is reset.
DROPPED_SCRIPT = """
import json, sys, time, weakref
from pathlib import Path
from parabench import strategies
from parabench.run import cell
from parabench.run import profiling
from parabench.process import runtime
from parabench.spec import RunSpec

spec = RunSpec.from_dict(json.loads(sys.argv[1]))
copy, at_reset = [], []
real_build, real_reset = strategies.build, profiling.reset_high_water

def build(model, spec, ctx):
    got = real_build(model, spec, ctx)
    if not ctx.communicates:  # the check's copy
        copy.extend(weakref.ref(x) for x in [*model.module.modules(), *got.module.parameters()])
    return got

def reset(devices):
    at_reset.append(sum(ref() is not None for ref in copy))
    return real_reset(devices)

strategies.build, profiling.reset_high_water = build, reset
ctx = runtime.start(spec)
try:
    cell._timed(spec, ctx, Path(sys.argv[2]), time.perf_counter(), "host")
finally:
    runtime.stop(ctx)
print(json.dumps({"copy": len(copy), "alive_at_reset": at_reset}))
"""


def alive_at_reset(spec, tmp_path) -> tuple[int, list[int]]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "WORLD_SIZE")}
    proc = subprocess.run(
        [sys.executable, "-c", DROPPED_SCRIPT, json.dumps(spec.to_dict()), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return got["copy"], got["alive_at_reset"]


def test_dropped_check_copy_is_gone_when_the_peak_is_reset(tmp_path):
    # FSDP2's state holds its module in reference cycles: dropping the last reference
    # frees nothing until a collection, so the counted step's CUDA peak would include
    # the no-communication check's copy of the model.
    spec = tiny_spec("fsdp", 1, steps=3, warmup=1, profile_steps=1)
    copy, at_reset = alive_at_reset(spec, tmp_path)
    # the last reset: after the plan's steps, before the counted step
    assert copy > 0 and at_reset[-1] == 0, f"{at_reset[-1]} of {copy} parts of the copy alive"


@pytest.mark.slow
def test_dropped_compiled_copy_is_gone_when_the_peak_is_reset(tmp_path):
    # compile sets block.forward = torch.compile(block.forward): block -> its compiled
    # forward -> the bound method -> block, a cycle on every block.
    spec = tiny_spec("ddp", 1, steps=3, warmup=1, profile_steps=1, compile=True)
    copy, at_reset = alive_at_reset(spec, tmp_path)
    assert copy > 0 and at_reset[-1] == 0, f"{at_reset[-1]} of {copy} parts of the copy alive"


def test_a_rank_measured_alone_counts_its_peak_from_its_counted_step(monkeypatch):
    """As a cell's (run/cell.py), a rank measured alone (ranks.csv, plan.csv) resets
    the CUDA high-water mark just before its counted step: not its build, which moves
    the whole model onto the device before sharding it (FSDP, TP, layouts; counted, it
    made a sharded layout of an 8B model look 32 GB larger than it is), nor its warm-up
    steps. (On this CPU the reset does nothing: what is checked is when it comes.)"""
    order = []
    real_build, real_step = strategies.build, rank_alone.run_step
    monkeypatch.setattr(
        rank_alone.strategies, "build", lambda *a: order.append("build") or real_build(*a)
    )
    monkeypatch.setattr(
        rank_alone.profiling, "reset_high_water", lambda devices: order.append("reset")
    )
    monkeypatch.setattr(
        rank_alone, "run_step", lambda *a, **k: order.append("step") or real_step(*a, **k)
    )
    got = rank_alone.rank_of(tiny_spec("fsdp", 2), threads=1)
    assert got["status"] == "ok", got
    counted = [i for i, e in enumerate(order) if e == "step"][ALONE_STEPS + ALONE_WARMUP]
    assert order[counted - 1] == "reset" and order.count("reset") == 1, order
