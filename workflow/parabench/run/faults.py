"""Test-only fault injection: make one cell's rank crash, hang or run out of memory.

Set PARABENCH_FAULT to `KIND@MODEL/STRATEGY/nDEVICES/rREPEAT:rank=R:step=S`, e.g.
`hang@tiny/ddp/n2/r0:rank=1:step=2`. Only the named cell and rank are affected; every
other cell of a sweep runs normally. The check runs before the step's timer starts.

- crash: the rank dies at once with exit code 13 (no Python cleanup)
- abort: the rank dies of SIGABRT, as native code does on a failed check or a
         corrupted heap (faulthandler prints where Python was)
- hang:  the rank sleeps forever, so its peers wait in the gradient all-reduce until
         the process-group timeout (timeout_s) or the cell timeout (cell_timeout_s)
- oom:   the rank raises torch.OutOfMemoryError, the exception a real CUDA OOM raises
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

ENV = "PARABENCH_FAULT"
_FORMAT = re.compile(
    r"^(crash|abort|hang|oom)@([^/]+)/([^/]+)/n(\d+)/r(\d+):rank=(\d+):step=(\d+)$"
)


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int

    def fire(self) -> None:
        if self.kind == "crash":
            os._exit(13)
        if self.kind == "abort":
            os.abort()
        if self.kind == "hang":
            while True:
                time.sleep(3600)
        import torch

        raise torch.OutOfMemoryError(
            "injected by PARABENCH_FAULT: CUDA out of memory. Tried to allocate 80.00 GiB"
        )


def for_cell(model: str, strategy: str, devices: int, repeat: int, rank: int) -> Fault | None:
    """The fault aimed at this cell and rank, if any."""
    raw = os.environ.get(ENV)
    if not raw:
        return None
    m = _FORMAT.match(raw)
    if not m:
        raise ValueError(f"{ENV}={raw!r} is not KIND@MODEL/STRATEGY/nN/rR:rank=R:step=S")
    kind, m_model, m_strategy, n, r, f_rank, step = m.groups()
    if (m_model, m_strategy, int(n), int(r), int(f_rank)) != (
        model,
        strategy,
        devices,
        repeat,
        rank,
    ):
        return None
    return Fault(kind, int(f_rank), int(step))
