"""PPOTrainer: the PPO / GRPO / REINFORCE++ / RLOO loop.

One step = one batch from the experience source (`lightrft.experience.sources`) through `step`:
the replay buffer, `max_epochs` PPO passes, the KL controller; then logs and saves when due. The
class spans three files by role: this one (construction, `fit`, `step`, logs, evaluation),
`ppo_update.py` (the epochs and losses of one batch) and `ppo_checkpoints.py` (checkpoints and
resume); every method is meant to be overridden by research code.
"""

import time
from functools import cached_property
from typing import Optional, Sequence

import torch
from tqdm import tqdm

from lightrft.config.sections import REQUIRED_LOSS_AGG, AlgorithmConfig  # noqa: F401  (re-exported)
from lightrft.experience.builder import NONFINITE_SOURCES
from lightrft.experience.generation import sampling_params
from lightrft.experience.maker import NaiveExperienceMaker
from lightrft.experience.samples import Experience
from lightrft.experience.sources import ColocatedSource, PromptSampler, SourceContext, next_batch
from lightrft.experience.sources import after_step as source_after_step
from lightrft.rollout.base import SamplingParams
from lightrft.strategy.deepspeed_strategy import PendingReduction
from lightrft.trainer.assembly import PPOParts, build_ppo_parts, classic_reward_sources
from lightrft.trainer.evaluation import evaluate_policy, held_out_services
from lightrft.trainer.metrics import (EXTREME_SUFFIXES, GlobalCounts, combine_metric,  # noqa: F401  (re-exported)
                                     perf_metrics, start_step_totals)
from lightrft.trainer.ppo_config import (PPOModels, PPOTrainerConfig, classic_options_config,  # noqa: F401
                                         classic_trainer_config, legacy_models, legacy_positionals,
                                         rollout_generate_kwargs)
from lightrft.trainer.ppo_checkpoints import PINNED_OPTIONS, PPOCheckpoints, as_ppo_config  # noqa: F401
from lightrft.trainer.ppo_health import PPOHealth
from lightrft.trainer.ppo_update import PPOUpdate


