"""One module per strategy; `get` finds a strategy's class from its catalog record.

Imports are lazy: torch.distributed.pipelining or FSDP alone take over a second to
import, which every short cell would otherwise pay.
"""

from __future__ import annotations

import importlib

import torch

from parabench.catalog import record
from parabench.models.base import Model
from parabench.process.runtime import Context
from parabench.spec import RunSpec
from parabench.strategies import checkpointing
from parabench.strategies.base import Strategy


def get(name: str) -> type[Strategy]:
    module, cls = record(name).impl.split(":")
    strategy = getattr(importlib.import_module(f"{__name__}.{module}"), cls)
    # A layout's records share one class; every other strategy has its own.
    assert strategy.name in (name, "layout"), f"{record(name).impl} is {strategy.name!r}"
    return strategy


def build(model: Model, spec: RunSpec, ctx: Context) -> Strategy:
    """The strategy for this cell, set up on `model`, its blocks checkpointed and
    compiled if the cell says so (a layout does both itself, in its order)."""
    cls = get(spec.strategy)
    if cls.applies_ac_and_compile:
        return cls(model, spec, ctx)
    # AC before the strategy wraps the blocks (FSDP's hooks and DDP's stay outside the
    # checkpointed forward, whose recompute then issues none of their collectives).
    checkpointing.apply(model.blocks(), spec.ac)
    strategy = cls(model, spec, ctx)
    if spec.compile:
        # Each block's forward, as torchtitan compiles per block. After the strategy
        # has wrapped the model, so no shape probe in a constructor compiles on the
        # wrong device; the forward only, so wrappers' hooks (FSDP's all-gather, DDP's)
        # stay outside the compiled region; in place, so parameter names do not change.
        for block in model.blocks() or [model.module]:
            block.forward = torch.compile(block.forward)
    return strategy


__all__ = ["Strategy", "build", "get"]
