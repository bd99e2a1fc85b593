"""Did a strategy do the same maths as `single`? Parameters compared after the run.

Two measures of the difference between parameter sets a and b:
- max |a - b| over every element: strict, and the right test for fp32 + SGD, where
  rounding alone leaves about 1e-7;
- ‖a - b‖₂ / ‖b - b₀‖₂, relative to how far training moved the reference from its
  initial weights b₀. This is the verdict's measure: under AdamW every parameter moves
  by about lr per step whatever its gradient, so a gradient that rounding flips in sign
  moves one weight by 2·lr, and the largest element says little; halving the learning
  rate, by contrast, shows as ~0.5.

The tolerance is measured, not assumed: `single` trains a second time on the same
batches with the samples of each batch in reverse order. That is the same maths with
every sum over the batch taken in another order, so its distance from `single` is what
rounding alone does to this model, optimizer and precision over these steps. A cell is
"same maths" while it stays within TOLERANCE_FACTOR times that distance (and never
stricter than FLOOR).

A strategy that rounds gradients before averaging them (a compression hook: its
record's `gradient_bits`) does other maths on purpose, by a bounded amount: each rank's
gradient is rounded once to `bits` significant bits and the n of them are summed in that
precision, so each element of the averaged gradient is off by at most (n + 1) units of
roundoff, u = 2^-bits, to first order. SGD's and AdamW's parameters move by sums of
those gradients, so their relative distance from single's stays within that bound
while training does not amplify it; ROUNDING_ROOM allows for that. Its tolerance is
the larger of the two.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from parabench.catalog import record

if TYPE_CHECKING:  # the report reads the tolerances without importing torch
    import torch

# Measured here on a small resmlp, 6 steps, n=2 and 4, fp32/bf16 x SGD/AdamW, against
# the reversed-order distance: DDP, ZeRO-1, FSDP2, pipeline and grad_accum landed at
# 1.2-4.8x it; tensor parallel in bf16 with AdamW at 9.2x (its row-parallel partial
# sums are rounded to bf16 before the all-reduce: one rounding more than one GEMM);
# half the learning rate at 148x or more. 25 sits between, with room on both sides.
TOLERANCE_FACTOR = 25.0
FLOOR = 1e-6
# Room over the first-order bound on rounded gradients, for the error that training
# feeds back into later gradients (see rounding_bound).
ROUNDING_ROOM = 2.0


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)


def l2_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(((a[k].double() - b[k].double()) ** 2).sum().item() for k in b))


def rounding_bound(bits: int, devices: int) -> float:
    """First-order relative error of a gradient rounded to `bits` significant bits on
    each of `devices` ranks and summed in that precision: (n + 1) x 2^-bits."""
    return (devices + 1) * 2.0**-bits


def tolerance(reorder_rel_diff: float, strategy: str, devices: int) -> float:
    """The relative parameter distance from single that still counts as the same maths
    (the module's docstring says how each part is derived)."""
    measured = max(FLOOR, TOLERANCE_FACTOR * reorder_rel_diff)
    bits = record(strategy).gradient_bits
    if bits is None:
        return measured
    return max(measured, ROUNDING_ROOM * rounding_bound(bits, devices))
