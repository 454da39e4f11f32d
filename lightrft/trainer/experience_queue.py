"""What flows between explorers and trainers, and the record of every prompt.

- `RolloutBatch`: one trainer's share of a scored rollout batch, with the policy version that
  generated it (explorer -> trainer over the experience channel).
- `ExperienceReceiver` (trainer side): a thread that takes batches off the channel into a bounded
  buffer. When the buffer is full it stops receiving, so the explorers' sends wait
  (back-pressure) and nothing is dropped on the way.
- `WeightPublisher` (trainer rank 0) and `WeightSubscriber` (explorers): new weights, retries and
  the stop signal over the control channel; the weights themselves go inline (`broadcast`) or
  through a folder (`checkpoint`). The subscriber always receives at once, so publishing never
  waits on generation.
- `PromptLedger`: which prompts were generated, dropped as too stale, and trained at which step.
  It travels in every checkpoint, so a resumed run knows exactly which prompts its weights have
  seen; a prompt trained twice in one episode is an error, not a silent duplicate.

No path waits in a cycle: trainers wait only for batches, explorers for weights or for buffer
space, and the two threads only for the channel.
"""

import os
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from lightrft.rollout.base import RolloutOutput
from lightrft.strategy.checkpoint_io import load_plain
from lightrft.trainer.roles import flatten_tensors, unflatten_tensors, wire_type

wire_type(RolloutOutput)    # sent inside RolloutBatch, as plain data (lightrft.trainer.roles)


@wire_type
@dataclass
class RolloutBatch:
    """One trainer's share of rollout batch `batch` (0-based; trained at step batch + 1)."""

    batch: int
    episode: int
    version: int                    # trainer steps behind the weights that generated it
    prompt_ids: list[int]           # dataset rows of the whole batch, in batch order
    rollout: RolloutOutput          # their samples, G per prompt, contiguous
    scores: torch.Tensor            # (B,) combined reward
    valid: torch.Tensor             # (B,) bool
    seconds: dict = field(default_factory=dict)   # generate / reward time on the explorer


DONE = "done"           # an explorer's last message: nothing more will come
FAILED = "failed"       # (FAILED, traceback text): an explorer stopped on an error


class ExperienceReceiver:
    """Receives this trainer's rollout batches from `explorers` senders on `channel` into a
    buffer of at most `capacity` batches (more only while the batch the trainer waits for is
    missing, so a slow explorer never deadlocks the others)."""

    def __init__(self, channel, explorers: int, capacity: int):
        self.channel, self.explorers, self.capacity = channel, explorers, capacity
        self.pending: dict[int, RolloutBatch] = {}
        self.wanted: Optional[int] = None
        self.finished = self.draining = False
        self.error: Optional[BaseException] = None
        self.received = 0
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="lightrft-experience-receiver", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _room(self) -> bool:
        return (self.draining or len(self.pending) < self.capacity
                or (self.wanted is not None and self.wanted not in self.pending))

    def _run(self) -> None:
        done = set()
        try:
            while len(done) < self.explorers:
                with self.cond:
                    self.cond.wait_for(self._room)
                message, source = self.channel.recv()
                if isinstance(message, str) and message == DONE:
                    done.add(source)
                    continue
                if isinstance(message, tuple) and message[0] == FAILED:
                    done.add(source)
                    with self.cond:
                        self.error = RuntimeError(f"an explorer failed:\n{message[1]}")
                        self.cond.notify_all()
                    continue
                with self.cond:
                    self.received += 1
                    if not self.draining:
                        self.pending[message.batch] = message
                    self.cond.notify_all()
        except BaseException as err:  # surfaced in the trainer's thread by `take`
            self.error = RuntimeError(f"the experience channel from the explorers failed: {err!r}")
        with self.cond:
            self.finished = True
            self.cond.notify_all()

    def take(self, batch: int, interrupted=lambda: False) -> Optional[RolloutBatch]:
        """Waits for rollout batch `batch`; None when the explorers ended without sending it, or
        as soon as `interrupted()` holds (checked twice a second: a preempted trainer must not
        wait for explorers that may be gone)."""
        with self.cond:
            self.wanted = batch
            self.cond.notify_all()
            while not self.cond.wait_for(lambda: batch in self.pending or self.finished or self.error is not None,
                                         timeout=0.5):
                if interrupted():
                    return None
            if self.error is not None:
                raise self.error
            taken = self.pending.pop(batch, None)
            self.wanted = None
            self.cond.notify_all()      # room for the next batch
            return taken

    def drain(self) -> None:
        """From now on: receive (and drop) whatever the explorers still send, until each has said
        it is done (after the stop signal), so no explorer is left blocked in a send."""
        with self.cond:
            self.draining = True
            self.pending.clear()
            self.cond.notify_all()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)


