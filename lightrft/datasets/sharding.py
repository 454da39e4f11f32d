"""Evaluation batches split over ranks without double counting.

A distributed sampler pads the last round by repeating samples so every rank runs the same number
of forwards (ZeRO-3 needs that: parameters are gathered collectively). For training that is
harmless; for an evaluation mean it counts some samples twice. Here every rank gets the same number
of batches too, but each item carries a weight: 1 for a real item, 0 for a filler, so sums over
all ranks count each item exactly once.
"""

from typing import Any, Callable, Iterator, Sequence

import torch


def eval_shard_batches(dataset: Sequence, collate_fn: Callable[[list], Any], batch_size: int, rank: int,
                       world_size: int) -> Iterator[tuple[Any, torch.Tensor]]:
    """Yields (collated batch, keep) for rank `rank` of `world_size`, in dataset order.

    Rank r takes items r, r + W, r + 2W, ... of the dataset padded to a multiple of W * batch_size
    with item 0 as filler; `keep` (b,) bool is False on fillers. Every rank yields
    ceil(len / (W * batch_size)) batches."""
    if batch_size <= 0:
        raise ValueError(f"evaluation batch size must be positive, got {batch_size}")
    n = len(dataset)
    per_round = world_size * batch_size
    total = -(-n // per_round) * per_round
    positions = list(range(rank, total, world_size))
    for start in range(0, len(positions), batch_size):
        chunk = positions[start:start + batch_size]
        items = [dataset[p if p < n else 0] for p in chunk]
        yield collate_fn(items), torch.tensor([p < n for p in chunk])
