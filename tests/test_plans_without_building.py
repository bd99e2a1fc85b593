"""Nothing on the planning host (a login node) builds a full model: a transformers model
is planned from its config, a custom factory's model is built on fake tensors, so a
70B config plans in seconds and a few hundred MB; a factory that reads values while it
builds still plans without building for real. A pipeline or model-parallel rank reads
its cut as planning does, on a fake copy of the model it built: no second copy of its
weights, no forward of the whole model on the CPU. Each memory check runs in a
process of its own, its peak resident memory read from the kernel (VmHWM), and killed
well before a real build could take the machine's memory."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import HF_INSTALLED, REPO, peak_memory_run

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

GIB = 2**30
# Llama 3 70B's shape
LLAMA_70B = {
    "arch": "hf",
    "model_type": "llama",
    "seq_len": 4096,
    "batch_size": 8,
    "config": {
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
}
# examples/my_model.py's module at 21.5 billion parameters (86 GB in fp32)
CUSTOM_21B = {
    "arch": "custom",
    "factory": "my_model:build_module",
    "args": {"width": 8192, "depth": 80},
    "batch_size": 8,
}
STRATEGIES = ["single", "ddp", "fsdp", "tp", "pipeline", "model_parallel"]

PLAN = """
import json, sys, yaml
from parabench import checks, models
from parabench.config import cells, checked, problems, skipped
config = checked(yaml.safe_load(open("config.yaml")))
found = problems(config)
planned = cells(config)
skips = skipped(config)
facts = models.facts(next(iter(planned)).spec.model)
print(json.dumps({"problems": found, "cells": len(planned), "skipped": len(skips),
                  "n_blocks": facts.n_blocks, "n_params": facts.n_params}))
"""


def measured(argv: list[str], cwd: Path, kill_above: int = 3 * GIB) -> tuple[int, str, int, float]:
    """(exit status, output, peak RSS in bytes, seconds) of `argv` (conftest's
    peak_memory_run)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "workflow")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    log = cwd / "out.log"
    code, peak, seconds = peak_memory_run(argv, log, kill_above, cwd=cwd, env=env)
    return code, log.read_text(), peak, seconds