class WeightPublisher:
    """Trainer rank 0's side of the control channel: publishes (version, weights) and control
    messages in order from a thread, holding at most one unsent set of weights."""

    def __init__(self, channel, method: str = "broadcast", sync_dir: Optional[str] = None, keep: int = 2):
        self.channel, self.method, self.keep = channel, method, keep
        self.sync_dir = Path(sync_dir) if sync_dir else None
        if method == "checkpoint":
            self.sync_dir.mkdir(parents=True, exist_ok=True)
        self.outbox: queue.Queue = queue.Queue(maxsize=1)
        self.error: Optional[BaseException] = None
        self.published = 0
        self.thread = threading.Thread(target=self._run, name="lightrft-weight-publisher", daemon=True)
        self.thread.start()

    def publish(self, version: int, named: list[tuple[str, torch.Tensor]], start_batch: int) -> None:
        """Queues the weights of `version` (copied to host memory here, so training may go on)."""
        self._check()
        spec = [(name, tuple(t.shape), t.dtype) for name, t in named]
        self.outbox.put(({"kind": "weights", "version": version, "start_batch": start_batch, "spec": spec},
                         flatten_tensors([t for _, t in named])))

    def send(self, message: dict) -> None:
        self._check()
        self.outbox.put((message, None))

    def close(self, timeout: float) -> None:
        self.outbox.put(({"kind": "stop"}, None))
        self.thread.join(timeout)

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"sending weights to the explorers failed: {self.error}") from self.error

    def _run(self) -> None:
        try:
            while True:
                message, data = self.outbox.get()
                if data is not None and self.method == "checkpoint":
                    message = {**message, "path": str(self._write(message, data))}
                    data = None
                self.channel.publish(message, data)
                self.published += message["kind"] == "weights"
                if message["kind"] == "stop":
                    return
        except BaseException as err:
            self.error = err

    def _write(self, message: dict, data: torch.Tensor) -> Path:
        """`<sync_dir>/policy_v<version>.pt`, written whole or not at all; older ones pruned."""
        path = self.sync_dir / f"policy_v{message['version']:08d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save({"version": message["version"], "spec": message["spec"], "data": data}, tmp)
        os.replace(tmp, path)
        for old in sorted(self.sync_dir.glob("policy_v*.pt"))[:-self.keep]:
            old.unlink(missing_ok=True)
        return path


def latest_published(sync_dir: str | os.PathLike) -> Optional[tuple[int, list[tuple[str, torch.Tensor]]]]:
    """The newest (version, named weights) in a `--sync_method checkpoint` folder, or None: what an
    explorer running as a separate job polls."""
    files = sorted(Path(sync_dir).glob("policy_v*.pt"))
    return read_published(files[-1]) if files else None


def read_published(path: str | os.PathLike) -> tuple[int, list[tuple[str, torch.Tensor]]]:
    """(version, named weights) of one file `WeightPublisher` wrote: a dict of an int, the spec
    (names, shapes, dtypes) and one uint8 tensor, so it is read as plain data (`load_plain`): a file
    holding any other object is refused unread."""
    state = load_plain(path, f"published weights {path} (--sync_method checkpoint)")
    return state["version"], unflatten_tensors(state["data"], state["spec"])


