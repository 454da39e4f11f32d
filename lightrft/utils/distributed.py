"""Rank and world size from one place.

Every helper works whether or not a process group has been initialised: a plain `python script.py`
is rank 0 of a world of 1. Nothing here imports deepspeed.
"""

import torch.distributed as dist


def is_dist_initialized() -> bool:
    """True when a torch.distributed process group is available and initialised."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """Global rank of this process; 0 without a process group."""
    return dist.get_rank() if is_dist_initialized() else 0


def get_world_size() -> int:
    """Number of processes in the default group; 1 without a process group."""
    return dist.get_world_size() if is_dist_initialized() else 1


def is_rank_0() -> bool:
    """True on the process that writes files and logs (global rank 0)."""
    return get_rank() == 0


def barrier() -> None:
    """Waits for every rank; does nothing without a process group."""
    if is_dist_initialized():
        dist.barrier()
