"""Shared test helpers: the tiny model and workflow config every test starts from, and
launching real cells (torchrun ranks where the strategy has them)."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TypeVar

import pytest
import torch
import yaml

from parabench.jobs import launch, warm
from parabench.spec import ModelSpec, RunSpec

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")
# Small enough for 2 cores, deep enough (6 blocks) to cut into 4 stages.
TINY_DIMS = [48, 32, 24, 16, 8, 4, 1]
TINY_MLP = ModelSpec.of("mlp", dims=TINY_DIMS)
# The same model as a workflow config's model entry.
TINY_ENTRY = {"arch": "mlp", "dims": TINY_DIMS, "batch_size": 64}
# The equivalence tests' SGD learning rate: large, so parameters move far and a wrong
# gradient scale cannot hide. Tests that read other records of the same cells use it too,
# so that each cell is launched once (see `cells`).
SGD_LR = 0.5


# OpenMP's idle threads spin while they wait for work. The test workers share the cores,
# so a process's second thread spins on a core another worker's cell needs: the tiny
# gpt's 2-thread `single` cell, beside another worker, timed its steps in 5.9 s and
# launched in 29 s; with waiting threads asleep, 0.3 s and 11 s. Sleeping changes no
# result: the same threads split the same work (its parameters the same to the bit).
QUIET_THREADS = {"OMP_WAIT_POLICY": "PASSIVE"}


# The files that take longest (measured: minutes each on two cores), first. make test
# hands the files out to its two workers in collection order (--dist loadfile), and a
# long one handed out last runs alone at the end while the other worker idles. Only
# the order: a file missing from the list runs after them, as collected.
LONGEST_FIRST = [
    "test_rehearse.py",
    "test_custom_model.py",
    "test_slurm.py",  # mostly waits on Slurm: beside the others' work
    "test_equivalence.py",
    "test_advise.py",
    "test_sweep_faults.py",
    "test_outcomes.py",
    "test_sweep_resume.py",
    "test_workflow.py",
    "test_layouts.py",
    "test_faults.py",
    "test_shipped_configs.py",
]


def pytest_collection_modifyitems(config, items) -> None:
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # stable: each file's own order kept
    items.sort(key=lambda item: order.get(item.path.name, len(order)))


@pytest.fixture(scope="session", autouse=True)
def warm_launches():
    """Every process a test worker starts with QUIET_THREADS, and every launch forked
    from one warm process, as a local run's are (parabench.jobs.warm), which imported torch
    with them (OpenMP reads them then): Snakemake and the sweep use it rather than start
    their own. The cold start, a cluster job's, is tests/test_warm.py's."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in QUIET_THREADS.items():
            mp.setenv(key, value)
        # transformers too: the HF models' cells and advise's torchtitan check build them
        with warm.warm_process(hf_types=["gpt2", "llama"] if HF_INSTALLED else []):
            yield


def once_per_session(name: str, make: Callable[[], T]) -> T:
    """`make()`, made once per test session by whichever worker asks first and read by
    the others (pickled under the run's id, behind a lock): work that several files
    need, which `--dist loadfile` puts in different workers. Without xdist, once per
    process."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        if name not in _MADE:
            _MADE[name] = make()
        return _MADE[name]
    path = Path(tempfile.gettempdir()) / f"parabench-tests-{run}" / f"{name}.pickle"
    path.parent.mkdir(exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the others wait for the first
        if not path.exists():
            path.write_bytes(pickle.dumps(make()))
        return pickle.loads(path.read_bytes())


_MADE: dict = {}


def torchtitan_rows() -> list[dict]:
    """advise's check of torchtitan's published runs, as the CLI runs it (tens of
    seconds): test_advise's and the report's."""
    from parabench.hardware import gpus
    from parabench.hardware.fabric import PROFILES
    from parabench.predict import advise

    return once_per_session(
        "torchtitan",
        lambda: advise.check_torchtitan(
            gpus.PROFILES["h100-96gb-500w"], PROFILES["h100-nvlink-ndr400"], log=_quiet
        ),
    )


def _quiet(line: str) -> None:
    pass


def tiny_spec(strategy: str, devices: int, **kw) -> RunSpec:
    """A cell of the tiny model on CPU; keywords that are not RunSpec fields are the
    strategy's own options (accum_steps=4, microbatches=2, ...)."""
    fields = set(RunSpec.__dataclass_fields__)
    options = tuple(sorted((k, v) for k, v in kw.items() if k not in fields))
    settings = {
        "model_name": "tiny",
        "model": TINY_MLP,
        "batch_size": 64,
        "steps": 6,
        "warmup": 1,
        "device": "cpu",
        "timeout_s": 60.0,
        **{k: v for k, v in kw.items() if k in fields},
    }
    return RunSpec(strategy=strategy, devices=devices, options=options, **settings)


