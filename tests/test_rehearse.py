"""The GPU run rehearsed on this CPU (preflight/rehearse.py): every cell through its own code on
fake CUDA tensors, at its real size, before anything is queued.

Each rehearsal runs in a process of its own, as `parabench rehearse` does: on this
CPU-only torch the fake CUDA device loads before torch (preflight/fakecuda.py)."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO
from parabench import envinfo
from parabench.config import checked
from parabench.envinfo import torch_release
from parabench.preflight import doctor, fakecuda
from parabench.preflight import rehearse as rehearse_module

# A residual MLP small enough to rehearse in a second, with layers outside its tensor-
# parallel plan (its input projection and head): what CUDA's foreach default refuses.
RESMLP = {"arch": "resmlp", "d_in": 32, "width": 64, "depth": 2, "classes": 8, "batch_size": 16}


def config(tmp_path: Path, **over) -> dict:
    return checked(
        {
            "results": str(tmp_path / "results"),
            "device": "cuda",
            "models": {"res": dict(RESMLP)},
            "strategies": ["single", "ddp", "tp"],
            "devices": [1, 2],
            "precision": ["fp32", "bf16"],
            "optimizer": ["adamw"],
            "repeats": 1,
            "steps": 6,
            "warmup": 1,
            **over,
        }
    )


def rows_of(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def rehearse(
    cfg: dict, *extra: str, cwd: Path = REPO, timeout: float = 600
) -> tuple[subprocess.CompletedProcess, list]:
    argv = [sys.executable, "-m", "parabench", "rehearse", "--config-json", json.dumps(cfg)]
    proc = subprocess.run([*argv, *extra], capture_output=True, text=True, cwd=cwd, timeout=timeout)
    path = Path(cfg["results"]) / "rehearsal.csv"
    return proc, rows_of(path) if path.exists() else []


# Tests whose verdicts are a peak set against a GPU: judged on torch 2.13 and later only
# (rehearse.judge_fit), as a user's CUDA torch installed with `make test TORCH=` may not be.
JUDGED = pytest.mark.skipif(
    torch_release(torch.__version__) < rehearse_module.PEAKS_CHECKED_FROM,
    reason="this torch's rehearsed peaks are not judged (rehearse.PEAKS_CHECKED_FROM)",
)


@JUDGED
def test_every_rank_runs_its_cells_code_on_its_own_cuda_device(tmp_path):
    cfg = config(tmp_path)
    proc, rows = rehearse(cfg)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "not rehearsed: NCCL itself" in proc.stdout  # what it cannot stand in for
    ran = {(r["strategy"], r["devices"], r["precision"], r["rank"]): r for r in rows}
    # every cell's distinct ranks: rank 0, and the last one, on its own device index
    assert set(ran) == {
        (s, n, p, r)
        for p in ("fp32", "bf16")
        for s, n, r in [
            ("single", "1", "0"),
            ("ddp", "1", "0"),
            ("ddp", "2", "0"),
            ("ddp", "2", "1"),
            ("tp", "1", "0"),
            ("tp", "2", "0"),
            ("tp", "2", "1"),
        ]
    }
    assert all(r["status"] == "ok" for r in rows), [r["reason"] for r in rows]
    assert ran[("ddp", "2", "bf16", "1")]["device"] == "cuda:1"
    first = ran[("tp", "2", "bf16", "0")]
    # measured: its peak against the GPU's memory, its FLOPs and their time there
    assert first["fits"] == "True" and 0 < int(first["peak_memory_bytes"]) < 2**30
    assert float(first["flops_per_step"]) > 0 and 0 < float(first["compute_s_estimate"]) < 1
    # the same cells by the same code: kept, not rehearsed again
    again, kept = rehearse(cfg)
    assert again.returncode == 0 and kept == rows
    assert "rehearse runs/" not in again.stdout


# The mutation the rehearsal exists to catch: the optimizer given every parameter in one
# group, as before parabench grouped them by kind (strategies/base.py, param_groups).
# CUDA's foreach default then mixes a TP model's DTensors with its plain tensors, which
# CPU's per-parameter loop never does: a CPU cell of the same model passes.
FLAT_OPTIMIZER = """
import json, sys
from pathlib import Path
from parabench.preflight import fakecuda
fakecuda.install()
from parabench.preflight import rehearse
from parabench.config import checked
from parabench.strategies import base
base.param_groups = lambda params: [{"params": list(params)}]
rehearse.run(checked(json.loads(sys.argv[1])), Path(sys.argv[2]), "h100")
"""


def test_the_rehearsal_catches_foreach_over_mixed_tensors(tmp_path):
    cfg = config(tmp_path, strategies=["tp"], devices=[2], precision=["fp32"])
    out = Path(cfg["results"])
    proc = subprocess.run(
        [sys.executable, "-c", FLAT_OPTIMIZER, json.dumps(cfg), str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rows_of(out / "rehearsal.csv")
    assert rows and all(r["status"] == "failed" for r in rows), rows
    assert all("got mixed torch.Tensor and DTensor" in r["reason"] for r in rows)
    # the same cell on the CPU: torch's per-parameter loop, no mix, no failure
    cpu = dict(cfg, device="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", FLAT_OPTIMIZER, json.dumps(cpu), str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(r["status"] == "ok" for r in rows_of(out / "rehearsal.csv"))


# A user's model that runs on the CPU and not on CUDA: its forward adds a tensor it makes
# on the CPU.
CPU_CONSTANT = """
import torch
from torch import nn

