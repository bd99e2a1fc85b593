"""A real single-node Slurm for the profile tests: munged, slurmctld and slurmd from
Debian's packages (Slurm 22.05), four fake GRES GPUs, no accounting database.

Facts this is built on (found by trying, as root, without systemd):
- slurmd 22.05 drops GRES GPUs without `File=` character devices and drains the node,
  so the fake GPUs are `mknod c 1 3` devices (clones of /dev/null) in a temp dir.
- No cgroup.conf: proctrack/linuxproc and task/none work without systemd.
- DefMemPerCPU, or each job takes the node's whole memory and jobs run one at a time.
- snakemake-executor-plugin-slurm's jobstep strips SLURM_* before its inner srun, so
  SLURM_CONF is not enough: the config must be at /etc/slurm/slurm.conf. An existing
  one is moved aside and put back.
- Without slurmdbd `sacct` fails: the plugin must use `squeue`, which needs MinJobAge
  well above its status-check delay so finished jobs are still listed.
- Two partitions on the one node: `test` (MaxTime one hour, the default) and `day`
  (MaxTime 24 hours, a common GPU partition's), each enforced at submission
  (EnforcePartLimits=ALL: sbatch refuses a longer job, where by default it would queue
  it for ever).
- One cluster per machine at a time: its ports and /etc/slurm are the machine's. Two
  test workers each starting one (test_slurm.py and then test_slurm_time.py, side by side)
  had the second's slurmctld die on a bound port, unnoticed (the first's node answered
  sinfo), and its jobs killed when the first was stopped. A lock serializes them, and a
  daemon that died at start is an error.
Only the daemons started here are stopped.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ETC = Path("/etc/slurm")
GPUS = 4
CPUS = 4  # more than this machine has; config_overrides lets slurmd accept it


def _slurm_conf(tmp: Path, host: str) -> str:
    return f"""\
ClusterName=parabench-test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd.pid
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdLogFile={tmp}/slurmd.log
SlurmctldPort=16817
SlurmdPort=16818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
GresTypes=gpu
ReturnToService=2
MinJobAge=600
DefMemPerCPU=256
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
EnforcePartLimits=ALL
NodeName={host} NodeAddr=127.0.0.1 CPUs={CPUS} RealMemory=4096 Gres=gpu:{GPUS} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=60 State=UP
PartitionName=day Nodes={host} MaxTime=24:00:00 State=UP
"""


def _wait(check, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise RuntimeError(f"local Slurm: {what} did not come up in {timeout} s")


def _node_idle() -> bool:
    out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
    return out.returncode == 0 and out.stdout.strip() in ("idle", "mix")


LOCK = Path(tempfile.gettempdir()) / "parabench-local-slurm.lock"


@contextlib.contextmanager
def local_slurm(tmp: Path) -> Iterator[dict]:
    """The cluster, once this machine's other one (another test worker's) has stopped."""
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with _local_slurm(tmp) as info:
            yield info


@contextlib.contextmanager
def _local_slurm(tmp: Path) -> Iterator[dict]:
    host = socket.gethostname().split(".")[0]
    for d in ("state", "spool", "dev"):
        (tmp / d).mkdir(parents=True, exist_ok=True)
    # munged runs as the munge user, who cannot enter pytest's 0700 temp dirs.
    munge_dir = Path(tempfile.mkdtemp(prefix="parabench-munge-"))
    devices = []
    for i in range(GPUS):
        dev = tmp / "dev" / f"nvidia{i}"
        if not dev.exists():
            os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))
        devices.append(str(dev))

    backup = None
    if ETC.exists():
        backup = ETC.with_name(f"slurm.parabench-backup-{os.getpid()}")
        ETC.rename(backup)
    ETC.mkdir()
    (ETC / "slurm.conf").write_text(_slurm_conf(tmp, host))
    (ETC / "gres.conf").write_text(f"Name=gpu File={tmp}/dev/nvidia[0-{GPUS - 1}]\n")

    started: list[subprocess.Popen] = []
    munge_sock = munge_dir / "munge.socket"
    try:
        if not Path("/etc/munge/munge.key").exists():
            subprocess.run(["mungekey", "--create"], check=True)
            shutil.chown("/etc/munge/munge.key", "munge", "munge")
        # munged refuses root; it runs as its own user with a socket of ours.
        shutil.chown(munge_dir, "munge", "munge")
        munge_dir.chmod(0o755)  # munged insists every client can reach its socket
        started.append(
            subprocess.Popen(
                [
                    "runuser",
                    "-u",
                    "munge",
                    "--",
                    "munged",
                    "--foreground",
                    f"--socket={munge_sock}",
                    f"--pid-file={munge_dir}/munged.pid",
                    f"--log-file={munge_dir}/munged.log",
                    f"--seed-file={munge_dir}/seed",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        _wait(munge_sock.exists, "munged")
        # Slurm finds munge through its default socket path.
        default_sock = Path("/run/munge/munge.socket.2")
        default_sock.parent.mkdir(parents=True, exist_ok=True)
        if default_sock.is_symlink() or not default_sock.exists():
            default_sock.unlink(missing_ok=True)
            default_sock.symlink_to(munge_sock)
        started.append(
            subprocess.Popen(
                ["slurmctld", "-D", "-c", "-i"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        started.append(
            subprocess.Popen(
                ["slurmd", "-D", "-c"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        )
        _wait(_node_idle, "the node")
        if dead := [" ".join(p.args) for p in started if p.poll() is not None]:
            logs = "\n".join(
                (tmp / f).read_text()[-1500:]
                for f in ("slurmctld.log", "slurmd.log")
                if (tmp / f).exists()
            )
            raise RuntimeError(f"local Slurm: {dead} exited at start\n{logs}")
        yield {
            "host": host,
            "partition": "test",
            "partitions": {"test": 60, "day": 24 * 60},  # MaxTime, minutes
            "gpus": GPUS,
            "devices": devices,
            "logs": [tmp / "slurmctld.log", tmp / "slurmd.log"],
        }
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], capture_output=True)
        for proc in reversed(started):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        # runuser does not pass SIGTERM on to munged: stop it by its own pid file.
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((munge_dir / "munged.pid").read_text()), signal.SIGTERM)
        shutil.rmtree(ETC, ignore_errors=True)
        shutil.rmtree(munge_dir, ignore_errors=True)
        if backup is not None:
            backup.rename(ETC)


if __name__ == "__main__":  # bring it up by hand: python tests/slurm_cluster.py DIR
    import sys

    with local_slurm(Path(sys.argv[1])) as info:
        print(info, flush=True)
        subprocess.run(["sinfo", "-N", "-o", "%N %t %G %c %m"])
        subprocess.run(
            [
                "srun",
                "--gpus=2",
                "bash",
                "-c",
                "echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES "
                "SLURM_GPUS_ON_NODE=$SLURM_GPUS_ON_NODE",
            ]
        )
