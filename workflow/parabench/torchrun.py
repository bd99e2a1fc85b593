"""`python -m parabench.torchrun <torchrun's arguments> -m parabench <command> ...`:
torchrun itself (its argument parser, elastic agent, rendezvous, environment, failure
report) with one difference: the ranks are forked from the agent once it has imported
what they run, instead of each starting a new Python that imports torch again.

Why: a rank's imports (torch; torch._dynamo, which every optimizer's constructor pulls
in; DTensor for FSDP and tensor parallel) cost 4 to 6 s of CPU on the 2-core machines
the default run is sized for, and four ranks paid them on two cores before their first
step. DDP at 4 ranks of the default mlp (benchmarks/launch_overhead.py): 16.5 s with
`torch.distributed.run`, 8.2 s forked, the same timed steps (median 43.6 vs 42.9 ms).

Forking is safe because the agent runs no torch op before it forks and never starts
CUDA: device counts go through NVML (PYTORCH_NVML_BASED_CUDA_CHECK), a device-type
`--nproc-per-node` (gpu, auto) is left to plain torchrun, and a preload that initialised
CUDA is refused. Where NVML cannot count the visible devices (MIG UUIDs in
CUDA_VISIBLE_DEVICES, no libnvidia-ml), torch counts them with the CUDA runtime, which
leaves every forked child unable to start CUDA ("Cannot re-initialize CUDA in forked
subprocess"); if that count found devices, the ranks are started as torchrun starts
them, new Pythons (a slower start, said in one line). OpenMP's thread pool and the CUDA
context are started by each rank, never inherited, and each rank sets its own threads
and core binding (runtime.start).
Each rank restores the signal handlers a new Python has (the agent's raise
SignalException), so a killed rank dies as torchrun's own ranks do.
Everything else is torchrun's own code: its rendezvous rules (--standalone, a one-node
static rendezvous becoming c10d), environment and failure report. The differences: the
start method is fork whatever --start-method says, and PYTHON_EXEC is not used.
Any entrypoint other than `-m parabench ...` is started as torchrun starts it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Callable

import torch
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import record

from parabench import cli

# How long a rank that failed with a Python exception (its error file written) waits
# before exiting. A peer's death without one (a signal, os._exit) is then what the
# agent sees first, which its report names; forked ranks exit at once, and the agent
# names the lowest rank among those it finds dead in one poll (every 0.1 s).
FAILED_RANK_LINGER_S = 2.0

# Every handler as a new Python has it, read at import, before the agent installs its
# own (TORCHELASTIC_SIGNALS_TO_HANDLE: SIGTERM, SIGINT, SIGHUP, SIGQUIT by default, any
# signal by --signals-to-handle).
_FRESH_HANDLERS = {
    sig: handler
    for sig in signal.valid_signals()
    if (handler := signal.getsignal(sig)) is not None
    and sig not in (signal.SIGKILL, signal.SIGSTOP)
}


def restore_fresh_handlers() -> None:
    """Every signal handler as a new Python has it, in a process forked from one that
    changed some (torchrun's agent; the run's warm process, parabench.forkserver)."""
    for sig, handler in _FRESH_HANDLERS.items():
        if signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


def _rank(*argv: str) -> None:
    """A forked rank: what `python -m parabench <argv>` would run."""
    restore_fresh_handlers()
    # As a rank's output reaches the log line by line when the agent spawns it (the
    # guard reads it through a pipe and names the last lines of a failure).
    sys.stdout.reconfigure(line_buffering=True)
    try:
        code = cli.main(list(argv))
    except Exception:
        # The multiprocessing wrapper only pickles the traceback for the agent, which
        # prints the first failure's: every rank's goes into the log here.
        traceback.print_exc()
        sys.stderr.flush()
        time.sleep(FAILED_RANK_LINGER_S)
        raise
    if code:
        time.sleep(FAILED_RANK_LINGER_S)
        raise SystemExit(code)


def _cuda_counted_by_runtime() -> int:
    """The CUDA devices torch counted in this process with the CUDA runtime
    (torch._C._cuda_getDeviceCount), or 0 where NVML counted them or torch has no CUDA.
    That call poisons fork: a forked child then refuses to start CUDA, while
    is_initialized() stays False. With no device a child never starts CUDA, so a count
    of 0 leaves forking safe (a CUDA build of torch on a host without GPUs)."""
    if not torch.cuda._is_compiled():
        return 0
    # What torch.cuda.device_count() asks before the runtime (private helpers: if they
    # move, take it that the runtime counted). Without PYTORCH_NVML_BASED_CUDA_CHECK=1,
    # is_available() asks the runtime whatever NVML could say.
    nvml_check = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1"
    name = "_device_count_amdsmi" if torch.version.hip else "_device_count_nvml"
    count = getattr(torch.cuda, name, None)
    if nvml_check and count is not None and count() >= 0:
        return 0
    # torchrun's LaunchConfig has asked already (is_available, device_count): asking
    # again poisons nothing that was not.
    return torch.cuda.device_count()


def _forking(config_from_args: Callable) -> Callable:
    """torchrun's config_from_args, returning this module's forked rank as the
    entrypoint once the agent has preloaded what the ranks import; torchrun's own
    entrypoint where a forked rank could not start CUDA."""

    def forked(args):
        config, python, python_args = config_from_args(args)  # python -u -m parabench ...
        if devices := _cuda_counted_by_runtime():
            print(
                "parabench.torchrun: NVML cannot count the CUDA devices (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); the CUDA runtime counted "
                f"{devices}, after which a forked rank cannot start CUDA: each rank starts "
                "as a new Python (a slower start)",
                file=sys.stderr,
                flush=True,
            )
            return config, python, python_args
        command = list(args.training_script_args)
        cli.preload(command)
        if torch.cuda.is_initialized():  # a forked child cannot use its parent's context
            raise RuntimeError(f"preloading {command[:1]} initialised CUDA in the agent")
        config.start_method = "fork"
        return config, _rank, command

    return forked


@record
def main(argv: list[str] | None = None) -> None:
    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    if args.module and args.training_script == "parabench" and args.nproc_per_node.isdigit():
        # Before anything asks whether CUDA is there: NVML answers without starting
        # CUDA in the agent, which its forked ranks could then not use.
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        # torchrun.run applies torchrun's rules to the arguments, then calls this.
        torchrun.config_from_args = _forking(torchrun.config_from_args)
    torchrun.run(args)
    cli.exit_now(0)


if __name__ == "__main__":
    main()
