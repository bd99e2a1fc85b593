"""Warm starts (parabench.jobs.warm): a launch forked from a run's warm process is the cell a
cold launch runs (the same losses), ends as a cold one does (exit codes, signals,
timeouts, its guard killed), and one the warm process cannot stand for starts cold,
saying why. Real `parabench launch`, real torchrun ranks, a real warm process."""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import launch_argv, tiny_spec
from parabench.jobs import warm
from parabench.jobs.launch import cell_argv


@pytest.fixture(scope="module")
def warm_env():
    """The environment of a run with a warm process of its own (not the session's)."""
    saved = os.environ.pop(warm.ENV, None)
    try:
        with warm.warm_process() as name:
            assert name, "setproctitle is a dependency: a run has a warm process"
            yield {**os.environ, warm.ENV: name}
    finally:
        if saved is not None:
            os.environ[warm.ENV] = saved


def launched(spec, out, env, fault: str = "", cell_timeout_s: float = 120):
    proc = subprocess.run(
        launch_argv(spec, out, cell_timeout_s),
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "PARABENCH_FAULT": fault},
    )
    return proc, json.loads((out / "meta.json").read_text())


def steps(out) -> list[tuple[str, str]]:
    """(step, loss) of each row of a cell's steps.csv."""
    with open(out / "steps.csv") as f:
        return [(row["step"], row["loss"]) for row in csv.DictReader(f)]


def gone(out, within_s: float = 10) -> bool:
    """Whether no process shows `out` in its command line within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if subprocess.run(["pgrep", "-f", str(out)], capture_output=True).returncode == 1:
            return True
        time.sleep(0.2)
    return False


def shown(out, count: int, within_s: float = 60) -> bool:
    """Whether `count` processes show `out` in their command lines within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        found = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True)
        if len(found.stdout.split()) >= count:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("strategy, devices", [("single", 1), ("ddp", 2)])
def test_a_warm_launch_runs_the_cell_a_cold_launch_runs(tmp_path, warm_env, strategy, devices):
    """As Snakemake starts it: with the job's threads in OMP_NUM_THREADS (and MKL's),
    which the warm process did not import torch with and each rank overrides."""
    spec = tiny_spec(strategy, devices)
    job = {"OMP_NUM_THREADS": str(devices), "MKL_NUM_THREADS": str(devices)}
    proc, cold = launched(spec, tmp_path / "cold", {**os.environ, **job, warm.ENV: "0"})
    assert "warm start" not in proc.stderr and cold["status"] == "ok", proc.stderr[-2000:]
    proc, hot = launched(spec, tmp_path / "warm", {**warm_env, **job})
    assert "parabench guard: warm start, pid" in proc.stderr, proc.stderr[-2000:]
    assert hot["status"] == "ok", hot.get("reason")
    # the same steps, losses to the bit: the same code on the same numbers
    assert steps(tmp_path / "warm") == steps(tmp_path / "cold")
    assert hot["world_size"] == cold["world_size"] == devices
    assert hot["threads_per_rank"] == cold["threads_per_rank"]
    # the records say how it started, and the command, as a cold launch's records do
    assert (hot["env"]["started"], cold["env"]["started"]) == ("warm", "cold")
    command = [a.replace("/warm", "/cold") for a in hot["env"]["launch_command"]]
    assert command == cold["env"]["launch_command"]
    assert "parabench.torchrun" in command if devices > 1 else "run" in command


def test_a_warm_launch_ends_as_a_cold_one_exit_code_signal_and_timeout(tmp_path, warm_env):
    """A rank's exit code and a native abort reach the guard from the warm process
    (it is their parent, not the guard); a hang is killed at the cell timeout, with
    every process of the cell, which pgrep finds by the launch's own command line."""
    spec = tiny_spec("ddp", 2, timeout_s=60)
    _, meta = launched(spec, tmp_path / "crash", warm_env, "crash@tiny/ddp/n2/r0:rank=1:step=2")
    assert "rank 1 failed first (exit code 13)" in meta["reason"], meta["reason"]
    one = tiny_spec("single", 1)
    _, meta = launched(one, tmp_path / "abort", warm_env, "abort@tiny/single/n1/r0:rank=0:step=1")
    assert meta["reason"].startswith("launcher killed by signal SIGABRT without a record"), meta
    out = tmp_path / "hang"
    t0 = time.monotonic()
    proc, meta = launched(spec, out, warm_env, "hang@tiny/ddp/n2/r0:rank=0:step=1", 10)
    assert "warm start" in proc.stderr
    assert meta["reason"] == "timed out after 10 s (cell_timeout_s); killed", meta["reason"]
    assert 10 <= time.monotonic() - t0 < 30
    assert gone(out, 1), "no process of the killed cell may survive"