def tiny_config(**over) -> dict:
    """A workflow config of the tiny model on CPU, few steps, single and DDP at 1 and 2
    devices; tests override what they are about."""
    return {
        "device": "cpu",
        "models": {"tiny": dict(TINY_ENTRY)},
        "strategies": ["single", "ddp"],
        "devices": [1, 2],
        "repeats": 1,
        "steps": 5,
        "warmup": 1,
        "profile_steps": 4,
        "timeout_s": 60,
        "cell_timeout_s": 240,
        **over,
    }


def cell_argv(spec: RunSpec, out: Path) -> list[str]:
    """The processes a cell's launch starts (torchrun where it has ranks), with this
    interpreter; no guard around them."""
    return launch.cell_argv(spec, out, python=sys.executable)


def launch_argv(spec: RunSpec, out: Path, cell_timeout_s: float = 180) -> list[str]:
    """`parabench launch` of the cell, as the workflow runs it, with this interpreter."""
    return launch.launch_command(spec, out, cell_timeout_s, python=sys.executable)


def run_cell(
    spec: RunSpec, out: Path, timeout: float = 180
) -> tuple[dict, subprocess.CompletedProcess]:
    proc = subprocess.run(
        cell_argv(spec, out),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    meta_path = out / "meta.json"
    if not meta_path.exists():
        # A rank that died in native code says why where it died, often far above the
        # agent's report at the end: its fatal lines and faulthandler's stack first.
        fatal = re.compile(r"Fatal Python error|terminate called|what\(\):|File \"|Abort")
        first = [ln for ln in proc.stderr.splitlines() if fatal.search(ln)][:40]
        raise AssertionError(
            f"no record written; rc={proc.returncode}\n"
            + "\n".join(first)
            + f"\n...\n{proc.stderr[-3000:]}"
        )
    return json.loads(meta_path.read_text()), proc


@pytest.fixture(scope="session")
def cells(tmp_path_factory):
    """`cells(spec)` -> (meta, proc, out): each spec launched once per session, whichever
    worker asks first (once_per_session). Tests that only read a cell's records share
    its launch (most of a cell's cost on CPU is starting its processes); a test that
    changes the spec gets a launch of its own."""
    done: dict[RunSpec, tuple[dict, subprocess.CompletedProcess, Path]] = {}

    def run(spec: RunSpec, timeout: float = 180) -> tuple[dict, subprocess.CompletedProcess, Path]:
        def launch() -> tuple[dict, subprocess.CompletedProcess, Path]:
            out = tmp_path_factory.mktemp(f"{spec.strategy}-n{spec.devices}")
            meta, proc = run_cell(spec, out, timeout)
            return meta, proc, out

        if spec not in done:
            name = hashlib.sha256(repr(spec).encode()).hexdigest()[:16]
            done[spec] = once_per_session(f"cell-{name}", launch)
        return done[spec]

    return run


def assert_cell_records(
    spec: RunSpec, meta: dict, proc: subprocess.CompletedProcess | None, out: Path
) -> None:
    """A launched cell's records: schema-valid, every step of its step_kinds but the profiled
    ones in order, its samples and peaks; a DataParallel cell past one device skipped
    with its reason, writing nothing. `proc`: the launch, where the test ran it (None
    for a sweep's cell, whose log the sweep keeps)."""
    import csv

    from parabench import records
    from parabench.run.loop import PROFILED, step_kinds

    records.read_meta(out / "meta.json")  # schema-valid
    with open(out / "steps.csv") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    records.check_step_header(out / "steps.csv", reader.fieldnames)

    if spec.strategy == "dp" and spec.devices > 1:  # CPU: DataParallel would silently run one copy
        assert meta["status"] == "skipped"
        assert "CUDA devices" in meta["reason"]
        assert rows == [] and not (out / "params.pt").exists()
        return
    assert meta["status"] == "ok", f"{meta['reason']}\n{proc.stderr[-2000:] if proc else ''}"
    assert proc is None or proc.returncode == 0
    # every step but the profiled ones, in order: warm-up, then timed runs
    # with one warm-up step after each profiler session but the last
    kinds = step_kinds(spec.steps, spec.warmup, spec.profile_steps)
    assert [r["phase"] for r in rows] == [k for k in kinds if k != PROFILED]
    assert [int(r["step"]) for r in rows] == [i for i, k in enumerate(kinds) if k != PROFILED]
    assert sum(r["phase"] == "timed" for r in rows) == spec.steps - spec.warmup
    assert all(float(r["step_time_s"]) >= float(r["step_time_min_s"]) > 0 for r in rows)
    assert {int(r["samples"]) for r in rows} == {spec.global_batch}
    assert meta["emulated"] == (spec.strategy == "model_parallel" and spec.devices > 1)
    assert len(meta["peak_memory_per_rank"]) == meta["world_size"]
    assert meta["peak_flops_total"] > 0 and meta["peak_memory_bytes"] > 0
    assert meta["env"]["torch"] and meta["threads_per_rank"] >= 1
    if spec.strategy in ("model_parallel", "pipeline"):
        assert len(meta["stage_cuts"]) == spec.devices


def load_params(cell_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(cell_dir / "params.pt", weights_only=True)


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable(msg: str) -> NoReturn:
    """Skip a test this machine cannot run, locally; fail it in CI, which runs as root
    with every tool (tests/setup-system.sh) and where a skip would hide a test not run."""
    if in_ci():
        pytest.fail(msg)
    pytest.skip(msg)


def require_tool(name: str) -> str:
    """Path of a system tool; skip without it locally, fail without it in CI."""
    path = shutil.which(name)
    if path is None:
        unavailable(f"{name} is not installed (tests/setup-system.sh installs it as root)")
    return path


def require_root(why: str) -> None:
    """Skip without root locally, fail without it in CI; `why` says what needs it."""
    if os.geteuid() != 0:
        unavailable(why)


def pyproject() -> dict:
    """pyproject.toml, read with Python 3.11's tomllib or, on 3.10, tomli: pytest's own
    dependency there (it reads its settings from pyproject.toml), so never missing."""
    try:
        import tomllib
    except ModuleNotFoundError:
        import tomli as tomllib
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def snakemake(
    workdir: Path, *args: str, config: dict, env: dict | None = None, popen: bool = False
):
    """The real `snakemake` of this venv on the repository's Snakefile, in `workdir`."""
    cfg = workdir / "config.yaml"
    cfg.write_text(yaml.safe_dump(config))
    bin_dir = str(Path(sys.executable).parent)
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(REPO / "Snakefile"),
        "--directory",
        str(workdir),
        "--configfile",
        str(cfg),
        *args,
    ]
    full_env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"], **(env or {})}
    if popen:  # its own session, so a test can signal it like a terminal would
        return subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
            start_new_session=True,
        )
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=full_env)


