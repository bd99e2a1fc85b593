"""Every launch, built in one place: a cell (one process, torchrun's ranks on one node,
or one torchrun agent per node under srun) and the collectives benchmark, each under
`guard`, which records a failure when the launch leaves no record.

`parabench launch` (a cell) and `parabench launch-collectives` run these; the
workflow's rules and `parabench sweep` call those two commands, so a cell starts the
same way however it is run, and whether it needs torchrun is decided here alone (from
its spec's `ranks`). Torch-free: it starts in milliseconds and survives a broken torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from parabench.spec import RunSpec

# torchrun with its ranks forked from a warm agent (see parabench.torchrun); it takes
# torchrun's own arguments.
TORCHRUN = ["-m", "parabench.torchrun"]


def _torchrun(python: str, nproc: int) -> list[str]:
    return [
        python,
        *TORCHRUN,
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
    ]


def cell_argv(spec: RunSpec, out: Path | str, python: str = "python") -> list[str]:
    """`python [-m parabench.torchrun ...] -m parabench run <spec> --out <out>` on
    one node (torchrun where spec.torchrun); across nodes (spec.nodes > 1, several
    ranks), see `multinode_argv`."""
    head = _torchrun(python, spec.ranks) if spec.torchrun else [python]
    return [*head, "-m", "parabench", "run", *spec.to_argv(), "--out", str(out)]


def multinode_argv(spec: RunSpec, out: Path | str, python: str = "python") -> list[str]:
    """The cell as one torchrun agent per node of the Slurm allocation, started by
    srun, meeting at a c10d rendezvous on the allocation's first node, keyed by the job
    id (so concurrent jobs never meet each other). Reads the allocation from Slurm's
    environment; `mpi` in the rule's resources stops the Slurm plugin from wrapping
    the command in an srun of its own."""
    job = os.environ["SLURM_JOB_ID"]
    hosts = subprocess.run(
        ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    port = 20000 + int(job) % 20000
    per_node = spec.devices // spec.nodes
    srun = ["srun", f"--nodes={spec.nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    torchrun = [
        python,
        *TORCHRUN,
        f"--nnodes={spec.nodes}",
        f"--nproc-per-node={per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={hosts[0]}:{port}",
        f"--rdzv-id={job}",
    ]
    return [*srun, *torchrun, "-m", "parabench", "run", *spec.to_argv(), "--out", str(out)]


def collectives_argv(
    devices: int,
    message_bytes: list[int],
    device: str,
    timeout_s: float,
    out: Path | str,
    python: str = "python",
) -> list[str]:
    """The collectives benchmark at `devices` ranks (always torchrun: it needs n > 1)."""
    args = ["--devices", str(devices), "--message-bytes", ",".join(map(str, message_bytes))]
    args += ["--device", device, "--timeout-s", f"{timeout_s:g}", "--out", str(out)]
    return [*_torchrun(python, devices), "-m", "parabench", "collectives", *args]


def launch_command(
    spec: RunSpec, out: Path | str, cell_timeout_s: float, python: str = "python"
) -> list[str]:
    """`parabench launch ...`: the command the workflow's rule and the sweep run."""
    tail = ["--out", str(out), "--cell-timeout-s", f"{cell_timeout_s:g}"]
    return [python, "-m", "parabench", "launch", *spec.to_argv(), *tail]


def launch_collectives_command(
    devices: int,
    message_bytes: list[int],
    device: str,
    timeout_s: float,
    out: Path | str,
    cell_timeout_s: float,
    python: str = "python",
) -> list[str]:
    """`parabench launch-collectives ...`: the benchmark's command for the rule and sweep."""
    args = collectives_argv(devices, message_bytes, device, timeout_s, out)
    tail = args[args.index("collectives") + 1 :]
    return [
        python,
        "-m",
        "parabench",
        "launch-collectives",
        *tail,
        "--cell-timeout-s",
        f"{cell_timeout_s:g}",
    ]


def launch_cell(spec: RunSpec, out: Path, cell_timeout_s: float) -> int:
    """Start the cell and make sure `out` ends with its record (guard.guard)."""
    from parabench.checks import static_skip_reason
    from parabench.guard import guard

    try:  # a custom model's facts run its factory: what fails is left to the guarded cell
        reason = static_skip_reason(spec)
    except Exception:
        reason = None
    if reason:  # the settings alone say: nothing to start
        print(f"parabench launch: skipped, no process started: {reason}", flush=True)
        record_skip(spec, out, reason)
        return 0
    python = sys.executable
    across = spec.nodes > 1 and spec.ranks > 1
    argv = multinode_argv(spec, out, python) if across else cell_argv(spec, out, python)
    return guard(out, argv, cell_timeout_s, spec.record_fields(), ranks=spec.ranks)


def record_skip(spec: RunSpec, out: Path, reason: str) -> None:
    """The record of a cell its settings skip (checks.static_skip_reason)."""
    from parabench import envinfo, records

    out.mkdir(parents=True, exist_ok=True)
    fields = spec.record_fields()
    records.write_outcome(
        out, "skipped", reason, **fields, env=envinfo.base(), device_type=spec.device
    )


def launch_collectives(
    devices: int,
    message_bytes: list[int],
    device: str,
    timeout_s: float,
    out: Path,
    cell_timeout_s: float,
) -> int:
    """Start the collectives benchmark; a failure leaves a `failed` meta.json."""
    from parabench.guard import guard

    argv = collectives_argv(devices, message_bytes, device, timeout_s, out, sys.executable)
    fields = {"kind": "collectives", "devices": devices}
    return guard(out, argv, cell_timeout_s, fields, ranks=devices)


def launch_ranks(config: dict, out: Path) -> int:
    """`parabench ranks`: measure one rank of each multi-rank cell alone (ranks.py) in
    a child process, and make sure out/ranks.csv ends with a row for every rank. The
    child rewrites the table after each rank; where it crashed, was killed or ran past
    its time (cell_timeout_s for each cell's ranks), the ranks it never measured get a
    row that says so. Returns 0: the sweep goes on to its summary and report."""
    import json

    from parabench.config import alone_ranks, rank_key
    from parabench.guard import describe_exit
    from parabench.records import RANK_COLUMNS, RANK_KEY, write_rows

    wanted = alone_ranks(config)
    path = out / "ranks.csv"
    path.unlink(missing_ok=True)  # never a stale row
    out.mkdir(parents=True, exist_ok=True)
    cells = len({spec for spec, _ in wanted})
    timeout = config["cell_timeout_s"] * max(1, cells)
    argv = [sys.executable, "-m", "parabench", "ranks", "--measure"]
    argv += ["--config-json", json.dumps(config), "--out", str(out)]
    try:
        code = subprocess.run(argv, timeout=timeout, check=False).returncode
        why = None if code == 0 else f"ended ({describe_exit(code)})"
    except subprocess.TimeoutExpired:
        why = f"ran past its {timeout:g} s (cell_timeout_s for each cell's ranks) and was killed"
    rows = []
    if path.exists():
        import csv

        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    done = {tuple(str(r[k]) for k in RANK_KEY) for r in rows}
    for spec, rank in wanted:
        key = rank_key(spec, rank)
        if tuple(str(key[k]) for k in RANK_KEY) not in done:
            reason = f"the ranks process {why or 'wrote no row for it'} before it was measured"
            rows.append({**key, "status": "failed", "reason": reason + " (logs/ranks.log)"})
    write_rows(path, RANK_COLUMNS, rows)
    print(f"ranks: {path} ({len(rows)} ranks; the process {why or 'finished'})", flush=True)
    return 0
