"""`parabench doctor [CONFIG]`: is this environment able to run this config? One line per
check, before anything is queued or launched, each failure saying what to do.

The checks, and where each can be answered:

- planning host (a cluster's login node: no GPU, little memory; or the laptop itself):
  the torch build against `device` (a CPU wheel cannot run a cuda cell), a C compiler
  when `compile` is on (Triton's launcher on CUDA, Inductor's C++ on CPU), the Slurm
  account and partition a profile sets (and that the partition exists and has GPUs,
  and that its MaxTime allows every job of the run, where `sinfo` answers), free disk
  under `results`;
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

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from parabench import checks, models
from parabench.analyze import fingerprint
from parabench.config import cells, slurm_jobs
from parabench.envinfo import nvidia_smi_gpus, runs_on_cuda, torch_build, torch_release
from parabench.models.facts import UNKNOWN_BLOCKS
from parabench.spec import RunSpec

OK, WARN, FAIL, LATER = "ok", "warn", "FAIL", "later"

# What one cell leaves on disk (_results_bytes), from 48 cells of mlp and gpt (2 and 4
# blocks) run on this CPU at 1, 2 and 4 ranks with 5 profiled steps (docs/results.md,
# "Disk"). Its records: meta.json (8-90 KB: per rank, per profiled step, its regions),
# its log (3 KB), steps.csv (125 bytes a step); the fixed part bounded at 256 KiB.
RECORD_BYTES = 256 * 2**10
STEP_BYTES = 160
# Its traces, one per rank: one step recorded in full (every op) and each profiled step
# lightly. Both grow with the blocks a step runs, over all ranks and micro-batches
# (_block_passes). In full, a gpt block (the largest measured) took 15 KB a pass (gzip);
# on CUDA each op adds its kernel, its launch and the flow between them: 2.9 events an
# op in Holistic Trace Analysis's full CUDA trace (tests/data of HTA, ns_resolution_trace,
# 16.8 bytes each) against 1.4 here (23 bytes each), x1.5: 23 KB, bounded at 32 KiB.
BLOCK_PASS_BYTES = 32 * 2**10
# A profiled step, as a share of the full one: on CPU its regions in meta.json and its
# few ranges (4% measured); on CUDA also every kernel, launch and flow, 60% of a full
# step's events in that trace.
PROFILED_SHARE = {"cpu": 0.05, "cuda": 0.65}
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
    if (release := torch_release(version)) is not None and release < TORCH_MIN:
        oldest = ".".join(map(str, TORCH_MIN))
        return Check(
            "torch",
            WARN,
            f"{build}: older than {oldest}, the oldest torch parabench is tested with; its "
            f"cells may fail. Install torch>={oldest} (README, GPU users)",
        )
    return Check("torch", OK, build)


def check_compiler(config: dict) -> Check | None:
    if not any(s.compile for s in _runnable(config)):
        return None
    # Triton builds its launcher with a C compiler; Inductor's CPU code is C++.
    cuda = runs_on_cuda(config["device"])
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


def _block_passes(spec: RunSpec, blocks: int) -> int:
    """Blocks run in one step, summed over the cell's ranks (a one-process strategy's
    devices: DataParallel's replicas): what its traces and regions grow with. A
    pipeline's stage runs its blocks once per micro-batch, grad_accum every block once
    per micro-batch."""
    options = dict(spec.options)
    micro = options.get("microbatches" if spec.record.pipelined else "accum_steps", 1)
    return spec.devices // spec.stages * blocks * micro


def cell_bytes(spec: RunSpec, n_params: int | None, blocks: int | None) -> int:
    """What one cell that runs leaves on disk: its records, its parameters as params.pt
    keeps them (analyze/fingerprint.py; an unknown size at its largest) and its traces (none
    counted where its blocks are unknown)."""
    params = fingerprint.stored_bytes(n_params or fingerprint.EXACT_MAX)
    records = RECORD_BYTES + STEP_BYTES * (spec.steps + spec.profile_steps)
    if not blocks:
        return records + params
    share = PROFILED_SHARE["cpu" if spec.device == "cpu" else "cuda"]
    traces = BLOCK_PASS_BYTES * _block_passes(spec, blocks) * (1 + share * spec.profile_steps)
    return records + params + int(traces)


def _results_bytes(config: dict) -> tuple[int, list[str]]:
    """What a sweep writes (cell_bytes, from the models' facts: torch-free), and the
    models whose blocks planning does not know."""
    total, unknown = 0, []
    for c in cells(config):
        if checks.static_skip_reason(c.spec):  # recorded as skipped: a few KB
            continue
        found = models.facts(c.spec.model)
        blocks = found.n_blocks if 0 < found.n_blocks < UNKNOWN_BLOCKS else None
        if blocks is None and c.spec.model_name not in unknown:
            unknown.append(c.spec.model_name)
        total += cell_bytes(c.spec, found.n_params, blocks)
    return total, unknown


def check_disk(config: dict, workdir: Path) -> Check:
    where = (workdir / config["results"]).resolve()
    probe = next(p for p in (where, *where.parents) if p.exists())
    free = shutil.disk_usage(probe).free
    need, unknown = _results_bytes(config)
    gib = 2**30
    detail = f"{free / gib:.1f} GiB free under {probe}; the sweep writes up to {need / gib:.1f} GiB"
    if unknown:
        detail += f" besides the traces of {', '.join(unknown)} (blocks found in the cell)"
    # An estimate, at its largest (a cell that fails early writes little): the run is
    # refused only where not even the records fit, warned where the rest may not.
    if free < len(cells(config)) * RECORD_BYTES:
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
        if runs_on_cuda(config["device"]) and not any(g.startswith("gpu") for g in gres):
            return Check("slurm", FAIL, f"partition {part!r} has no GPUs (sinfo %G: {gres[0]})")
    if missing:
        return Check(
            "slurm",
            WARN,
            f"{' and '.join(missing)} not set (the profile's default-resources): the plugin "
            "guesses the account, and Slurm's default partition may have no GPUs",
        )
    return Check("slurm", OK, f"account {res['slurm_account']}, partition {part}")


def time_limit_minutes(text: str) -> int | None:
    """A Slurm time limit as sinfo prints it (`[days-]hours:minutes:seconds`, or
    `minutes[:seconds]`) in whole minutes; None for none (`infinite`, `UNLIMITED`)."""
    text = text.strip()
    if not text or text.lower() in ("infinite", "unlimited", "n/a"):
        return None
    days, _, clock = text.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    hours, minutes = (parts[0], parts[1]) if len(parts) == 3 else (0, parts[0])
    return (int(days or 0) * 24 + hours) * 60 + minutes


def check_time_limit(config: dict, res: dict[str, str]) -> Check | None:
    """Every Slurm job this run submits (config.slurm_jobs: their runtimes) against the
    MaxTime of its partition (slurm_partition, else Slurm's default one), where `sinfo`
    answers: a job asking for more is refused by sbatch (EnforcePartLimits) or never
    starts, and the run waits on it for ever."""
    if not shutil.which("sinfo"):
        return None
    try:
        got = subprocess.run(
            ["sinfo", "-h", "-o", "%P %l"], capture_output=True, text=True, timeout=20
        )
    except subprocess.TimeoutExpired:
        return Check("slurm time", WARN, "sinfo did not answer in 20 s: time limits unchecked")
    named = res.get("slurm_partition")
    found = [
        (name.rstrip("*"), text)
        for name, text in (line.split() for line in got.stdout.splitlines() if line.count(" ") == 1)
        if (name.rstrip("*") == named if named else name.endswith("*"))
    ]
    if got.returncode != 0 or not found:
        return None  # check_slurm says the partition is unknown
    part, text = found[0]
    try:
        limits = [time_limit_minutes(t) for _, t in found]
    except ValueError:  # a format this does not know: Slurm decides
        return Check("slurm time", WARN, f"sinfo's time limit of {part!r}: {text!r}")
    if None in limits:
        return Check("slurm time", OK, f"partition {part!r} has no time limit")
    limit = min(limits)
    jobs = [j for j in slurm_jobs(config) if j.runs]
    detail = f"partition {part!r} allows {limit} min (sinfo MaxTime {text})"
    over = [j for j in jobs if j.minutes > limit]
    if over:
        said = "; ".join(f"{j.rule} {j.minutes} min: {j.fix.format(limit=limit)}" for j in over)
        return Check("slurm time", FAIL, f"{detail}, and this run's jobs ask for more: {said}")
    longest = max(j.minutes for j in jobs)
    return Check("slurm time", OK, f"{detail}; the longest job asks {longest} min")


def gpu_checks(config: dict) -> list[Check]:
    """The checks only a GPU node answers: GPUs, NCCL, bf16."""
    need = gpus_per_node(config)
    _, cuda = torch_build()
    if cuda is None:
        seen = nvidia_smi_gpus()
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
    if any(s.processes > 1 or s.record.process_group(s.devices) for s in _runnable(config)):
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
        if limit := check_time_limit(config, slurm):
            found.append(limit)
    if runs_on_cuda(config["device"]):
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
    # A minute where the rest take seconds: once nothing else refuses the run.
    if rehearses(config) and not failed(found):
        found.append(check_rehearsal(config, workdir))
    return found


def rehearses(config: dict) -> bool:
    """Whether the preflight rehearses this config's GPU run (preflight/rehearse.py): a cuda
    config, or an auto one where torch is a CUDA build (it will find GPUs), unless
    rehearse.enabled is off. A CPU config's cells are their own rehearsal."""
    return config["rehearse"]["enabled"] and runs_on_cuda(config["device"])


def check_rehearsal(config: dict, workdir: Path, python: str | None = None) -> Check:
    """Every cell of the config at its real size on fake tensors of its device (rehearse
    .py), in a process of its own: FAIL where a cell fails there or a rank's peak does
    not fit rehearse.gpu (judged on torch 2.13 and later: rehearse.judge_fit), unless
    rehearse.failing is run (then WARN: those cells run and record their own failure)."""
    from parabench.preflight import rehearse

    settings = config["rehearse"]
    out = workdir / config["results"]
    rows, why = rehearse.in_child(config, out, settings["gpu"], python, cwd=workdir)
    if why:  # not rehearsed at all (no compiler, a crash): said, and nothing refused for it
        return Check("rehearsal", WARN, f"{why}: the run goes on unrehearsed")
    lines = rehearse.summary(rows)
    detail = f"{len(rows)} ranks on fake {rehearse.device_type(config)} ({settings['gpu']}): "
    detail += "; ".join(lines) + f" ({config['results']}/rehearsal.csv)"
    if not rehearse.refused(rows):
        return Check("rehearsal", OK, detail)
    if settings["failing"] == "run":
        return Check("rehearsal", WARN, detail + "; they run (rehearse.failing: run)")
    return Check(
        "rehearsal",
        FAIL,
        detail + "; refused before any job: fix or drop those cells, or set "
        "rehearse.failing: run to run them anyway",
    )


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
        got = subprocess.run(argv, capture_output=True, text=True, timeout=1200, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"{FAIL:>5}  doctor: could not run `{python} -m parabench doctor`: {e}"], False
    lines = got.stdout.splitlines()
    if got.returncode not in (0, 1) or not lines:  # it could not check: say why
        why = (got.stderr.strip().splitlines() or ["no output"])[-1]
        lines.append(f"{FAIL:>5}  doctor: `{python} -m parabench doctor` failed: {why}")
        return lines, False
    return lines, got.returncode == 0
