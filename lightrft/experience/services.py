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
from typing import Optional, Sequence

import torch

from lightrft.datasets.prompt_record import Prompt
from lightrft.experience.builder import BuiltExperience, ExperienceBuilder
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
    def rollout(self, prompts: list[Prompt], labels: Optional[list], params: SamplingParams, call: int,
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

    def experiences(self, prompts: list[Prompt], labels: Optional[list], params: SamplingParams, call: int,
                    timings: Optional[dict] = None) -> list[Experience]:
        """The experiences of `build`, without its counts (the classic call)."""
        return self.build(prompts, labels, params, call, timings).experiences

    @torch.no_grad()
    def build(self, prompts: list[Prompt], labels: Optional[list], params: SamplingParams, call: int,
              timings: Optional[dict] = None) -> BuiltExperience:
        """This rank's training experience for `prompts` (`params.n` samples each) in rollout
        number `call`: generated, scored and built, with the models in eval mode, with the
        samples dropped for a non-finite value. Adds the seconds of each phase to `timings` when
        given."""
        self.builder.eval_models()
        self.scorer.eval_models()
        rollout, rewards = self.rollout(prompts, labels, params, call, timings=timings)
        started = time.perf_counter()
        built = self.builder.build(rollout, rewards, params.n)
        if timings is not None:
            timings["experience"] = timings.get("experience", 0.0) + time.perf_counter() - started
        return built


def build_rollout_services(engine, tokenizer, strategy=None, *, algo=None, prompt_max_len: int,
                           micro_rollout_batch_size: int, apply_chat_template: bool = False,
                           actor=None, critic=None, initial_model=None, teacher=None, kl_controller=None,
                           reward_models: Sequence = (), reward_sources: Sequence = (), reward_fn=None,
                           eos_token_ids: Optional[Sequence[int]] = None, workflow_runner=None,
                           reuse_policy_log_probs: bool = False, seed: Optional[int] = None,
                           scorer_tokenizer=None, task_reward_optional: Optional[bool] = None,
                           device=None, micro_rollout_max_tokens: Optional[int] = None) -> RolloutServices:
    """The one wiring of a run's three services: the trainer's (`lightrft.trainer.assembly`), an
    explorer's, `lightrft.cli.bench`'s and the classic `NaiveExperienceMaker`'s.

    `algo` holds the estimator, KL, truncation, distillation and overlong-shaping options (an
    `AlgorithmConfig`, or an object with those fields); None for services that only evaluate
    (no shaping, nothing trains). `engine` generates (the trainer's
    `RolloutManager`, or an engine); this rank's place in the global batch (its prompts' seeds) is
    `strategy`'s rank among its ranks, or rank 0 of 1 without one (`Generator.at` moves it).
    Without an `actor` nothing trains: the services generate and score only (evaluation,
    explorers). `scorer_tokenizer` is a tokenizer of the scorer's own when it decodes on another
    thread than generation (a fast tokenizer is not safe to call from two at once).
    `task_reward_optional` (default: when a teacher or a workflow scores) lets a run go without a
    reward source. `seed` defaults to the strategy's run seed. `device` is where the reward models
    score (default: the strategy's device). `micro_rollout_max_tokens`: the experience forwards'
    token budget (`ExperienceBuilder.forward_chunks`)."""
    eos_token_ids = list(eos_token_ids) if eos_token_ids else [tokenizer.eos_token_id]
    builder = None
    if actor is not None:
        builder = ExperienceBuilder.for_algorithm(
            algo, actor, critic, initial_model, kl_controller, strategy,
            micro_rollout_batch_size=micro_rollout_batch_size, eos_token_ids=eos_token_ids, teacher=teacher,
            reuse_policy_log_probs=reuse_policy_log_probs, micro_rollout_max_tokens=micro_rollout_max_tokens)
    if task_reward_optional is None:
        task_reward_optional = teacher is not None or workflow_runner is not None
    scorer = Scorer(scorer_tokenizer or tokenizer, reward_models=list(reward_models),
                    reward_sources=list(reward_sources), reward_fn=reward_fn,
                    micro_batch_size=micro_rollout_batch_size,
                    device=device if device is not None or strategy is None else strategy.device,
                    overlong_buffer_len=getattr(algo, "overlong_buffer_len", 0),
                    overlong_penalty_factor=getattr(algo, "overlong_penalty_factor", 1.0),
                    eos_token_ids=eos_token_ids, task_reward_optional=task_reward_optional)
    if seed is None:
        seed = strategy.config.seed if strategy is not None else 0
    generator = Generator(engine, tokenizer, prompt_max_len=prompt_max_len, apply_chat_template=apply_chat_template,
                          seed=seed, rank=strategy.rank if strategy is not None else 0,
                          world_size=strategy.world_size if strategy is not None else 1,
                          workflow_runner=workflow_runner)
    return RolloutServices(generator, scorer, builder)
