"""`python -m parabench.torchrun <torchrun's arguments> -m parabench <command> ...`:
torchrun itself (its argument parser, elastic agent, rendezvous, environment, failure
report) with one difference: the ranks are forked from the agent once it has imported
what they run, instead of each starting a new Python that imports torch again.

Why: a rank's imports (torch; torch._dynamo, which every optimizer's constructor pulls
in; DTensor for FSDP and tensor parallel) cost 4 to 6 s of CPU on the 2-core machines
the default run is sized for, and four ranks paid them on two cores before their first
step. DDP at 4 ranks of the default mlp: 16.3 s with `torch.distributed.run`, 8.9 s
forked, the same timed steps (median 45 vs 43 ms).

Forking is safe because the agent runs no torch op and touches no GPU before it forks:
OpenMP's thread pool and the CUDA context are started by each rank, never inherited
(checked below), and each rank sets its own threads and core binding (runtime.start).
Any entrypoint other than `-m parabench ...` is started as torchrun starts it.
"""

from __future__ import annotations

import sys
import time
import uuid

import torch
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import elastic_launch

from parabench import cli

# How long a rank that failed with a Python exception (its error file written) waits
# before exiting. A peer's death without one (a signal, os._exit) is then what the
# agent sees first, which its report names; forked ranks exit at once, and the agent
# names the lowest rank among those it finds dead in one poll (every 0.1 s).
FAILED_RANK_LINGER_S = 2.0


def _rank(*argv: str) -> None:
    """A forked rank: what `python -m parabench <argv>` would run."""
    try:
        code = cli.main(list(argv))
    except Exception:
        time.sleep(FAILED_RANK_LINGER_S)
        raise
    if code:
        time.sleep(FAILED_RANK_LINGER_S)
        raise SystemExit(code)


@record
def main(argv: list[str] | None = None) -> None:
    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    if not (args.module and args.training_script == "parabench"):
        torchrun.run(args)
        return
    if args.standalone:  # as torchrun.run does: a private rendezvous on this host
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:  # torchrun's default, for the static rendezvous
        args.master_port = 29500
    config, _, _ = torchrun.config_from_args(args)
    command = list(args.training_script_args)
    cli.preload(command)
    if torch.cuda.is_initialized():  # a forked child cannot use its parent's context
        raise RuntimeError(f"preloading {command[:1]} initialised CUDA in the agent")
    config.start_method = "fork"
    elastic_launch(config=config, entrypoint=_rank)(*command)
    cli.exit_now(0)


if __name__ == "__main__":
    main()