def test_a_warm_launch_goes_with_its_guard(tmp_path, warm_env):
    """Its guard killed (SIGKILL: no handler runs), the cell's processes go too, as a
    cold launch's do (PR_SET_PDEATHSIG): the warm process sees the guard's end."""
    out = tmp_path / "cell"
    guard = subprocess.Popen(
        launch_argv(tiny_spec("ddp", 2), out, 120),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**warm_env, "PARABENCH_FAULT": "hang@tiny/ddp/n2/r0:rank=1:step=1"},
    )
    if not shown(out, 4):  # the guard, the agent and two ranks
        pytest.fail("the cell's processes never all showed up")
    guard.send_signal(signal.SIGKILL)
    guard.wait()
    assert gone(out, 15), "the cell outlived its guard"


def test_a_launch_torch_would_import_differently_starts_cold_and_says_why(tmp_path, warm_env):
    spec = tiny_spec("single", 1)
    # From a process that has compiled, as a test worker or a sweep may have: torch put
    # its compilers' cache directories in its environment, which it reads when it
    # compiles, not when it is imported: warm (every test's launches went cold so).
    compiled = {**warm_env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    proc, meta = launched(spec, tmp_path / "compiled", {**compiled, "TRITON_CACHE_DIR": "/x"})
    assert meta["status"] == "ok", meta.get("reason")
    assert "parabench guard: warm start, pid" in proc.stderr, proc.stderr[-2000:]
    env = {**warm_env, "TORCH_SHOW_CPP_STACKTRACES": "1"}  # read when torch is imported
    proc, meta = launched(spec, tmp_path / "cell", env)
    assert meta["status"] == "ok", meta.get("reason")
    assert (
        "parabench guard: cold start: warm start refused: torch was imported with other "
        "TORCH_SHOW_CPP_STACKTRACES" in proc.stderr
    ), proc.stderr[-2000:]


def test_a_jobs_own_command_runs_warm_with_its_exit_code_and_goes_when_stopped(tmp_path, warm_env):
    """A job whose command imports torch itself (advise) starts it through `python -m
    parabench.jobs.warm`: forked from the warm process, its exit status the job's; the job
    stopped (Snakemake's SIGTERM), the command goes too."""
    # `python` as the rules name it: the PATH's, this one (make test's PATH)
    path = f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"
    warm_env = {**warm_env, "PATH": path}
    advise = ["python", "-m", "parabench", "advise", "--gpus", "x", "--out", str(tmp_path)]
    bad = subprocess.run(
        [sys.executable, "-m", "parabench.jobs.warm", *advise],
        capture_output=True,
        text=True,
        timeout=120,
        env=warm_env,
    )
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "parabench: warm start, pid" in bad.stderr, bad.stderr[-2000:]
    assert "argument --gpus: invalid int value: 'x'" in bad.stderr
    out = tmp_path / "cell"
    job = subprocess.Popen(
        [sys.executable, "-m", "parabench.jobs.warm", *cell_argv(tiny_spec("single", 1), out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**warm_env, "PARABENCH_FAULT": "hang@tiny/single/n1/r0:rank=0:step=1"},
    )
    if not shown(out, 2):  # the job and the command it forked
        pytest.fail("the command never showed up")
    job.send_signal(signal.SIGTERM)
    assert job.wait(30) == 128 + signal.SIGTERM
    assert "parabench: warm start, pid" in job.stderr.read()
    assert gone(out, 15), "the command outlived its job"


def test_the_warm_process_imports_the_runs_transformers_models_and_stays_forkable():
    """A run with Hugging Face models (or advise's torchtitan check, Llama 3.1) has its
    warm process import transformers and each type's model module, which every HF
    launch's agent would import again (3 to 7 s each); still one thread, no CUDA."""
    pytest.importorskip("transformers")
    config = {
        "models": {
            "a": {"arch": "hf", "model_type": "gpt2"},
            "b": {"arch": "mlp"},
            "c": {"arch": "hf", "model_type": "gpt2"},
        },
        "advise": {"enabled": True, "torchtitan": True},
    }
    assert warm.hf_types(config) == ["gpt2", "llama"]
    assert warm.hf_types({**config, "advise": {"enabled": False, "torchtitan": True}}) == ["gpt2"]
    assert warm.hf_types({"models": {"b": {"arch": "mlp"}}}) == []
    probe = (
        "import sys; from parabench import forkserver\n"
        "unsafe = forkserver._preload(sys.argv[1:])\n"
        "mods = [m for m in sys.modules if m.startswith('transformers.models.')"
        " and m.endswith(('modeling_gpt2', 'modeling_llama'))]\n"
        "print(unsafe, sorted(mods))"
    )
    got = subprocess.run(
        [sys.executable, "-c", probe, "gpt2", "llama"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.stdout.split("\n")[0] == (
        "None ['transformers.models.gpt2.modeling_gpt2', "
        "'transformers.models.llama.modeling_llama']"
    ), got.stdout + got.stderr[-2000:]
