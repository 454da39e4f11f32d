"""Reward files: a Python file defining `reward_func(queries, prompts, labels)`.

The convention is OpenRLHF's, so files written for it work unchanged: the function gets the full
texts (prompt + response), the prompts and the labels, and returns the rewards as a tensor or a
list, or a dict whose "rewards" entry holds them (other entries such as "scores" are ignored and
"extra_logs" is kept for logging). The file is executed only when a user names it
(`--remote_rm_url path/to/reward.py`); it runs with the trainer's permissions, like any code the
user passes.

Two ways to run it:

- `RewardFuncProcess` (what `--remote_rm_url file.py` uses): the file lives in a worker process
  of its own, kept across calls. A call that takes longer than `timeout` is stopped by killing the
  worker; a worker that dies (os._exit, a segfault in an extension) is noticed; either way a fresh
  worker is started for the next call, and the failure follows `on_failure` like a failed HTTP
  reward request. A hung or crashing reward function therefore cannot hang or kill the run.
- `load_reward_func` / `RewardFuncSource`: in the caller's process, with no timeout (for research
  code and tests that want the function's objects in hand).

Both check the output the same way and give the same numbers.
"""

import logging
import multiprocessing
import os
import signal
import threading
import weakref
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from lightrft.rewards.base import (FailurePolicySource, RewardResult, RewardSourceError, accepts_keyword,
                                   check_batch_lengths, to_reward_tensor)
from lightrft.utils.lifeline import exit_with_parent
from lightrft.utils.pyfile import PythonFileError, import_python_file

logger = logging.getLogger(__name__)

ON_FAILURE_POLICIES = ("error", "drop")


def check_reward_output(output: Any, num_queries: int, where: str) -> RewardResult:
    """The `RewardResult` for what `reward_func` returned (a tensor, a list, or a dict with
    "rewards" and optionally "extra_logs"), raising `RewardSourceError` naming `where` when it is
    not one finite number per query."""
    extra_logs = {}
    if isinstance(output, dict):
        if "rewards" not in output:
            raise RewardSourceError(f"{where} returned a dict without a 'rewards' entry "
                                    f"(keys: {sorted(output)}); return {{'rewards': [...]}} or the list itself")
        extra_logs = {name: to_reward_tensor(values, num_queries, f"{where}, extra_logs[{name!r}]")
                      for name, values in (output.get("extra_logs") or {}).items()}
        output = output["rewards"]
    rewards = to_reward_tensor(output, num_queries, where)
    return RewardResult(rewards, torch.ones(num_queries, dtype=torch.bool), extra_logs)


def call_reward_func(func, path: Path, queries: Sequence[str], prompts: Sequence[str],
                     labels: Sequence[Any], truncated: Sequence[bool] | None = None) -> RewardResult:
    """Calls `func` and checks its output; any exception becomes a `RewardSourceError` naming the file.
    A function that takes a `truncated` keyword gets, per query, whether the response was cut at
    the length limit (no stop token)."""
    where = f"reward_func in {path}"
    extra = {"truncated": list(truncated)} if truncated is not None and accepts_keyword(func, "truncated") else {}
    try:
        output = func(list(queries), list(prompts), list(labels), **extra)
    except Exception as err:
        raise RewardSourceError(f"{where} raised {type(err).__name__}: {err}") from err
    return check_reward_output(output, len(queries), where)


class RewardFuncSource:
    """Calls `reward_func` from a user file in this process and checks what it returns."""

    def __init__(self, path: str | Path, func):
        self.path = Path(path)
        self.func = func

    def __repr__(self) -> str:
        return f"RewardFuncSource({str(self.path)!r})"

    def __call__(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any],
                 truncated: Sequence[bool] | None = None) -> torch.Tensor:
        return self.score(queries, prompts, labels, truncated).rewards

    def score(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any],
              truncated: Sequence[bool] | None = None) -> RewardResult:
        """Rewards and the file's "extra_logs" (each checked to one finite value per query)."""
        return call_reward_func(self.func, self.path, queries, prompts, labels, truncated)


