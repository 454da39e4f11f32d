"""Reward files run in a worker process (`RewardFuncProcess`, what `--remote_rm_url file.py` uses):
the same numbers as in-process; a hanging call is stopped at the timeout and counted; a crashing
worker (os._exit, a segfault) is contained and counted; either way the next call gets a fresh
worker; `on_failure="error"` stops with a message naming the file and the cause, `"drop"` returns
the samples invalid and counts them; the worker never outlives its trainer."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch

from lightrft.rewards import RewardFuncProcess, RewardSourceError, load_reward_func
from tests.conftest import REPO_ROOT, subprocess_env
from tests.rewards.test_func import DICT_FILE, LABELS, PROMPTS, QUERIES, TENSOR_FILE, write

# Misbehaves when a label asks it to, so one worker can fail and then serve normal calls.
MOODY_FILE = """
import ctypes, os, time

def reward_func(queries, prompts, labels):
    if "hang" in labels:
        time.sleep(3600)
    if "spin" in labels:
        while True:
            pass
    if "exit" in labels:
        os._exit(3)
    if "segfault" in labels:
        ctypes.string_at(0)
    if "raise" in labels:
        raise RuntimeError("the grader is down")
    return [float(len(q)) for q in queries]
"""
NORMAL = [float(len(q)) for q in QUERIES]


@pytest.fixture
def sources():
    """Builds RewardFuncProcess objects and stops their workers after the test."""
    made = []

    def make(path, **kwargs):
        made.append(RewardFuncProcess(path, **kwargs))
        return made[-1]

    yield make
    for source in made:
        source.close()


FLOAT64_FILE = """
import numpy as np

def reward_func(queries, prompts, labels):
    return np.array([len(q) / 7 for q in queries], dtype=np.float64)
"""
BF16_FILE = """
import torch

def reward_func(queries, prompts, labels):
    return torch.tensor([len(q) / 7 for q in queries], dtype=torch.bfloat16)
