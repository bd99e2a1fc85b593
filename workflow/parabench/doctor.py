"""`parabench doctor [CONFIG]`: is this environment able to run this config? One line per
check, before anything is queued or launched, each failure saying what to do.

The checks, and where each can be answered:

- planning host (a cluster's login node: no GPU, little memory; or the laptop itself):
  the torch build against `device` (a CPU wheel cannot run a cuda cell), a C compiler
  when `compile` is on (Triton's launcher on CUDA, Inductor's C++ on CPU), the Slurm
  account and partition a profile sets (and that the partition exists and has GPUs,
  where `sinfo` answers), free disk under `results`;
- GPU node (where the cells run): the GPUs visible against the most any cell needs on
  one node, NCCL where ranks communicate, bf16 where the config asks for it.

The Snakefile runs them before its first job (onstart, never on a dry run), in a
process of their own with the jobs' python: all of them for a local run (the cells run
on this host), the planning host's under a Slurm profile, whose GPU checks are left to
the GPU node: `snakemake --profile profiles/slurm doctor` runs every check there in a
short job (seconds; five minutes at most), and each cell checks its own node (too few
GPUs or no bf16: skipped with the reason; a CPU torch: failed, saying so).
`parabench sweep` runs all of them before its first cell.

Torch-free until a GPU check needs torch: the build is read from torch's version.py, so
a login node answers the rest in milliseconds.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from parabench import checks, models
from parabench.config import cells

OK, WARN, FAIL, LATER = "ok", "warn", "FAIL", "later"
# What one cell leaves on disk besides its parameters (steps.csv, meta.json, one trace
# per rank, its log): a few MB on the default run; a generous bound.
CELL_BYTES = 20 * 2**20
# The oldest torch release the strategies' tests run on (`make test-torch-min`); pyproject's
# `torch>=` bound and the Makefile's TORCH_MIN pin name the same (a test holds them together).
TORCH_MIN = (2, 10)


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # OK, WARN, FAIL or LATER (needs a GPU node)
    detail: str

    def line(self) -> str:
        return f"{self.status:>5}  {self.name}: {self.detail}"


def torch_build() -> tuple[str | None, str | None]:
    """(torch's version, its CUDA (or ROCm) version or None for a CPU build), read from
    the installed torch/version.py without importing torch (seconds on a login node)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None, None
    values: dict[str, object] = {}
    source = (Path(spec.origin).parent / "version.py").read_text()
    for node in ast.parse(source).body:
        target = getattr(node, "target", None) or (getattr(node, "targets", None) or [None])[0]
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
            values[target.id] = node.value.value
    # ROCm's torch is a GPU build too, driven through torch.cuda
    gpu = values.get("cuda") or (f"ROCm {values['hip']}" if values.get("hip") else None)
    return values.get("__version__"), gpu  # type: ignore[return-value]


def _runnable(config: dict) -> list:
    return [
        c.spec
        for c in cells(config)
        if c.spec.repeat == 0 and not checks.static_skip_reason(c.spec)
    ]


def gpus_per_node(config: dict) -> int:
    """The most GPUs one node must show any runnable cell: one per rank on it, or all
    of a one-process strategy's (DataParallel, model parallel)."""
    return max((s.devices // s.nodes for s in _runnable(config)), default=0)


def check_torch(config: dict) -> Check:
    version, cuda = torch_build()
    if version is None:
        return Check("torch", FAIL, "not installed in this python (make run sets up .venv)")
    if config["device"] == "cuda" and cuda is None:
        return Check(
            "torch",
            FAIL,
            f"torch {version} is a CPU-only build, and device is cuda: install your CUDA "
            "build of torch into the venv first (README, GPU users: make run TORCH=)",
        )
    build = f"torch {version}, " + (f"CUDA {cuda}" if cuda else "CPU build")
    if (release := _release(version)) is not None and release < TORCH_MIN:
        oldest = ".".join(map(str, TORCH_MIN))
        return Check(
            "torch",
            WARN,
            f"{build}: older than {oldest}, the oldest torch parabench is tested with; its "
            f"cells may fail. Install torch>={oldest} (README, GPU users)",
        )
    return Check("torch", OK, build)


def _release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version: '2.13.0+cpu', or an image's own build of a
    release ('2.10.0a0+5228986c39.nv25.06' is 2.10)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m[1]), int(m[2])) if m else None


def check_compiler(config: dict) -> Check | None:
    if not any(s.compile for s in _runnable(config)):
        return None
    # Triton builds its launcher with a C compiler; Inductor's CPU code is C++.
    cuda = config["device"] == "cuda"
    names = ("CC", "cc", "gcc", "clang") if cuda else ("CXX", "c++", "g++", "clang++")
    found = [os.environ.get(names[0])] + [shutil.which(n) for n in names[1:]]
    if path := next((p for p in found if p), None):
        return Check("compiler", OK, f"{path} (torch.compile: true)")
    need = "a C compiler (Triton)" if cuda else "a C++ compiler (Inductor)"
    return Check(
        "compiler",
        FAIL,
        f"compile: true needs {need}, and none of {', '.join(names[1:])} is on PATH "
        f"(or set {names[0]}); or set compile: [false]",
    )


def _results_bytes(config: dict) -> tuple[int, list[str]]:
    """What a sweep writes: each cell's parameters (params.pt, fp32) and records, from
    the models' facts (torch-free); and the models whose size planning does not know."""
    total, unknown = 0, []
    for c in cells(config):
        if checks.static_skip_reason(c.spec):  # recorded as skipped: a few KB
            continue
        n = models.facts(c.spec.model).n_params
        if n is None and c.spec.model_name not in unknown:
            unknown.append(c.spec.model_name)
        total += 4 * (n or 0) + CELL_BYTES
    return total, unknown


def check_disk(config: dict, workdir: Path) -> Check:
    where = (workdir / config["results"]).resolve()
    probe = next(p for p in (where, *where.parents) if p.exists())
    free = shutil.disk_usage(probe).free
    need, unknown = _results_bytes(config)
    gib = 2**30
    detail = f"{free / gib:.1f} GiB free under {probe}; the sweep writes up to {need / gib:.1f} GiB"
    if unknown:
        detail += f" besides the parameters of {', '.join(unknown)} (a copy per cell)"
    # An estimate, at its largest (a cell that fails early writes little): the run is
    # refused only where not even the records fit, warned where the parameters may not.
    if free < len(cells(config)) * CELL_BYTES:
        return Check("disk", FAIL, detail + ": not even the records fit")
    if free < need:
        return Check("disk", WARN, detail + ": free space or fewer repeats/models")
    return Check("disk", WARN if free < 2 * need else OK, detail)


def profile_resources(profile: Path) -> dict[str, str]:
    """A Snakemake profile's default-resources (its config.yaml), as key -> value."""
    data = yaml.safe_load((profile / "config.yaml").read_text()) or {}
    return resources(data.get("default-resources") or {})


def resources(found: dict | list) -> dict[str, str]:
    """Default resources as key -> value, from a profile's mapping or the command
    line's form (["key=value", ...], what Snakemake hands a Snakefile), unquoted."""
    if isinstance(found, list):
        found = dict(item.split("=", 1) for item in found if "=" in item)
    return {k: str(v).strip("'\"") for k, v in found.items()}


def check_slurm(config: dict, res: dict[str, str]) -> Check:
    """The account and partition the Slurm jobs will ask for; where `sinfo` answers,
    that the partition exists and, for a cuda config, has GPUs."""
    missing = [k for k in ("slurm_account", "slurm_partition") if not res.get(k)]
    part = res.get("slurm_partition")
    if part and shutil.which("sinfo"):
        try:  # a hung slurmctld must not hang the run's start
            got = subprocess.run(
                ["sinfo", "-h", "-p", part, "-o", "%G"], capture_output=True, text=True, timeout=20
            )
        except subprocess.TimeoutExpired:
            return Check("slurm", WARN, f"sinfo did not answer in 20 s: {part!r} unchecked")
        if got.returncode != 0 or not got.stdout.strip():
            return Check(
                "slurm", FAIL, f"partition {part!r} (slurm_partition) is not known to sinfo"
            )
        gres = got.stdout.split()  # the generic resources (%G) of each group of its nodes
        if config["device"] == "cuda" and not any(g.startswith("gpu") for g in gres):
            return Check("slurm", FAIL, f"partition {part!r} has no GPUs (sinfo %G: {gres[0]})")
    if missing:
        return Check(
            "slurm",
            WARN,
            f"{' and '.join(missing)} not set (the profile's default-resources): the plugin "
            "guesses the account, and Slurm's default partition may have no GPUs",
        )
    return Check("slurm", OK, f"account {res['slurm_account']}, partition {part}")


def _nvidia_smi_gpus() -> int | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        got = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):  # a wedged driver: torch says the rest
        return None
    return sum(line.startswith("GPU ") for line in got.stdout.splitlines())


