import itertools

from torch import nn

from parabench.flops import block_flops, step_flops
from parabench.models import build
from parabench.models.base import Model
from parabench.models.presets import features_batch
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
