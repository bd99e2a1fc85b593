"""Results are data, never code: a cell records what the steps after it need of its model
(FLOPs, parameters, activation bytes, the layers whose maths changes under a split), so
aggregate, report and compare never import a model, build one or call a factory,
whatever a meta.json names; a record of other settings than the config's, or of an
older contract, is refused with its file named."""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from conftest import LLAMA, REPO, run_cell, tiny_spec
from parabench import models, records
from parabench.process.flops import activation_bytes_per_sample, step_flops
from parabench.report.aggregate import aggregate
from parabench.spec import ModelSpec, RunSpec

CAUSE = "BatchNorm1d at blocks.1.1 normalises over the samples one rank or micro-batch sees"


def write_cell(root: Path, spec: RunSpec, offset: float = 0.0, **extra) -> Path:
    """A cell that ran, by hand: six steps, its parameters `offset` from single's."""
    rows = [
        {
            **spec.identity(),
            "step": i,
            "phase": "warmup" if i < 2 else "timed",
            "step_time_s": 0.01,
            "step_time_min_s": 0.009,
            "loss": 0.5,
            "samples": spec.global_batch,
        }
        for i in range(6)
    ]
    buf = io.BytesIO()
    torch.save({"0.weight": torch.full((4, 8), 0.5 + offset)}, buf)
    out = root / spec.path
    reference = {"param_travel": 4.0, "reorder_rel_diff": 1e-7} if spec.is_reference else {}
    records.write_ran(
        out,
        rows,
        buf.getvalue(),
        **spec.record_fields(),
        **reference,
        env={"host": "node1"},
        device_type="cpu",
        peak_flops_total=1e11,
        **extra,
    )
    return out / "meta.json"


def hostile(tmp_path: Path, model: ModelSpec) -> list[Path]:
    """single and ddp of `model`, recorded as a cell records them (model_facts), ddp's
    parameters apart from single's: a merge reaches every use of the model."""
    facts = {
        "flops_per_step": 1234,
        "params": 40,
        "params_bytes": 160,
        "activation_bytes_per_sample": 64.0,
        "blocks": 2,
        "tokens_per_sample": None,
        "maths_notes": {"batch": [CAUSE], "random": []},
    }
    return [
        write_cell(
            tmp_path,
            tiny_spec(strategy, n, model_name="m", model=model),
            0.25 * (strategy == "ddp"),
            model_facts=facts,
        )
        for strategy, n in (("single", 1), ("ddp", 2))
    ]


def merge(metas: list[Path], out: Path, cwd: Path) -> subprocess.CompletedProcess:
    """`parabench aggregate` of the cells, then `parabench report`, as the workflow's
    rules run them, in `cwd`."""
    tables = [f"--{t}-out={out / f'{t}.csv'}" for t in ("steps", "summary", "cells")]
    argv = [sys.executable, "-m", "parabench", "aggregate", "--meta", *map(str, metas), *tables]
    env = {**os.environ, "PYTHONPATH": str(REPO / "workflow")}
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=300, env=env)
    if proc.returncode:
        return proc
    report = [sys.executable, "-m", "parabench", "report", "--results", str(out)]
    report += ["--out", str(out / "report.html")]
    return subprocess.run(report, capture_output=True, text=True, cwd=cwd, timeout=300, env=env)


def test_a_results_file_naming_os_system_is_merged_and_runs_nothing(tmp_path):
    """A shared results directory whose meta.json names `os:system` as a custom model's
    factory, with a command as its arguments: aggregated and reported, and the command
    never runs. The figures come from what the record says."""
    marker = tmp_path / "ran"
    model = ModelSpec.of("custom", factory="os:system", args={"command": f"touch {marker}"})
    metas = hostile(tmp_path / "results", model)
    proc = merge(metas, tmp_path / "results", tmp_path)
    assert not marker.exists(), f"the results file ran a command\n{proc.stderr[-1500:]}"
    assert proc.returncode == 0, proc.stderr[-3000:]
    cells = pd.read_csv(tmp_path / "results" / "cells.csv").set_index("strategy")
    assert (cells["flops_per_step"] == 1234).all()
    assert cells.loc["ddp", "equivalent"] == False  # noqa: E712 (a CSV's bool)
    assert cells.loc["ddp", "likely_cause"] == CAUSE
    summary = pd.read_csv(tmp_path / "results" / "summary.csv").set_index("strategy")
    assert summary.loc["single", "model_params_bytes"] == 40 * 4


def test_merging_never_imports_the_module_a_record_names(tmp_path):
    """Not even a file of the user's, in the working directory: its import would run
    its code."""
    marker = tmp_path / "imported"
    (tmp_path / "marker_model.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n\ndef build(**kw):\n    raise SystemExit(3)\n"
    )
    metas = hostile(tmp_path / "results", ModelSpec.of("custom", factory="marker_model:build"))
    proc = merge(metas, tmp_path / "results", tmp_path)
    assert not marker.exists(), "aggregate or report imported the model's module"
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_record_of_other_settings_than_the_configs_is_refused_naming_its_file(tmp_path):
    spec = tiny_spec("single", 1)
    meta = write_cell(tmp_path, spec)
    out = [tmp_path / f"{t}.csv" for t in ("steps", "summary", "cells")]
    aggregate([meta], *out, config_hashes=[spec.config_hash()])  # its own settings: merged
    other = RunSpec.from_dict({**spec.to_dict(), "lr": 0.3})
    with pytest.raises(records.ResultsError, match="settings other than the config's") as e:
        aggregate([meta], *out, config_hashes=[other.config_hash()])
    assert str(meta) in str(e.value)


