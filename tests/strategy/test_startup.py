"""What starting costs: DeepSpeed must not JIT-build ops, or compile functions, that lightrft never calls."""

import subprocess
import sys

import pytest
import torch

from tests.conftest import free_port, subprocess_env

JOIN = """
import os
import deepspeed
import torch.distributed as dist
from lightrft.strategy import DeepspeedStrategy, StrategyConfig
if os.environ.get("STARTED_BEFORE"):     # as explorer roles do: the group exists before the strategy
    dist.init_process_group("gloo")
strategy = DeepspeedStrategy(StrategyConfig())
strategy.setup_distributed()
deepspeed.init_distributed(dist_backend="gloo")   # what deepspeed.initialize does when DeepSpeed's backend is unset
print("shm op:", deepspeed.comm.comm.cdb.shm_comm_op)
strategy.close()
"""


@pytest.mark.parametrize("started_before", [False, True], ids=["fresh", "group-started-before"])
def test_joining_the_group_builds_no_shared_memory_op(tmp_path, started_before):
    """DeepSpeed's CPU backend would compile `deepspeed_shm_comm_op` (used only by its inference
    all-reduce) on each machine's first run, 40-85 s of a new user's first minute. With an empty
    extension cache, joining the group leaves the cache empty and the backend without the op,
    also when the process group was started before the strategy (explorer roles)."""
    cache = tmp_path / "torch_extensions"
    cache.mkdir()
    launch = dict(STARTED_BEFORE="1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(free_port())) if started_before else {}
    result = subprocess.run([sys.executable, "-c", JOIN], env=subprocess_env(TORCH_EXTENSIONS_DIR=str(cache), **launch),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "shm op: None" in result.stdout
    assert list(cache.iterdir()) == []


TWO_RUNS = """
import torch
import torch.distributed as dist
from lightrft.strategy import DeepspeedStrategy, StrategyConfig

for run in range(2):
    strategy = DeepspeedStrategy(StrategyConfig(zero_stage=3, seed=run))
    strategy.setup_distributed()
    model = torch.nn.Linear(4, 4)
    engine, *_ = strategy.prepare((model, torch.optim.AdamW(model.parameters(), lr=1e-3), None))
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    dist.destroy_process_group()       # as vLLM's teardown does, before the strategy closes
    strategy.close()
    print("run", run, "done")
import sys
from deepspeed.runtime.zero.muon import original_muon
print("inductor's compiler loaded:", "torch._inductor.compile_fx" in sys.modules)
print("Muon deferred:", original_muon.zeropower_via_newtonschulz5.__code__.co_name)
"""


def test_a_second_zero3_run_in_the_same_process_after_the_group_was_destroyed_elsewhere():
    """A rollout engine's teardown may destroy the world group before the strategy closes (vLLM
    does). The strategy then releases DeepSpeed's cached groups itself: without that, the next
    ZeRO-3 engine in the same process (a second run in a script or notebook) partitioned over the
    dead group's clone and failed with "Group ... is not registered"."""
    launch = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    result = subprocess.run([sys.executable, "-c", TWO_RUNS], env=subprocess_env(**launch), capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "run 0 done" in result.stdout and "run 1 done" in result.stdout
    # DeepSpeed's ZeRO optimizers import its Muon module, whose torch.compile decorations load
    # inductor's compiler at import (~1.5 s a rank); the strategy defers them to their first call.
    assert "inductor's compiler loaded: False" in result.stdout
    assert "Muon deferred: first_call_compiles" in result.stdout


def test_deferred_compile_compiles_once_on_the_first_call_with_the_decorations_options():
    from lightrft.strategy.deepspeed_strategy import deferred_compile

    compiled = []

    def compile_fn(fn, **options):          # stands in for torch.compile: records, then doubles the result
        compiled.append((getattr(fn, "__name__", type(fn).__name__), options))
        return lambda *args, **kwargs: 2 * fn(*args, **kwargs)

    compile_lazily = deferred_compile(compile_fn)

    @compile_lazily
    def add(a, b):
        return a + b

    @compile_lazily(mode="max-autotune", dynamic=False)
    def negate(a):
        return -a

    assert compiled == [] and add.__name__ == "add" and add.__wrapped__(1, 2) == 3
    assert add(1, b=2) == 6 and add(3, 4) == 14 and negate(5) == -10
    assert compiled == [("add", {}), ("negate", {"mode": "max-autotune", "dynamic": False})]
    module = torch.nn.Linear(2, 2)
    assert compile_lazily(module, fullgraph=True)(torch.ones(2)).shape == (2,)   # a module goes at once
    assert len(compiled) == 3


def test_a_build_lock_left_by_a_killed_build_is_named_with_the_fix(tmp_path, monkeypatch, capsys):
    """torch waits forever on the lock file of a JIT build that was killed (DeepSpeed's CPU Adam is
    built on a machine's first offload run). An old lock is named on stderr, with the file to
    delete; a fresh one (another rank building right now) and none at all say nothing."""
    import os
    import time

    from lightrft.strategy.deepspeed_strategy import STALE_BUILD_LOCK_S, stale_build_lock, warn_if_build_is_locked

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "cpu_adam" / "lock"
    assert stale_build_lock("cpu_adam") is None            # no lock (torch makes the folder)
    lock.write_text("")
    assert stale_build_lock("cpu_adam") is None            # a build running now
    warn_if_build_is_locked("cpu_adam")
    assert capsys.readouterr().err == ""
    old = time.time() - STALE_BUILD_LOCK_S - 60
    os.utime(lock, (old, old))
    assert stale_build_lock("cpu_adam") == lock
    warn_if_build_is_locked("cpu_adam")
    err = capsys.readouterr().err
    assert f"waiting for the build lock {lock}" in err and f"delete {lock}" in err and "cpu_adam extension" in err


TAKEN_PORT = """
import socket
import lightrft.strategy.deepspeed_strategy as ds
from lightrft.strategy import DeepspeedStrategy, StrategyConfig
taken = socket.socket()
taken.bind(("127.0.0.1", 0))
taken.listen()
ds._free_port = lambda: taken.getsockname()[1]    # every pick is a port another process holds
strategy = DeepspeedStrategy(StrategyConfig())
strategy.setup_distributed()
import torch, torch.distributed as dist
total = torch.ones(1)
dist.all_reduce(total)
port = int(__import__("os").environ["MASTER_PORT"])
print("joined:", strategy.world_size, total.item(), port == taken.getsockname()[1])
strategy.close()
"""


def test_a_one_rank_group_binds_no_port():
    """A single process's group of one lives in an in-process store: no port is bound, so none
    can be taken by another process between a pick and the bind (parallel test workers hit
    EADDRINUSE when it bound one). Here the only port it could pick is held, and it joins."""
    result = subprocess.run([sys.executable, "-c", TAKEN_PORT], env=subprocess_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "joined: 1 1.0 True" in result.stdout