def gpu_checks(config: dict) -> list[Check]:
    """The checks only a GPU node answers: GPUs, NCCL, bf16."""
    need = gpus_per_node(config)
    _, cuda = torch_build()
    if cuda is None:
        seen = _nvidia_smi_gpus()
        also = f" (nvidia-smi lists {seen})" if seen else ""
        return [
            Check(
                "gpus",
                FAIL,
                f"0 GPUs usable: torch is a CPU build{also}, and the config runs up to "
                f"{need} per node (devices {config['devices']})",
            )
        ]
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    have = torch.cuda.device_count()
    out = []
    detail = f"{have} visible, the config runs up to {need} per node (devices {config['devices']})"
    if have == 0:
        out.append(Check("gpus", FAIL, detail + f"; CUDA_VISIBLE_DEVICES={_visible()!r}"))
        return out
    out.append(
        Check("gpus", WARN, detail + ": the cells needing more are skipped")
        if have < need
        else Check("gpus", OK, f"{detail}; {torch.cuda.get_device_name(0)}")
    )
    out.append(check_cuda_runs())
    if any(s.ranks > 1 or s.record.process_group(s.devices) for s in _runnable(config)):
        import torch.distributed as dist

        if not dist.is_nccl_available():
            out.append(Check("nccl", FAIL, "this torch has no NCCL; ranks cannot communicate"))
        else:
            version = ".".join(map(str, torch.cuda.nccl.version()))
            out.append(Check("nccl", OK, f"NCCL {version}"))
    if "bf16" in (s.precision for s in _runnable(config)):
        major, minor = torch.cuda.get_device_capability(0)
        if (major, minor) < (8, 0):
            out.append(
                Check(
                    "bf16",
                    FAIL,
                    f"{torch.cuda.get_device_name(0)} (sm_{major}{minor}) has no bfloat16; "
                    "its bf16 cells would be skipped: set precision: [fp32]",
                )
            )
        else:
            out.append(Check("bf16", OK, f"sm_{major}{minor} supports bfloat16"))
    return out


