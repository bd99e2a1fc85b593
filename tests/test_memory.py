"""What each rank holds between steps (parameters, gradients, optimizer state), counted
from the tensors by real torchrun ranks, against the analytic bytes of each strategy.
AdamW, so there is optimizer state to shard (two fp32 moments per parameter)."""

import math

import pytest

from conftest import tiny_spec
from parabench.models import build
from parabench.spec import ModelSpec

pytestmark = pytest.mark.slow

MODEL = ModelSpec.of("resmlp", d_in=32, width=64, depth=2, classes=10)
F32 = 4


def params_of(model: ModelSpec) -> dict:
    return dict(build(model, 0).module.named_parameters())


def total_bytes(model: ModelSpec) -> int:
    return sum(p.numel() * F32 for p in params_of(model).values())


def run(cells, strategy: str, devices: int) -> list[dict]:
    # the equivalence tests' AdamW cells (at n=2): one launch for both (see `cells`)
    spec = tiny_spec(strategy, devices, model=MODEL, optimizer="adamw", lr=0.01)
    meta, proc, _ = cells(spec)
    assert meta["status"] == "ok", f"{meta['reason']}\n{proc.stderr[-2000:]}"
    held = meta["held_bytes_per_rank"]
    assert len(held) == (devices if devices > 1 else 1)
    assert all(m > 0 for m in meta["peak_memory_per_rank"])
    return held


def adam_state(param_bytes: int, tensors: int) -> int:
    """AdamW: exp_avg and exp_avg_sq like the parameter, plus a scalar step each."""
    return 2 * param_bytes + tensors * F32


def test_ddp_replicates_everything(cells):
    total, count = total_bytes(MODEL), len(params_of(MODEL))
    for rank in run(cells, "ddp", 2):
        assert rank == {"params": total, "grads": total, "optimizer": adam_state(total, count)}


@pytest.mark.parametrize("devices", [2, 4])
def test_fsdp_keeps_one_nth_of_everything(cells, devices):
    # Each parameter is split on dim 0 into n chunks of ceil(rows / n) rows (the last
    # ones shorter, as torch.chunk): a rank holds at most that padded 1/n of every
    # parameter, gradient and optimizer state, and the ranks together hold the model once.
    params = params_of(MODEL)
    padded = sum(
        math.ceil(p.shape[0] / devices) * (p.numel() // p.shape[0]) * F32 for p in params.values()
    )
    total = total_bytes(MODEL)
    held = run(cells, "fsdp", devices)
    for rank in held:
        assert rank["params"] <= padded
        assert rank["grads"] == rank["params"]
        assert rank["optimizer"] == adam_state(rank["params"], len(params))
    assert sum(rank["params"] for rank in held) == total
    assert padded <= 1.01 * total / devices  # so the fullest rank holds 1/n, +1% at most


@pytest.mark.parametrize("devices", [2, 4])
def test_zero1_shards_only_the_optimizer_state(cells, devices):
    # torch's ZeroRedundancyOptimizer assigns whole parameters, largest first, each to
    # the rank with the fewest elements so far (ties: the lowest rank).
    params = sorted(params_of(MODEL).values(), key=lambda p: p.numel(), reverse=True)
    sizes, counts = [0] * devices, [0] * devices
    for p in params:
        r = sizes.index(min(sizes))
        sizes[r] += p.numel()
        counts[r] += 1
    total = total_bytes(MODEL)
    held = run(cells, "zero1", devices)
    for r, rank in enumerate(held):
        assert rank["params"] == rank["grads"] == total
        assert rank["optimizer"] == adam_state(sizes[r] * F32, counts[r])
    assert sum(r["optimizer"] for r in held) == adam_state(total, len(params))


def test_tensor_parallel_splits_the_planned_layers(cells):
    # fc1 (column-wise): weight and bias split by output rows; fc2 (row-wise): weight
    # split by input columns, bias replicated. Everything else replicated.
    n = 2
    model = build(MODEL, 0)
    split = 0
    for fqn in model.tp_plan:
        layer = model.module.get_submodule(fqn)
        split += layer.weight.numel() * F32
        if model.tp_plan[fqn] == "colwise":
            split += layer.bias.numel() * F32
    total = total_bytes(MODEL)
    expected = total - split + split // n
    for rank in run(cells, "tp", n):
        assert rank["params"] == rank["grads"] == expected