def check_reward_file(path: str | Path) -> Path:
    """`path` with `~` expanded; FileNotFoundError naming the flag when it is not a file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"reward file {path} not found (--remote_rm_url): pass the path of a .py file "
                                "defining reward_func(queries, prompts, labels)")
    return path


def import_reward_func(path: Path):
    """Imports the reward file and returns its `reward_func`; RewardSourceError naming the file
    when importing fails or there is no callable `reward_func`."""
    try:
        module = import_python_file(path, "lightrft_reward_file", "reward file")
    except PythonFileError as err:
        raise RewardSourceError(str(err)) from err.__cause__
    func = getattr(module, "reward_func", None)
    if not callable(func):
        raise RewardSourceError(f"reward file {path} defines no function reward_func(queries, prompts, labels)")
    return func


def load_reward_func(path: str | Path) -> RewardFuncSource:
    """Imports the reward file at `path` into this process and returns a source calling its
    `reward_func` (no timeout; `RewardFuncProcess` runs it isolated).

    Raises FileNotFoundError when the file does not exist, and RewardSourceError when importing
    it fails or it defines no callable `reward_func`; each message names the file."""
    path = check_reward_file(path)
    return RewardFuncSource(path, import_reward_func(path))


@dataclass
class RewardFuncStats:
    """Counters since the source was built, for logging (`rollout/reward_source<i>_*`)."""

    calls: int = 0  # batches sent to reward_func
    samples: int = 0  # samples in those batches
    timeouts: int = 0  # calls stopped after `timeout` seconds
    errors: int = 0  # calls where reward_func raised or returned unusable rewards
    crashes: int = 0  # calls during which the worker process died
    dropped: int = 0  # samples returned invalid under on_failure="drop"
    restarts: int = 0  # workers started to replace a stopped or dead one

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class RewardFuncProcess(FailurePolicySource):
    """Runs `reward_func` from a user file in a worker process (module docstring).

    Args:
        path: the reward file.
        timeout: seconds one call may take (`--reward_timeout`); the worker is then killed.
        on_failure: "error" raises `RewardSourceError` naming the file and the cause; "drop"
            returns a `RewardResult` whose samples are all invalid (their groups train on nothing)
            and counts them (`--reward_on_failure`).
        start_timeout: seconds the worker may take to import the file (heavy imports included).

    The file is imported once at construction, so a missing file, an import error or a missing
    `reward_func` stops the run at start-up as with `load_reward_func`. Call `close()` to stop the
    worker; it is also stopped when the source is garbage-collected, at exit, and, through a
    parent-death signal and a watcher thread, when the trainer dies.
    """

    def __init__(self, path: str | Path, timeout: float = 30.0, on_failure: str = "error",
                 start_timeout: float = 120.0):
        if on_failure not in ON_FAILURE_POLICIES:
            raise ValueError(f"on_failure must be one of {ON_FAILURE_POLICIES} (--reward_on_failure), "
                             f"got {on_failure!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive (--reward_timeout), got {timeout}")
        self.path = check_reward_file(path)
        self.where = f"reward_func in {self.path}"
        self.timeout = timeout
        self.on_failure = on_failure
        self.start_timeout = start_timeout
        self.stats = RewardFuncStats()
        self._context = multiprocessing.get_context("spawn")  # fork is unsafe in a process with threads
        self._worker: dict = {}  # "process", "conn" of the running worker
        self._finalizer = weakref.finalize(self, _stop_worker, self._worker)
        self._start_worker()

    def __repr__(self) -> str:
        return f"RewardFuncProcess({str(self.path)!r}, timeout={self.timeout}, on_failure={self.on_failure!r})"

    def score(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any],
              truncated: Sequence[bool] | None = None) -> RewardResult:
        """Rewards, validity and extra_logs of every sample; raises `RewardSourceError` under "error"."""
        check_batch_lengths(queries, prompts, labels)
        count = len(queries)
        self.stats.calls += 1
        self.stats.samples += count
        if not self._worker:
            self.stats.restarts += 1
            self._start_worker()
        process, conn = self._worker["process"], self._worker["conn"]
        try:
            conn.send((list(queries), list(prompts), list(labels), None if truncated is None else list(truncated)))
            answered = conn.poll(self.timeout)
            answer = conn.recv() if answered else None
        except (EOFError, OSError):
            return self._fail("crashes", f"the worker process running it died ({_exit_cause(process)}) while "
                                         f"scoring {count} samples", count)
        except Exception as err:  # the request itself could not be pickled (labels of an unusual type)
            raise RewardSourceError(f"{self.where}: prompts and labels must be picklable to reach the reward "
                                    f"worker ({type(err).__name__}: {err})") from None
        if not answered:
            return self._fail("timeouts", f"no answer within timeout={self.timeout}s (--reward_timeout) for "
                                          f"{count} samples; the call was stopped", count)
        if answer[0] == "error":
            return self._fail("errors", answer[1], count, prefixed=True)
        _, rewards, extra_logs = answer
        return RewardResult(torch.tensor(rewards, dtype=torch.float32), torch.ones(count, dtype=torch.bool),
                            {name: torch.tensor(values, dtype=torch.float32) for name, values in extra_logs.items()})

    def close(self) -> None:
        """Stops the worker; a later call starts a new one."""
        _stop_worker(self._worker)

    def _fail(self, counter: str, reason: str, count: int, prefixed: bool = False) -> RewardResult:
        """Counts the failure, stops the worker unless it only reported an error, and applies the
        failure policy to the `count` samples of the call."""
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        if counter != "errors":
            _stop_worker(self._worker)
        message = reason if prefixed else f"{self.where}: {reason}"
        if self.on_failure == "error":
            raise RewardSourceError(message + " (--reward_on_failure error; 'drop' trains on without these "
                                              "samples)")
        self.stats.dropped += count
        logger.warning("%s; dropping %d samples (--reward_on_failure drop)", message, count)
        return RewardResult(torch.zeros(count, dtype=torch.float32), torch.zeros(count, dtype=torch.bool))

    def _start_worker(self) -> None:
        parent_conn, child_conn = self._context.Pipe()
        watch_with_signal = threading.current_thread() is threading.main_thread()
        process = self._context.Process(target=_worker_main, name=f"lightrft-reward-{self.path.name}",
                                        args=(str(self.path), child_conn, os.getpid(), watch_with_signal))
        process.start()
        child_conn.close()
        self._worker.update(process=process, conn=parent_conn)
        try:
            ready = parent_conn.poll(self.start_timeout)
            answer = parent_conn.recv() if ready else None
        except (EOFError, OSError):
            _stop_worker(self._worker)
            raise RewardSourceError(f"reward file {self.path}: the worker process died while importing it "
                                    f"({_exit_cause(process)})") from None
        if not ready:
            _stop_worker(self._worker)
            raise RewardSourceError(f"reward file {self.path}: importing it took longer than {self.start_timeout:.0f} s "
                                    "in the reward worker")
        if answer[0] != "ready":
            _stop_worker(self._worker)
            raise RewardSourceError(answer[1])


def _stop_worker(worker: dict) -> None:
    """Kills the worker process (SIGKILL: a hung function may ignore anything gentler) and reaps it."""
    process, conn = worker.pop("process", None), worker.pop("conn", None)
    if conn is not None:
        conn.close()
    if process is not None and process.is_alive():
        process.kill()
    if process is not None:
        process.join(timeout=10)


def _exit_cause(process) -> str:
    process.join(timeout=5)
    code = process.exitcode
    if code is None:
        return "still running, its pipe is broken"
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def _worker_main(path: str, conn, parent_pid: int, watch_with_signal: bool) -> None:
    """The reward worker: imports the file, answers "ready" (or the import error), then scores one
    request at a time until the pipe closes. Exits with its parent
    (`lightrft.utils.lifeline.exit_with_parent`); Ctrl-C is left to the trainer, which stops the
    worker itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent(parent_pid, watch_with_signal, "lightrft-reward-parent-watch")
    try:
        func = import_reward_func(Path(path))
    except RewardSourceError as err:
        conn.send(("load_error", str(err)))
        return
    conn.send(("ready",))
    while True:
        try:
            queries, prompts, labels, truncated = conn.recv()
        except (EOFError, OSError):
            return
        try:
            result = call_reward_func(func, Path(path), queries, prompts, labels, truncated)
        except RewardSourceError as err:
            conn.send(("error", str(err)))
            continue
        except BaseException as err:  # SystemExit, KeyboardInterrupt raised by the function
            conn.send(("error", f"reward_func in {path} raised {type(err).__name__}: {err}"))
            continue
        conn.send(("ok", result.rewards.tolist(), {k: v.tolist() for k, v in result.extra_logs.items()}))
