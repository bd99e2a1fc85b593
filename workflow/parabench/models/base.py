"""The contract every model keeps, presets and custom ones alike, and what is read off it.

A model is an nn.Sequential of blocks plus a loss and a batch generator:
- blocks: block i+1 takes block i's output; stages are cut between blocks
- loss(output, target) -> scalar mean over the batch
- batch(batch_size, generator) -> (inputs, targets), deterministic given the generator,
  batch dimension first; parabench moves it to the device and slices it per rank
- tp_plan (optional): module name (relative to blocks) -> "colwise" | "rowwise" (or a
  torch ParallelStyle), each column-wise layer followed by its row-wise partner
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Model:
    blocks: nn.Sequential
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # batch(n, generator) -> (inputs, targets). Presets draw on the generator's device;
    # a custom model's batch is drawn on the CPU (device_batches False) and moved.
    batch: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    # Tensor parallelism: module names (relative to `blocks`) -> "colwise" | "rowwise".
    tp_plan: dict = field(default_factory=dict)
    device_batches: bool = True
    tokens_per_sample: int = 0  # language models: tokens in one sample (throughput)


def example_batch(model: Model, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A CPU batch of n samples, for shapes and checks."""
    gen = torch.Generator().manual_seed(seed)
    return model.batch(n, gen)


def maths_notes(model: Model) -> list[str]:
    """Layers whose result depends on how the batch is split or on random draws: under
    data parallelism or micro-batching their maths really changes, so a strategy that
    splits the batch differs from `single` for a reason, named here."""
    notes = []
    for name, m in model.blocks.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            notes.append(
                f"{type(m).__name__} at blocks.{name} normalises over the samples one "
                "rank or micro-batch sees (B/n or B/m), not the whole batch B "
                "(SyncBatchNorm would restore it across ranks)"
            )
        elif isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            notes.append(
                f"{type(m).__name__}(p={m.p}) at blocks.{name} draws random masks, "
                "which no two strategies draw alike"
            )
    return notes
