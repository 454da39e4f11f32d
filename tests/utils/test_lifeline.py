"""A process with a lifeline stops when its parent (the launcher) is killed with SIGKILL: it gets
SIGTERM at once (the signal the trainers turn into "save and exit"), and if it cannot stop, because
it ignores the signal or is stuck in a C call such as a collective waiting for a dead peer, it is
ended `grace` seconds later. A launcher *thread* that exits while the launcher lives does not count.

Each test builds a launcher -> worker pair of real processes, kills the launcher and watches the
worker by PID. The 60 s bounds are liveness bounds (the worker must exit at all), not timings."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from tests.conftest import REPO_ROOT, subprocess_env

LIVENESS_BOUND_S = 60.0

# The worker: installs the lifeline, reports its pid, then "trains" (blocks) according to MODE.
WORKER = """
import os, signal, sys, threading, time
import lightrft.utils.lifeline as lifeline

mode, out, grace = sys.argv[1], sys.argv[2], float(sys.argv[3])
poll = 3600.0 if mode == "kernel_signal_only" else 0.2
if mode == "polling_only":
    lifeline.set_parent_death_signal = lambda sig: False  # as on a system without prctl

def on_term(signum, frame):
    with open(out + ".term", "w") as f:
        f.write("saved")
    sys.exit(0)

if mode == "ignore_term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, on_term)
lifeline.install_lifeline(grace=grace, poll_interval=poll)
with open(out + ".pid", "w") as f:
    f.write(str(os.getpid()))
if mode == "ignore_term":
    r, w = os.pipe()
    os.read(r, 1)  # blocked in a C call for good, like a collective whose peer is gone
else:
    while True:
        time.sleep(0.1)
"""

# The launcher: starts the worker (when asked, from a helper thread that exits once the worker has
# armed its lifeline), then waits forever.
LAUNCHER = """
import os, subprocess, sys, threading, time
worker, mode, out, grace, from_thread = sys.argv[1:6]
cmd = [sys.executable, worker, mode, out, grace]
log = open(out + ".log", "w")

def start_and_leave():
    subprocess.Popen(cmd, stderr=log, start_new_session=True)
    while not os.path.exists(out + ".pid"):
        time.sleep(0.05)

if from_thread == "1":
    t = threading.Thread(target=start_and_leave)
    t.start()
    t.join()
else:
    subprocess.Popen(cmd, stderr=log, start_new_session=True)
while True:
    time.sleep(1)
"""


def wait_for_file(path, proc, timeout=60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        assert proc.poll() is None, f"launcher exited early with {proc.returncode}"
        time.sleep(0.05)
    raise AssertionError(f"{path} was not written within {timeout} s")


def wait_gone(pid: int, bound: float) -> float | None:
    """Seconds until process `pid` is gone (or a zombie), None if it outlives `bound`."""
    start = time.monotonic()
    while time.monotonic() - start < bound:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return time.monotonic() - start
        except psutil.NoSuchProcess:
            return time.monotonic() - start
        time.sleep(0.05)
    return None


@pytest.fixture
def launch(tmp_path):
    """Starts launcher -> worker; yields (launcher process, worker pid, output prefix); kills
    whatever is left afterwards."""
    started = []

    def start(mode: str, grace: float, from_thread: bool = False):
        worker = tmp_path / "worker.py"
        worker.write_text(textwrap.dedent(WORKER))
        out = tmp_path / mode
        launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LAUNCHER), str(worker), mode, str(out),
                                     str(grace), "1" if from_thread else "0"], cwd=REPO_ROOT, env=subprocess_env())
        started.append(launcher)
        pid = int(wait_for_file(tmp_path / f"{mode}.pid", launcher))
        started.append(pid)
        return launcher, pid, out

    yield start
    for item in started:
        try:
            if isinstance(item, int):
                os.kill(item, signal.SIGKILL)
            else:
                item.kill()
                item.wait()
        except (ProcessLookupError, OSError):
            pass


@pytest.mark.parametrize("mode", [
    "handle_term",
    pytest.param("kernel_signal_only", marks=pytest.mark.skipif(not sys.platform.startswith("linux"),
                                                                reason="prctl(PR_SET_PDEATHSIG) is Linux-only")),
    "polling_only",
])
def test_orphaned_worker_gets_sigterm_and_exits(launch, mode):
    launcher, pid, out = launch(mode, grace=30.0)
    time.sleep(0.5)
    assert psutil.pid_exists(pid) and not out.with_suffix(".term").exists()
    launcher.kill()  # SIGKILL: the launcher cannot forward anything
    launcher.wait()
    took = wait_gone(pid, LIVENESS_BOUND_S)
    assert took is not None, f"worker {pid} still running {LIVENESS_BOUND_S} s after its launcher was killed"
    # It stopped through its SIGTERM handler (the trainers' "save and exit"), not the hard deadline.
    assert out.with_suffix(".term").read_text() == "saved"
    assert "the launcher" in out.with_suffix(".log").read_text()


def test_worker_that_cannot_stop_is_ended_after_the_grace(launch):
    launcher, pid, out = launch("ignore_term", grace=2.0)
    launcher.kill()
    launcher.wait()
    took = wait_gone(pid, LIVENESS_BOUND_S)
    assert took is not None, f"worker {pid} stuck in a C call outlived the grace period"
    assert took >= 2.0  # the deadline, not the SIGTERM (which it ignores), ended it
    log = out.with_suffix(".log").read_text()
    assert "exiting now with code 143" in log, log
    assert not out.with_suffix(".term").exists()


def test_launcher_thread_exiting_is_not_the_launcher_dying(launch):
    # Linux sends the parent-death signal when the *thread* that forked the worker exits.
    launcher, pid, out = launch("handle_term", grace=30.0, from_thread=True)
    time.sleep(2.0)  # ten polls, and the kernel's signal for the thread exit has long arrived
    assert psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    assert not out.with_suffix(".term").exists()
    launcher.kill()
    launcher.wait()
    assert wait_gone(pid, LIVENESS_BOUND_S) is not None
    assert out.with_suffix(".term").read_text() == "saved"


def test_no_lifeline_without_torchrun(monkeypatch):
    from lightrft.utils.lifeline import lifeline_for_launcher

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert lifeline_for_launcher(600.0) is None  # a nohup'd plain `python` run outlives its shell
