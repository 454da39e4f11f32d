"""Turns prompts into training experience: generate, score, forward, KL, advantages.

One call of `NaiveExperienceMaker.make_experience_list` handles this rank's share of a rollout batch:

    prompts --RolloutEngine.generate--> sequences, action_mask, rollout log-probs     (B, T) / (B, A)
            --reward sources (Scorer)--> scores                                       (B,)
            --actor / reference / critic forwards, micro-batched--> log-probs, values  (B, A)
            --KL (in the reward or left for the loss) + advantage estimator--> advantages, returns

The last two lines are the `ExperienceBuilder`, which rollouts made elsewhere (explorer ranks,
recorded traffic) go through alike. The B = prompts x G samples of one prompt are contiguous rows,
so group estimators (GRPO, RLOO) see each group whole on one rank.
"""

import time
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from lightrft.algorithms.advantages import (AdvantageInputs, AdvantageOutputs, compute_advantages,
                                            get_advantage_estimator)
from lightrft.algorithms.distill import distill_token_rewards
from lightrft.algorithms.kl import compute_approx_kl
from lightrft.algorithms.masked import masked_mean, masked_sum
from lightrft.config.sections import AlgorithmConfig, RolloutConfig
from lightrft.datasets.prompt_dataset import encode_prompts
from lightrft.rewards.batch import RewardBatch
from lightrft.rollout.base import RolloutOutput, SamplingParams
from lightrft.rollout.seeds import request_seeds
from lightrft.experience.placement import arrive
from lightrft.experience.samples import Experience
from lightrft.experience.scorer import Scorer, truncated_rows


def encode_rollout_prompts(tokenizer, prompts: list[str], apply_chat_template: bool,
                           prompt_max_len: int) -> list[list[int]]:
    """The token ids a rollout engine is given for `prompts` (through the chat template when
    asked), each cut to its last `prompt_max_len` tokens: the question is usually last. Datasets
    reject or skip over-long rows earlier unless the user asked for truncation."""
    return [row[-prompt_max_len:] for row in encode_prompts(tokenizer, prompts, apply_chat_template)]


def sampling_params(n: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, max_new_tokens: int = 64,
                    min_new_tokens: int = 0, **unused) -> SamplingParams:
    """`SamplingParams` of `n` responses per prompt from a run's generate kwargs (other keys,
    such as an engine's own options, are ignored); the randomness comes from per-prompt seeds."""
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                          min_new_tokens=min_new_tokens, n=n)


