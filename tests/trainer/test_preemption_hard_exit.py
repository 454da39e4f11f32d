"""The preemption grace is enforced even when the trainer's main thread never returns to Python:
a regular-expression match that backtracks for hours holds the interpreter lock, so neither the
Python signal handler nor the in-process watchdog thread can run. The watcher process reads the
signal from the wakeup pipe (written by the C-level handler) and kills the trainer once the grace
and its margin have passed; without a signal, or once the flag is restored, it exits by itself."""

import signal
import subprocess
import sys
import time

from tests.conftest import REPO_ROOT, subprocess_env

STUCK = """
import re, sys
from lightrft.trainer.preemption import PreemptionFlag
flag = PreemptionFlag(1.0, hard_exit_margin=1.0)
flag.install()
print("watcher", flag._watcher.pid, flush=True)
re.match(r"(a+)+$", "a" * 60 + "b")          # 2^60 steps with the interpreter lock held
print("returned", flush=True)
"""

CLEAN = """
from lightrft.trainer.preemption import PreemptionFlag
flag = PreemptionFlag(600.0)
flag.install()
print("watcher", flag._watcher.pid, flush=True)
flag.restore()
print("restored", flush=True)
"""


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pid: int, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_a_trainer_stuck_holding_the_interpreter_lock_is_ended_after_the_grace():
    proc = subprocess.Popen([sys.executable, "-c", STUCK], cwd=REPO_ROOT, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        watcher = int(proc.stdout.readline().split()[1])
        time.sleep(0.5)                        # inside the match by now
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)                 # hours without the watcher
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert "did not exit within the preemption grace of 2 s" in proc.stderr.read()
    assert "returned" not in proc.stdout.read()
    assert wait_gone(watcher), "the watcher outlived the trainer"


def test_the_watcher_exits_when_the_flag_is_restored():
    proc = subprocess.run([sys.executable, "-c", CLEAN], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    watcher = int(proc.stdout.split()[1])
    assert "restored" in proc.stdout and wait_gone(watcher)


FORKED = """
import os, signal, time
from lightrft.trainer.preemption import PreemptionFlag
flag = PreemptionFlag(0.5, hard_exit_margin=0.5)
flag.install()
child = os.fork()
if child == 0:                       # a data-loader-like worker, ended by SIGTERM
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    time.sleep(60)
    os._exit(1)
time.sleep(0.3)
os.kill(child, signal.SIGTERM)
os.waitpid(child, 0)
time.sleep(3)                        # past the grace and the margin: the watcher must not have fired
flag.restore()
print("alive", flush=True)
"""


def test_a_forked_worker_ended_by_sigterm_does_not_arm_the_trainers_watcher():
    proc = subprocess.run([sys.executable, "-c", FORKED], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "alive" in proc.stdout, (proc.returncode, proc.stderr[-2000:])
