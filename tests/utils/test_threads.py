"""Threads per rank: cores // local ranks unless the user chose, cores from affinity and cgroup quota."""

import os
import subprocess
import sys

import pytest

from lightrft.utils.threads import available_cores, configure_threads, threads_per_rank
from tests.conftest import subprocess_env


@pytest.mark.parametrize("cores, ranks, expected", [(16, 2, 8), (16, 3, 5), (2, 2, 1), (2, 1, 2), (2, 4, 1),
                                                    (1, 1, 1)])
def test_cores_split_evenly_over_local_ranks(cores, ranks, expected):
    assert threads_per_rank(ranks, environ={}, cores=cores) == (expected, "cores // local ranks")


def test_the_users_setting_wins_lightrft_first():
    assert threads_per_rank(2, environ={"OMP_NUM_THREADS": "3"}, cores=16) == (3, "OMP_NUM_THREADS")
    env = {"OMP_NUM_THREADS": "3", "LIGHTRFT_NUM_THREADS": "6"}
    assert threads_per_rank(2, environ=env, cores=16) == (6, "LIGHTRFT_NUM_THREADS")
    assert threads_per_rank(2, environ={"OMP_NUM_THREADS": " "}, cores=16) == (8, "cores // local ranks")


@pytest.mark.parametrize("value", ["0", "two", "-1", "1.5"])
def test_bad_thread_counts_are_refused_by_name(value):
    with pytest.raises(ValueError, match=f"OMP_NUM_THREADS='{value}' is not a thread count"):
        threads_per_rank(1, environ={"OMP_NUM_THREADS": value}, cores=4)
    with pytest.raises(ValueError, match="local_world_size must be >= 1"):
        threads_per_rank(0, environ={}, cores=4)


@pytest.mark.parametrize("cpu_max, expected", [("max 100000\n", 64), ("150000 100000\n", 2), ("300000 100000", 3),
                                               ("50000 100000", 1), ("garbage", 64)])
def test_cgroup_quota_caps_the_cores(tmp_path, monkeypatch, cpu_max, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    path = tmp_path / "cpu.max"
    path.write_text(cpu_max)
    assert available_cores(path) == expected
    assert available_cores(tmp_path / "missing") == 64


def test_configure_threads_sets_torch_and_reads_local_world_size():
    # In a fresh process: earlier tests in this one (vLLM's CPU worker among them) may pin the
    # OpenMP runtime, after which torch.set_num_threads no longer changes the count.
    code = ("import torch; from lightrft.utils.threads import configure_threads; "
            "a = configure_threads(environ={'LOCAL_WORLD_SIZE': '2'}, cores=6); b = torch.get_num_threads(); "
            "c = configure_threads(local_world_size=1, environ={'OMP_NUM_THREADS': '2'}, cores=6); "
            "print(a, b, c, torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["3", "3", "2", "2"]


def test_affinity_of_a_real_process_bounds_its_threads():
    """A process pinned to one core gets one thread per rank, whatever the machine has."""
    code = ("import os, torch; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from lightrft.utils.threads import available_cores, configure_threads; "
            "print(available_cores(), configure_threads(2), torch.get_num_threads())")
    env = subprocess_env()
    env.pop("OMP_NUM_THREADS")
    env.pop("LIGHTRFT_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "1", "1"]