class ExperienceBuilder:
    """Turns a scored rollout into training experience on this rank: the actor, reference,
    teacher and critic forwards (micro-batched), the KL, the advantages and returns, and which
    samples may train. Used alike for colocated rollouts, explorers' rollouts and recorded traffic.

    Models may be DeepSpeed engines or plain modules; `critic`, `initial_model` and `teacher` may
    be None (critic-free methods, no KL, no distillation). A `teacher` (on-policy distillation,
    `lightrft.algorithms.distill`) scores the student's sampled tokens like the reference does;
    with `distill_mode` "reward" its signal `distill_coef` x (log p_teacher - log p_student) joins
    the token rewards before the returns, with "loss" its log-probs travel in the experience for
    the trainer's reverse-KL loss. `nonfinite_counts` counts, per source, the samples dropped for
    a non-finite value."""

    def __init__(self, actor, critic, initial_model, kl_controller, strategy, *, advantage_estimator: str = "gae",
                 kl_estimator: str = "k1", use_kl_loss: bool = False, gamma: float = AlgorithmConfig.gamma,
                 lambd: float = AlgorithmConfig.lambd, kl_clamp: str = "scale",
                 micro_rollout_batch_size: int = RolloutConfig.micro_rollout_batch_size,
                 mask_truncated_samples: bool = False, eos_token_ids: Sequence[int] = (), teacher=None,
                 distill_coef: float = AlgorithmConfig.distill_coef, distill_mode: str = AlgorithmConfig.distill_mode):
        self.actor, self.critic, self.initial_model = actor, critic, initial_model
        self.teacher, self.distill_coef, self.distill_mode = teacher, distill_coef, distill_mode
        self.reward_models: list = []
        self.kl_ctl = kl_controller
        self.strategy = strategy
        self.estimator = get_advantage_estimator(advantage_estimator)
        self.kl_estimator, self.kl_clamp = kl_estimator, kl_clamp
        self.use_kl_loss = use_kl_loss
        self.gamma = gamma
        self.lambd = lambd
        self.micro_rollout_batch_size = micro_rollout_batch_size
        self.mask_truncated_samples = mask_truncated_samples
        self.eos_token_ids = list(eos_token_ids)
        self.nonfinite_counts = {"reward": 0, "logprob": 0, "advantage": 0}
        self.reuse_policy_log_probs = False   # set by the trainer when it provides the old log-probs itself

    # ----------------------------------------------------------------------------------- forwards
    def _to_device(self, *tensors: Tensor) -> tuple[Tensor, ...]:
        return tuple(t.to(self.strategy.device) for t in tensors)

    @torch.no_grad()
    def _forward_all(self, model, rollout: RolloutOutput, kind: str) -> Tensor:
        """Runs `model` over the rollout in micro-batches. Shape: (B, A)."""
        a = rollout.action_mask.size(1)
        outs = []
        for i in range(0, rollout.sequences.size(0), self.micro_rollout_batch_size):
            sl = slice(i, i + self.micro_rollout_batch_size)
            seq, mask = self._to_device(rollout.sequences[sl], rollout.attention_mask[sl])
            outs.append(model(seq, a, attention_mask=mask).float().cpu())
        return torch.cat(outs) * rollout.action_mask.to(torch.float32)

    def eval_models(self) -> None:
        """The models that make experience, in eval mode (no dropout in the rollout forwards)."""
        for model in (self.actor, self.critic, self.initial_model, self.teacher, *self.reward_models):
            if model is not None:
                model.eval()

    @staticmethod
    def _finite_rows(mask: Tensor, *tensors: Optional[Tensor]) -> Tensor:
        """Per sample: are all its action-token values finite in every given tensor? Shape: (B,)."""
        ok = torch.ones(mask.size(0), dtype=torch.bool)
        for t in tensors:
            if t is not None:
                ok &= (torch.isfinite(t) | ~mask).all(dim=1)
        return ok

    def _count_invalid(self, source: str, before: Tensor, after: Tensor) -> None:
        self.nonfinite_counts[source] += int((before & ~after).sum())

    def kl_in_use(self) -> bool:
        """Whether a KL term can reach the loss: a reference model and a non-zero coefficient
        (the adaptive controller keeps a zero coefficient at zero). Otherwise the reference
        forward is skipped."""
        return self.initial_model is not None and self.kl_ctl.value != 0.0

    def truncated_rows(self, rollout: RolloutOutput) -> Tensor:
        """Which responses were cut at the length limit (`lightrft.experience.scorer.truncated_rows`)."""
        return truncated_rows(rollout, self.eos_token_ids)

    @torch.no_grad()
    def experience_from_rollout(self, rollout: RolloutOutput, rewards: RewardBatch, n: int) -> list[Experience]:
        rollout, rewards = arrive(rollout, rewards)
        action_mask = rollout.action_mask.bool()
        mask_f = action_mask.float()
        # With one epoch (see PPOTrainer.reuse_old_log_probs) the trainer provides the "old"
        # log-probs itself: the first optimizer step from its own forward, the later ones from a
        # forward before the first update, so none runs here. Distillation needs them at rollout time.
        reuse = self.reuse_policy_log_probs and not self.kl_in_use() and self.teacher is None
        action_log_probs = None if reuse else self._forward_all(self.actor, rollout, "actor")
        base_log_probs = self._forward_all(self.initial_model, rollout, "reference") if self.kl_in_use() else None
        teacher_log_probs = self._forward_all(self.teacher, rollout, "teacher") if self.teacher is not None else None
        values = self._forward_all(self.critic, rollout, "critic") if self.critic is not None else None
        scores = rewards.scores.clone()
        token_rewards = rewards.token_rewards
        if token_rewards is not None and not self.estimator.uses_token_rewards:
            scores, token_rewards = scores + (token_rewards * mask_f).sum(dim=1), None
        truncated = self.truncated_rows(rollout)

        valid = self._valid_samples(rewards.valid, scores, action_mask, n, action_log_probs, base_log_probs, values,
                                    teacher_log_probs, rollout.rollout_log_probs)
        keep = valid.unsqueeze(1)
        scores = torch.where(valid, scores, torch.zeros_like(scores))
        action_log_probs, base_log_probs, values, teacher_log_probs = (
            None if t is None else torch.where(keep, t, torch.zeros_like(t))
            for t in (action_log_probs, base_log_probs, values, teacher_log_probs))

        kl = None
        if base_log_probs is not None:
            kl = compute_approx_kl(action_log_probs, base_log_probs, action_mask, self.kl_estimator, self.kl_clamp)
        # The KL penalty enters the advantages (per token, before the returns) unless it is a loss term.
        kl_coef = 0.0 if (self.use_kl_loss or kl is None) else self.kl_ctl.value
        if token_rewards is not None:
            token_rewards = torch.where(keep, token_rewards.float(), 0.0)
        if teacher_log_probs is not None and self.distill_mode == "reward":
            # The teacher's per-token signal, a dense reward like the KL penalty (0 on invalid rows).
            distill = distill_token_rewards(action_log_probs, teacher_log_probs, action_mask, self.distill_coef,
                                            self.kl_clamp)
            token_rewards = distill if token_rewards is None else token_rewards + distill
        outputs = self.advantages(AdvantageInputs(action_mask=mask_f, scores=scores, values=values, group_size=n,
                                                  gamma=self.gamma, lambd=self.lambd, token_rewards=token_rewards),
                                  kl, kl_coef)
        advantages, returns = outputs.advantages, outputs.returns
        checked = valid & self._finite_rows(action_mask, advantages, returns)
        self._count_invalid("advantage", valid, checked)
        valid = checked
        if self.mask_truncated_samples:
            # Cut responses keep their place (and their group's baseline) but train on nothing.
            valid = valid & ~truncated
        keep = valid.unsqueeze(1)
        advantages = torch.where(keep, advantages, torch.zeros_like(advantages))
        returns = torch.where(keep, returns, torch.zeros_like(returns))
        info = {
            "reward": scores,
            "response_length": mask_f.sum(dim=1),
            "total_length": rollout.attention_mask.float().sum(dim=1),
            "kl": masked_mean(kl, mask_f, dim=1) if kl is not None else torch.zeros_like(scores),
            "truncated": truncated.float(),
            "valid": valid.float(),
            **{k: v.float() for k, v in rewards.info.items()},
        }
        if teacher_log_probs is not None:
            info.update(self.distill_info(action_log_probs, teacher_log_probs, action_mask & keep))
        exp = Experience(
            sequences=rollout.sequences, attention_mask=rollout.attention_mask, action_mask=action_mask,
            num_actions=action_mask.size(1), packed_seq_lens=None, action_log_probs=action_log_probs,
            advantages=advantages, returns=returns, base_action_log_probs=base_log_probs,
            rollout_log_probs=torch.where(keep, rollout.rollout_log_probs.float(), 0.0),
            values=values, kl=kl, teacher_log_probs=teacher_log_probs, info=info)
        return [exp]

    @staticmethod
    def distill_info(student_log_probs: Tensor, teacher_log_probs: Tensor, mask: Tensor) -> dict[str, Tensor]:
        """Per sample, the sums over its trained tokens of the reverse-KL estimate log p_student -
        log p_teacher and of each log-prob, and the token count: summed over the step's samples
        and divided by the tokens they are per-token means (`PPOTrainer.step` logs them as
        distill/*). Shape: (B, A) each -> (B,) each."""
        return {"distill_tokens": mask.float().sum(dim=1),
                "distill_reverse_kl": masked_sum(student_log_probs - teacher_log_probs, mask, dim=1),
                "distill_teacher_logprob": masked_sum(teacher_log_probs, mask, dim=1),
                "distill_student_logprob": masked_sum(student_log_probs, mask, dim=1)}

    def advantages(self, inputs: AdvantageInputs, kl: Optional[Tensor], kl_coef: float) -> AdvantageOutputs:
        """Advantages and returns of the configured estimator, with the per-token KL penalty
        (`kl_coef` x kl) in the rewards before the returns. Override to try another estimator on
        the same experience."""
        return compute_advantages(self.estimator, inputs, kl=kl, kl_coef=kl_coef)

    def _valid_samples(self, reward_valid: Tensor, scores: Tensor, action_mask: Tensor, n: int,
                       *per_action: Optional[Tensor]) -> Tensor:
        """Samples that may train: a reward source scored them, and their reward and every given
        per-action tensor are finite. A group estimator's baseline needs the whole group, so one
        bad sample invalidates its group. Invalid samples keep their place in the batch (every
        rank must run the same number of micro-batches) but count in no loss or normaliser.
        Shape: (B,) bool."""
        valid = reward_valid.clone()
        checked = valid & torch.isfinite(scores)
        self._count_invalid("reward", valid, checked)
        valid = checked
        checked = valid & self._finite_rows(action_mask, *per_action)
        self._count_invalid("logprob", valid, checked)
        valid = checked
        if self.estimator.group:
            valid = valid.view(-1, n).all(dim=1).repeat_interleave(n)
        return valid


