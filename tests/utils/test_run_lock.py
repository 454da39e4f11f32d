"""One writer per checkpoint folder: a second holder is refused with a message naming the folder and
the holder; a lock whose holder was killed is taken over and its stale record reported; release
clears the record; only rank 0 of a job takes the lock."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from lightrft.utils.run_lock import LOCK_NAME, RunLock, RunLockError, checkpoint_folder_lock, read_record
from tests.conftest import REPO_ROOT, subprocess_env

# A process that takes the lock, says so, and holds it until killed.
HOLDER = """
import sys, time
from lightrft.utils.run_lock import RunLock
lock = RunLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """Starts a process holding the lock on a folder; yields (process, folder); kills it after."""
    procs = []

    def start(folder):
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), str(folder), "--tag", "first-run"],
                                cwd=REPO_ROOT, env=subprocess_env(), stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_second_holder_is_refused_naming_folder_and_holder(tmp_path, holder):
    folder = tmp_path / "ckpt"
    first = holder(folder)
    with pytest.raises(RunLockError) as info:
        RunLock(folder).acquire()
    message = str(info.value)
    assert str(folder) in message and "--ckpt_path" in message
    assert f"pid {first.pid}" in message and "first-run" in message  # the holder's command line
    assert "pass a different --ckpt_path" in message
    assert first.poll() is None  # the first holder is untouched


def test_lock_of_a_killed_holder_is_taken_over(tmp_path, holder, capfd):
    folder = tmp_path / "ckpt"
    first = holder(folder)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert read_record(folder / LOCK_NAME)["pid"] == first.pid  # the dead run's record is still there
    with checkpoint_folder_lock(folder, rank=0) as lock:
        assert lock.taken_over["pid"] == first.pid
        assert read_record(folder / LOCK_NAME)["pid"] == os.getpid()
    assert f"taking over the lock left by a run that is no longer running (pid {first.pid}" in capfd.readouterr().err
    assert read_record(folder / LOCK_NAME) is None  # released: record cleared


def test_release_lets_the_next_run_in_without_a_takeover(tmp_path):
    folder = tmp_path / "ckpt"
    with RunLock(folder) as first:
        record = read_record(folder / LOCK_NAME)
        assert record["pid"] == os.getpid() and record["host"] and record["started"] and record["command"]
        assert first.held
    assert not first.held
    second = RunLock(folder).acquire()
    assert second.taken_over is None
    second.release()
    second.release()  # twice is fine


def test_same_process_second_lock_is_refused(tmp_path):
    # flock locks belong to an open file: a second open in the same process is a second writer too.
    folder = tmp_path / "ckpt"
    with RunLock(folder):
        with pytest.raises(RunLockError, match="in use by another run"):
            RunLock(folder).acquire()


def test_unreadable_holder_record_still_refuses(tmp_path, holder):
    folder = tmp_path / "ckpt"
    holder(folder)
    (folder / LOCK_NAME).write_text("{not json")  # the holder's record was damaged
    with pytest.raises(RunLockError, match=r"in use by another run: an unknown process \(no holder record\)"):
        RunLock(folder).acquire()


def test_only_rank_0_takes_the_lock(tmp_path, holder):
    folder = tmp_path / "ckpt"
    holder(folder)
    with checkpoint_folder_lock(folder, rank=1) as lock:  # a rank of the holder's own job
        assert lock is None
    with pytest.raises(RunLockError):
        with checkpoint_folder_lock(folder, rank=0):
            pass
    with checkpoint_folder_lock(None, rank=0) as lock:
        assert lock is None


def test_folder_that_cannot_be_made_is_an_error_naming_it(tmp_path):
    (tmp_path / "file").write_text("")  # a file where a folder is needed (fails even for root)
    with pytest.raises(RunLockError, match=r"cannot create the checkpoint folder .*file/ckpt \(--ckpt_path\)"):
        RunLock(tmp_path / "file" / "ckpt").acquire()


def test_record_is_json_with_the_command_line(tmp_path):
    folder = tmp_path / "ckpt"
    with RunLock(folder):
        record = json.loads((folder / LOCK_NAME).read_text())
    assert set(record) == {"host", "pid", "started", "command"}