class WeightSubscriber:
    """An explorer's side of the control channel: a thread that receives every message at once
    and keeps the published weights the explorer may still need (by version), the retry
    requests addressed to this explorer and the stop signal."""

    def __init__(self, channel, explorer_index: int):
        self.channel, self.explorer_index = channel, explorer_index
        self.versions: dict[int, list] = {}     # version -> named weights, oldest first
        self.start_batch: Optional[int] = None  # the first message's: where the trainers stand
        self.retries: list[int] = []
        self.stopped = False
        self.error: Optional[BaseException] = None
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="lightrft-weight-subscriber", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                message, data = self.channel.receive()
                if message["kind"] == "weights":
                    named = (read_published(message["path"])[1] if "path" in message
                             else unflatten_tensors(data, message["spec"]))
                    with self.cond:
                        self.versions[message["version"]] = named
                        if self.start_batch is None:
                            self.start_batch = message["start_batch"]
                        self.cond.notify_all()
                elif message["kind"] == "retry":
                    if message["explorer"] == self.explorer_index:
                        with self.cond:
                            self.retries.append(message["batch"])
                            self.cond.notify_all()
                elif message["kind"] == "stop":
                    break
        except BaseException as err:
            self.error = err
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def wait(self, predicate) -> None:
        """Blocks until `predicate()` holds or the trainers said stop; raises if the channel failed."""
        with self.cond:
            self.cond.wait_for(lambda: self.stopped or predicate())
        if self.error is not None:
            raise RuntimeError(f"the control channel from the trainers failed: {self.error}") from self.error

    def wake(self) -> None:
        """Makes a waiting `wait` re-check its predicate (something else changed)."""
        with self.cond:
            self.cond.notify_all()

    def newest(self) -> int:
        """The newest version received; -1 before the first."""
        with self.cond:
            return max(self.versions, default=-1)

    def take(self, needed: int, newest: bool = False) -> tuple[int, list]:
        """The oldest received version >= `needed` (or the newest one), forgetting older ones:
        an explorer generates with exactly the version its batch calls for, so a run is
        reproducible whatever the timing."""
        with self.cond:
            candidates = [v for v in self.versions if v >= needed]
            version = max(self.versions) if newest or not candidates else min(candidates)
            for old in [v for v in self.versions if v < version]:
                del self.versions[old]
            return version, self.versions[version]


class PromptLedger:
    """Every rollout batch's fate: received from an explorer, dropped as too stale, trained at a
    step. `trained[s]` holds the dataset rows trained at step s + 1; what a checkpoint holds is
    exactly what its weights have learned from."""

    def __init__(self):
        self.received = 0
        self.dropped = 0
        self.trained: list[dict] = []    # {"step", "batch", "episode", "version", "prompts"}

    def record_trained(self, step: int, batch: RolloutBatch) -> None:
        seen = {p for entry in self.trained if entry["episode"] == batch.episode for p in entry["prompts"]}
        twice = sorted(seen.intersection(batch.prompt_ids))
        if twice:
            raise RuntimeError(f"prompt ledger: rows {twice[:5]} of episode {batch.episode} would be trained a second "
                               f"time at step {step} (rollout batch {batch.batch}); this is a bug, please report it")
        self.trained.append({"step": step, "batch": batch.batch, "episode": batch.episode, "version": batch.version,
                             "prompts": list(batch.prompt_ids)})

    def state_dict(self) -> dict:
        return {"received": self.received, "dropped": self.dropped, "trained": list(self.trained)}

    def load_state_dict(self, state: dict) -> None:
        self.received, self.dropped = state["received"], state["dropped"]
        self.trained = list(state["trained"])
