"""`NaiveExperienceMaker`: the classic one-object front of generation, scoring and experience
building. The run itself uses the three services (`lightrft.experience.services`); this front
builds them from the classic arguments and keeps the classic calls working for research code:

    prompts --Generator--> samples --Scorer--> scores --ExperienceBuilder--> Experience

The B = prompts x G samples of one prompt are contiguous rows, so group estimators (GRPO, RLOO)
see each group whole on one rank.
"""

from types import SimpleNamespace
from typing import Callable, Optional, Sequence

import torch

from lightrft.config.sections import AlgorithmConfig, RolloutConfig
from lightrft.datasets.prompt_record import Prompt
from lightrft.experience.builder import ExperienceBuilder  # noqa: F401  (re-exported)
from lightrft.experience.generation import (Generator, encode_rollout_prompts,  # noqa: F401  (re-exported)
                                            sampling_params)
from lightrft.experience.samples import Experience
from lightrft.experience.scorer import RewardBatch, Scorer, truncated_rows  # noqa: F401  (re-exported)
from lightrft.experience.services import PHASES, RolloutServices, build_rollout_services
from lightrft.rollout.base import RolloutOutput, SamplingParams


class NaiveExperienceMaker:
    """Makes Experiences on each rank with a colocated rollout engine: generation (per-prompt
    seeds), scoring (every reward source) and experience building, as three services
    (`services`) behind the classic calls. Attributes it does not define itself are the
    `ExperienceBuilder`'s (`kl_in_use`, `advantages`, ...).

    Models may be DeepSpeed engines or plain modules; `critic`, `reward_model` and `initial_model`
    may be None (critic-free methods, reward from `remote_rm_url` sources, no KL). `reward_model`
    may be a list of models; `reward_fn` combines the (K, B) scores of all reward sources into (B,)
    and defaults to their sum. With a `teacher` (distillation) the task reward may be absent (a
    zero score per sample). Called without `call`, `generate` and `rollout` count their own
    rollouts; a run passes the experience source's count instead."""

    def __init__(self, actor, critic, reward_model, initial_model, tokenizer, prompt_max_len: int,
                 kl_controller, strategy, remote_rm_url=None, reward_fn: Optional[Callable] = None, *,
                 rollout_engine, advantage_estimator: str = "gae", n_samples_per_prompt: int = 1,
                 kl_estimator: str = "k1", use_kl_loss: bool = False, gamma: float = AlgorithmConfig.gamma,
                 lambd: float = AlgorithmConfig.lambd, kl_clamp: str = "scale",
                 micro_rollout_batch_size: int = RolloutConfig.micro_rollout_batch_size, reward_sources: Sequence = (),
                 overlong_buffer_len: int = 0, overlong_penalty_factor: float = 1.0, seed: int = 0,
                 apply_chat_template: bool = False, mask_truncated_samples: bool = False,
                 eos_token_ids: Optional[Sequence[int]] = None, teacher=None,
                 distill_coef: float = AlgorithmConfig.distill_coef, distill_mode: str = AlgorithmConfig.distill_mode,
                 workflow_runner=None):
        reward_models = [] if reward_model is None else (
            list(reward_model) if isinstance(reward_model, (list, tuple)) else [reward_model])
        if remote_rm_url:
            from lightrft.rewards import make_reward_sources

            reward_sources = [*reward_sources, *make_reward_sources(remote_rm_url)]
        # The classic keywords stand for an algorithm section (not validated as a run's: the
        # classic front accepted any of their combinations).
        algo = SimpleNamespace(advantage_estimator=advantage_estimator, kl_estimator=kl_estimator,
                               use_kl_loss=use_kl_loss, gamma=gamma, lambd=lambd, kl_clamp=kl_clamp,
                               mask_truncated_samples=mask_truncated_samples, distill_coef=distill_coef,
                               distill_mode=distill_mode, overlong_buffer_len=overlong_buffer_len,
                               overlong_penalty_factor=overlong_penalty_factor)
        services = build_rollout_services(
            rollout_engine, tokenizer, strategy, algo=algo, prompt_max_len=prompt_max_len,
            micro_rollout_batch_size=micro_rollout_batch_size, apply_chat_template=apply_chat_template,
            actor=actor, critic=critic, initial_model=initial_model, teacher=teacher, kl_controller=kl_controller,
            reward_models=reward_models, reward_sources=reward_sources, reward_fn=reward_fn,
            eos_token_ids=eos_token_ids, workflow_runner=workflow_runner, seed=seed)
        self._use(services, n_samples_per_prompt)

    def _use(self, services: RolloutServices, n_samples_per_prompt: int) -> None:
        self.services, self.n_samples_per_prompt = services, n_samples_per_prompt
        self.calls = 0                 # training rollouts so far, when the caller passes no `call`
        self.eval_calls = 0
        self.timings = dict.fromkeys(PHASES, 0.0)   # seconds, summed over calls

    @classmethod
    def from_services(cls, services: RolloutServices, n_samples_per_prompt: int = 1) -> "NaiveExperienceMaker":
        """The classic front over a run's own services (`PPOTrainer.experience_maker`)."""
        maker = cls.__new__(cls)
        maker._use(services, n_samples_per_prompt)
        return maker

    def __getattr__(self, name: str):
        if name == "services":         # not yet set: no recursion through the builder
            raise AttributeError(name)
        return getattr(self.services.builder, name)

    @property
    def generator(self) -> Generator:
        return self.services.generator

    @property
    def scorer(self) -> Scorer:
        return self.services.scorer

    @property
    def engine(self):
        return self.services.generator.engine

    @engine.setter
    def engine(self, engine) -> None:
        self.services.generator.engine = engine

    @property
    def tokenizer(self):
        return self.services.generator.tokenizer

    @property
    def workflow_runner(self):
        return self.services.generator.workflow_runner

    @property
    def reward_models(self) -> list:
        return self.services.scorer.reward_models

    @property
    def reward_sources(self) -> list:
        return self.services.scorer.reward_sources

    @classmethod
    def for_algorithm(cls, algo, actor, critic, reward_model, initial_model, tokenizer, prompt_max_len: int,
                      kl_controller, strategy, remote_rm_url=None, reward_fn: Optional[Callable] = None, *,
                      rollout_engine, **kwargs) -> "NaiveExperienceMaker":
        """A maker with the estimator, KL, overlong shaping and truncation options of `algo` (an
        `AlgorithmConfig`) and the run seed of `strategy`; `kwargs` are the other keywords."""
        return cls(actor, critic, reward_model, initial_model, tokenizer, prompt_max_len, kl_controller, strategy,
                   remote_rm_url, reward_fn, rollout_engine=rollout_engine,
                   advantage_estimator=algo.advantage_estimator, n_samples_per_prompt=algo.n_samples_per_prompt,
                   kl_estimator=algo.kl_estimator, use_kl_loss=algo.use_kl_loss, gamma=algo.gamma, lambd=algo.lambd,
                   kl_clamp=algo.kl_clamp, overlong_buffer_len=algo.overlong_buffer_len,
                   overlong_penalty_factor=algo.overlong_penalty_factor, seed=strategy.config.seed,
                   mask_truncated_samples=algo.mask_truncated_samples, distill_coef=algo.distill_coef,
                   distill_mode=algo.distill_mode, **kwargs)

    def eval_models(self) -> None:
        """Every model that makes experience or scores it, in eval mode."""
        self.services.builder.eval_models()
        self.services.scorer.eval_models()

    # ----------------------------------------------------------------------------------- generate
    def tokenize_prompts(self, prompts: list[Prompt]) -> list[list[int]]:
        return self.services.generator.tokenize(prompts)

    def _call(self, stream: str, call: Optional[int]) -> int:
        if stream == "train":
            self.calls = self.calls + 1 if call is None else call
            return self.calls
        self.eval_calls += 1
        return self.eval_calls

    @torch.no_grad()
    def generate(self, prompts: list[Prompt], params: SamplingParams, stream: str = "train",
                 call: Optional[int] = None) -> RolloutOutput:
        """Samples `params.n` responses per prompt in one engine call, seeded per prompt for
        rollout number `call` (`Generator.seeds`)."""
        generator = self.services.generator
        return generator.engine.generate(generator.tokenize(prompts), params,
                                         seeds=self.prompt_seeds(len(prompts), stream, call))

    def prompt_seeds(self, count: int, stream: str = "train", call: Optional[int] = None) -> list[int]:
        """The seeds of this rank's `count` prompts for one rollout call (see `generate`)."""
        return self.services.generator.seeds(count, self._call(stream, call), stream)

    def rollout(self, prompts: list[Prompt], labels: Optional[list], params: SamplingParams, stream: str = "train",
                call: Optional[int] = None, shaping: bool = True) -> tuple[RolloutOutput, RewardBatch]:
        """Samples and scores `params.n` responses (or episodes) per prompt
        (`RolloutServices.rollout`); training rollouts add their seconds to `timings`."""
        return self.services.rollout(prompts, labels, params, self._call(stream, call), stream=stream,
                                     shaping=shaping, timings=self.timings if stream == "train" else None)

    def sampling_params(self, n: Optional[int] = None, **generate_kwargs) -> SamplingParams:
        """SamplingParams from generate kwargs (temperature, top_p, top_k, max_new_tokens,
        min_new_tokens); the randomness comes from the per-prompt seeds of `generate`."""
        return sampling_params(self.n_samples_per_prompt if n is None else n, **generate_kwargs)

    # ------------------------------------------------------------------------------------ rewards
    def decode(self, rollout: RolloutOutput, prompts: list[Prompt], n: int) -> tuple[list[str], list[str]]:
        """Query texts and prompts of each sample (`Scorer.decode`)."""
        return self.services.scorer.decode(rollout, prompts, n)

    def compute_rewards(self, rollout: RolloutOutput, prompts: list[Prompt], labels: list, n: int,
                        max_new_tokens: Optional[int] = None, shaping: bool = True) -> RewardBatch:
        """Every sample's combined score (`Scorer.score`)."""
        return self.services.scorer.score(rollout, prompts, labels, n, max_new_tokens, shaping)

    # -------------------------------------------------------------------------------- experience
    @torch.no_grad()
    def make_experience_list(self, prompts: list[Prompt], labels: Optional[list] = None, *, call: Optional[int] = None,
                             **generate_kwargs) -> list[Experience]:
        """This rank's experience for `prompts` (G samples each), as one padded Experience per
        micro-rollout batch. `call` is the rollout count of the sampling seeds (see `generate`);
        `generate_kwargs`: temperature, top_p, top_k, max_new_tokens."""
        params = self.sampling_params(**generate_kwargs)
        return self.services.experiences(list(prompts), labels, params, self._call("train", call),
                                         timings=self.timings)
