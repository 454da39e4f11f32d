"""Seeding and RNG states that can be stored in a checkpoint's client state.

Seeding policy (used by `DeepspeedStrategy.setup_distributed`): every rank seeds Python, NumPy and
torch with the same `seed`, so models built after set-up are identical on all ranks (ZeRO and data
parallelism assume identical initial weights). Randomness that must differ between ranks (sampling
the same prompt on two ranks, say) uses a generator seeded with `seed + rank`
(`DeepspeedStrategy.rank_generator`).
"""

import random

import numpy as np
import torch


def set_seed(seed: int) -> None:
    """Seeds Python's `random`, NumPy's global generator and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state_dict() -> dict:
    """The states of Python's, NumPy's and torch's global generators as plain data and tensors,
    so `torch.load(weights_only=True)` reads them back."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def load_rng_state_dict(state: dict) -> None:
    """Restores the generators saved by `rng_state_dict`."""
    random.setstate(_as_tuples(state["python"]))
    numpy_state = state["numpy"]
    np.random.set_state(("MT19937", numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                         numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(value):
    # random.setstate wants tuples; a round trip through some serialisers turns them into lists.
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuples(v) for v in value)
    return value