"""


@pytest.mark.parametrize("body", [TENSOR_FILE, DICT_FILE, FLOAT64_FILE, BF16_FILE])
def test_same_numbers_as_in_process(tmp_path, sources, body):
    path = write(tmp_path, "reward.py", body)
    expected = load_reward_func(path).score(QUERIES, PROMPTS, LABELS)
    source = sources(path, timeout=30.0)
    got = source.score(QUERIES, PROMPTS, LABELS)
    assert got.rewards.dtype == torch.float32 and torch.equal(got.rewards, expected.rewards)
    assert got.valid.all()
    assert got.extra_logs.keys() == expected.extra_logs.keys()
    for name in expected.extra_logs:
        assert torch.equal(got.extra_logs[name], expected.extra_logs[name])
    assert torch.equal(source(QUERIES, PROMPTS, LABELS), expected.rewards)  # under "error": the tensor
    assert source.stats.as_dict() == {"calls": 2, "samples": 6, "timeouts": 0, "errors": 0, "crashes": 0,
                                      "dropped": 0, "restarts": 0}


@pytest.mark.parametrize("mood", ["hang", "spin"])
def test_hanging_call_is_stopped_counted_and_dropped(tmp_path, sources, mood):
    source = sources(write(tmp_path, "moody.py", MOODY_FILE), timeout=1.0, on_failure="drop")
    worker = source._worker["process"].pid
    started = time.monotonic()
    result = source(QUERIES, PROMPTS, ["2", mood, "6"])
    assert time.monotonic() - started < 30.0  # liveness: the call came back at all
    assert result.valid.tolist() == [False] * 3 and result.rewards.tolist() == [0.0] * 3
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
    # The next call gets a fresh worker and normal numbers.
    assert source(QUERIES, PROMPTS, LABELS).rewards.tolist() == NORMAL
    stats = source.stats.as_dict()
    assert (stats["calls"], stats["timeouts"], stats["dropped"], stats["restarts"]) == (2, 1, 3, 1)
    assert stats["errors"] == stats["crashes"] == 0


@pytest.mark.parametrize("mood, cause", [("exit", "exit code 3"), ("segfault", "killed by signal SIGSEGV")])
def test_crashing_worker_is_contained_and_counted(tmp_path, sources, mood, cause):
    path = write(tmp_path, "moody.py", MOODY_FILE)
    dropping = sources(path, timeout=30.0, on_failure="drop")
    result = dropping(QUERIES, PROMPTS, [mood, "4", "6"])
    assert result.valid.tolist() == [False] * 3
    assert dropping(QUERIES, PROMPTS, LABELS).rewards.tolist() == NORMAL
    assert (dropping.stats.crashes, dropping.stats.dropped, dropping.stats.restarts) == (1, 3, 1)

    stopping = sources(path, timeout=30.0, on_failure="error")
    with pytest.raises(RewardSourceError) as info:
        stopping(QUERIES, PROMPTS, [mood, "4", "6"])
    message = str(info.value)
    assert f"reward_func in {path}: the worker process running it died ({cause}) while scoring 3 samples" in message
    assert "--reward_on_failure error" in message
    assert stopping.stats.crashes == 1


def test_timeout_under_error_policy_names_file_flag_and_fix(tmp_path, sources):
    path = write(tmp_path, "moody.py", MOODY_FILE)
    source = sources(path, timeout=1.0, on_failure="error")
    with pytest.raises(RewardSourceError) as info:
        source(QUERIES, PROMPTS, ["hang", "4", "6"])
    assert str(info.value) == (f"reward_func in {path}: no answer within timeout=1.0s (--reward_timeout) for 3 "
                               "samples; the call was stopped (--reward_on_failure error; 'drop' trains on without "
                               "these samples)")
    assert source.stats.timeouts == 1 and source.stats.dropped == 0


def test_exception_in_the_function_is_an_error_without_a_restart(tmp_path, sources):
    path = write(tmp_path, "moody.py", MOODY_FILE)
    source = sources(path, timeout=30.0, on_failure="drop")
    worker = source._worker["process"].pid
    assert source(QUERIES, PROMPTS, ["raise", "4", "6"]).valid.tolist() == [False] * 3
    assert source(QUERIES, PROMPTS, LABELS).rewards.tolist() == NORMAL
    assert source._worker["process"].pid == worker  # a Python exception does not cost a worker
    assert (source.stats.errors, source.stats.restarts, source.stats.dropped) == (1, 0, 3)
    with pytest.raises(RewardSourceError, match=r"reward_func in .*moody\.py raised RuntimeError: the grader is down"):
        sources(path, timeout=30.0)(QUERIES, PROMPTS, ["raise", "4", "6"])


@pytest.mark.parametrize("returned, words", [
    ("[1.0, 2.0]", r"expected 3 rewards \(one per query\), got shape \(2,\)"),
    ("[1.0, float('nan'), 2.0]", r"rewards at positions \[1\] are NaN or infinite"),
])
def test_bad_returns_are_errors_naming_the_file(tmp_path, sources, returned, words):
    path = write(tmp_path, "bad.py", f"def reward_func(queries, prompts, labels):\n    return {returned}\n")
    with pytest.raises(RewardSourceError, match=words) as info:
        sources(path, timeout=30.0)(QUERIES, PROMPTS, LABELS)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("body, words", [
    ("def other(q, p, l):\n    return []\n", "defines no function reward_func"),
    ("import not_a_module_anywhere\n", "importing reward file .* failed: ModuleNotFoundError"),
    ("import os\nos._exit(5)\n", r"the worker process died while importing it \(exit code 5\)"),
])
def test_broken_files_fail_at_start_up(tmp_path, body, words):
    path = write(tmp_path, "broken.py", body)
    with pytest.raises(RewardSourceError, match=words) as info:
        RewardFuncProcess(path)
    assert str(path) in str(info.value)


def test_missing_file_and_bad_options_name_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.py not found \(--remote_rm_url\)"):
        RewardFuncProcess(tmp_path / "nope.py")
    path = write(tmp_path, "reward.py", TENSOR_FILE)
    with pytest.raises(ValueError, match="--reward_timeout"):
        RewardFuncProcess(path, timeout=0)
    with pytest.raises(ValueError, match="--reward_on_failure"):
        RewardFuncProcess(path, on_failure="ignore")


# A trainer stand-in: starts the source, reports the worker's pid, then blocks in a hanging call.
TRAINER = """
import sys
from lightrft.rewards import RewardFuncProcess
source = RewardFuncProcess(sys.argv[1], timeout=3600)
print(source._worker["process"].pid, flush=True)
source(["a"], ["a"], ["hang"])
"""


def test_worker_dies_with_its_trainer(tmp_path):
    path = write(tmp_path, "moody.py", MOODY_FILE)
    trainer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(TRAINER), str(path)], cwd=REPO_ROOT,
                               env=subprocess_env(), stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        worker = int(trainer.stdout.readline())
        time.sleep(0.5)  # the call is in progress
        trainer.kill()
        trainer.wait()
        deadline = time.monotonic() + 60.0  # liveness bound
        while time.monotonic() < deadline:
            try:
                if psutil.Process(worker).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"reward worker {worker} outlived its killed trainer by 60 s")
    finally:
        trainer.kill()
        if worker is not None:
            try:
                os.kill(worker, signal.SIGKILL)
            except ProcessLookupError:
                pass
