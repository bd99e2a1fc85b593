"""One module per strategy; `get` maps the config's names to them.

Imports are lazy: torch.distributed.pipelining alone takes over a second to import,
which every short cell would otherwise pay.
"""

from __future__ import annotations

import importlib

from parabench.catalog import STRATEGIES
from parabench.strategies.base import Strategy

_WHERE = {
    "single": "single:Single",
    "dp": "dp:DataParallel",
    "ddp": "ddp:DistributedDataParallel",
    "model_parallel": "model_parallel:ModelParallel",
    "pipeline": "pipeline:Pipeline",
    "grad_accum": "grad_accum:GradAccum",
}
assert tuple(_WHERE) == STRATEGIES, "catalog.STRATEGIES and the strategy modules must agree"


def get(name: str) -> type[Strategy]:
    module, cls = _WHERE[name].split(":")
    strategy = getattr(importlib.import_module(f"{__name__}.{module}"), cls)
    assert strategy.name == name
    return strategy


__all__ = ["Strategy", "get"]
