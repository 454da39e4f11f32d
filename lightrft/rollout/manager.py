"""The one owner of a rollout engine's lifecycle: wake, sync weights when stale, generate, sleep.

Experience making and evaluation both generate through a `RolloutManager`, so neither can sample
from a sleeping engine or from weights older than the trainer's. The trainer tells the manager
when its weights changed (`mark_stale`, after each optimizer phase) and when it needs the memory
back (`sleep`, before the training passes); the manager does the rest on the next `generate`:

    wake_up -> update_weights(bucket) for each bucket, if stale -> generate

Every rank must call `generate` (and so the sync) at the same points: under ZeRO-3 each bucket is a
collective gather. The stale flag changes only through these calls, so ranks stay in step.
"""

import time
from collections.abc import Callable, Iterable

import torch

from lightrft.rollout.base import RolloutEngine, RolloutOutput, SamplingParams

WeightBuckets = Callable[[], Iterable[list[tuple[str, torch.Tensor]]]]


class RolloutManager:
    """Wraps a `RolloutEngine` and keeps its weights in step with the trainer.

    Args:
        engine: the rollout engine. One with `shares_live_weights = True` (`HFEngine`) decodes
            with the trainer's module and is never synced.
        weight_buckets: called once per sync; returns the actor's weights as an iterable of
            buckets, each a list of `(Hugging Face name, tensor)` holding whole decoder layers
            (`DeepspeedStrategy.iter_parameter_buckets`). Required unless the engine shares live
            weights.

    A separate engine starts stale: it was built from the pretrained folder, while the actor may
    hold different weights (a resumed checkpoint), so the first `generate` syncs.
    """

    def __init__(self, engine: RolloutEngine, weight_buckets: WeightBuckets | None = None):
        self.engine = engine
        self.shares_live_weights = bool(getattr(engine, "shares_live_weights", False))
        if weight_buckets is None and not self.shares_live_weights:
            raise ValueError(f"{type(engine).__name__} holds its own copy of the weights: RolloutManager needs "
                             "weight_buckets to sync it (RolloutManager.for_actor builds them from the strategy)")
        self.weight_buckets = weight_buckets
        self.stale = not self.shares_live_weights
        self.asleep = False
        self.syncs = 0                 # weight syncs done so far
        self.last_sync_seconds = 0.0   # duration of the latest sync
        self.last_sync_bytes = 0       # bytes of weights moved by the latest sync

    @classmethod
    def for_actor(cls, engine: RolloutEngine, strategy, actor, prefix: str = "model.",
                  bucket_mb: float | None = None) -> "RolloutManager":
        """A manager syncing `engine` from `actor` (an `ActorLanguage`, its Hugging Face model under
        `prefix`) through `strategy.iter_parameter_buckets`, in buckets of `bucket_mb` MB
        (default: the engine's `sync_bucket_mb`, `--vllm_sync_bucket_mb`)."""
        if getattr(engine, "shares_live_weights", False):
            return cls(engine)
        size = bucket_mb if bucket_mb is not None else engine.sync_bucket_mb
        return cls(engine, lambda: strategy.iter_parameter_buckets(actor, size, prefix=prefix))

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None) -> RolloutOutput:
        """Wakes the engine, brings its weights up to date if they are stale, and generates
        (`RolloutEngine.generate`: one call for the whole rollout, one seed per prompt)."""
        self.wake_up()
        if self.stale:
            self.sync_weights()
        return self.engine.generate(prompt_token_ids, params, seeds=seeds)

    def mark_stale(self) -> None:
        """The trainer changed the weights (an optimizer phase ended): sync before the next
        generate. Free for an engine that shares live weights."""
        if not self.shares_live_weights:
            self.stale = True

    def sleep(self) -> None:
        """Frees the engine's memory for the training passes (where the platform can)."""
        if not self.asleep:
            self.engine.sleep()
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.engine.wake_up()
            self.asleep = False

    def sync_weights(self) -> None:
        """Pushes the trainer's weights to the engine now, bucket by bucket (all ranks together)."""
        if self.shares_live_weights:
            self.stale = False
            return
        self.wake_up()
        started, moved = time.perf_counter(), 0
        for bucket in self.weight_buckets():
            self.engine.update_weights(bucket)
            moved += sum(t.numel() * t.element_size() for _, t in bucket)
        self.last_sync_seconds = time.perf_counter() - started
        self.last_sync_bytes = moved
        self.syncs += 1
        self.stale = False
