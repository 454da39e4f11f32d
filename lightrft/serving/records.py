"""Experiences recorded by `lightrft.cli.serve --record DIR`, and the rewards attached to them later.

A record folder holds two append-only JSON-lines files:

- `experiences.jsonl`: one line per served response (one per choice of a request), written when
  the response is sent: `id` (the response id the client sees) and `index` (the choice), the
  prompt and response token ids, the sampling log-probs of the response tokens, the policy
  version that generated it, the prompt text (and chat `messages`), the response text, the
  sampling parameters with the request's seed, the tokenizer fingerprint and the time.
- `feedback.jsonl`: one line per `POST /v1/feedback {"id": ..., "index": 0, "reward": ...}`.
  When an experience gets several rewards, the last one counts.

Every line is written with one `write` and flushed to disk (`fsync`) before the server answers,
so an answered request is on disk. A write that fails (a full disk) is cut back off the file
before the error reaches the request (`RecordWriteError`), so a failed line leaves nothing behind.
A crash in the middle of a write can leave a torn last line: the next recorder on the folder cuts
it off. Readers skip every line that is not a whole record (torn by a crash, by an older lightrft
on a full disk, or edited by hand) and report the skipped lines by file and line number: a
warning, and `RecordFolder.skipped`.

One recorder writes into a folder at a time: `ExperienceRecorder` holds the folder's lock
(`DIR/.lock`, `lightrft.utils.run_lock`) until it is closed or its process exits.
"""

import atexit
import errno
import hashlib
import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from lightrft.utils.run_lock import RunLock

logger = logging.getLogger(__name__)

EXPERIENCES_FILE = "experiences.jsonl"
FEEDBACK_FILE = "feedback.jsonl"
FEEDBACK_FIELDS = ("id", "reward")
SHOWN_LINES = 5  # skipped lines a warning names one by one


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of the tokenizer's vocabulary (token -> id) and special tokens: records made
    with one tokenizer only train a model that tokenizes the same way."""
    payload = json.dumps({"vocab": tokenizer.get_vocab(), "eos": tokenizer.eos_token_id,
                          "bos": tokenizer.bos_token_id}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ExperienceRecord:
    """One served response, as stored in `experiences.jsonl` (see the module docstring)."""

    id: str
    index: int
    prompt_token_ids: list[int]       # (T_prompt,)
    response_token_ids: list[int]     # (A,)
    log_probs: list[float]            # (A,) the sampling distribution's log-probs of the response tokens
    policy_version: int
    tokenizer: str
    prompt: str
    response: str
    messages: list | None
    sampling: dict
    finish_reason: str
    time: float

    def to_json(self) -> str:
        return json.dumps(self.__dict__, ensure_ascii=False)


class RecordWriteError(OSError):
    """A line could not be appended to a record file (a full disk, a file size limit, an I/O error).
    The message names the file, the cause, what the file holds now and the fix; `errno` is the
    cause's."""

    def __init__(self, path: Path, cause: OSError, state: str):
        hints = {errno.ENOSPC: f"free space on the disk holding {path.parent}",
                 errno.EDQUOT: f"free space on the disk holding {path.parent}, or raise the quota",
                 errno.EFBIG: "the file is as large as this process may write (ulimit -f) or the file system "
                              "allows: record into a new folder (--record)"}
        hint = hints.get(cause.errno, f"check the disk holding {path.parent}")
        super().__init__(f"could not record in {path}: {cause.strerror or cause}; this line was not recorded and "
                         f"{state}; {hint}")
        self.errno = cause.errno


@dataclass
class SkippedLines:
    """Lines of one record file that a reader skipped, as (line number, reason); `total` counts the
    file's non-blank lines."""

    path: Path
    total: int = 0
    lines: list[tuple[int, str]] = field(default_factory=list)

    def summary(self) -> str:
        shown = ", ".join(f"line {number} ({reason})" for number, reason in self.lines[:SHOWN_LINES])
        more = f" and {len(self.lines) - SHOWN_LINES} more" if len(self.lines) > SHOWN_LINES else ""
        return (f"{self.path}: skipped {len(self.lines)} of {self.total} lines: {shown}{more}. A crash or a full "
                "disk tore them, or they were edited by hand; the other lines are used")

    def warn(self) -> None:
        if self.lines:
            logger.warning(self.summary())


