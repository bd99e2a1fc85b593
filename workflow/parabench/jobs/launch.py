"""Every launch, built in one place: a cell (one process, torchrun's ranks on one node,
or one torchrun agent per node under srun) and the collectives benchmark, each under
`guard`, which records a failure when the launch leaves no record; the ranks measured
alone and the plan, each a child process under `guard_table`, which leaves a row for
every rank whatever the child does.

`parabench launch` (a cell) and `parabench launch-collectives` run these; the
workflow's rules and `parabench sweep` call those two commands, so a cell starts the
same way however it is run, and whether it needs torchrun is decided here alone (from
its spec's `ranks`). Torch-free: it starts in milliseconds and survives a broken torch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from parabench.jobs import warm
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
    head = _torchrun(python, spec.processes) if spec.torchrun else [python]
    return [*head, "-m", "parabench", "run", *spec.to_argv(), "--out", str(out)]


def rendezvous_port(rng=None, tries: int = 100) -> int:
    """A TCP port for the c10d rendezvous, chosen now, free on this host when checked.

    This runs in the batch script, which Slurm runs on the allocation's first node,
    where the rendezvous listens. Random (the `secrets` generator unless `rng` is given,
    for tests), so no other job can predict it or be handed the same one by formula;
    from 20000 up to the kernel's ephemeral range (ip_local_port_range), which it leaves
    to outgoing connections. Checked by binding it; between that and torchrun's bind
    another process may take it, the race torchrun's own `get_free_port` accepts. Where
    the ephemeral range leaves no room, or every try is taken, the kernel's free port."""
    import secrets
    import socket

    low = 20000
    try:
        start = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]
        high = int(start) - 1
    except (OSError, IndexError, ValueError):  # not Linux: below IANA's ephemeral range
        high = 49151
    rng = rng or secrets.SystemRandom()
    candidates = [rng.randint(low, high) for _ in range(tries)] if high > low else []
    for port in [*candidates, 0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:  # in use here
                continue
            return s.getsockname()[1]
    raise OSError("no free TCP port for the rendezvous")


def multinode_argv(spec: RunSpec, out: Path | str, python: str = "python") -> list[str]:
    """The cell as one torchrun agent per node of the Slurm allocation, started by
    srun, meeting at a c10d rendezvous on the allocation's first node, keyed by the job
    id (so concurrent jobs never meet each other), at a port chosen when it launches
    (`rendezvous_port`). Reads the allocation from Slurm's environment; `mpi` in the
    rule's resources stops the Slurm plugin from wrapping the command in an srun of its
    own."""
    job = os.environ["SLURM_JOB_ID"]
    hosts = subprocess.run(
        ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    port = rendezvous_port()
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
    """The collectives benchmark at `devices` ranks (always torchrun, one rank too: on CUDA
    that runs NCCL's path on one GPU)."""
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


def collectives_settings(message_bytes: list[int], device: str) -> dict:
    """What a collectives benchmark measures with, as its meta.json records it: a sweep
    reruns one recorded with other settings, and the workflow's rule compares the same.
    Not its timeout: raising one after it ran out reruns nothing."""
    return {"message_bytes": [int(b) for b in message_bytes], "device": device}


def ranks_command(
    config: dict, out: Path | str, part: tuple[int, int] | None = None, python: str = "python"
) -> list[str]:
    """`parabench ranks ...`: the ranks job's command for the rule and the sweep; `part`
    (i, k): the i-th of k jobs measuring them (config.ranks_of)."""
    parts = ["--part", f"{part[0]}/{part[1]}"] if part else []
    return [python, "-m", "parabench", "ranks", *_config_args(config), *parts, "--out", str(out)]


def plan_command(
    config: dict, out: Path | str, collectives: Path | str | None = None, python: str = "python"
) -> list[str]:
    """`parabench plan ...`: the plan's command for the rule and the sweep; `collectives`:
    the curves to read (fabric `curves`)."""
    curves = ["--collectives", str(collectives)] if collectives else []
    return [python, "-m", "parabench", "plan", *_config_args(config), *curves, "--out", str(out)]


def advise_command(
    config: dict, out: Path | str, collectives: Path | str | None = None, python: str = "python"
) -> list[str]:
    """`parabench advise ...`: advise.csv (and advise-torchtitan.csv where asked) for
    the rule and the sweep; `collectives`: the curves to read (fabric `curves`)."""
    curves = ["--collectives", str(collectives)] if collectives else []
    # through parabench.jobs.warm: advise imports torch itself, so it is forked from the run's
    # warm process where there is one (as ranks' and plan's measuring children are)
    advise = [python, "-m", "parabench", "advise", *_config_args(config), *curves]
    return [python, "-m", "parabench.jobs.warm", *advise, "--out", str(out)]


def _config_args(config: dict) -> list[str]:
    import json

    return ["--config-json", json.dumps(config, sort_keys=True)]


def launch_cell(spec: RunSpec, out: Path, cell_timeout_s: float) -> int:
    """Start the cell and make sure `out` ends with its record (guard.guard)."""
    from parabench.checks import static_skip_reason
    from parabench.jobs.guard import guard

    try:  # a custom model's facts run its factory: what fails is left to the guarded cell
        reason = static_skip_reason(spec)
    except Exception:
        reason = None
    if reason:  # the settings alone say: nothing to start
        print(f"parabench launch: skipped, no process started: {reason}", flush=True)
        record_skip(spec, out, reason)
        return 0
    python = sys.executable
    across = spec.nodes > 1 and spec.processes > 1
    argv = multinode_argv(spec, out, python) if across else cell_argv(spec, out, python)
    return guard(out, argv, cell_timeout_s, spec.record_fields(), ranks=spec.processes)


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
    """Start the collectives benchmark; a failure leaves a `failed` meta.json. Either
    record holds the settings it ran with (collectives_settings)."""
    import json

    from parabench.jobs.guard import guard
    from parabench.records import write_meta

    argv = collectives_argv(devices, message_bytes, device, timeout_s, out, sys.executable)
    settings = collectives_settings(message_bytes, device)
    fields = {"kind": "collectives", "devices": devices, "settings": settings}
    code = guard(out, argv, cell_timeout_s, fields, ranks=devices)
    meta = out / "meta.json"
    if meta.exists():  # rank 0 wrote it: add what the benchmark's processes do not know
        recorded = json.loads(meta.read_text())
        if recorded.get("settings") != settings:
            write_meta(meta, {**recorded, "settings": settings})
    return code


def guard_table(
    argv: list[str],
    path: Path,
    columns: tuple[str, ...],
    key: tuple[str, ...],
    wanted: list[dict],
    timeout_s: float,
    what: str,
    resumes: bool = False,
    log: str | None = None,
) -> str | None:
    """Run `argv`, a child that measures the `wanted` rows (their keys) in that order and
    rewrites the CSV `path` atomically after each, and make sure the table ends with a
    row for every one. Each row has `timeout_s` (rank_timeout_s): the child is killed
    when it goes that long without a new row, so a rank that hangs costs its own limit,
    never the time of the ranks after it, and a job of n rows ends within n times it
    (and a second a row: how often it looks). Where the child crashed, was killed or
    ran past a row's time, the row it was measuring (the first it had not written) is
    a failed row that says how, and so is each row it never reached. A child that
    `resumes` (skips the rows already in the table) and was killed by the kernel (the
    OOM killer's SIGKILL, a crash in native code) or ran past a row's time is started
    again for the rest instead. Returns how the child last ended (None: it finished);
    what goes on is left to the caller, whose table is whole. `log`: where the child's
    output goes, for the reasons (default logs/<what>.log)."""
    from parabench.jobs.guard import describe_exit
    from parabench.records import read_rows, write_rows

    path.unlink(missing_ok=True)  # never a stale row
    path.parent.mkdir(parents=True, exist_ok=True)
    log = log or f"logs/{what}.log"

    def key_of(row: dict) -> tuple[str, ...]:
        return tuple(str(row[k]) for k in key)

    def failed(row: dict, why: str) -> dict:
        return {**row, "status": "failed", "reason": f"the {what} process {why} ({log})"}

    while True:
        code = _while_writing(argv, path, timeout_s)
        if code is None:
            why = (
                f"ran past {timeout_s:g} s on one rank and was killed (rank_timeout_s, "
                "or cell_timeout_s where lower)"
            )
        else:
            why = None if code == 0 else f"ended ({describe_exit(code)})"
        rows = read_rows(path)
        done = {key_of(r) for r in rows}
        missing = [row for row in wanted if key_of(row) not in done]
        if not missing:
            break
        if why is None:
            rows += [failed(row, "wrote no row for it") for row in missing]
            break
        rows.append(failed(missing[0], f"{why} while measuring it"))
        # a signal the kernel sends (SIGKILL of the OOM killer, SIGSEGV, SIGABRT), not
        # one a person or the scheduler sends to stop the job; or our own kill of a row
        # past its time
        killed = code is None or (code < 0 and -code not in (signal.SIGINT, signal.SIGTERM))
        if resumes and killed and len(missing) > 1:
            write_rows(path, columns, rows)
            print(f"{what}: {why}; again, for the {len(missing) - 1} rows left", flush=True)
            continue
        rows += [failed(row, f"{why} before it was measured") for row in missing[1:]]
        break
    write_rows(path, columns, rows)
    print(f"{what}: {path} ({len(rows)} rows; the process {why or 'finished'})", flush=True)
    return why


POLL_S = 1.0  # how often guard_table looks for a new row


def _while_writing(argv: list[str], path: Path, timeout_s: float) -> int | None:
    """Run `argv` until it ends (its exit code) or goes `timeout_s` without rewriting
    `path`, each rewrite (an atomic replace: a new inode) starting the time again;
    then kill it (None). Its own start counts against its first row."""

    def stamp() -> tuple[int, int] | None:
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns

    proc = warm.popen(argv)  # forked from the run's warm process where there is one
    try:
        seen, deadline = stamp(), time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                return proc.wait(timeout=max(0.0, min(POLL_S, left)))
            except subprocess.TimeoutExpired:
                pass
            if (now := stamp()) != seen:
                seen, deadline = now, time.monotonic() + timeout_s
            elif left <= 0:
                proc.kill()
                proc.wait()
                return None
    except BaseException:  # interrupted: the child goes with the guard
        proc.kill()
        proc.wait()
        raise


def launch_ranks(config: dict, out: Path, part: tuple[int, int] | None = None) -> int:
    """`parabench ranks`: measure one rank of each multi-rank cell alone
    (predict/rank_alone.py; with `part`, that job's share of them: config.ranks_of) in
    a child process under
    guard_table, which gives each rank config.rank_limit_s and starts the child again
    after a rank that killed it or ran past it, so out/ranks.csv ends with a row for
    every rank. Returns 0: the sweep goes on to its summary and report."""
    from parabench.config import rank_key, rank_limit_s, ranks_of
    from parabench.records import RANK_COLUMNS, RANK_KEY

    wanted = [rank_key(spec, rank) for spec, rank in ranks_of(config, part)]
    argv = [*ranks_command(config, out, part, sys.executable), "--measure"]
    log = f"logs/ranks/part{part[0]}of{part[1]}.log" if part else "logs/ranks.log"
    out.mkdir(parents=True, exist_ok=True)
    guard_table(
        argv,
        out / "ranks.csv",
        RANK_COLUMNS,
        RANK_KEY,
        wanted,
        rank_limit_s(config),
        "ranks",
        resumes=True,
        log=log,
    )
    return 0


def launch_plan(config: dict, out: Path, collectives: Path | None, fields: dict) -> int:
    """`parabench plan`: plan every rank (predict/plan.py) in a child process under guard_table,
    which gives each planned rank config.rank_limit_s and starts the child again after
    a rank that killed it or ran past it, so out/plan.csv ends with a row for every
    planned rank. `fields`: what each row carries whatever its rank did (the fabric's
    name and source, the scaling). Returns 0: the sweep goes on to its report."""
    from parabench.config import plan_key, planned_specs, rank_limit_s
    from parabench.records import PLAN_COLUMNS, PLAN_KEY

    wanted = [{**plan_key(spec), **fields} for spec in planned_specs(config)]
    timeout = rank_limit_s(config)
    argv = [*plan_command(config, out, collectives, sys.executable), "--measure"]
    out.mkdir(parents=True, exist_ok=True)
    guard_table(argv, out / "plan.csv", PLAN_COLUMNS, PLAN_KEY, wanted, timeout, "plan", True)
    return 0
