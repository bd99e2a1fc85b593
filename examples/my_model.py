"""A custom model for parabench: copy this file into the directory you run parabench
or snakemake from (the working directory, which is not necessarily where the config
file is), change the model, and point the config at its factory.

    models:
      mine:
        arch: custom
        factory: "my_model:build"          # module:function: this file, in the working
        args: {width: 256, depth: 4}       # directory or the entry's `path`; args -> kwargs
        batch_size: 256

The factory is plain PyTorch and returns a dict:
- blocks: an nn.Sequential; parabench cuts pipeline stages between its blocks, so make
  them units of similar cost, each taking the previous one's output;
- loss(output, target): a scalar, the mean over the batch;
- batch(batch_size, generator): (inputs, targets) with the batch dimension first, every
  value drawn from `generator` (parabench seeds it per step, so every strategy sees the
  same samples; it moves the batch to the device and slices it per rank);
- tp_plan (optional): which Linear layers tensor parallelism splits, as pairs: a
  "colwise" layer, elementwise work, then its "rowwise" partner.

`batchnorm=True` adds BatchNorm1d to the hidden blocks: under data parallelism each rank
then normalises over its B/n samples rather than all B, so the maths really changes,
and parabench's report says so and why.
"""

from __future__ import annotations

import torch
from torch import nn


def build(
    in_features: int = 64,
    width: int = 128,
    depth: int = 4,
    classes: int = 10,
    batchnorm: bool = False,
) -> dict:
    def hidden() -> nn.Sequential:
        layers: list[nn.Module] = [nn.Linear(width, width)]
        if batchnorm:
            layers.append(nn.BatchNorm1d(width))
        layers.append(nn.GELU())
        return nn.Sequential(*layers)

    blocks = nn.Sequential(
        nn.Sequential(nn.Linear(in_features, width), nn.GELU()),
        *(hidden() for _ in range(depth)),
        nn.Linear(width, classes),
    )

    def batch(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, in_features, generator=generator)
        y = torch.randint(0, classes, (n,), generator=generator)
        return x, y

    model = {"blocks": blocks, "loss": nn.CrossEntropyLoss(), "batch": batch}
    if not batchnorm:  # BatchNorm over a column-split activation would see 1/n of it
        plan = {}
        for i in range(1, depth, 2):  # hidden blocks (i, i+1): split i by columns, i+1 by rows
            plan[f"{i}.0"], plan[f"{i + 1}.0"] = "colwise", "rowwise"
        model["tp_plan"] = plan
    return model


class Block(nn.Module):
    """A residual MLP block, its residual inside as in a transformer's layers."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(h)


class ResidualNet(nn.Module):
    """A model as people write it: a forward of its own over a ModuleList of blocks."""

    def __init__(self, in_features: int, width: int, depth: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Linear(in_features, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def build_module(
    in_features: int = 64, width: int = 128, depth: int = 4, classes: int = 10
) -> dict:
    """The same contract with `module=` in place of `blocks=`: any nn.Module, unchanged.
    parabench finds its repeated blocks (here `layers`, the largest ModuleList of one
    class; the config key `blocks` can name them) and shards each as one FSDP unit;
    pipeline and model parallel cut stages between them, the embedding on the first
    stage and the head on the last."""
    module = ResidualNet(in_features, width, depth, classes)

    def batch(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, in_features, generator=generator)
        y = torch.randint(0, classes, (n,), generator=generator)
        return x, y

    plan = {}
    for i in range(depth):  # each block's MLP: up-projection by columns, down by rows
        plan[f"layers.{i}.mlp.1"], plan[f"layers.{i}.mlp.3"] = "colwise", "rowwise"
    return {"module": module, "loss": nn.CrossEntropyLoss(), "batch": batch, "tp_plan": plan}
