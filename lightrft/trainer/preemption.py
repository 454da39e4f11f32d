"""Preemption: SIGTERM / SIGUSR1 end a run at its next safe point, after a checkpoint."""

import os
import signal
import threading
import time


class PreemptionFlag:
    """Records SIGTERM / SIGUSR1 so the loop can finish its step, save and exit at the next safe
    point. If that takes longer than `grace_seconds` after the signal, a watchdog ends the process
    (exit code 143): checkpoints are crash-consistent, so the newest complete one stays loadable."""

    def __init__(self, grace_seconds: float = 600.0):
        self.grace_seconds = grace_seconds
        self.raised = False
        self.received_at = None
        self._previous = {}
        self._watchdog = None

    def install(self):
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            self._previous[sig] = signal.signal(sig, self._handle)

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
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
