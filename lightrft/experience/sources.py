"""Where a training step's experience comes from: the `ExperienceSource` seam.

`PPOTrainer.fit` asks its source for one batch of experience per step and trains on it with the
same `PPOTrainer.step`, whatever made it:

- `ColocatedSource` (the default): this rank draws its prompts (`PromptSampler`), generates with
  the colocated engine, scores and builds experience (`RolloutServices`), refilling groups with
  dynamic sampling (DAPO) when asked. It holds the run's one rollout counter.
- `RecordedSource` (`lightrft/experience/recorded.py`): batches of served traffic
  (`train_ppo --recorded_data`); the recorded rewards score them.
- `ExplorerLink` (`lightrft/explorers/link.py`): explorer ranks or an explorer thread generate
  and score; this rank builds the experience with its current weights.

A source is given what it may use once, at `start` (a `SourceContext`: the run's generation,
scoring and experience-building services, the prompt sampler, a weight stream), each step's
sampling parameters as an argument of `next` (`PPOTrainer.sampling_params`, which a curriculum
overrides), and returns what it made with its counters (`SourceBatch`) instead of writing into
the trainer. Its resumable state travels in the
trainer's checkpoint (`state_dict` / `load_state_dict`, keys of the trainer's client state).
"""

import inspect
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch

from lightrft.config.sections import AlgorithmConfig
from lightrft.experience.builder import NONFINITE_SOURCES, BuiltExperience
from lightrft.experience.dynamic_sampling import sample_informative_batch
from lightrft.experience.samples import Experience
from lightrft.experience.services import PHASES, RolloutServices
from lightrft.rollout.base import SamplingParams

WeightBuckets = Callable[[], Iterable[list[tuple[str, torch.Tensor]]]]


class PromptSampler:
    """This rank's prompt batches, episode after episode, from a position in the run.

    Each episode's order is the dataloader's `DistributedSampler` shuffle of that episode (seeded
    by the run seed), so a run resumed after `consumed_samples` prompts draws what the
    uninterrupted run would have. `batches` holds no counter: the caller counts what it drew.
    With `endless` (dynamic sampling, which may need more prompts than the planned episodes hold)
    it goes on past the last episode."""

    def __init__(self, dataloader, rollout_batch_size: int, num_episodes: int, endless: bool = False):
        self.dataloader, self.rollout_batch_size = dataloader, rollout_batch_size
        self.num_episodes, self.endless = num_episodes, endless

    def batches(self, consumed_samples: int) -> Iterator[tuple[list, list]]:
        """(prompts, labels) of this rank, one rollout batch at a time, starting after
        `consumed_samples` prompts (counted over all ranks)."""
        per_episode = len(self.dataloader.dataset) // self.rollout_batch_size * self.rollout_batch_size
        episode, consumed_in_episode = divmod(consumed_samples, per_episode)
        while episode < self.num_episodes or self.endless:
            self.dataloader.sampler.set_epoch(episode, consumed_samples=consumed_in_episode)
            consumed_in_episode = 0
            for prompts, labels in self.dataloader:
                yield list(prompts), list(labels)
            episode += 1


@dataclass
class SourceContext:
    """What an experience source may use, handed over once by `PPOTrainer.fit`."""

    services: RolloutServices         # generation, scoring and experience building
    strategy: Any
    algo: AlgorithmConfig
    prompts: PromptSampler            # the run's prompts, for sources that draw them on this rank
    consumed_samples: int             # prompts the run has drawn so far (over all ranks)
    rollout_batch_size: int           # prompts per step, over all ranks
    total_steps: int                  # the steps the run plans
    first_step: int                   # the step the run starts at (> 0 when resumed)
    preempted: Callable[[], bool]     # whether this rank was asked to stop
    weight_buckets: Optional[WeightBuckets] = None   # the actor's weights, bucketed (publishing sources)
    adapter: Optional[dict] = None    # a LoRA actor's adapter name and config (`WeightStream.adapter_spec`)


@dataclass
class SourceBatch:
    """One step's experience and what making it counted."""

    experiences: list[Experience]
    prompts: int                                     # prompts drawn for it, over all ranks
    counters: dict[str, int] = field(default_factory=dict)      # added to the trainer's counters
    timings: dict[str, float] = field(default_factory=dict)     # seconds: generate, reward, experience
    # samples dropped for a non-finite value, per source (reward, logprob, advantage): the run's
    # totals (`rollout/nonfinite_*_samples`) are the trainer's, checkpointed with it
    nonfinite: dict[str, int] = field(default_factory=lambda: dict.fromkeys(NONFINITE_SOURCES, 0))

    @classmethod
    def of(cls, built: list[BuiltExperience], prompts: int, experiences: Optional[list[Experience]] = None,
           **kwargs) -> "SourceBatch":
        """The batch of one or more builds (dynamic sampling's rounds), their non-finite counts
        added up; `experiences` (default: all the builds') are those that train."""
        nonfinite = dict.fromkeys(NONFINITE_SOURCES, 0)
        for one in built:
            for name, count in one.nonfinite.items():
                nonfinite[name] += count
        if experiences is None:
            experiences = [e for one in built for e in one.experiences]
        return cls(experiences, prompts, nonfinite=nonfinite, **kwargs)


