"""Model presets, each an nn.Sequential of blocks so stages can be cut between blocks.

Every model also defines its loss and the shape of its synthetic data, so the rest of
the package treats all of them alike.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from parabench.spec import ModelSpec


@dataclass
class Model:
    blocks: nn.Sequential
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    in_features: int
    # "binary": float targets in {0, 1} of shape (B, 1); "classes": int64 labels.
    target: str
    classes: int


class Residual(nn.Module):
    """Pre-norm residual MLP block: x + W2·gelu(W1·LN(x)). Uniform cost per block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def _linear_stack(dims: list[int], last: nn.Module | None) -> nn.Sequential:
    blocks: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(dims)):
        is_last = i == len(dims) - 2
        act = last if is_last else nn.ReLU()
        blocks.append(nn.Sequential(nn.Linear(a, b), act) if act is not None else nn.Linear(a, b))
    return nn.Sequential(*blocks)


def build(spec: ModelSpec, seed: int) -> Model:
    """Build the model on CPU with weights drawn from `seed`, so every rank and every
    strategy starts from identical parameters."""
    torch.manual_seed(seed)
    if spec.arch == "mlp":
        dims = list(spec.size("dims"))
        return Model(_linear_stack(dims, nn.Sigmoid()), nn.BCELoss(), dims[0], "binary", 1)
    if spec.arch == "seqnet":
        dims = list(spec.size("dims"))
        return Model(_linear_stack(dims, None), nn.CrossEntropyLoss(), dims[0], "classes", dims[-1])
    if spec.arch == "resmlp":
        d_in, width = spec.size("d_in"), spec.size("width")
        classes, depth = spec.size("classes"), spec.size("depth")
        blocks = nn.Sequential(
            nn.Sequential(nn.Linear(d_in, width), nn.GELU()),
            *(Residual(width) for _ in range(depth)),
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, classes)),
        )
        return Model(blocks, nn.CrossEntropyLoss(), d_in, "classes", classes)
    raise ValueError(f"unknown model arch {spec.arch!r}")