class PPOTrainer(PPOUpdate, PPOCheckpoints, PPOHealth):
    """Trains `actor` with PPO-family updates. `critic=None` selects a critic-free method.

    Two ways to build one, which build the same trainer:

    - `PPOTrainer.from_config(strategy, models, config, tokenizer=..., ...)`: the models
      (`PPOModels`) and the typed sections of a run config (`lightrft.config.PPORunConfig`, or
      a `PPOTrainerConfig`); every option comes from the config. This is what `train_ppo` does.
    - The classic constructor below (the seed design's signature, kept for research code): its
      option arguments are turned into those sections (`classic_trainer_config`), with the
      documented OpenRLHF-compatible defaults. `reward_model` may be a list, combined by
      `reward_fn` ((K, B) -> (B,)); `remote_rm_url` adds HTTP reward servers, reward files and
      builtin rules; `generate_kwargs` (temperature, top_p, top_k, max_new_tokens) are the
      rollout sampling parameters. The classic arguments (`init_kl_coef`, `kl_target`,
      `kl_horizon`, `ptx_coef`, `eps_clip`, `value_clip`) default to None, which takes the value
      of the same field of `algo`; a value given explicitly overrides it. Without `algo` they take
      the classic values 0.001, None (fixed KL), 10000, 0, 0.2 and 0.2. Given `config`
      (what `from_config` passes), the option arguments are not read.

    Models are DeepSpeed engines from `strategy.prepare` (or plain modules for frozen ones).
    `reward_sources` takes ready-made reward sources (objects with `__call__(queries, prompts,
    labels)`). `teacher_model` (a prepared frozen policy, `--teacher_pretrain`) distils into the
    actor on its own samples, as `algo.distill_mode` says (docs/distillation.md).
    `workflow_runner` (`lightrft.agents.WorkflowRunner`, --workflow) makes each sample a
    multi-turn episode (docs/agents.md). `processor` is a vision-language run's processor (set by
    `build_ppo_run` for --image_key): Hugging Face exports carry its files with the tokenizer's."""

    def __init__(self, strategy, actor, critic, reward_model, initial_model, ema_model, actor_optim,
                 critic_optim, actor_scheduler, critic_scheduler, ema_beta: float = 0.992,
                 init_kl_coef: Optional[float] = None, kl_target: Optional[float] = None,
                 kl_horizon: Optional[int] = None, ptx_coef: Optional[float] = None, micro_train_batch_size: int = 8,
                 buffer_limit: int = 0, buffer_cpu_offload: bool = True, eps_clip: Optional[float] = None,
                 value_clip: Optional[float] = None,
                 micro_rollout_batch_size: int = 8, gradient_checkpointing: bool = False,
                 max_epochs: int = 1, max_norm: float = 1.0, tokenizer=None, prompt_max_len: int = 128,
                 dataloader_pin_memory: bool = True, remote_rm_url=None, reward_fn=None,
                 save_hf_ckpt: bool = False, disable_ds_ckpt: bool = False, *,
                 algo: Optional[AlgorithmConfig] = None, rollout_engine=None, reward_sources: Sequence = (),
                 packing_samples: bool = False, callbacks: Sequence = (), tracker=None,
                 preemption_grace: float = 600.0, apply_chat_template: bool = False,
                 eos_token_ids: Optional[Sequence[int]] = None, max_ckpt_num: int = 3,
                 eval_generate_kwargs: Optional[dict] = None, engine_logprob_gap_threshold: Optional[float] = None,
                 engine_logprob_gap_action: str = "stop", experience_source=None,
                 sync_bucket_mb: Optional[float] = None, teacher_model=None, workflow_runner=None,
                 config: Optional[PPOTrainerConfig] = None, processor=None, parts: Optional[PPOParts] = None,
                 **generate_kwargs):
        if parts is None:
            if config is None:         # the classic form: its option arguments (by name) stand for the sections
                config = classic_options_config(algo, locals())
                reward_sources = [*reward_sources, *classic_reward_sources(remote_rm_url)]
            else:
                generate_kwargs = {**rollout_generate_kwargs(config.rollout), **generate_kwargs}
            parts = build_ppo_parts(
                strategy, legacy_models(actor, critic, reward_model, initial_model, ema_model, actor_optim, critic_optim,
                                        actor_scheduler, critic_scheduler, teacher_model=teacher_model),
                config, tokenizer=tokenizer, processor=processor, rollout_engine=rollout_engine,
                reward_sources=reward_sources, reward_fn=reward_fn, callbacks=callbacks, tracker=tracker,
                experience_source=experience_source, workflow_runner=workflow_runner, eos_token_ids=eos_token_ids,
                generate_kwargs=generate_kwargs, eval_generate_kwargs=eval_generate_kwargs, buffer_limit=buffer_limit,
                buffer_cpu_offload=buffer_cpu_offload, dataloader_pin_memory=dataloader_pin_memory,
                reuse_old_log_probs=self.reuse_old_log_probs)
        self.assign(parts)

    @classmethod
    def from_config(cls, strategy, models: PPOModels, config=None, *legacy, tokenizer, **keywords) -> "PPOTrainer":
        """The trainer of `models` (prepared) with every option from `config` (a `PPORunConfig`, or
        the `PPOTrainerConfig` sections); `keywords` are `build_ppo_parts`' (what a config cannot
        hold) and a subclass's own. The earlier form, `from_config(config, strategy, actor, critic,
        ..., critic_scheduler, tokenizer=..., teacher_model=..., ...)`, still works."""
        if not isinstance(models, PPOModels):
            config, strategy, models = strategy, models, legacy_models(config, *legacy,
                                                                       teacher_model=keywords.pop("teacher_model", None))
        elif legacy:
            raise TypeError(f"PPOTrainer.from_config(strategy, models, config) takes 3 positional arguments; "
                            f"{3 + len(legacy)} were given")
        return cls(strategy, *legacy_positionals(models), tokenizer=tokenizer, config=config,
                   teacher_model=models.teacher_model, **keywords)

    @classmethod
    def from_parts(cls, parts: PPOParts, **kwargs) -> "PPOTrainer":
        """The trainer of built parts (`build_ppo_parts`); `kwargs`: a subclass's own arguments."""
        return cls(parts.strategy, *legacy_positionals(parts.models), parts=parts, **kwargs)

    def assign(self, parts: PPOParts) -> None:
        """Takes the built parts (`PPOParts`), and starts the run's state (`args`: the config `fit` runs)."""
        config, models, optim = parts.config, parts.models, parts.config.optim
        self.strategy, self.tokenizer, self.processor, self.algo = (parts.strategy, parts.tokenizer, parts.processor,
                                                                    config.algorithm)
        self.actor, self.critic, self.initial_model = models.actor, models.critic, models.initial_model
        self.ema_model, self.teacher_model, self.reward_model = (models.ema_model, models.teacher_model,
                                                                 models.classic_reward_model)
        self.actor_optim, self.critic_optim, self.max_epochs = models.actor_optim, models.critic_optim, optim.max_epochs
        self.actor_scheduler, self.critic_scheduler = models.actor_scheduler, models.critic_scheduler
        self.max_norm, self.micro_train_max_tokens = optim.max_norm, optim.micro_train_max_tokens
        self.micro_train_batch_size, self.prompt_max_len = optim.micro_train_batch_size, config.data.prompt_max_len
        self.micro_rollout_batch_size, self.ema_beta = config.rollout.micro_rollout_batch_size, config.model.ema_beta
        self.save_hf_ckpt, self.disable_ds_ckpt = config.checkpoint.save_hf_ckpt, config.checkpoint.disable_ds_ckpt
        self.gradient_checkpointing, self.dataloader_pin_memory = (config.distributed.gradient_checkpointing,
                                                                   parts.dataloader_pin_memory)
        self.generate_kwargs, self.eval_generate_kwargs = parts.generate_kwargs, parts.eval_generate_kwargs
        self.rollout_engine, self.weight_stream, self.rollout = parts.rollout_engine, parts.weight_stream, parts.rollout
        self.experience_services, self.replay_buffer = parts.services, parts.replay_buffer
        self.experience_source = parts.experience_source     # None: the colocated source over `fit`'s prompts
        self.kl_ctl, self.normalize_advantages_globally = parts.kl_ctl, parts.normalize_advantages_globally
        self.actor_loss_fn, self.critic_loss_fn = parts.actor_loss_fn, parts.critic_loss_fn
        self.ptx_loss_fn, self.engine_gap, self.services = parts.ptx_loss_fn, parts.engine_gap, parts.run_services
        self.callbacks, self.tracker = parts.callbacks, parts.tracker
        self.global_step, self.consumed_samples = 0, 0
        self.counters, self.nonfinite_counts = ({"skipped_steps": 0, "dropped_groups": 0, "sampling_rounds": 0},
                                                dict.fromkeys(NONFINITE_SOURCES, 0))
        self.stop_reason = self.pass_preempted = self.pretrain_iter = self.args = self.health = None
        self._warned_no_aux_loss, self.resumed_state, self.last_timings = False, {}, {}

    @cached_property
    def experience_maker(self) -> NaiveExperienceMaker:
        """The classic one-object front over the run's services, for research code that calls it."""
        return NaiveExperienceMaker.from_services(self.experience_services, self.algo.n_samples_per_prompt)

    # ====================================================================================== fit
    def fit(self, args, prompts_dataloader, pretrain_dataloader=None, consumed_samples: int = 0,
            num_update_steps_per_episodes: int = 1, eval_dataloader=None) -> None:
        """Runs the planned steps over the prompts (resuming after `consumed_samples`): each takes
        a batch from the experience source, trains on it (`step`), logs and saves. `args` is the
        run config (a `PPORunConfig`; an argparse namespace of its flags is converted)."""
        config = self.args = as_ppo_config(args)
        total_steps = self.start_run(config, prompts_dataloader, pretrain_dataloader, consumed_samples)
        if eval_dataloader is not None and config.data.eval_on_startup and self.global_step == 0:
            self.log(self.evaluate(eval_dataloader), step=0)         # the starting point of the curve
        bar = tqdm(total=total_steps, initial=self.global_step, desc="PPO steps",
                   disable=not self.strategy.is_rank_0(), dynamic_ncols=True)
        ckpt_path = config.checkpoint.ckpt_path
        try:
            while self.global_step < total_steps:
                # 1. Rollout and 2. training: the experience source's batch, then the named step.
                logs = self.rollout_and_train(config)
                if logs is None:      # prompts exhausted, or preempted while waiting for explorers
                    self.stop_reason = self.services.stop_reason(ckpt_path)
                    break
                # Whether any rank was asked to stop travelled with the last pass's metrics.
                preempted = self.services.preempted() if self.pass_preempted is None else self.pass_preempted
                bar.update(1)
                bar.set_postfix(reward=f"{logs.get('rollout/reward', float('nan')):.3f}")
                # 3. Logs, evaluation, checkpoints; stop early on preemption or non-finite streaks.
                self.save_logs_and_checkpoints(config, self.global_step, bar, logs, eval_dataloader=eval_dataloader)
                # 4. The health monitors read the step's metrics: warn, stop, or roll back.
                self.stop_reason = self.act_on_health(config, self.last_logs)
                # A signal that came during a save (which can take long) stops the run now, not a step later.
                self.stop_reason = self.stop_reason or self.services.stop_reason(
                    ckpt_path, None if self.saved_at_step(config, self.global_step) else preempted)
                if self.stop_reason is not None:
                    break
            if self.stop_reason is None and 0 < config.optim.max_steps <= self.global_step:
                self.stop_reason = "max_steps"
            # However the loop ended, the last completed step is resumable.
            if self.global_step > 0 and not self.saved_at_step(config, self.global_step):
                self.save_checkpoint(config)
        finally:
            bar.close()
            self.experience_source.stop(preempted=self.stop_reason == "preempted")
            self.services.stop()
        self.callbacks.on_train_end(self)

    def start_run(self, config, prompts_dataloader, pretrain_dataloader=None, consumed_samples: int = 0) -> int:
        """What the loop needs before its first step: the pretraining stream, the run services,
        the experience source started where the run left off (the colocated one over
        `prompts_dataloader` unless one was given). Returns the planned steps."""
        self.set_pretrain_data(pretrain_dataloader)
        self.start_health(config, self.resumed_state.get("health"))
        self.consumed_samples = consumed_samples
        total_steps = self.planned_steps(config, prompts_dataloader)
        if self.experience_source is None:
            self.experience_source = ColocatedSource()
        rollout = config.rollout
        sampler = PromptSampler(prompts_dataloader, rollout.rollout_batch_size, config.optim.num_episodes,
                                endless=self.algo.dynamic_sampling)
        self.services.start(self)
        self.experience_source.load_state_dict(self.resumed_state)
        self.experience_source.start(SourceContext(
            services=self.experience_services, strategy=self.strategy, algo=self.algo, prompts=sampler, consumed_samples=consumed_samples, rollout_batch_size=rollout.rollout_batch_size,
            total_steps=total_steps, first_step=self.global_step, preempted=lambda: self.services.preemption.raised,
            weight_buckets=self.weight_stream.buckets, adapter=self.weight_stream.adapter_spec()))
        self.callbacks.on_train_begin(self)
        return total_steps

    def rollout_and_train(self, config) -> Optional[dict[str, float]]:
        """One step of the loop: the source's experience, the engine put to sleep, `step`, the
        source's own logs and the timings. None when the source has no more experience."""
        started = time.time()
        experiences = self.make_experience()
        self.rollout.sleep()
        if experiences is None:
            return None
        rollout_time = time.time() - started
        self.callbacks.on_rollout_end(self, experiences)
        started = time.time()
        logs = self.step(experiences)
        train_time = time.time() - started
        logs.update(source_after_step(self.experience_source, self.global_step, logs))
        logs.update(self.rollout.sync_logs())
        logs.update(perf_metrics(self.last_timings, rollout_time, train_time,
                                 config.rollout.rollout_batch_size * self.algo.n_samples_per_prompt))
        return logs

    def make_experience(self, prompt_batches=None) -> Optional[list[Experience]]:
        """This step's experience from the experience source; None when it has no more. Counts
        the prompts it drew and its counters (dynamic sampling's dropped groups and rounds).
        Override to act around each rollout (`prompt_batches` is unused, kept for subclasses that
        pass it on)."""
        batch = next_batch(self.experience_source, self.global_step, self.sampling_params(self.global_step))
        if batch is None:
            return None
        self.consumed_samples += batch.prompts
        for name, value in batch.counters.items():
            self.counters[name] += value
        for name, value in batch.nonfinite.items():
            self.nonfinite_counts[name] += value
        self.last_timings = {**dict.fromkeys(("generate", "reward", "experience"), 0.0), **batch.timings}
        return batch.experiences

    def sampling_params(self, step: int) -> SamplingParams:
        """What step `step` (0-based) samples with, handed to the experience source: G =
        `n_samples_per_prompt` responses per prompt under the run's sampling parameters
        (`generate_kwargs`, from the rollout section). Override to change them per step (a length
        curriculum, a temperature schedule); explorers sample with the run's own."""
        return sampling_params(self.algo.n_samples_per_prompt, **self.generate_kwargs)

    def step(self, experiences: list[Experience], check_engine: bool = True) -> dict[str, float]:
        """One optimisation round on a rollout's experiences: the step `fit` repeats and
        `lightrft.cli.doctor` runs. The replay buffer takes them (advantages whitened over all
        ranks where the estimator asks), the PPO epochs train on them, the engine is marked stale
        and its log-prob gap checked (`check_engine=False` for samples drawn otherwise than
        training draws them, as the doctor's memory probe forces their lengths), and the KL
        controller follows the observed KL. Returns the step's rollout/* and train/* logs;
        `global_step` counts it."""
        # The controller counts the step's samples over all ranks (every rank makes as many).
        samples = sum(experience.batch_size for experience in experiences) * self.strategy.world_size
        # The ranks sharing rows (--sequence_parallel_size) train on their rollouts together.
        if getattr(self.strategy, "sequence_parallel_size", 1) > 1:
            experiences = self.strategy.sequence_parallel.union(experiences)
        for experience in experiences:
            self.replay_buffer.append(experience)
        if self.normalize_advantages_globally:
            self.replay_buffer.normalize("advantages", self.strategy)
        # The step's totals are reduced over ranks while the actor trains.
        totals = self.start_step_totals(self.replay_buffer.info_sums())
        self.pass_preempted = None
        train_logs = self.ppo_train(self.global_step)
        self.rollout.mark_stale()
        if check_engine:
            self.check_engine_gap(train_logs)
        self.replay_buffer.clear()
        rollout_logs = routing_metrics(distill_metrics(totals.result()))
        self.kl_ctl.update(rollout_logs.get("rollout/kl", 0.0), samples)
        self.global_step += 1
        return {**rollout_logs, **train_logs, "train/kl_coef": self.kl_ctl.value}

    def start_step_totals(self, rollout_sums: dict[str, torch.Tensor]) -> PendingReduction:
        """The rollout's statistics over all ranks, in one all-reduce started now and read when
        the step ends (`lightrft.trainer.metrics.start_step_totals`)."""
        return start_step_totals(self.strategy, rollout_sums, self.nonfinite_counts,
                                 self.experience_services.scorer.reward_sources)

    def set_pretrain_data(self, pretrain_dataloader=None) -> None:
        """The pretraining data stream of the PPO-ptx loss (`--pretrain_data`), cycled; None for
        none. `fit` sets it; `lightrft.cli.doctor` sets it to run steps outside `fit`."""
        self.pretrain_iter = self._cycle(pretrain_dataloader) if pretrain_dataloader is not None else None

    def planned_steps(self, args, dataloader) -> int:
        """Rollout steps of the run: prompts // rollout_batch_size per episode, times the
        episodes, capped by --max_steps. The LR schedule spans exactly these steps, and the run
        takes them all: with dynamic sampling, prompts are drawn past the last episode if needed."""
        return as_ppo_config(args).planned_steps(len(dataloader.dataset))


    def check_engine_gap(self, logs: dict[str, float]) -> None:
        """Stops the run (or warns once) when this step's rollouts were sampled from other weights
        than the trainer's (`lightrft.rollout.checks.EngineGapCheck`). Only where the experience
        source's samples come from the trainer's own engine: explorers sample from a policy up to
        `--sync_offset` versions old on purpose, served traffic from whatever policy served it."""
        source = self.experience_source
        if source is None or source.checks_engine:
            self.engine_gap.check(logs, self.global_step + 1, type(self.rollout_engine).__name__, self.rollout)

    @staticmethod
    def _cycle(dataloader):
        while True:
            yield from dataloader

    # =============================================================================== logs
    def save_logs_and_checkpoints(self, args, global_step: int, step_bar, logs_dict: dict,
                                  client_states: Optional[dict] = None, eval_dataloader=None) -> None:
        args = as_ppo_config(args)
        # Save first, so this step's logs already count a save that failed.
        if self.saved_at_step(args, global_step):
            self.save_checkpoint(args)
        logs_dict = {**logs_dict, **{f"train/{k}": float(v) for k, v in self.counters.items()},
                     "train/failed_saves": float(self.services.failed_saves)}
        eval_steps = args.data.eval_steps
        if eval_dataloader is not None and eval_steps > 0 and global_step % eval_steps == 0:
            logs_dict.update(self.evaluate(eval_dataloader))
        if global_step % max(args.logging.logging_steps, 1) == 0:
            self.log(logs_dict, step=global_step)
        self.last_logs = logs_dict

    def log(self, logs: dict, step: int) -> None:
        """Sends metrics to the tracker (W&B / TensorBoard), if there is one."""
        if self.tracker is not None:
            self.tracker.log(logs, step=step)

    # ================================================================================ evaluation
    def evaluate(self, eval_dataloader) -> dict[str, float]:
        """Mean reward of greedy decoding, and pass@k over k samples when `eval_n_samples` > 1
        (see `lightrft.trainer.evaluation.evaluate_policy`)."""
        return evaluate_policy(self.eval_services, self.strategy, eval_dataloader,
                               {**self.generate_kwargs, **self.eval_generate_kwargs},
                               k=self.args.data.eval_n_samples if self.args is not None else 1)

    @cached_property
    def eval_services(self):
        """The run's rollout services, scored by --eval_remote_rm_url's sources when it names a
        held-out scorer (evaluation only; training keeps its own reward)."""
        return held_out_services(self.experience_services, self.args.rewards if self.args is not None else None)