def check_cuda_runs() -> Check:
    """One small matmul on each visible GPU, synchronized: a driver older than the
    toolkit, a GPU in a bad state or a busy exclusive-mode GPU fails here, in a second,
    not in every cell."""
    import torch

    try:
        for i in range(torch.cuda.device_count()):
            x = torch.ones(256, 256, device=f"cuda:{i}")
            (x @ x).sum().item()
    except Exception as e:  # the driver's own words are the diagnosis
        return Check("cuda", FAIL, f"{type(e).__name__}: {e}".splitlines()[0][:300])
    return Check("cuda", OK, f"a matmul ran on each GPU (driver CUDA {torch.version.cuda})")


def _visible() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def run_checks(
    config: dict, workdir: Path, slurm: dict[str, str] | None = None, gpus: bool | None = None
) -> list[Check]:
    """Every check this config needs. `slurm`: the default resources of a Slurm run
    (None: a local one). `gpus`: True runs the GPU checks here (the cells run on this
    host), False leaves them to the GPU node (LATER: this is a cluster's login node),
    None: here unless the run is Slurm's."""
    found = [check_torch(config)]
    if compiler := check_compiler(config):
        found.append(compiler)
    found.append(check_disk(config, workdir))
    if slurm is not None:
        found.append(check_slurm(config, slurm))
    if config["device"] == "cuda":
        if gpus is None:
            gpus = slurm is None
        if gpus:
            found += gpu_checks(config)
        else:
            found.append(
                Check(
                    "gpus",
                    LATER,
                    "checked on the GPU node: `snakemake --profile profiles/slurm doctor` "
                    "runs every check there, and each cell checks its own node",
                )
            )
    return found


def failed(found: list[Check]) -> list[Check]:
    return [c for c in found if c.status == FAIL]


def in_child(
    config: dict,
    python: str,
    slurm: dict[str, str] | None = None,
    gpus: bool | None = None,
    cwd: Path | None = None,
) -> tuple[list[str], bool]:
    """run_checks in a process of its own, with `python`, the interpreter the jobs run
    (what matters is their torch, not the caller's), which holds the CUDA context and
    environment the GPU checks set up only while it lives: the caller (Snakemake's main
    process, a sweep) goes on to run the cells. Returns the lines and whether all
    passed."""
    import json

    argv = [python, "-m", "parabench", "doctor", "--config-json", json.dumps(config)]
    argv += ["--gpus", {None: "auto", True: "here", False: "later"}[gpus]]
    if slurm is not None:
        argv += ["--slurm-resources", json.dumps(slurm)]
    try:
        got = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"{FAIL:>5}  doctor: could not run `{python} -m parabench doctor`: {e}"], False
    lines = got.stdout.splitlines()
    if got.returncode not in (0, 1) or not lines:  # it could not check: say why
        why = (got.stderr.strip().splitlines() or ["no output"])[-1]
        lines.append(f"{FAIL:>5}  doctor: `{python} -m parabench doctor` failed: {why}")
        return lines, False
    return lines, got.returncode == 0
