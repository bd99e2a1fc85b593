"""A cell builds its model once: the second copy it needs (the no-communication check's,
or the reference's reorder run) is a copy of the one it built, equal to it parameter
for parameter, never a second build from the factory (minutes for a 7B model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import GPT2, LLAMA, REPO, TINY_MLP, cell_argv, tiny_spec
from parabench import models
from parabench.run import cell
from parabench.spec import ModelSpec

TESTS = Path(__file__).resolve().parent
EXAMPLES = REPO / "examples"  # the custom factories' files, named by their `path`

KINDS = {
    "mlp": TINY_MLP,
    "seqnet": ModelSpec.of("seqnet", dims=[12, 8, 4]),
    "resmlp": ModelSpec.of("resmlp", d_in=8, width=8, depth=2, classes=3),
    "gpt": ModelSpec.of("gpt", vocab=32, seq_len=8, n_layer=2, n_head=2, d_model=16),
    "my_model:build": ModelSpec.of(
        "custom", factory="my_model:build", args={"width": 8}, path=str(EXAMPLES)
    ),
    "my_model:build batchnorm": ModelSpec.of(
        "custom",
        factory="my_model:build",
        args={"width": 8, "batchnorm": True},
        path=str(EXAMPLES),
    ),
    "my_model:build_module": ModelSpec.of(
        "custom", factory="my_model:build_module", args={"width": 8, "depth": 2}, path=str(EXAMPLES)
    ),
    "counted_model:build": ModelSpec.of("custom", factory="counted_model:build", path=str(TESTS)),
    "hf llama": ModelSpec.of(**{k: v for k, v in LLAMA.items() if k != "batch_size"}),
    "hf gpt2": ModelSpec.of(**{k: v for k, v in GPT2.items() if k != "batch_size"}),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_copy_is_the_model_as_built_and_apart_from_it(kind):
    spec = KINDS[kind]
    if spec.arch == "hf":
        pytest.importorskip("transformers")
    model = models.build(spec, 0)
    copy = cell.copy_model(model)
    assert copy is not None, f"{kind} cannot be deep-copied"
    before = {**dict(model.module.named_parameters()), **dict(model.module.named_buffers())}
    after = {**dict(copy.module.named_parameters()), **dict(copy.module.named_buffers())}
    assert before.keys() == after.keys() and copy.block_names == model.block_names
    for name, value in before.items():
        assert torch.equal(after[name], value), name
        assert after[name].data_ptr() != value.data_ptr() or value.numel() == 0, name

    # Weights the model ties stay tied in the copy, to its own tensor.
    def ties(module):
        named = module.named_parameters(remove_duplicate=False)
        return sorted(Counter(id(p) for _, p in named).values())

    assert ties(copy.module) == ties(model.module)

    # A step on the copy, through its own loss and batch, leaves the original as built.
    x, y = copy.batch(4, torch.Generator().manual_seed(0))
    copy.loss_fn(copy.module(x), y).backward()
    assert all(p.grad is None for p in model.module.parameters()), "the original got gradients"
    assert any(p.grad is not None for p in copy.module.parameters())


def test_a_model_that_cannot_be_copied_is_built_again(monkeypatch):
    spec = tiny_spec("single", 1)
    model = models.build(spec.model, spec.seed)
    model.module.lock = __import__("threading").Lock()  # deepcopy refuses a lock
    assert cell.copy_model(model) is None
    spare = cell.Spare(spec, model)
    built = spare.take()
    assert built is not model
    same = zip(model.module.named_parameters(), built.module.parameters(), strict=True)
    for (name, p), q in same:
        assert torch.equal(p, q), name


def test_take_leaves_the_generators_as_the_build_left_them():
    spec = tiny_spec("single", 1, seed=3)
    model = models.build(spec.model, spec.seed)
    after_build = torch.get_rng_state()
    spare = cell.Spare(spec, model)
    torch.rand(100)  # the timed run draws (dropout)
    spare.take()
    assert torch.equal(torch.get_rng_state(), after_build)


# A cell run in a process of its own without torchrun (one rank), each call of
# parabench.models.build counted, on the meta device (check_fits) or for real.
COUNT_SCRIPT = """
import json, sys
from pathlib import Path
import torch
from parabench.run import cell
from parabench.spec import RunSpec

spec = RunSpec.from_dict(json.loads(sys.argv[1]))
calls = []
real_build = cell.build

def build(model_spec, seed):
    calls.append(torch.empty(0).device.type)
    return real_build(model_spec, seed)

cell.build = build
rc = cell.run_cell(spec, Path(sys.argv[2]))
print(json.dumps({"rc": rc, "calls": calls}))
"""


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_a_cell_builds_its_model_once(strategy, tmp_path):
    spec = tiny_spec(strategy, 1, steps=3, warmup=1, profile_steps=1)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "WORLD_SIZE")}
    proc = subprocess.run(
        [sys.executable, "-c", COUNT_SCRIPT, json.dumps(spec.to_dict()), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert got["rc"] == 0 and meta["status"] == "ok", meta.get("reason")
    # check_fits' build on the meta device sizes the model; one real build runs it.
    assert Counter(got["calls"]) == {"meta": 1, "cpu": 1}, got["calls"]
    if strategy == "single":
        assert meta["reorder_max_abs_diff"] is not None


@pytest.mark.parametrize("strategy,devices", [("ddp", 2), ("single", 1)])
def test_every_process_builds_a_custom_model_once(strategy, devices, tmp_path):
    """The factory counts its calls per process. The cell's check of its settings
    (checks.problems, as planning's) calls it on fake tensors, which allocate nothing;
    the cell's own build is the one real build in each process, and nothing else there
    builds it again (not the FLOPs counted for its record, not check_fits)."""
    builds = tmp_path / "builds.txt"
    spec = tiny_spec(
        strategy,
        devices,
        model_name="counted",
        model=KINDS["counted_model:build"],
        batch_size=8,
        steps=3,
        warmup=1,
        profile_steps=1,
        seed=1,
    )
    out = tmp_path / "cell"
    proc = subprocess.run(
        cell_argv(spec, out),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PARABENCH_TEST_BUILDS": str(builds)},
    )
    meta = json.loads((out / "meta.json").read_text())
    assert meta["status"] == "ok", (meta.get("reason"), proc.stderr[-3000:])
    lines = [line.split() for line in builds.read_text().splitlines()]
    real = Counter(pid for pid, _seed, kind in lines if kind != "fake")
    assert len(real) == devices and set(real.values()) == {1}, lines
    # ... and it is the cell's own, seeded with the cell's seed
    assert {seed for _pid, seed, kind in lines if kind != "fake"} == {"1"}, lines
    assert meta["model_facts"]["params"] == 3 * (16 * 16 + 16)  # counted, not built again