class Shift(nn.Module):
    def forward(self, x):
        return x + torch.ones(x.shape[-1])

def build(width: int = 16):
    blocks = nn.Sequential(nn.Linear(8, width), Shift(), nn.Linear(width, 1))

    def batch(n, generator):
        return torch.randn(n, 8, generator=generator), torch.randn(n, 1, generator=generator)

    return {"blocks": blocks, "loss": nn.MSELoss(), "batch": batch}
"""


def test_a_model_that_only_the_cpu_runs_is_refused_before_any_job(tmp_path, monkeypatch):
    (tmp_path / "cpu_only.py").write_text(textwrap.dedent(CPU_CONSTANT))
    model = {"arch": "custom", "factory": "cpu_only:build", "batch_size": 8}
    raw = {
        "results": "results",
        "device": "cuda",
        "models": {"mine": model},
        "strategies": ["single"],
        "devices": [1],
        "repeats": 1,
        "steps": 4,
        "warmup": 1,
    }
    monkeypatch.chdir(tmp_path)
    cfg = checked(raw)
    proc, rows = rehearse(dict(cfg, results=str(tmp_path / "results")), cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (row,) = rows
    assert row["status"] == "failed" and "cuda:0 and cpu" in row["reason"]
    assert "mine single x1 rank 0" in proc.stdout
    # The preflight, on a planning host whose torch is a CUDA build (a Slurm login
    # node: the GPU checks are left to the GPU node): the run is refused, naming it.
    monkeypatch.setattr(envinfo, "_build", lambda: ("2.13.0", "12.8"))
    monkeypatch.setattr(doctor, "torch_build", lambda: ("2.13.0", "12.8"))
    found = doctor.run_checks(cfg, tmp_path, slurm={}, gpus=False)
    line = next(c for c in found if c.name == "rehearsal")
    assert line.status == doctor.FAIL and "refused before any job" in line.detail
    assert "mine single x1 rank 0: FakeTensorDeviceMismatchError: Expected all" in line.detail
    cfg["rehearse"]["failing"] = "run"  # the user's choice: run it, and let it fail
    found = doctor.run_checks(cfg, tmp_path, slurm={}, gpus=False)
    assert next(c for c in found if c.name == "rehearsal").status == doctor.WARN


@JUDGED
def test_each_rank_is_set_against_its_gpus_memory_at_the_real_size(tmp_path):
    # 4.3B parameters: 69 GB of fp32 parameters, gradients and AdamW state, which one
    # 80 GB H100 does not hold with headroom, and FSDP over 8 does. Fake tensors: this
    # test allocates none of it.
    big = dict(RESMLP, d_in=1024, width=4096, depth=32, classes=1000, batch_size=64)
    cfg = config(tmp_path, models={"big": big}, strategies=["single", "fsdp"], devices=[1, 8])
    cfg["precision"] = ["bf16"]
    proc, rows = rehearse(cfg)
    by = {(r["strategy"], r["devices"], r["rank"]): r for r in rows}
    single = by[("single", "1", "0")]
    assert single["status"] == "ok" and single["fits"] == "False", single
    assert "does not fit h100's" in single["reason"]
    assert int(single["peak_memory_bytes"]) > 70 * 2**30
    sharded = by[("fsdp", "8", "0")]
    assert sharded["fits"] == "True" and int(sharded["peak_memory_bytes"]) < 20 * 2**30
    assert proc.returncode == 1  # refused: a rank that does not fit


def test_a_peak_is_judged_only_on_a_torch_whose_peaks_the_tests_check():
    from parabench.hardware import gpus

    judge, refused = rehearse_module.judge_fit, rehearse_module.refused
    h100 = gpus.resolve("h100")
    past, within = int(h100.memory_bytes), int(h100.memory_bytes) // 2
    new = judge(past, h100, release=(2, 13))
    assert new["fits"] is False and "does not fit h100's" in new["reason"]
    assert judge(within, h100, release=(2, 13)) == {"fits": True, "reason": ""}
    assert refused([{"status": "ok", **new}])
    # an older torch: the peak said, in the summary the preflight shows; nothing refused
    old = judge(past, h100, release=(2, 10))
    assert old["fits"] == "" and "torch 2.10's" in old["reason"] and "2.13" in old["reason"]
    row = {"status": "ok", "peak_memory_bytes": past, "device_memory_bytes": past, **old}
    assert not refused([row])
    assert any("1 peaks not judged: peak" in line for line in rehearse_module.summary([row]))


def test_peaks_are_checked_from_the_torch_make_test_pins():
    pin = re.search(r"^TORCH\s*\?=\s*torch==(\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert pin and torch_release(pin[1]) == rehearse_module.PEAKS_CHECKED_FROM, pin


def test_the_stand_ins_answer_as_a_node_and_leave_torch_as_it_was():
    before = torch.cuda.is_available(), torch.cuda.device_count()
    with fakecuda.node(8, "h100", 80 * 2**30):
        assert torch.cuda.is_available() and torch.cuda.device_count() == 8
        assert torch.cuda.get_device_properties(0).total_memory == 80 * 2**30
        assert torch.cuda.nccl.version() >= (2, 10)
    assert (torch.cuda.is_available(), torch.cuda.device_count()) == before


SHIPPED = sorted(str(p.relative_to(REPO)) for p in REPO.glob("config/*.yaml"))


@JUDGED
@pytest.mark.slow
@pytest.mark.parametrize("path", SHIPPED)
def test_every_shipped_config_rehearses(tmp_path, path):
    raw = yaml.safe_load((REPO / path).read_text())
    raw["results"] = str(tmp_path / "results")
    cfg = checked(raw)
    # a guard against a hang, not a time limit: gpu.yaml's 114 ranks take about 6 minutes
    # on 2 quiet cores, and went past 10 at a load of 4 to 6
    proc, rows = rehearse(cfg, timeout=1800)
    failed = [
        f"{r['model']} {r['strategy']} x{r['devices']}: {r['reason']}"
        for r in rows
        if r["status"] == "failed"
    ]
    assert not failed, "\n".join(failed)
    # A peak past the GPU is a finding, said and refused (exit 1), not a crash. Only
    # advise's config has such cells: its Llama models are for advise, not for one GPU.
    too_big = [r for r in rows if str(r["fits"]) == "False"]
    assert bool(too_big) == (path == "config/advise.yaml"), too_big
    assert proc.returncode == (1 if too_big else 0), proc.stdout[-3000:] + proc.stderr[-3000:]
    outcomes = {r["status"] for r in rows}
    assert outcomes <= {"ok", "skipped", "not rehearsed"} and "ok" in outcomes
    # what fake tensors cannot run is said, never passed as rehearsed
    for r in rows:
        if r["strategy"] == "dp":
            assert r["status"] in ("not rehearsed", "skipped"), r


# One rank's step under torch's MemTracker as advise runs it (it follows each module)
# and as the rehearsal does (total_tracker_class: no module hooks): the same total.
TRACKERS = """
import json, sys
from parabench.predict import fakerank
from parabench.hardware import gpus
from parabench.preflight import rehearse
from parabench.config import cells, checked
cfg = checked(json.loads(sys.argv[1]))
got = {}
for cell in cells(cfg):
    spec = cell.spec
    peaks = []
    for cls in (fakerank._tracker_class, fakerank.total_tracker_class):
        rehearse.total_tracker_class = cls
        row = rehearse.rank(spec, 0, gpus.resolve("h100"), "cpu", 8)
        peaks.append(row["peak_memory_bytes"])
    got[spec.path] = peaks
