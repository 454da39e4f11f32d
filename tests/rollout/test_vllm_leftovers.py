"""What vLLM would leave behind a run, and lightrft removes: its socket files (a folder per
process, removed at exit and, after a kill, at the next start) and the names of its CPU
communicator's shared memory (unique per launch, so two runs of the same ranks do not collide).
The end-to-end check is tests/e2e/test_vllm_tp.py (a tensor-parallel run leaves no socket)."""

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightrft.rollout import vllm_engine
from lightrft.rollout.vllm_engine import RPC_FOLDER_PREFIX, remove_stale_rpc_folders, use_run_rpc_folder


def gone_pid() -> int:
    """The pid of a process that has ended."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def test_socket_folders_of_gone_processes_are_removed_and_a_live_ones_kept(tmp_path):
    dead, alive = tmp_path / f"{RPC_FOLDER_PREFIX}{gone_pid()}", tmp_path / f"{RPC_FOLDER_PREFIX}{os.getpid()}"
    other = tmp_path / f"{RPC_FOLDER_PREFIX}notapid"
    for folder in (dead, alive, other):
        folder.mkdir()
    (dead / "0826e097-17e8-44fd-80c9-837b1dd82231").write_text("")
    assert remove_stale_rpc_folders(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and alive.is_dir() and other.is_dir()


@pytest.fixture
def short_temp():
    """A temp folder with a short path (the test's own may be too long for a socket address)."""
    folder = Path(tempfile.mkdtemp(prefix="lrft", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_each_process_gets_a_short_socket_folder_of_its_own(short_temp, monkeypatch):
    tmp_path = short_temp
    monkeypatch.setattr(vllm_engine, "_rpc_folder", [])
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    monkeypatch.setattr(vllm_engine.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(vllm_engine.atexit, "register", lambda fn: None)
    folder = use_run_rpc_folder()
    assert folder == str(tmp_path / f"{RPC_FOLDER_PREFIX}{os.getpid()}") and os.path.isdir(folder)
    assert os.environ["VLLM_RPC_BASE_PATH"] == folder and use_run_rpc_folder() == folder
    vllm_engine.remove_rpc_folder()
    assert not os.path.exists(folder)
    # A temp folder whose path leaves no room for a socket's name (107 characters in all) gives
    # way to /tmp; a folder the user chose is left alone.
    deep = tmp_path / ("d" * 80)
    deep.mkdir()
    monkeypatch.setattr(vllm_engine, "_rpc_folder", [])
    monkeypatch.delenv("VLLM_RPC_BASE_PATH")
    monkeypatch.setattr(vllm_engine.tempfile, "gettempdir", lambda: str(deep))
    assert use_run_rpc_folder() == f"/tmp/{RPC_FOLDER_PREFIX}{os.getpid()}"
    vllm_engine.remove_rpc_folder()
    monkeypatch.setattr(vllm_engine, "_rpc_folder", [])
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path / "mine"))
    assert use_run_rpc_folder() is None and os.environ["VLLM_RPC_BASE_PATH"] == str(tmp_path / "mine")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_cpu_shared_memory_names_carry_the_launch(monkeypatch):
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    monkeypatch.setattr(shm, "make_group_name", shm.__dict__["make_group_name"])     # restored afterwards
    # vLLM's own function (an engine built earlier in this process may have wrapped it already).
    shm.make_group_name = staticmethod(getattr(shm.make_group_name, "vllm_original", shm.make_group_name))
    monkeypatch.setenv("VLLM_DIST_IDENT", "//")        # what vLLM sets under an external launcher
    group = SimpleNamespace(unique_name="tp:0", ranks=[0, 1])
    plain = shm.make_group_name(group)
    assert plain == "//-tp:0-[0-1]-cpushm"             # the same in every launch of these ranks
    monkeypatch.setenv("MASTER_PORT", "29512")
    vllm_engine.unique_cpu_shared_memory_names()
    vllm_engine.unique_cpu_shared_memory_names()       # once only
    assert shm.make_group_name(group) == "lightrft29512--tp:0-[0-1]-cpushm"
    assert vllm_engine.CPU_SHM_SEGMENT.match(f"/dev/shm/{shm.make_group_name(group)}_0")   # still released
