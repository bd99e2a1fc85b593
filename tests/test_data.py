"""Where batches come from: synthetic shards tile the global batch; loader epochs differ."""

import torch

from parabench.models import build
from parabench.process.data import LoaderBatches, Shard, SyntheticBatches
from parabench.spec import ModelSpec


def test_rank_shards_are_exactly_the_global_batch():
    model = build(ModelSpec.of("mlp", dims=[4, 2, 1]), 0)
    cpu = torch.device("cpu")
    whole = SyntheticBatches(model, 8, 3, Shard(0, 1), cpu).batch(5)
    parts = [SyntheticBatches(model, 8, 3, Shard(r, 4), cpu).batch(5) for r in range(4)]
    assert torch.equal(torch.cat([x for x, _ in parts]), whole[0])
    assert torch.equal(torch.cat([y for _, y in parts]), whole[1])
    # Each step's batch depends on (seed, step) only, not on what came before.
    assert torch.equal(SyntheticBatches(model, 8, 3, Shard(0, 1), cpu).batch(5)[0], whole[0])


def test_loader_epochs_reshuffle():
    # set_epoch every epoch: the second epoch is not the first one again.
    model = build(ModelSpec.of("mlp", dims=[4, 2, 1]), 0)
    batches = LoaderBatches(
        model, 8, 0, Shard(0, 1), torch.device("cpu"), workers=0, epoch_batches=2
    )
    epoch0 = [batches.batch(i)[0] for i in range(2)]
    epoch1 = [batches.batch(i)[0] for i in range(2, 4)]
    assert batches.epoch == 2
    assert not all(torch.equal(a, b) for a, b in zip(epoch0, epoch1, strict=True))
    assert torch.equal(torch.cat(epoch0).sort(0).values, torch.cat(epoch1).sort(0).values)