def test_a_record_of_the_contract_before_model_facts_is_refused_naming_its_file(tmp_path):
    """Its FLOPs and sizes could only come from building its model, which a merge never
    does: the reader refuses the older version, naming the file (the sweep reruns it)."""
    meta = write_cell(tmp_path, tiny_spec("single", 1))
    old = json.loads(meta.read_text())
    meta.write_text(json.dumps({**old, "schema_version": 2}))
    out = [tmp_path / f"{t}.csv" for t in ("steps", "summary", "cells")]
    with pytest.raises(records.ResultsError, match="schema version 2") as e:
        aggregate([meta], *out)
    assert str(meta) in str(e.value)


class RealAllocations(TorchDispatchMode):
    """Every op that makes a new real tensor of more than a few elements (not a view,
    not on the meta device, not fake): the storage and arithmetic a count must not do."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))

        def real(t) -> bool:
            return (
                isinstance(t, torch.Tensor)
                and not isinstance(t, FakeTensor)
                and t.device.type != "meta"
            )

        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if real(t)}
        for t in tree_leaves(out):
            if real(t) and t.numel() > 256 and t.untyped_storage().data_ptr() not in given:
                self.seen.append(str(func))
                break
        return out


def test_counting_a_transformers_model_copies_no_weight_and_runs_nothing_for_real():
    """A transformers forward reads values (its mask), so it cannot run on the meta
    device: it is counted on fake tensors, with eager attention (whose FLOPs torch
    counts), to exactly what a real count of the same maths gives, without a real
    forward or a copy of the weights (for a 7B model: 28 GB and minutes on the CPU)."""
    pytest.importorskip("transformers")
    llama = models.build(ModelSpec.of(**{k: v for k, v in LLAMA.items() if k != "batch_size"}), 0)
    with RealAllocations() as spy:
        flops = step_flops(llama, 8)
        activation_bytes_per_sample(llama)
    assert spy.seen == [], spy.seen[:5]
    eager = llama.for_counting(copy.deepcopy(llama.module))  # a real count, by hand
    x = llama.batch(1, torch.Generator().manual_seed(0))[0]
    with FlopCounterMode(display=False) as real:
        eager(x).float().sum().backward()
    assert flops == 8 * real.get_total_flops()


def test_a_cell_records_what_the_merge_needs_of_its_model(tmp_path):
    """The real cell: its record holds the model's figures, counted as process/flops.py counts
    them on the model the factory builds, and the merge reads them from there."""
    from parabench.process.flops import model_facts

    model = ModelSpec.of(
        "custom",
        factory="my_model:build",
        args={"width": 16, "depth": 2, "batchnorm": True},
        path=str(REPO / "examples"),
    )
    spec = tiny_spec("single", 1, model_name="mine", model=model, steps=3, profile_steps=1)
    meta, proc = run_cell(spec, tmp_path)
    assert meta["status"] == "ok", (meta.get("reason"), proc.stderr[-3000:])
    built = models.build(model, 0)
    expected = {
        "flops_per_step": step_flops(built, spec.global_batch),
        "params": sum(p.numel() for p in built.module.parameters()),
        "activation_bytes_per_sample": activation_bytes_per_sample(built),
        "blocks": 4,
    }
    facts = meta["model_facts"]
    assert {k: facts[k] for k in expected} == expected
    assert facts == json.loads(json.dumps(model_facts(built, spec.global_batch)))
    assert facts["maths_notes"]["batch"][0].startswith(CAUSE)
    out = [tmp_path / f"{t}.csv" for t in ("steps", "summary", "cells")]
    aggregate([tmp_path / "meta.json"], *out, config_hashes=[spec.config_hash()])
    summary = pd.read_csv(tmp_path / "summary.csv")
    assert summary.loc[0, "flops_per_step"] == expected["flops_per_step"]
    assert summary.loc[0, "model_params_bytes"] == 4 * expected["params"]


@pytest.mark.slow
def test_a_resumed_sweep_runs_nothing_a_recorded_file_names(tmp_path):
    """`parabench sweep` keeps a cell recorded with the config's settings hash and merges
    it: a meta.json changed since to name `os:system` (its recorded hash kept) is
    refused by the merge with its file named, and its command never runs."""
    config = {
        "device": "cpu",
        "models": {"tiny": {"arch": "mlp", "dims": [16, 8, 1], "batch_size": 16}},
        "strategies": ["single"],
        "devices": [1],
        "repeats": 1,
        "steps": 3,
        "warmup": 1,
        "profile_steps": 1,
        "timeout_s": 60,
        "cell_timeout_s": 240,
        "plan": {"enabled": False},
    }
    (tmp_path / "config.yaml").write_text(json.dumps(config))
    argv = [sys.executable, "-m", "parabench", "sweep", "config.yaml"]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "workflow"),
        "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
    }

    def sweep() -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, env=env)

    first = sweep()
    assert first.returncode == 0, first.stderr[-3000:]
    (meta,) = (tmp_path / "results" / "runs").rglob("meta.json")
    record = json.loads(meta.read_text())
    marker = tmp_path / "ran"
    record["spec"]["model"] = {
        "arch": "custom",
        "factory": "os:system",
        "args": {"command": f"touch {marker}"},
    }
    meta.write_text(json.dumps(record))
    again = sweep()
    assert "recorded, kept" in again.stdout
    assert not marker.exists(), "a resumed sweep ran a command a results file named"
    # one outcome: the merge hashes the settings the record holds, not the hash it
    # claims, so it refuses the record, its file named, and the sweep ends with 1
    assert again.returncode == 1, again.stderr[-3000:]
    assert "refusing to merge" in again.stderr and str(meta) in again.stderr