def planned_outputs(proc: subprocess.CompletedProcess) -> list[str]:
    return [
        line.split("output:", 1)[1].strip()
        for line in proc.stdout.splitlines()
        if line.strip().startswith("output:")
    ]


# Hugging Face models from small configs (no weights, no network). GPT-2's dropout
# draws random masks, which no two strategies draw alike: off, as for any equivalence
# check (the report would name it otherwise).
LLAMA = {
    "arch": "hf",
    "model_type": "llama",
    "seq_len": 32,
    "batch_size": 8,
    "config": {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    },
}
GPT2 = {
    "arch": "hf",
    "model_type": "gpt2",
    "seq_len": 32,
    "batch_size": 8,
    "config": {
        "vocab_size": 256,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 64,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
}
HF_INSTALLED = importlib.util.find_spec("transformers") is not None

# Users' own models in one sweep (each sweep pays Snakemake, the collectives benchmark,
# aggregation and the report once): examples/my_model.py's Sequential, its module with a
# forward of its own and its BatchNorm variant; with transformers, Llama and GPT-2.
# what a model with blocks can run, but the one-process DataParallel and ddp_compress
EVERY_STRATEGY = [
    "single",
    "ddp",
    "zero1",
    "fsdp",
    "tp",
    "grad_accum",
    "pipeline",
    "model_parallel",
]
OWN_MODELS = {
    "device": "cpu",
    "models": {
        "mine": {
            "arch": "custom",
            "factory": "my_model:build",
            "args": {"width": 32, "depth": 4},
            "batch_size": 64,
            "strategies": ["single", "ddp", "pipeline"],
            "devices": [2],
        },
        "mine_module": {
            "arch": "custom",
            "factory": "my_model:build_module",
            "args": {"width": 32, "depth": 3},
            "batch_size": 64,
            "strategies": EVERY_STRATEGY,
            "devices": [2],  # single runs at 1 device whatever the list
        },
        "mine_bn": {
            "arch": "custom",
            "factory": "my_model:build",
            "args": {"width": 32, "depth": 2, "batchnorm": True},
            "batch_size": 64,
            "strategies": ["single", "ddp"],
        },
        **(
            {
                "llama": {
                    **LLAMA,
                    "strategies": EVERY_STRATEGY,
                    "devices": [2],
                },
                # what differs from Llama: Conv1D (no TP, no plan); untied, so that
                # stages can be cut (gpt2_tied: GPT-2 as it comes, tied, which no cut can take)
                "gpt2": {
                    **GPT2,
                    "config": {**GPT2["config"], "tie_word_embeddings": False},
                    "strategies": EVERY_STRATEGY[:-1],
                    "devices": [2],
                },
                "gpt2_tied": {**GPT2, "strategies": ["pipeline", "model_parallel"], "devices": [2]},
            }
            if HF_INSTALLED
            else {}
        ),
    },
    "devices": [1, 2],
    "repeats": 1,
    "steps": 6,
    "warmup": 1,
    "profile_steps": 1,  # no test of this sweep reads the anatomy: one profiled step
    "lr": 0.5,
    "timeout_s": 60,
    "cell_timeout_s": 240,
    "plan": {"enabled": False},
    "collectives": {"message_bytes": [65536]},  # a point of the curve is enough here
}


@pytest.fixture(scope="session")
def own_models_sweep(tmp_path_factory):
    """(workdir, summary indexed by model, strategy, devices) of the OWN_MODELS sweep,
    with examples/my_model.py copied next to its config, as a user would."""
    import pandas as pd

    work = tmp_path_factory.mktemp("own_models")
    shutil.copy(REPO / "examples" / "my_model.py", work / "my_model.py")
    proc = snakemake(work, "--cores", "2", config=OWN_MODELS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = pd.read_csv(work / "results/summary.csv")
    return work, summary.set_index(["model", "strategy", "devices"])


def peak_memory_run(
    argv: list[str],
    log: Path,
    kill_above: int,
    cwd: Path | None = None,
    env: dict | None = None,
    timeout_s: float = 300,
) -> tuple[int, int, float]:
    """Run `argv` (one process that does the work) with its output in `log`; return its
    exit status, its peak resident memory in bytes and its seconds. The peak is its
    VmHWM, polled: the kernel's ru_maxrss of a child (wait4, getrusage) starts at its
    parent's RSS when it forks, pytest's after a long session, so it cannot tell a
    small child from a large one. Killed once its RSS passes `kill_above` (a regression
    fails in seconds, not by taking the machine's memory) or after `timeout_s`."""
    import time

    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    status, peak = Path(f"/proc/{proc.pid}/status"), 0
    while proc.poll() is None:
        try:
            fields = dict(x.split(":", 1) for x in status.read_text().splitlines() if ":" in x)
            peak = max(peak, int(fields["VmHWM"].split()[0]) * 1024)
            if int(fields["VmRSS"].split()[0]) * 1024 > kill_above:
                proc.kill()
        except (OSError, KeyError, ValueError):  # exiting: its memory is gone
            pass
        if time.monotonic() - start > timeout_s:
            proc.kill()
        time.sleep(0.01)
    return proc.returncode, peak, time.monotonic() - start
