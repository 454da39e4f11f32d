"""Holding out an evaluation split from a training dataset."""

import torch
from torch.utils.data import Dataset, Subset


def split_train_eval(dataset: Dataset, eval_fraction: float, seed: int = 42) -> tuple[Subset, Subset]:
    """Splits `dataset` into (train, eval) subsets with `round(eval_fraction * len)` eval items (at
    least 1), chosen by a permutation seeded with `seed`, so every rank gets the same split. Both
    subsets keep ascending index order."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"--eval_split must be a fraction strictly between 0 and 1, got {eval_fraction}")
    n = len(dataset)
    n_eval = max(1, round(eval_fraction * n))
    if n_eval >= n:
        raise ValueError(f"--eval_split {eval_fraction} leaves no training rows out of {n}; lower it")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    eval_idx = sorted(order[:n_eval].tolist())
    train_idx = sorted(order[n_eval:].tolist())
    return Subset(dataset, train_idx), Subset(dataset, eval_idx)
