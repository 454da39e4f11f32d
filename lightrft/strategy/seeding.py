"""Seeding policy of DeepspeedStrategy.

`DeepspeedStrategy.setup_distributed` seeds Python, NumPy and torch with the same `seed` on every
rank, so models built after set-up are identical on all ranks (ZeRO and data parallelism assume
identical initial weights). Randomness that must differ between ranks (sampling the same prompt on
two ranks, say) uses a generator seeded with `seed + rank` (`DeepspeedStrategy.rank_generator`).
Capturing and restoring RNG states for checkpoints is `lightrft.trainer.checkpoint`'s
`capture_rng_state` / `restore_rng_state`.
"""

import random

import numpy as np
import torch


def set_seed(seed: int) -> None:
    """Seeds Python's `random`, NumPy's global generator and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
