"""CPU threads per rank: the cores this process may use, split evenly over the ranks of a node.

PyTorch starts with one intra-op thread per core it sees, in every process. With several ranks
on one machine that oversubscribes the cores: on 2 cores, 2 ranks x 2 threads make every
parallel operation wait for a thread that another rank has descheduled. A rank should get
`cores // local ranks` threads, where `cores` is what this process may actually run on (its CPU
affinity and its cgroup quota, which containers set below the machine's core count).

The user's choice wins: `LIGHTRFT_NUM_THREADS`, then `OMP_NUM_THREADS` (torchrun sets it to 1 for
every rank when it launches more than one and the variable is unset, which equals the even split
on a 2-core machine; set it yourself on larger ones, or use `LIGHTRFT_NUM_THREADS`).
"""

import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def available_cores(cgroup_cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """Cores this process may use: its CPU affinity, capped by the cgroup v2 CPU quota when one is
    set (`cpu.max` holds "quota period" in microseconds, or "max period" without a quota); a
    fractional quota rounds up, since 1.5 cores of time still run two threads usefully."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = cgroup_cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return cores
    if quota != "max" and int(period) > 0:
        cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    return cores


def threads_per_rank(local_world_size: int, environ: Mapping[str, str] | None = None,
                     cores: int | None = None) -> tuple[int, str]:
    """The intra-op thread count a rank should use and where it came from ("LIGHTRFT_NUM_THREADS",
    "OMP_NUM_THREADS" or "cores // local ranks")."""
    if local_world_size < 1:
        raise ValueError(f"local_world_size must be >= 1 (ranks on this node), got {local_world_size}")
    environ = os.environ if environ is None else environ
    for name in ("LIGHTRFT_NUM_THREADS", "OMP_NUM_THREADS"):
        value = environ.get(name, "").strip()
        if value:
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"{name}={value!r} is not a thread count: set it to a positive integer or unset it")
            return int(value), name
    cores = available_cores() if cores is None else cores
    return max(1, cores // local_world_size), "cores // local ranks"


def configure_threads(local_world_size: int | None = None, environ: Mapping[str, str] | None = None,
                      cores: int | None = None) -> int:
    """Sets torch's intra-op threads for this rank (see `threads_per_rank`) and returns the count.

    `local_world_size` defaults to torchrun's LOCAL_WORLD_SIZE (1 without torchrun). Call it once
    at start-up, before the first parallel operation.
    """
    environ = os.environ if environ is None else environ
    if local_world_size is None:
        local_world_size = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    threads, _ = threads_per_rank(local_world_size, environ, cores)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
