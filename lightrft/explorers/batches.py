"""What flows from explorers to trainers: scored rollout batches.

- `RolloutBatch`: one trainer's share of a scored rollout batch, with the policy version that
  generated it (explorer -> trainer over the experience channel).
- `ExperienceReceiver` (trainer side): a thread that takes batches off the channel into a bounded
  buffer. When the buffer is full it stops receiving, so the explorers' sends wait
  (back-pressure) and nothing is dropped on the way.

No path waits in a cycle: trainers wait only for batches, explorers for weights (`weights.py`) or
for buffer space, and the two threads only for the channel.
"""


import threading
from dataclasses import dataclass, field
from typing import Optional

import torch

from lightrft.rollout.base import RolloutOutput
from lightrft.explorers.roles import wire_type

wire_type(RolloutOutput)    # sent inside RolloutBatch, as plain data (lightrft.explorers.roles)


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
    token_rewards: Optional[torch.Tensor] = None  # (B, A) per-turn rewards of multi-turn episodes
    info: dict = field(default_factory=dict)      # (B,) per-episode numbers (turns, tool calls, ...)


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