class ExperienceSource(Protocol):
    """The seam between making experience and training on it (see the module docstring)."""

    #: whether the samples come from the trainer's own rollout engine, synced to its weights, so a
    #: log-prob gap between the two means a broken sync (`PPOTrainer.check_engine_gap`)
    checks_engine: bool

    def start(self, context: SourceContext) -> None: ...

    def next(self, step: int, params: SamplingParams) -> Optional[SourceBatch]:
        """The experience of step `step` (0-based), sampled with `params` where this source
        samples; None when the source is exhausted or the run was preempted while waiting."""

    def after_step(self, step: int, logs: Optional[dict[str, float]] = None) -> dict[str, float]:
        """Called once step `step` (now completed, 1-based count) has trained, with the step's
        logs so far (`train/...`: what the update measured); returns logs of its own."""

    def stop(self, preempted: bool = False) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def after_step(source: ExperienceSource, step: int, logs: dict[str, float]) -> dict[str, float]:
    """`source.after_step(step, logs)`. A source written for the earlier protocol, `after_step(step)`
    (before sources were shown the step's logs), is called that way."""
    if _takes(source.after_step, "logs"):
        return source.after_step(step, logs)
    return source.after_step(step)


def _takes(method, name: str) -> bool:
    try:
        return name in inspect.signature(method).parameters
    except (TypeError, ValueError):      # a callable without a signature: the earlier protocol
        return False


def next_batch(source: ExperienceSource, step: int, params: SamplingParams) -> Optional[SourceBatch]:
    """`source.next(step, params)`. A source written for the earlier protocol, `next(step)`
    (before sources were handed the step's sampling parameters), is called that way, with a
    warning once per class: it samples with whatever it was given at `start`."""
    try:
        inspect.signature(source.next).bind(step, params)
    except TypeError:
        if type(source) not in _WARNED_ONE_ARGUMENT:
            _WARNED_ONE_ARGUMENT.add(type(source))
            warnings.warn(f"{type(source).__name__}.next(step) takes no sampling parameters: define "
                          "next(self, step, params) (lightrft.experience.sources.ExperienceSource)", FutureWarning,
                          stacklevel=3)
        return source.next(step)
    return source.next(step, params)


_WARNED_ONE_ARGUMENT: set = set()


class ColocatedSource:
    """Generates, scores and builds each step's experience on this rank (the default source)."""

    checks_engine = True

    def __init__(self):
        self.calls = 0        # rollout calls so far: the step of the sampling seeds (resumed from checkpoints)
        self._batches: Optional[Iterator] = None

    def start(self, context: SourceContext) -> None:
        self.context = context
        self._batches = context.prompts.batches(context.consumed_samples)

    def _rollout(self, prompts: list, labels: list, params: SamplingParams, timings: dict) -> BuiltExperience:
        self.calls += 1
        return self.context.services.build(list(prompts), labels, params, self.calls, timings=timings)

    def next(self, step: int, params: SamplingParams) -> Optional[SourceBatch]:
        ctx = self.context
        timings = dict.fromkeys(PHASES, 0.0)
        batch = next(self._batches, None)
        if batch is None:
            return None
        built = [self._rollout(*batch, params, timings)]
        if not ctx.algo.dynamic_sampling:
            return SourceBatch.of(built, ctx.rollout_batch_size, timings=timings)

        def extra_rollouts():
            for extra in self._batches:
                built.append(self._rollout(*extra, params, timings))
                yield built[-1].experiences
        n = params.n
        experiences, dropped, rounds = sample_informative_batch(
            built[0].experiences, extra_rollouts(), len(batch[0]) * n, n, ctx.algo.max_sampling_rounds, ctx.strategy)
        return SourceBatch.of(built, len(built) * ctx.rollout_batch_size, experiences, timings=timings,
                              counters={"dropped_groups": dropped, "sampling_rounds": rounds})

    def after_step(self, step: int, logs: Optional[dict[str, float]] = None) -> dict[str, float]:
        return {}

    def stop(self, preempted: bool = False) -> None:
        pass

    def state_dict(self) -> dict:
        return {"rollout_calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = state.get("rollout_calls", 0)
