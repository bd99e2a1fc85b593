"""The command that starts one cell on one node: torchrun for cells with several ranks,
a plain process otherwise. The workflow's rules, `parabench sweep` and the tests all
build it here, so a cell starts the same way however it is run."""

from __future__ import annotations

from pathlib import Path

from parabench.cli import spec_argv
from parabench.spec import RunSpec


def launch_argv(spec: RunSpec, out: Path | str, python: str = "python") -> list[str]:
    """`python [-m torch.distributed.run ...] -m parabench run <spec> --out <out>`."""
    head = [python]
    if spec.record.uses_torchrun(spec.devices):
        head += ["-m", "torch.distributed.run", "--standalone", "--nnodes", "1"]
        head += ["--nproc-per-node", str(spec.devices)]
    return [*head, "-m", "parabench", "run", *spec_argv(spec), "--out", str(out)]


def guarded_argv(spec: RunSpec, out: Path | str, timeout_s: float, python: str = "python"):
    """The launch under `parabench guard`, which records a failure if it leaves none."""
    guard = [python, "-m", "parabench", "guard", "--out", str(out), "--timeout", f"{timeout_s:g}"]
    return [*guard, "--", *launch_argv(spec, out, python)]


def collectives_argv(
    devices: int, sizes: list[int], device: str, timeout_s: float, out: Path | str, python="python"
) -> list[str]:
    """The collectives benchmark at `devices` ranks (always torchrun: it needs n > 1)."""
    head = [python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1"]
    head += ["--nproc-per-node", str(devices)]
    args = ["--devices", str(devices), "--sizes", ",".join(map(str, sizes))]
    args += ["--device", device, "--timeout-s", f"{timeout_s:g}", "--out", str(out)]
    return [*head, "-m", "parabench", "collectives", *args]


def guarded_collectives_argv(
    devices: int, sizes: list[int], device: str, timeout_s: float, cell_timeout_s: float, out
) -> list[str]:
    guard = ["python", "-m", "parabench", "guard", "--out", str(out)]
    guard += ["--timeout", f"{cell_timeout_s:g}"]
    return [*guard, "--", *collectives_argv(devices, sizes, device, timeout_s, out)]
