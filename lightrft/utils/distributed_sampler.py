"""A resumable distributed sampler: each rank reads a disjoint slice of one shuffled order, and a run
restarted mid-epoch skips exactly the samples it had already consumed.
"""

import math
from typing import Iterator, Sized

import torch
from torch.utils.data import Sampler

from lightrft.utils.distributed import get_rank, get_world_size


class DistributedSampler(Sampler[int]):
    """Splits a dataset over `num_replicas` ranks, resumable within an epoch.

    Order: with `shuffle`, the epoch's order is `torch.randperm(len(dataset))` drawn from a generator
    seeded with `seed + epoch`, so every rank computes the same order and it changes per epoch.
    Without `drop_last` the order is padded by repeating its head until it divides by
    `num_replicas`; with it, the tail that does not divide is dropped.

    Split: global position k of the order goes to rank `k % num_replicas`, so rank r reads positions
    r, r + R, r + 2R, ... (R = num_replicas): the slices are disjoint and together cover the order.

    Resume: `consumed_samples` counts samples consumed in this epoch over all ranks (what the trainer
    records). Each rank has consumed `consumed_samples // R` of its own positions, so it skips that
    many; together the ranks then read exactly global positions `consumed_samples, ...` of the order.
    `consumed_samples` must be a multiple of `num_replicas` (every rank takes equal steps).
    """

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, consumed_samples: int = 0):
        num_replicas = get_world_size() if num_replicas is None else num_replicas
        rank = get_rank() if rank is None else rank
        if num_replicas < 1:
            raise ValueError(f"DistributedSampler: num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"DistributedSampler: rank {rank} is outside [0, {num_replicas - 1}] "
                             f"for num_replicas={num_replicas}")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        size = len(dataset)
        if drop_last:
            self.num_samples = size // num_replicas
        else:
            self.num_samples = math.ceil(size / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.epoch = 0
        self.consumed_indices = self._consumed_per_rank(consumed_samples)

    def _consumed_per_rank(self, consumed_samples: int) -> int:
        if consumed_samples < 0 or consumed_samples % self.num_replicas:
            raise ValueError(
                f"DistributedSampler: consumed_samples={consumed_samples} must be a non-negative multiple "
                f"of the number of ranks ({self.num_replicas}); it counts samples over all ranks")
        if consumed_samples > self.total_size:
            raise ValueError(
                f"DistributedSampler: consumed_samples={consumed_samples} exceeds the {self.total_size} samples "
                f"of one epoch; pass the samples consumed within the current epoch")
        return consumed_samples // self.num_replicas

    def set_epoch(self, epoch: int, consumed_samples: int = 0) -> None:
        """Selects the epoch's shuffle and skips the `consumed_samples` (over all ranks) already read."""
        self.epoch = epoch
        self.consumed_indices = self._consumed_per_rank(consumed_samples)

    def epoch_order(self) -> list[int]:
        """The whole epoch's order over all ranks (padded or truncated to `total_size`)."""
        size = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(size, generator=generator).tolist()
        else:
            order = list(range(size))
        if self.total_size > size:
            # Pad by cycling through the order; repeats only when the dataset is tiny.
            order += (order * math.ceil((self.total_size - size) / max(size, 1)))[: self.total_size - size]
        return order[: self.total_size]

    def __iter__(self) -> Iterator[int]:
        mine = self.epoch_order()[self.rank: self.total_size: self.num_replicas]
        return iter(mine[self.consumed_indices:])

    def __len__(self) -> int:
        return self.num_samples - self.consumed_indices
