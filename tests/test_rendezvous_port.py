"""The multi-node rendezvous port: chosen when the cell launches, on the allocation's
first node (where Slurm runs the batch script), random, free there, and below the
kernel's ephemeral range; never a formula of the job id, which other jobs share.
(tests/test_multinode.py runs the launch itself, across two network namespaces.)"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

import pytest

from conftest import tiny_spec
from parabench.jobs import launch

FAKE = Path(__file__).parent / "fake_slurm"


def ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:
        return 49152


def endpoint_port(argv: list[str]) -> int:
    (endpoint,) = [a for a in argv if a.startswith("--rdzv-endpoint=")]
    return int(endpoint.rpartition(":")[2])


@pytest.fixture
def allocation(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", f"{FAKE}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_LOG", str(tmp_path / "fake-slurm.log"))
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-2]")
    monkeypatch.setenv("SLURM_NNODES", "2")


def test_each_launch_chooses_its_own_port_below_the_ephemeral_range(allocation, monkeypatch):
    spec = tiny_spec("ddp", 4, gpus_per_node=2, device="cuda")  # a spec: nothing runs
    assert spec.nodes == 2
    ports = []
    # jobs 20000 apart once met on one port (20000 + job % 20000); and one job's
    # launches do not reuse one either
    for job in (4242, 24242, 4242, 4242, 4242):
        monkeypatch.setenv("SLURM_JOB_ID", str(job))
        ports.append(endpoint_port(launch.multinode_argv(spec, "out")))
    assert len(set(ports)) > 1, ports
    assert all(20000 <= p < ephemeral_start() for p in ports), ports


def test_a_port_in_use_here_is_never_chosen():
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        busy = taken.getsockname()[1]

        class Stub(random.Random):
            picks = iter([busy, busy, 23456])

            def randint(self, a: int, b: int) -> int:
                return next(self.picks, 23456)

        free = launch.rendezvous_port(Stub())
        assert free != busy
        with socket.socket() as s:
            s.bind(("", free))  # free when chosen, and still
