import itertools

import pytest

from parabench.models import build
from parabench.models.partition import balanced_cuts
from parabench.process.flops import block_flops
from parabench.spec import ModelSpec


def bottleneck(costs, cuts):
    return max(sum(costs[lo:hi]) for lo, hi in cuts)


def test_cuts_are_contiguous_cover_everything_and_nonempty():
    costs = [5, 1, 1, 1, 1, 9, 2]
    for stages in range(1, len(costs) + 1):
        cuts = balanced_cuts(costs, stages)
        assert len(cuts) == stages
        assert cuts[0][0] == 0 and cuts[-1][1] == len(costs)
        assert all(lo < hi for lo, hi in cuts)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(cuts))


def test_cut_minimises_the_slowest_stage_exhaustively():
    import itertools

    costs = [7, 2, 3, 8, 1, 1, 4, 6]
    for stages in (2, 3, 4):
        best = min(
            bottleneck(costs, list(zip((0, *b), (*b, len(costs)), strict=False)))
            for b in itertools.combinations(range(1, len(costs)), stages - 1)
        )
        assert bottleneck(costs, balanced_cuts(costs, stages)) == best


def test_uniform_blocks_split_evenly():
    assert balanced_cuts([1] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_seed_mlp_is_cut_by_cost_not_by_layer_count():
    # The first layer holds ~66 % of the parameters: it must get a stage of its own,
    # where an equal-layer cut would give the first stage layers 1-3 (~90 % of FLOPs).
    model = build(ModelSpec.of("mlp"), seed=0)
    costs = block_flops(model)
    cuts = balanced_cuts(costs, 2)
    assert cuts == [(0, 1), (1, 6)]
    equal_layers = [(0, 3), (3, 6)]
    assert bottleneck(costs, cuts) < bottleneck(costs, equal_layers)


def test_more_stages_than_blocks_is_refused():
    with pytest.raises(ValueError, match="cannot cut 3 blocks into 4"):
        balanced_cuts([1, 2, 3], 4)
