"""A custom model for the tests that counts its builds: each call of the factory appends
a line to the file named by PARABENCH_TEST_BUILDS (process id, torch's seed, what it
builds on: cpu, meta, or fake for fake tensors, which allocate nothing), and its loss
reads the module itself, as a model with an auxiliary loss does."""

from __future__ import annotations

import os

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor


def build(width: int = 16, depth: int = 3) -> dict:
    if path := os.environ.get("PARABENCH_TEST_BUILDS"):
        probe = torch.empty(0)
        kind = "fake" if isinstance(probe, FakeTensor) else probe.device.type
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {torch.initial_seed()} {kind}\n")
    blocks = nn.Sequential(
        *(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
    )
    head = blocks[-1][0]
    ce = nn.MSELoss()

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # 0 x a weight of this very module: its gradient shows which module the loss used
        return ce(out, target) + 0.0 * head.weight.sum()

    def batch(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, width, generator=generator), torch.randn(
            n, width, generator=generator
        )

    return {"blocks": blocks, "loss": loss, "batch": batch}
