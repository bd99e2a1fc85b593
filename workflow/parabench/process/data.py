"""Where batches come from.

Synthetic (default): the global batch of step s is drawn by the model's `batch` from a
generator seeded with (seed, s), on the device itself for presets (on the CPU, then
moved, for a custom model's), so every strategy sees the same samples and no input
pipeline sits inside the strategy's timing. A data-parallel rank keeps its contiguous
slice of that global batch, so the union over ranks is exactly `single`'s batch.

DataLoader: a real map-style Dataset read sample by sample through a DataLoader with a
DistributedSampler (set_epoch every epoch), workers and pin_memory. Its fetch time is
measured on purpose (see run/loop.py), and its samples differ from the synthetic ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from parabench.models.base import Model


@dataclass(frozen=True)
class Shard:
    """Which part of each global batch this process consumes."""

    index: int  # 0 <= index < count
    count: int  # 1 for strategies where every process sees the whole batch


class SyntheticBatches:
    """Deterministic global batches from (seed, step), sliced to this process's shard."""

    timed_fetch = False

    def __init__(
        self, model: Model, global_batch: int, seed: int, shard: Shard, device: torch.device
    ) -> None:
        self.model, self.global_batch, self.seed = model, global_batch, seed
        self.shard, self.device = shard, device
        self.gen = torch.Generator(device=device if model.device_batches else "cpu")

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        # One seed per step: independent of how many steps came before, so a cell can
        # be re-run or resumed and still see the same samples.
        self.gen.manual_seed(self.seed * 1_000_003 + step)
        x, y = self.model.batch(self.global_batch, self.gen)
        per = self.global_batch // self.shard.count
        lo = self.shard.index * per
        return x[lo : lo + per].to(self.device), y[lo : lo + per].to(self.device)


class SampleDataset(Dataset):
    """A materialised synthetic data set read one sample at a time, like a real one."""

    def __init__(self, model: Model, size: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x, self.y = model.batch(size, gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class LoaderBatches:
    """Batches through DataLoader + DistributedSampler; the fetch is part of the step."""

    timed_fetch = True

    def __init__(
        self,
        model: Model,
        global_batch: int,
        seed: int,
        shard: Shard,
        device: torch.device,
        workers: int,
        epoch_batches: int = 8,
    ) -> None:
        per = global_batch // shard.count
        self.device = device
        self.dataset = SampleDataset(model, global_batch * epoch_batches, seed)
        self.sampler = DistributedSampler(
            self.dataset, num_replicas=shard.count, rank=shard.index, shuffle=True, seed=seed
        )
        self.loader = DataLoader(
            self.dataset,
            batch_size=per,
            sampler=self.sampler,
            num_workers=workers,
            pin_memory=device.type == "cuda",
            drop_last=True,
            persistent_workers=workers > 0,
        )
        self.epoch = 0
        self._it: Iterator = self._next_epoch()

    def _next_epoch(self) -> Iterator:
        # Without set_epoch every epoch repeats the same order (a classic slip).
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            x, y = next(self._it)
        except StopIteration:
            self._it = self._next_epoch()
            x, y = next(self._it)
        nb = self.device.type == "cuda"
        return x.to(self.device, non_blocking=nb), y.to(self.device, non_blocking=nb)