DISTILL_SUMS = ("reverse_kl", "teacher_logprob", "student_logprob")


def distill_metrics(rollout_logs: dict[str, float]) -> dict[str, float]:
    """A step's rollout logs with the distillation sums (`ExperienceBuilder.distill_info`, means
    over samples of per-sample sums) turned into per-token means over the step's trained tokens:
    distill/reverse_kl (mean log p_student - log p_teacher of the sampled tokens, an unbiased
    estimate of KL(student || teacher) per token), distill/teacher_logprob, distill/student_logprob.
    Logs without them (no teacher) come back unchanged."""
    if "rollout/distill_tokens" not in rollout_logs:
        return rollout_logs
    logs = dict(rollout_logs)
    tokens = logs.pop("rollout/distill_tokens")
    for name in DISTILL_SUMS:
        total = logs.pop(f"rollout/distill_{name}")
        logs[f"distill/{name}"] = total / tokens if tokens > 0 else float("nan")
    return logs


def routing_metrics(rollout_logs: dict[str, float]) -> dict[str, float]:
    """A step's rollout logs with routing replay's statistics (`ExperienceBuilder.old_policy_forward`,
    means over samples) as routing/*: flip_share, the share of (token, MoE layer) pairs where the
    trainer's live router would have chosen another expert set than the rollout's; logprob_gap_live
    and logprob_gap_replayed, the mean absolute gap between the engine's and the actor's log-probs
    without and with replay (first micro-batch). Logs without them come back unchanged."""
    if "rollout/route_pairs" not in rollout_logs:
        return rollout_logs
    logs = dict(rollout_logs)
    flips, pairs = logs.pop("rollout/route_flips"), logs.pop("rollout/route_pairs")
    logs["routing/flip_share"] = flips / pairs if pairs > 0 else 0.0
    for kind in ("live", "replayed"):
        logs[f"routing/logprob_gap_{kind}"] = logs.pop(f"rollout/route_gap_{kind}")
    return logs