print(json.dumps(got))
"""


def test_the_rehearsals_total_peak_is_torchs_memtrackers(tmp_path):
    cfg = config(tmp_path, device="cpu", strategies=["single", "fsdp", "tp"], devices=[2])
    cfg["precision"] = ["bf16"]
    proc = subprocess.run(
        [sys.executable, "-c", TRACKERS, json.dumps(cfg)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert len(got) == 3
    for path, (module_tracker, total_tracker) in got.items():
        assert module_tracker > 0 and total_tracker == module_tracker, path


# Ranks of several cells one after another in one process, each on its own device: a
# tensor-parallel rank on cuda:0, then one on cuda:3 (what a rehearsal's worker does).
ONE_PROCESS = """
import json, sys
from pathlib import Path
from parabench.preflight import fakecuda
fakecuda.install()
from parabench.preflight import rehearse
from parabench.config import checked
rows = rehearse.run(checked(json.loads(sys.argv[1])), Path(sys.argv[2]), "h100", workers=1)
print(json.dumps([(r["strategy"], r["rank"], r["status"], r["reason"]) for r in rows]))
"""


def test_ranks_on_other_devices_one_after_another_in_one_process(tmp_path):
    cfg = config(tmp_path, strategies=["tp", "fsdp_tp"], devices=[2, 4], precision=["fp32"])
    cfg["options"] = {"fsdp_tp": {"tp": 2}}
    cfg = checked(cfg)
    proc = subprocess.run(
        [sys.executable, "-c", ONE_PROCESS, json.dumps(cfg), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.splitlines()[-1])
    assert ["fsdp_tp", 3, "ok", ""] in rows, rows
    assert all(status == "ok" for _, _, status, _ in rows), rows
