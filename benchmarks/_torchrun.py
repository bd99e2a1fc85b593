"""Start a benchmark script as n torchrun ranks of itself (shared by the benchmarks)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable


def run_as_ranks(script: str, devices: int, worker: Callable[[], None]) -> None:
    """In a rank (torchrun set LOCAL_RANK): run `worker`. Otherwise start `devices`
    ranks of `script` with the same arguments and exit with torchrun's status."""
    if "LOCAL_RANK" in os.environ:
        worker()
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(devices), script, *sys.argv[1:]]
    sys.exit(subprocess.call(cmd))