def _parse_line(raw: bytes, required: Iterable[str]) -> tuple[dict | None, str | None]:
    """(the object, None) for a line holding a JSON object with the `required` keys, else (None, why not)."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return None, f"not JSON: {e.msg} at column {e.colno}"
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    if not isinstance(obj, dict):
        return None, f"a JSON {type(obj).__name__}, not an object"
    missing = [name for name in required if name not in obj]
    if missing:
        more = f" and {len(missing) - 4} more fields" if len(missing) > 4 else ""
        return None, f"lacks {', '.join(missing[:4])}{more}"
    return obj, None


def read_json_lines(path: Path, required: Iterable[str] = ()) -> tuple[list[tuple[int, dict]], SkippedLines]:
    """(line number, object) of each line of a JSON-lines file that is a JSON object with the
    `required` keys, and the lines skipped: every other non-blank line, and a last line without its
    newline (cut off by a crash, or still being written). A missing file has no lines."""
    required = tuple(required)
    skipped = SkippedLines(path)
    if not path.exists():
        return [], skipped
    lines = path.read_bytes().split(b"\n")  # lines[-1] is b"" when the file ends with a newline
    out = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        skipped.total += 1
        if number == len(lines):
            skipped.lines.append((number, "no newline at the end: cut off by a crash, or still being written"))
            continue
        obj, problem = _parse_line(raw, required)
        if problem is None:
            out.append((number, obj))
        else:
            skipped.lines.append((number, problem))
    return out, skipped


def _read_experiences(path: Path) -> tuple[list[ExperienceRecord], SkippedLines]:
    fields = ExperienceRecord.__dataclass_fields__
    lines, skipped = read_json_lines(path, fields)
    return [ExperienceRecord(**{k: obj[k] for k in fields}) for _, obj in lines], skipped


def _cut_torn_tail(path: Path) -> None:
    """Drops bytes after the last newline (a line a crash left half-written), saying so."""
    if not path.exists():
        return
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep != len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
            os.fsync(f.fileno())
        number = data.count(b"\n") + 1
        logger.warning(f"{path}: cut off line {number}, {len(data) - keep} bytes without a "
                       "newline at the end (a write cut short by a crash or a full disk)")


def _cut_back(fd: int, size: int) -> str:
    """Truncates a file to `size` after a failed write; says what the file holds now."""
    try:
        os.ftruncate(fd, size)
    except OSError as err:
        return (f"cutting its partial line back off failed too ({err.strerror or err}): readers skip it and the "
                "next write cuts it off")
    try:
        os.fsync(fd)
    except OSError:
        pass  # the truncation stands in the page cache, which is what readers and the next write see
    return "the file is left as it was before this write"


def _append_line(path: Path, line: str) -> None:
    """Appends `line` and its newline with one write and flushes it to disk (`fsync`). A write that
    fails (a full disk) is cut back off the file before `RecordWriteError` is raised, so the file
    never keeps part of a line; a torn tail left by a crash, or by a cut-back that failed, is cut
    off first."""
    data = (line + "\n").encode()
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as err:
        raise RecordWriteError(path, err, "nothing was written") from None
    size = None
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            _cut_torn_tail(path)
            size = os.fstat(fd).st_size
        written = os.write(fd, data)
        while written < len(data):  # the disk filled up within the line: writing the rest raises why
            step = os.write(fd, data[written:])
            if step == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            written += step
        os.fsync(fd)
    except OSError as err:
        state = "nothing was written" if size is None else _cut_back(fd, size)
        raise RecordWriteError(path, err, state) from None
    finally:
        os.close(fd)


class ExperienceRecorder:
    """Appends served responses and their rewards to a record folder; safe to call from several
    request threads at once.

    It holds the folder's lock from construction to `close()` (or the end of its process): a
    second recorder on the folder, in any process, is refused with `RunLockError` naming the folder
    and the holder's pid; the lock of a server that died is taken over (said on stderr). Opening
    cuts off a torn last line and warns about lines readers will skip. `record` and `add_feedback`
    raise `RecordWriteError` when the disk is full, leaving the files as they were."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.experiences_path = self.folder / EXPERIENCES_FILE
        self.feedback_path = self.folder / FEEDBACK_FILE
        self._lock = threading.Lock()
        self._folder_lock = RunLock(self.folder, flag="--record", report_takeover=True, what="record folder",
                                    action="record into").acquire()
        try:
            _cut_torn_tail(self.experiences_path)
            _cut_torn_tail(self.feedback_path)
            # Feedback may name any response recorded in this folder, by earlier servers too.
            experiences, skipped = _read_experiences(self.experiences_path)
        except BaseException:
            self._folder_lock.release()
            raise
        skipped.warn()
        self._known = {(r.id, r.index) for r in experiences}
        atexit.register(self.close)

    def __enter__(self) -> "ExperienceRecorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Releases the folder (another server may then record into it); safe to call twice."""
        with self._lock:
            self._folder_lock.release()
        atexit.unregister(self.close)

    def _check_open(self) -> None:
        if not self._folder_lock.held:
            raise RuntimeError(f"the recorder of {self.folder} is closed; open a new ExperienceRecorder")

    def record(self, record: ExperienceRecord) -> None:
        with self._lock:
            self._check_open()
            _append_line(self.experiences_path, record.to_json())
            self._known.add((record.id, record.index))

    def add_feedback(self, response_id: str, reward: float, index: int = 0) -> None:
        """Attaches `reward` to choice `index` of response `response_id`. Raises KeyError for an
        id this folder never recorded, ValueError for a reward that is not a finite number."""
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ValueError(f"'reward' must be a finite number, got {reward!r}")
        with self._lock:
            self._check_open()
            if (response_id, index) not in self._known:
                raise KeyError(f"no recorded response with id {response_id!r} and index {index} in {self.folder}")
            _append_line(self.feedback_path, json.dumps({"id": response_id, "index": index, "reward": float(reward),
                                                         "time": time.time()}))


