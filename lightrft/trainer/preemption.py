"""Preemption: SIGTERM / SIGUSR1 end a run at its next safe point, after a checkpoint."""

import os
import signal
import subprocess
import sys
import threading
import time


# The hard exit's watcher: a separate process that reads the signal numbers the trainer's C-level
# signal handler writes to the wakeup pipe (`signal.set_wakeup_fd`, written with no Python code
# and no interpreter lock), and after SIGTERM/SIGUSR1 waits the grace period (plus a margin) and
# ends the trainer if it is still there. It ignores SIGTERM/SIGINT itself (a scheduler signals the
# whole process group), and exits when the pipe closes: when the trainer ends, however it ends.
_WATCHER = """
import os, select, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
fd, parent, grace = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
watched = {int(s) for s in sys.argv[4].split(",")}
deadline = None
while True:
    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
    ready, _, _ = select.select([fd], [], [], timeout)
    if ready:
        data = os.read(fd, 256)
        if not data:
            sys.exit(0)
        if deadline is None and watched & set(data):
            deadline = time.monotonic() + grace
        continue
    try:
        os.kill(parent, 0)
    except ProcessLookupError:
        sys.exit(0)
    print(f"lightrft: the trainer (pid {parent}) did not exit within the preemption grace of {grace:.0f} s after "
          "its signal (its main thread did not return to Python: a call that never ends while holding the "
          "interpreter lock); killing it. The newest complete checkpoint is kept.", file=sys.stderr, flush=True)
    os.kill(parent, signal.SIGKILL)
    sys.exit(0)
"""
WATCHER_MARGIN = 30.0        # seconds the watcher adds to the grace: the in-process timer acts first
_WATCHED_WAKEUP = [None]     # the wakeup pipe's write end while a watcher runs


def _forget_wakeup_in_child() -> None:
    """A process forked from the trainer (a data-loader worker) inherits the wakeup pipe; a
    SIGTERM that ends the worker would then arm the trainer's watcher. The child drops it."""
    if _WATCHED_WAKEUP[0] is None:
        return
    try:
        signal.set_wakeup_fd(-1)
        os.close(_WATCHED_WAKEUP[0])
    except (OSError, ValueError):
        pass
    _WATCHED_WAKEUP[0] = None


os.register_at_fork(after_in_child=_forget_wakeup_in_child)


class PreemptionFlag:
    """Records SIGTERM / SIGUSR1 so the loop can finish its step, save and exit at the next safe
    point. If that takes longer than `grace_seconds` after the signal, a watchdog ends the process
    (exit code 143): checkpoints are crash-consistent, so the newest complete one stays loadable.
    That timer is a Python thread; where the main thread never gives the interpreter back (a C
    call that holds its lock forever), a watcher process (`hard_exit`, the main thread only) kills
    the process `hard_exit_margin` seconds later, whatever the trainer is doing."""

    def __init__(self, grace_seconds: float = 600.0, hard_exit: bool = True, hard_exit_margin: float = WATCHER_MARGIN):
        self.grace_seconds = grace_seconds
        self.raised = False
        self.received_at = None
        self._previous = {}
        self._watchdog = None
        self.hard_exit, self.hard_exit_margin = hard_exit, hard_exit_margin
        self._watcher = self._wakeup = self._previous_wakeup = None

    def install(self):
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            self._previous[sig] = signal.signal(sig, self._handle)
        if self.hard_exit and threading.current_thread() is threading.main_thread():
            self._start_watcher()

    def _start_watcher(self) -> None:
        """The hard exit (`_WATCHER`): the in-process timer below needs the main thread to run the
        Python handler, which a call holding the interpreter lock forever never lets happen."""
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            self._watcher = subprocess.Popen(
                [sys.executable, "-c", _WATCHER, str(read), str(os.getpid()),
                 str(self.grace_seconds + self.hard_exit_margin), f"{int(signal.SIGTERM)},{int(signal.SIGUSR1)}"],
                pass_fds=(read,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            self._previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            self._wakeup = _WATCHED_WAKEUP[0] = write
        except (OSError, ValueError):      # no hard exit, the in-process timer still works
            os.close(write)
            self._watcher = None
        finally:
            os.close(read)

    def _stop_watcher(self) -> None:
        if self._wakeup is None:
            return
        signal.set_wakeup_fd(self._previous_wakeup if self._previous_wakeup is not None else -1)
        os.close(self._wakeup)
        _WATCHED_WAKEUP[0] = None              # the watcher reads end of file and exits
        self._wakeup = None
        try:
            self._watcher.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._watcher.kill()
            self._watcher.wait()
        self._watcher = None

    def _handle(self, signum, frame):
        if self.raised:
            return
        self.raised = True
        self.received_at = time.time()
        print(f"received {signal.Signals(signum).name}: finishing this step, then saving a checkpoint and "
              f"exiting (at most {self.grace_seconds:.0f} s)", flush=True)
        self._watchdog = threading.Timer(self.grace_seconds, self._expire)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _expire(self):
        print(f"the preemption grace period of {self.grace_seconds:.0f} s ran out before the checkpoint was "
              "written; exiting now, the newest complete checkpoint is kept", flush=True)
        os._exit(143)

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        self._stop_watcher()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
