import itertools

import pytest
import torch
from torch import nn

from conftest import HF_INSTALLED, LLAMA
from parabench.models import build
from parabench.models.base import Model
from parabench.models.presets import features_batch
from parabench.process.flops import block_flops, step_flops
from parabench.spec import ModelSpec


def two_layer() -> Model:
    blocks = nn.Sequential(nn.Sequential(nn.Linear(10, 5), nn.ReLU()), nn.Linear(5, 3))
    return Model(blocks, nn.CrossEntropyLoss(), features_batch(10, 3))


def test_known_model_counts_exactly():
    # B=4. Forward: 2*4*10*5 + 2*4*5*3 = 400 + 120. Backward: layer 2 needs weight and
    # input gradients (120 + 120); layer 1 only its weight gradient (400): its input is
    # data, which needs no gradient.
    assert step_flops(two_layer(), batch=4) == 400 + 120 + 120 + 120 + 400


def test_flops_scale_linearly_with_batch():
    m = two_layer()
    assert step_flops(m, 64) == 16 * step_flops(m, 4)


def test_seed_mlp_is_below_six_params_per_sample():
    # 6 * weights * B overcounts: the first layer (400k of ~605k weights) has no input
    # gradient, so the exact count is 6*W*B - 2*W1*B.
    model = build(ModelSpec.of("mlp"), seed=0)
    dims = [1000, 400, 300, 200, 100, 50, 1]
    weights = sum(a * b for a, b in itertools.pairwise(dims))
    batch = 2048
    assert step_flops(model, batch) == 6 * weights * batch - 2 * dims[0] * dims[1] * batch


def test_block_costs_sum_to_the_whole_step():
    model = build(ModelSpec.of("resmlp", d_in=16, width=16, depth=3, classes=4), seed=0)
    assert sum(block_flops(model, batch=8)) == step_flops(model, 8)


class Scale(nn.Module):
    """x times a weight per feature: elementwise, which FlopCounterMode counts as free,
    or (counted) the same maths as a matrix product, as Model.for_counting gives a
    model's attention in counted ops."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(width))
        self.counted = False

    def forward(self, x):
        return x @ torch.diag(self.w) if self.counted else x * self.w


def counted_maths(module: nn.Module) -> nn.Module:
    module[1].counted = True
    return module


def test_the_counting_copy_is_counted_on_the_meta_device_too():
    """A model whose forward reads no values is counted on the meta device: as the
    model's for_counting gives it there too, not in ops the counter calls free."""
    blocks = nn.Sequential(nn.Linear(10, 5), Scale(5))
    model = Model(blocks, nn.CrossEntropyLoss(), features_batch(10, 5), for_counting=counted_maths)
    # B=4. The Linear: 400 forward, 400 for its weight's gradient (its input is data).
    # The product: 2*4*5*5 = 200 forward, 200 for each of its inputs' gradients.
    assert step_flops(model, 4) == 400 + 400 + 200 + 200 + 200
    assert not blocks[1].counted  # the model itself runs as written


@pytest.mark.skipif(not HF_INSTALLED, reason="needs transformers")
def test_a_transformers_models_count_includes_its_attention():
    """Attention's two products grow with the square of the sequence, the rest of the
    model linearly: doubling it adds exactly attention's share, 12 * batch * layers *
    width * seq^2 per step (forward QK^T and AV, 2 * 2 * B * S^2 * d per layer, and
    twice that backward), whichever way the copy is counted."""
    batch, d, layers = 2, LLAMA["config"]["hidden_size"], LLAMA["config"]["num_hidden_layers"]
    sizes = {k: v for k, v in LLAMA.items() if k != "batch_size"}

    def flops(seq: int) -> int:
        return step_flops(build(ModelSpec.of(**{**sizes, "seq_len": seq}), 0), batch)

    s = 16
    assert flops(2 * s) - 2 * flops(s) == 12 * batch * layers * d * ((2 * s) ** 2 - 2 * s**2)