def workdir(tmp_path: Path, model: dict) -> Path:
    config = {
        "device": "cuda",
        "models": {"big": model},
        "strategies": STRATEGIES,
        "devices": [1, 2, 4, 8],
        "repeats": 1,
        "plan": {"enabled": False},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    shutil.copy(REPO / "examples" / "my_model.py", tmp_path / "my_model.py")
    return tmp_path


def plans(tmp_path: Path, model: dict) -> dict:
    """Planning through the package (what the Snakefile and the sweep call), in a
    process of its own: its findings, peak RSS and time."""
    work = workdir(tmp_path, model)
    code, out, peak, seconds = measured([sys.executable, "-c", PLAN], work)
    assert code == 0, f"planning exited {code} at peak RSS {peak / GIB:.2f} GiB\n{out[-3000:]}"
    got = json.loads(out.strip().splitlines()[-1])
    assert got["problems"] == [] and got["cells"] > 0, got
    return {**got, "peak": peak, "seconds": seconds}


def test_a_custom_factory_at_21b_parameters_plans_on_fake_tensors(tmp_path):
    got = plans(tmp_path, CUSTOM_21B)
    width, depth = 8192, 80
    block = 2 * width + (width * 2 * width + 2 * width) + (2 * width * width + width)
    assert got["n_params"] == (64 * width + width) + depth * block + (width * 10 + 10)
    assert got["n_blocks"] == depth
    assert got["peak"] < GIB, f"peak RSS {got['peak'] / GIB:.2f} GiB"
    assert got["seconds"] < 120, got["seconds"]


@pytest.mark.skipif(not HF_INSTALLED, reason="needs transformers")
def test_a_70b_transformers_config_plans_from_its_config(tmp_path):
    got = plans(tmp_path, LLAMA_70B)
    assert got["n_blocks"] == 80
    assert got["peak"] < GIB, f"peak RSS {got['peak'] / GIB:.2f} GiB"
    assert got["seconds"] < 120, got["seconds"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "model",
    [
        CUSTOM_21B,
        pytest.param(
            LLAMA_70B, marks=pytest.mark.skipif(not HF_INSTALLED, reason="needs transformers")
        ),
    ],
    ids=["custom-21b", "llama-70b"],
)
def test_snakemake_plans_a_70b_config_in_seconds_and_under_a_gib(tmp_path, model):
    """`snakemake -n`, as on a login node (and each Slurm job's parse of the Snakefile)."""
    work = workdir(tmp_path, model)
    argv = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile")]
    argv += ["--directory", str(work), "--configfile", str(work / "config.yaml"), "-n"]
    code, out, peak, seconds = measured(argv, work)
    assert code == 0, f"snakemake -n exited {code} at {peak / GIB:.2f} GiB\n{out[-3000:]}"
    assert "run_cell" in out or "benchmark" in out, out[-2000:]
    assert peak < GIB, f"peak RSS {peak / GIB:.2f} GiB"
    assert seconds < 180, seconds


# A factory that reads values while it builds: `scale` rescales its drawn weights by
# their spread (a value used in arithmetic), `device` reads a tensor it makes on a
# named device, `branch` decides what it builds by a value.
READS_VALUES = """
import torch
from torch import nn


def build(how="scale", width=8):
    layers = 3
    if how == "device":
        layers = int(torch.ones(layers, device="cpu").sum().item())
    blocks = nn.Sequential(
        *(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)),
        nn.Linear(width, 2),
    )
    if how != "device":
        with torch.no_grad():
            w = blocks[0][0].weight
            scale = w.std().item()
            if how == "branch" and scale > 0:
                blocks.append(nn.Identity())
            w /= scale

    def batch(n, g):
        return torch.randn(n, width, generator=g), torch.randn(n, 2, generator=g)

    plan = {"0.0": "colwise", "1.0": "rowwise"}
    return dict(blocks=blocks, loss=nn.MSELoss(), batch=batch, tp_plan=plan)
"""


@pytest.mark.parametrize("how", ["scale", "device", "branch"])
def test_a_factory_that_reads_values_while_building_plans(tmp_path, monkeypatch, how):
    """Fake tensors have no values: such a factory, which works for real, is not refused.
    Its facts are read off a build that allocates nothing either (symbolic values,
    or the meta device); where none can be built, they are unknown and no cell is
    skipped for them: each cell finds out for real."""
    from parabench.checks import static_skip_reason
    from parabench.config import cells, problems
    from parabench.models import facts
    from parabench.spec import ModelSpec

    monkeypatch.chdir(tmp_path)
    (tmp_path / "reads.py").write_text(READS_VALUES)
    entry = {"arch": "custom", "factory": "reads:build", "args": {"how": how}, "batch_size": 8}
    config = {
        "models": {"mine": entry},
        "strategies": ["single", "tp", "pipeline"],
        "devices": [1, 2, 4],
        "repeats": 1,
    }
    assert problems(config) == []
    found = facts(ModelSpec.of("custom", factory="reads:build", args={"how": how}))
    assert found.problems == ()
    if how == "branch":
        assert found.n_params is None
        assert all(static_skip_reason(c.spec) is None for c in cells(config))
        return
    assert found.n_params == 3 * (8 * 8 + 8) + (8 * 2 + 2)
    assert found.n_blocks == 4 and found.tp_problem(2) is None and found.tp_problem(3)
    skips = {(c.spec.strategy, c.spec.devices): static_skip_reason(c.spec) for c in cells(config)}
    assert skips[("pipeline", 2)] is None and skips[("tp", 2)] is None


RANK = """
import json
from parabench.models import build, stages
from parabench.spec import ModelSpec


def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024


small = build(ModelSpec.of("custom", factory="my_model:build_module"), 0)
stages.trace(small)  # torch's fake tensors' own imports and first use, apart
args = {"width": 2048, "depth": 8}
model = build(ModelSpec.of("custom", factory="my_model:build_module", args=args), 0)
seen = []  # what each block's forward is given: a fake tensor or a real one
for name in model.block_names:
    block = model.module.get_submodule(name)
    block.register_forward_pre_hook(lambda _m, a: seen.append(type(a[0]).__name__))
built = peak()
how = stages.trace(model)
given, sent = stages.boundary(model, how, [(0, 4), (4, 8)], 1, 8)
print(json.dumps({
    "built": built, "after": peak(), "problem": how.problem, "seen": sorted(set(seen)),
    "costs": len(how.costs), "shapes": [list(given.shape), list(sent.shape)],
    "bytes": sum(p.numel() * p.element_size() for p in model.module.parameters()),
}))
"""


def test_a_rank_reads_its_cut_on_a_fake_copy_of_its_model(tmp_path):
    """stages.trace and stages.boundary in a pipeline rank, on a model of 540 MB: its
    blocks only ever see fake tensors, and the rank's memory does not grow by a copy
    of the weights (it held two more before: a copy and a forward and backward)."""
    work = workdir(tmp_path, CUSTOM_21B)
    code, out, peak, _ = measured([sys.executable, "-c", RANK], work)
    assert code == 0, f"exited {code} at peak RSS {peak / GIB:.2f} GiB\n{out[-3000:]}"
    got = json.loads(out.strip().splitlines()[-1])
    assert got["problem"] is None and got["costs"] == 8, got
    assert got["seen"] == ["FakeTensor"], got["seen"]
    assert got["shapes"] == [[8, 2048], [8, 10]], got
    assert got["after"] - got["built"] < got["bytes"] / 10, got


# A module whose forward reads a value of its input, which fake tensors do not have.
READS_IN_FORWARD = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = self.embed(x) * (2.0 if x.sum().item() > 0 else 1.0)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def build():
    def batch(n, g):
        return torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)

    return dict(module=Net(), loss=nn.MSELoss(), batch=batch)
"""


def test_a_forward_that_reads_values_is_cut_for_real_in_the_rank(tmp_path, monkeypatch):
    """Planning leaves it to the rank; the rank reads the real model, on a copy that
    shares its weights (no copy of them), and checks the stages chained give its output."""
    from parabench.models import build, facts, stages
    from parabench.spec import ModelSpec

    monkeypatch.chdir(tmp_path)
    (tmp_path / "reads.py").write_text(READS_IN_FORWARD)
    spec = ModelSpec.of("custom", factory="reads:build")
    assert facts(spec).cut_skip is None and facts(spec).problems == ()
    model = build(spec, 0)
    before = {n: p.data_ptr() for n, p in model.module.named_parameters()}
    copies = []
    real_deepcopy = stages.copy.deepcopy

    def deepcopy(module, memo=None):
        copies.append(real_deepcopy(module, memo))
        return copies[-1]

    monkeypatch.setattr(stages.copy, "deepcopy", deepcopy)
    how = stages.trace(model)
    assert how.problem is None and len(how.costs) == 3 and how.costs[0] > 0
    assert (how.prefix, how.suffix) == (("embed",), ("head",))
    # a fake copy first, then the real reading's, which holds the model's own weights
    assert len(copies) == 2
    assert {n: p.data_ptr() for n, p in copies[1].named_parameters()} == before
    x, _ = model.batch(4, torch.Generator().manual_seed(2))
    first, second = stages.cut(model, how, 0, 1), stages.cut(model, how, 1, 3)
    assert torch.allclose(second.fed([x])(first(x)), model.module(x))
