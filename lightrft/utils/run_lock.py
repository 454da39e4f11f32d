"""One writer per checkpoint folder.

Two runs writing checkpoints into the same `--ckpt_path` overwrite each other's `latest` pointer
and rotate away each other's checkpoints. A run therefore holds an exclusive `flock` on
`<ckpt_path>/.lock` from start to exit, and writes a holder record into that file (host, pid,
start time, command line) so that a second run is refused with a message saying who holds it.

The kernel releases a `flock` when its holder dies, however it dies, so a lock left by a killed
run is simply taken over; its record, still in the file, is reported as stale and replaced. The
file itself is never deleted: deleting it would let a third process lock a fresh file while the
second still holds the old one.

Only rank 0 of a job takes the lock. Ranks of the same job need no lock of their own: they cannot
write a checkpoint without rank 0 (every save is a collective), and when rank 0 is refused it exits
before joining the process group, so the launcher stops the job's other ranks.

`serve --record` holds the same lock on its record folder (`lightrft.serving.records`).
"""

import contextlib
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path

from lightrft.utils.secrets import redact_argv

LOCK_NAME = ".lock"


class RunLockError(RuntimeError):
    """The folder is held by another run (or cannot be locked); the message names the folder, the
    holder and the fix."""


def holder_record() -> dict:
    """What this process writes into the lock file: who holds the folder."""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": shlex.join(redact_argv(sys.argv))}


def describe(record: dict | None) -> str:
    if not record:
        return "an unknown process (no holder record)"
    return (f"pid {record.get('pid')} on host {record.get('host')}, started {record.get('started')}, "
            f"command: {record.get('command')}")


class RunLock:
    """An exclusive lock on `folder/.lock` (the folder is created if missing). Messages name the
    folder as `what` ("checkpoint folder"), given by `flag`, and say the rule as "Only one run may
    `action` a folder" (other folders with one writer: `serve --record`'s record folder).

    `acquire()` raises `RunLockError` when another process holds it; `release()` (or leaving the
    `with` block) clears the record and unlocks. `taken_over` holds the stale record of a dead
    holder when `acquire` replaced one (printed on stderr with `report_takeover`)."""

    def __init__(self, folder: str | os.PathLike, flag: str = "--ckpt_path", report_takeover: bool = False,
                 what: str = "checkpoint folder", action: str = "write checkpoints into"):
        self.folder = Path(folder).expanduser()
        self.path = self.folder / LOCK_NAME
        self.flag = flag
        self.what = what
        self.action = action
        self.report_takeover = report_takeover
        self.taken_over: dict | None = None
        self._fd: int | None = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "RunLock":
        if self._fd is not None:
            return self
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RunLockError(f"cannot create the {self.what} {self.folder} ({self.flag}): "
                               f"{err.strerror or err}; choose a writable folder") from None
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise RunLockError(
                        f"the {self.what} {self.folder} ({self.flag}) is in use by another run: "
                        f"{describe(read_record(self.path))}. Only one run may {self.action} a folder: "
                        f"wait for that run to finish or stop it, or pass a different {self.flag}") from None
                raise RunLockError(f"cannot lock {self.path} ({self.flag}): {err.strerror or err}; the file "
                                   f"system may not support flock (put the {self.what} on a local disk or an NFS "
                                   "mount with locking)") from None
            # The file we locked must still be the one at the path (see the module docstring).
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self._fd = fd
        previous = read_record(self.path)
        self.taken_over = previous or None
        self._write(holder_record())
        if self.taken_over and self.report_takeover:
            print(f"{self.folder} ({self.flag}): taking over the lock left by a run that is no longer running "
                  f"({describe(self.taken_over)})", file=sys.stderr, flush=True)
        return self

    def release(self) -> None:
        """Clears the record and unlocks; safe to call twice."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass  # the lock is released below all the same; a stale record is reported, never trusted
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise RunLockError(f"cannot open {self.path} ({self.flag}): {err.strerror or err}; choose a "
                               "writable folder") from None

    def _write(self, record: dict) -> None:
        data = (json.dumps(record) + "\n").encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)


def read_record(path: str | os.PathLike) -> dict | None:
    """The holder record in a lock file, or None when it is empty or unreadable."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    try:
        record = json.loads(text) if text.strip() else None
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def checkpoint_folder_lock(ckpt_path: str | os.PathLike | None, rank: int):
    """The lock a training command holds on its `--ckpt_path` for the whole run: a `RunLock` on
    rank 0 (which reports a taken-over stale record on stderr), a no-op on the other ranks of the
    job and without a folder (module docstring)."""
    if rank != 0 or not ckpt_path:
        return contextlib.nullcontext()
    return RunLock(ckpt_path, report_takeover=True)
