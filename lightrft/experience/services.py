"""The three services that make experience, and the one call that chains them.

    Generator   prompts, labels, SamplingParams, call  ->  Generation (samples; episode scores)
    Scorer      Generation, prompts, labels            ->  RewardBatch (every reward source)
    ExperienceBuilder  rollout, RewardBatch, G         ->  list[Experience] (forwards, KL, advantages)

`RolloutServices` holds one of each for a run. Experience sources receive it (never a trainer or a
maker) and use what they need: the colocated source all three, explorers' and recorded batches
only the builder; evaluation, the doctor and `lightrft.cli.bench` call the same services.
"""

import time
from dataclasses import dataclass
from typing import Optional

import torch

from lightrft.experience.builder import ExperienceBuilder
from lightrft.experience.generation import Generator
from lightrft.experience.samples import Experience
from lightrft.experience.scorer import RewardBatch, Scorer
from lightrft.rollout.base import RolloutOutput, SamplingParams

PHASES = ("generate", "reward", "experience")


@dataclass
class RolloutServices:
    """Generation, scoring and experience building of one run (see the module docstring)."""

    generator: Generator
    scorer: Scorer
    builder: Optional[ExperienceBuilder]      # None where nothing trains (evaluation of saved policies)

    @torch.no_grad()
    def rollout(self, prompts: list[str], labels: Optional[list], params: SamplingParams, call: int,
                stream: str = "train", shaping: bool = True,
                timings: Optional[dict] = None) -> tuple[RolloutOutput, RewardBatch]:
        """Samples `params.n` responses (or episodes) per prompt in rollout number `call` of
        `stream` and scores them; `shaping=False` reports the task reward alone (evaluation).
        Adds the seconds of the two phases to `timings` ("generate", "reward") when given."""
        started = time.perf_counter()
        generation = self.generator.generate(prompts, labels, params, call, stream=stream)
        generated = time.perf_counter()
        rewards = self.scorer.score_generation(generation, prompts, labels, params, shaping=shaping)
        if timings is not None:
            timings["generate"] = timings.get("generate", 0.0) + generated - started
            timings["reward"] = timings.get("reward", 0.0) + time.perf_counter() - generated
        return generation.rollout, rewards

    @torch.no_grad()
    def experiences(self, prompts: list[str], labels: Optional[list], params: SamplingParams, call: int,
                    timings: Optional[dict] = None) -> list[Experience]:
        """This rank's training experience for `prompts` (`params.n` samples each) in rollout
        number `call`: generated, scored and built, with the models in eval mode. Adds the
        seconds of each phase to `timings` when given."""
        self.builder.eval_models()
        self.scorer.eval_models()
        rollout, rewards = self.rollout(prompts, labels, params, call, timings=timings)
        started = time.perf_counter()
        experiences = self.builder.experience_from_rollout(rollout, rewards, params.n)
        if timings is not None:
            timings["experience"] = timings.get("experience", 0.0) + time.perf_counter() - started
        return experiences
