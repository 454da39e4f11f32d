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
so an answered request is on disk. A crash can leave at most a torn last line: the writer cuts it
off when it reopens the folder, and readers skip a last line without its newline.
"""

import hashlib
import json
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

EXPERIENCES_FILE = "experiences.jsonl"
FEEDBACK_FILE = "feedback.jsonl"


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


def _cut_torn_tail(path: Path) -> None:
    """Drops bytes after the last newline (a line a crash left half-written)."""
    if not path.exists():
        return
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep != len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
            os.fsync(f.fileno())


def _append_line(path: Path, line: str) -> None:
    with open(path, "ab") as f:
        f.write((line + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def iter_json_lines(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each complete line of a JSON-lines file; a last line without its
    newline (being written, or torn by a crash) is skipped. A malformed complete line is an error
    naming the file and line."""
    if not path.exists():
        return
    lines = path.read_bytes().split(b"\n")
    for number, raw in enumerate(lines[:-1], start=1):  # lines[-1] is b"" or a torn tail
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}:{number}: not a JSON object ({e}); the file is written by "
                             "lightrft.cli.serve --record, do not edit it by hand") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object, got {type(obj).__name__}")
        yield number, obj


class ExperienceRecorder:
    """Appends served responses and their rewards to a record folder; safe to call from several
    request threads at once."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.experiences_path = self.folder / EXPERIENCES_FILE
        self.feedback_path = self.folder / FEEDBACK_FILE
        self._lock = threading.Lock()
        with self._lock:
            _cut_torn_tail(self.experiences_path)
            _cut_torn_tail(self.feedback_path)
            # Feedback may name any response recorded in this folder, by earlier servers too.
            self._known = {(obj.get("id"), obj.get("index", 0)) for _, obj in iter_json_lines(self.experiences_path)}

    def record(self, record: ExperienceRecord) -> None:
        with self._lock:
            _append_line(self.experiences_path, record.to_json())
            self._known.add((record.id, record.index))

    def add_feedback(self, response_id: str, reward: float, index: int = 0) -> None:
        """Attaches `reward` to choice `index` of response `response_id`. Raises KeyError for an
        id this folder never recorded, ValueError for a reward that is not a finite number."""
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ValueError(f"'reward' must be a finite number, got {reward!r}")
        with self._lock:
            if (response_id, index) not in self._known:
                raise KeyError(f"no recorded response with id {response_id!r} and index {index} in {self.folder}")
            _append_line(self.feedback_path, json.dumps({"id": response_id, "index": index, "reward": float(reward),
                                                         "time": time.time()}))


def read_records(folder: str | Path) -> tuple[list[tuple[ExperienceRecord, float | None]], Path]:
    """Every recorded experience of `folder` in recording order, each with its reward (the last
    feedback for it, None without any). Returns the records and the experiences file (for errors)."""
    folder = Path(folder)
    path = folder / EXPERIENCES_FILE
    if not folder.is_dir() or not path.exists():
        raise FileNotFoundError(f"--recorded_data {folder}: no {EXPERIENCES_FILE} there; point it at the folder "
                                "given to lightrft.cli.serve --record")
    rewards = {}
    for _, obj in iter_json_lines(folder / FEEDBACK_FILE):
        rewards[(obj.get("id"), obj.get("index", 0))] = obj.get("reward")
    fields = set(ExperienceRecord.__dataclass_fields__)
    out = []
    for number, obj in iter_json_lines(path):
        missing = sorted(fields - set(obj))
        if missing:
            raise ValueError(f"{path}:{number}: the record lacks {', '.join(missing)}; was it written by "
                             "lightrft.cli.serve --record?")
        record = ExperienceRecord(**{k: obj[k] for k in fields})
        out.append((record, rewards.get((record.id, record.index))))
    return out, path