class NaiveExperienceMaker(ExperienceBuilder):
    """Makes Experiences on each rank with a colocated rollout engine: generation (per-prompt
    seeds), scoring (`Scorer`, every reward source) and the `ExperienceBuilder` it extends.

    Models may be DeepSpeed engines or plain modules; `critic`, `reward_model` and `initial_model`
    may be None (critic-free methods, reward from `remote_rm_url` sources, no KL). `reward_model`
    may be a list of models; `reward_fn` combines the (K, B) scores of all reward sources into (B,)
    and defaults to their sum. With a `teacher` (distillation) the task reward may be absent (a
    zero score per sample)."""

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
        super().__init__(actor, critic, initial_model, kl_controller, strategy, advantage_estimator=advantage_estimator,
                         kl_estimator=kl_estimator, use_kl_loss=use_kl_loss, gamma=gamma, lambd=lambd,
                         kl_clamp=kl_clamp, micro_rollout_batch_size=micro_rollout_batch_size,
                         mask_truncated_samples=mask_truncated_samples,
                         eos_token_ids=list(eos_token_ids) if eos_token_ids else [tokenizer.eos_token_id],
                         teacher=teacher, distill_coef=distill_coef, distill_mode=distill_mode)
        self.reward_models = [] if reward_model is None else (
            list(reward_model) if isinstance(reward_model, (list, tuple)) else [reward_model])
        self.tokenizer = tokenizer
        self.prompt_max_len = prompt_max_len
        self.engine = rollout_engine
        self.n_samples_per_prompt = n_samples_per_prompt
        self.reward_sources = list(reward_sources)
        if remote_rm_url:
            from lightrft.rewards import make_reward_source

            specs = remote_rm_url if isinstance(remote_rm_url, (list, tuple)) else remote_rm_url.split(",")
            self.reward_sources += [make_reward_source(spec.strip()) for spec in specs if spec.strip()]
        self.seed = seed
        self.apply_chat_template = apply_chat_template
        self.scorer = Scorer(tokenizer, reward_models=self.reward_models, reward_sources=self.reward_sources,
                             reward_fn=reward_fn, micro_batch_size=micro_rollout_batch_size,
                             device=strategy.device if strategy is not None else None,
                             overlong_buffer_len=overlong_buffer_len, overlong_penalty_factor=overlong_penalty_factor,
                             eos_token_ids=self.eos_token_ids,
                             task_reward_optional=teacher is not None or workflow_runner is not None)
        self.calls = 0                 # training rollouts so far (the step of the sampling seeds)
        self.eval_calls = 0
        self.timings = {"generate": 0.0, "reward": 0.0, "experience": 0.0}   # seconds, reset per step
        # Runs multi-turn episodes instead of one response per prompt (`lightrft.agents`, --workflow).
        self.workflow_runner = workflow_runner

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

    # ----------------------------------------------------------------------------------- generate
    def tokenize_prompts(self, prompts: list[str]) -> list[list[int]]:
        return encode_rollout_prompts(self.tokenizer, prompts, self.apply_chat_template, self.prompt_max_len)

    @torch.no_grad()
    def generate(self, prompts: list[str], params: SamplingParams, stream: str = "train",
                 call: Optional[int] = None) -> RolloutOutput:
        """Samples `params.n` responses per prompt in one engine call. Each prompt draws from its
        own random stream, derived from the run seed, the rollout count `call` (1-based; the
        trainer's experience source passes it, and without it the maker counts its own calls) and
        the prompt's position in the global batch (`lightrft.rollout.seeds`): samples are
        independent across prompts, and a resumed run draws what the uninterrupted one would have."""
        seeds = self.prompt_seeds(len(prompts), stream, call)
        return self.engine.generate(self.tokenize_prompts(prompts), params, seeds=seeds)

    def prompt_seeds(self, count: int, stream: str = "train", call: Optional[int] = None) -> list[int]:
        """The seeds of this rank's `count` prompts for one rollout call (see `generate`)."""
        if stream == "train":
            self.calls = self.calls + 1 if call is None else call
            call = self.calls
        else:
            self.eval_calls += 1
            call = self.eval_calls
        # Global position of local prompt i: DistributedSampler deals position k to rank k % R.
        return request_seeds(self.seed, call, self.strategy.rank, count, stream, stride=self.strategy.world_size)

    def rollout(self, prompts: list[str], labels: Optional[list], params: SamplingParams, stream: str = "train",
                call: Optional[int] = None, shaping: bool = True) -> tuple[RolloutOutput, RewardBatch]:
        """Samples and scores `params.n` responses per prompt: one generation scored by the
        reward sources, or, with a workflow (--workflow), one multi-turn episode each, scored by
        the workflow (episodes whose workflow returns None by the reward sources). Times the two
        phases into `timings` (episodes count as generate)."""
        started = time.perf_counter()
        if self.workflow_runner is None:
            rollout = arrive(self.generate(prompts, params, stream=stream, call=call))
            generated = time.perf_counter()
            rewards = self.compute_rewards(rollout, prompts, labels, params.n, params.max_new_tokens, shaping=shaping)
        else:
            batch = self.workflow_runner.run(self.engine, self.tokenize_prompts(prompts), prompts, labels, params,
                                             self.prompt_seeds(len(prompts), stream, call))
            rollout, rewards = arrive(batch.rollout, batch.rewards)
            generated = time.perf_counter()
            if bool(batch.unscored.any()):
                scored = self.compute_rewards(rollout, prompts, labels, params.n, shaping=False)
                rewards.scores = torch.where(batch.unscored, scored.scores, rewards.scores)
                rewards.valid &= scored.valid | ~batch.unscored
        if stream == "train":
            self.timings["generate"] += generated - started
            self.timings["reward"] += time.perf_counter() - generated
        return rollout, rewards

    def sampling_params(self, n: Optional[int] = None, **generate_kwargs) -> SamplingParams:
        """SamplingParams from generate kwargs (temperature, top_p, top_k, max_new_tokens,
        min_new_tokens); the randomness comes from the per-prompt seeds of `generate`."""
        return sampling_params(self.n_samples_per_prompt if n is None else n, **generate_kwargs)

    # ------------------------------------------------------------------------------------ rewards
    def decode(self, rollout: RolloutOutput, prompts: list[str], n: int) -> tuple[list[str], list[str]]:
        """Query texts and prompts of each sample (`Scorer.decode`)."""
        return self.scorer.decode(rollout, prompts, n)

    def compute_rewards(self, rollout: RolloutOutput, prompts: list[str], labels: list, n: int,
                        max_new_tokens: Optional[int] = None, shaping: bool = True) -> RewardBatch:
        """Every sample's combined score (`Scorer.score`)."""
        return self.scorer.score(rollout, prompts, labels, n, max_new_tokens, shaping)

    # -------------------------------------------------------------------------------- experience
    @torch.no_grad()
    def make_experience_list(self, prompts: list[str], labels: Optional[list] = None, *, call: Optional[int] = None,
                             **generate_kwargs) -> list[Experience]:
        """This rank's experience for `prompts` (G samples each), as one padded Experience per
        micro-rollout batch. `call` is the rollout count of the sampling seeds (see `generate`);
        `generate_kwargs`: temperature, top_p, top_k, max_new_tokens."""
        self.eval_models()
        params = self.sampling_params(**generate_kwargs)
        rollout, rewards = self.rollout(list(prompts), labels, params, call=call)
        started = time.perf_counter()
        experiences = self.experience_from_rollout(rollout, rewards, params.n)
        self.timings["experience"] += time.perf_counter() - started
        return experiences