@dataclass(frozen=True)
class RecordFolder:
    """What a record folder holds: its readable experiences in recording order, each with its
    reward (the last feedback for it, None without any); the experiences file (for errors); and
    the lines skipped, per file (files with none skipped left out)."""

    records: list[tuple[ExperienceRecord, float | None]]
    path: Path
    skipped: list[SkippedLines]


def read_record_folder(folder: str | Path) -> RecordFolder:
    """Reads a record folder (see `RecordFolder`), warning once per file that has skipped lines."""
    folder = Path(folder)
    path = folder / EXPERIENCES_FILE
    if not folder.is_dir() or not path.exists():
        raise FileNotFoundError(f"--recorded_data {folder}: no {EXPERIENCES_FILE} there; point it at the folder "
                                "given to lightrft.cli.serve --record")
    experiences, skipped_experiences = _read_experiences(path)
    feedback, skipped_feedback = read_json_lines(folder / FEEDBACK_FILE, FEEDBACK_FIELDS)
    rewards = {(obj["id"], obj.get("index", 0)): obj["reward"] for _, obj in feedback}
    skipped = [s for s in (skipped_experiences, skipped_feedback) if s.lines]
    for s in skipped:
        s.warn()
    return RecordFolder([(r, rewards.get((r.id, r.index))) for r in experiences], path, skipped)


def read_records(folder: str | Path) -> tuple[list[tuple[ExperienceRecord, float | None]], Path]:
    """Every readable recorded experience of `folder` in recording order, each with its reward (the
    last feedback for it, None without any). Returns the records and the experiences file (for
    errors). Lines that are not whole records are skipped with a warning naming the file and
    lines (`read_record_folder` returns them too)."""
    found = read_record_folder(folder)
    return found.records, found.path
