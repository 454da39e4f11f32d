"""Workers that never outlive their launcher.

`torchrun` starts one process per rank and is their parent. When torchrun itself is killed with
SIGKILL (a scheduler tearing a job down, a closed terminal, the OOM killer), it cannot forward a
signal to the ranks, and without help they run on as orphans, still writing checkpoints.

`install_lifeline` makes a rank notice within about a second that its parent is gone and then
behave as if it had been preempted: it sends itself SIGTERM, which the trainers turn into "finish
the step, save a checkpoint, exit 0" (`lightrft.trainer.checkpoint.PreemptionFlag`). With the
launcher gone the other ranks may be gone too, and a collective waiting for a dead peer would
block for the whole `--dist_timeout`; so a hard deadline ends the process `grace` seconds after
the parent died whatever it is doing (exit code 143, like the preemption watchdog). Checkpoints
are crash-consistent, so the newest complete one stays loadable either way.

Two mechanisms, because each misses cases the other covers:

- on Linux, `prctl(PR_SET_PDEATHSIG)` makes the kernel signal the rank the moment its parent
  exits. The signal is a dedicated one (SIGUSR2) whose handler checks that the parent really
  changed, because the kernel also sends it when the *thread* that started the rank exits;
- a daemon thread compares `os.getppid()` with the parent recorded at start, once per
  `poll_interval`. It works on every POSIX system and, unlike a Python signal handler, runs while
  the main thread is blocked inside a C call (a collective waiting for a dead peer): the hard
  deadline is enforced from this thread.
"""

import ctypes
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_DEATH_SIGNAL = signal.SIGUSR2
ORPHAN_EXIT_CODE = 143  # 128 + SIGTERM, as when a launcher kills a rank after its grace period


def launched_by_torchrun() -> bool:
    """True in a process started by torchrun (the elastic agent sets TORCHELASTIC_RUN_ID)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def set_parent_death_signal(sig: int) -> bool:
    """Asks the Linux kernel to send `sig` to this process when its parent exits. Returns False
    where that is not available (not Linux, no libc), so the caller relies on polling alone."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@dataclass
class Lifeline:
    """Watches the parent recorded at `install` time; see the module docstring.

    `on_orphan` runs once, from the watcher thread or the signal handler, when the parent is
    gone (default: send this process SIGTERM). `grace` seconds later the process exits with
    `exit_code` unless it has exited by itself. `grace=0` exits at once without `on_orphan`."""

    grace: float = 30.0
    poll_interval: float = 1.0
    exit_code: int = ORPHAN_EXIT_CODE
    on_orphan: object = None
    parent_pid: int = field(default_factory=os.getppid)
    orphaned_at: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)
    _previous_handler: object = field(default=None, repr=False)

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    def install(self) -> "Lifeline":
        """Arms the kernel signal (Linux, main thread only) and starts the watcher thread. The
        parent is checked once more afterwards: it may have died before the signal was armed."""
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(PARENT_DEATH_SIGNAL, self._on_signal)
            set_parent_death_signal(PARENT_DEATH_SIGNAL)
        self._thread = threading.Thread(target=self._watch, name="lightrft-lifeline", daemon=True)
        self._thread.start()
        if not self.parent_alive():
            self._orphaned()
        return self

    def uninstall(self) -> None:
        """Stops watching (the kernel signal is disarmed too). Does not cancel a deadline that
        has already started: an orphan still exits."""
        self._stop.set()
        if threading.current_thread() is threading.main_thread() and self._previous_handler is not None:
            set_parent_death_signal(0)
            signal.signal(PARENT_DEATH_SIGNAL, self._previous_handler)
            self._previous_handler = None

    def _on_signal(self, signum, frame) -> None:
        if not self.parent_alive():  # not a thread of a still-living launcher exiting
            self._orphaned()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_interval):
            if not self.parent_alive():
                self._orphaned()
                return

    def _orphaned(self) -> None:
        with self._lock:
            if self.orphaned_at is not None:
                return
            self.orphaned_at = time.monotonic()
        deadline = threading.Thread(target=self._hard_exit, name="lightrft-lifeline-deadline", daemon=True)
        deadline.start()
        if self.grace <= 0:
            return
        print(f"[pid {os.getpid()}] the launcher (pid {self.parent_pid}) is gone: stopping this rank; it "
              f"saves a checkpoint if it can within {self.grace:.0f} s, then exits", file=sys.stderr, flush=True)
        (self.on_orphan or _send_sigterm)()

    def _hard_exit(self) -> None:
        time.sleep(max(self.grace, 0.0))
        print(f"[pid {os.getpid()}] the launcher (pid {self.parent_pid}) is gone and this rank did not stop "
              f"within {self.grace:.0f} s (a peer may be gone too); exiting now with code {self.exit_code}, the "
              "newest complete checkpoint is kept", file=sys.stderr, flush=True)
        os._exit(self.exit_code)


def exit_with_parent(parent_pid: int, arm_death_signal: bool, thread_name: str) -> None:
    """Makes a worker process die with the process that started it (`parent_pid`): SIGKILL from
    the kernel when the parent exits (Linux; armed only when the parent's main thread started the
    worker, since the signal follows the starting thread), and a watcher thread (`thread_name`)
    that compares getppid() once a second."""
    if arm_death_signal:
        set_parent_death_signal(signal.SIGKILL)

    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(1.0)

    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watch, name=thread_name, daemon=True).start()


def _send_sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def install_lifeline(grace: float = 30.0, poll_interval: float = 1.0, on_orphan=None) -> Lifeline:
    """Makes this process stop when its parent dies (module docstring): SIGTERM to itself at once,
    a hard exit `grace` seconds later. Returns the `Lifeline` (call `uninstall()` when done)."""
    return Lifeline(grace=grace, poll_interval=poll_interval, on_orphan=on_orphan).install()


ORPHAN_GRACE_CAP = 60.0  # seconds; see `lifeline_for_launcher`


def lifeline_for_launcher(preemption_grace: float) -> Lifeline | None:
    """The lifeline a training command installs under torchrun (None otherwise: a plain `python`
    run started with nohup must survive its shell). An orphaned rank gets the preemption grace
    to save, at most `ORPHAN_GRACE_CAP` seconds: the job is being torn down, and a peer that is
    gone makes every collective hang."""
    if not launched_by_torchrun():
        return None
    return install_lifeline(grace=min(preemption_grace, ORPHAN_GRACE_CAP))
