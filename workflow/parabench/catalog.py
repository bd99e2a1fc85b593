"""What exists: strategy names, how each is launched, and model architectures.

Torch-free on purpose: the Snakefile imports it at parse time to build the job graph,
and the schema's enums are checked against it by a test.
"""

from __future__ import annotations

STRATEGIES: tuple[str, ...] = ("single", "dp", "ddp", "model_parallel", "pipeline", "grad_accum")
ARCHS: tuple[str, ...] = ("mlp", "seqnet", "resmlp")
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")

# Strategies that run one process per device. grad_accum only needs ranks when there
# is more than one device: at n=1 it is plain accumulation in one process.
_TORCHRUN_ALWAYS = frozenset({"ddp", "pipeline"})


def uses_torchrun(strategy: str, devices: int) -> bool:
    """True when the cell is launched as `devices` ranks by torchrun."""
    if strategy in _TORCHRUN_ALWAYS:
        return True
    return strategy == "grad_accum" and devices > 1


def device_counts(strategy: str, devices: list[int]) -> list[int]:
    """The device counts a strategy is swept over: `single` is one device by definition."""
    return [1] if strategy == "single" else sorted(set(devices))
