"""PPOTrainer: the PPO / GRPO / REINFORCE++ / RLOO loop.

One step = one rollout batch: generate and score on every rank, put the experience in the
replay buffer, run `max_epochs` passes of micro-batches through the policy (and value) loss,
update the KL controller, log, and save when due. `fit` reads top to bottom; everything it calls
is a small method meant to be overridden by research code. Checkpoints, resume, preemption and
the non-finite guard are the run services shared with SFT and RM (`run_services.py`).
"""

import dataclasses
import time
from collections.abc import Mapping
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader
from tqdm import tqdm

from lightrft.algorithms.advantages import get_advantage_estimator
from lightrft.algorithms.aggregation import aggregate_loss
from lightrft.algorithms.kl import compute_approx_kl, make_kl_controller
from lightrft.builders.engines import build_hf_engine
from lightrft.config.run import PPORunConfig, plain_options
from lightrft.config.sections import REQUIRED_LOSS_AGG, AlgorithmConfig  # noqa: F401  (re-exported)
from lightrft.models.loss import GPTLMLoss, PolicyLoss, ValueLoss
from lightrft.rollout.checks import EngineGapCheck, engine_gap_tolerance, engine_logprob_gap
from lightrft.rollout.manager import RolloutManager, WeightStream
from lightrft.strategy.deepspeed_strategy import PendingReduction
from lightrft.trainer.callbacks import CallbackList
from lightrft.trainer.checkpoint import pinned_options
from lightrft.trainer.evaluation import evaluate_policy
from lightrft.experience.samples import Experience, Sample, collate_samples
from lightrft.experience.maker import NaiveExperienceMaker
from lightrft.experience.sources import ColocatedSource, PromptSampler, SourceContext
from lightrft.trainer.guards import nonfinite_grad_norms
from lightrft.trainer.metrics import (EXTREME_SUFFIXES, GlobalCounts, combine_metric,  # noqa: F401  (re-exported)
                                     combine_step_metrics, global_counts, perf_metrics, reduce_pass_metrics,
                                     start_step_totals)
from lightrft.experience.replay_buffer import NaiveReplayBuffer
from lightrft.trainer.run_services import CheckpointPart, RunServices

# Options that define the experiment: resuming with a different value is an error.
PINNED_OPTIONS = ("pretrain", "advantage_estimator", "n_samples_per_prompt", "rollout_batch_size",
                  "train_batch_size", "micro_train_batch_size", "policy_loss", "loss_agg_mode",
                  "kl_estimator", "use_kl_loss", "seed", "prompt_data", "recorded_data", "max_epochs")


def as_ppo_config(args) -> PPORunConfig:
    """The typed run config of `args` (an argparse namespace of its flags is converted)."""
    return args if isinstance(args, PPORunConfig) else PPORunConfig.from_namespace(args)


class PPOTrainer:
    """Trains `actor` with PPO-family updates. `critic=None` selects a critic-free method.

    Models are DeepSpeed engines from `strategy.prepare` (or plain modules for frozen ones).
    `reward_model` may be a list, combined by `reward_fn` ((K, B) -> (B,)); `remote_rm_url` adds
    HTTP reward servers, reward files and builtin rules. `generate_kwargs` (temperature, top_p,
    top_k, max_new_tokens) are the rollout sampling parameters. `reward_sources` takes ready-made
    reward sources (objects with `__call__(queries, prompts, labels)`); `packing_samples` packs the
    training micro-batches. The keyword defaults are the documented OpenRLHF-compatible ones; a
    run's defaults live in its config: `PPOTrainer.from_config(config, ...)` passes every option
    from a `lightrft.config.PPORunConfig`. The classic arguments (`init_kl_coef`, `kl_target`,
    `kl_horizon`, `ptx_coef`, `eps_clip`, `value_clip`) default to None, which takes the value of the
    same field of `algo`; a value given explicitly overrides it. Without `algo` they take the classic
    values 0.001, None (fixed KL), 10000, 0, 0.2 and 0.2."""

    # Whether the old log-probs skip the separate forward at rollout time: None decides per run
    # (yes with one epoch, no KL term needing the policy's log-probs at rollout time, and no active
    # dropout); False always runs the separate forward. When skipped, the first optimizer step of a
    # rollout, exactly on-policy, takes them from its own forward, detached, and the samples of the
    # later steps get theirs from a forward before the first update, with the same weights the
    # rollout-time forward would have used.
    reuse_old_log_probs: Optional[bool] = None

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
                 sync_bucket_mb: Optional[float] = None, **generate_kwargs):
        # A classic PPO argument given explicitly overrides `algo`; None takes `algo`'s value. Without
        # `algo` the classic signature's documented values apply (init_kl_coef 0.001, not the CLI's 0.01).
        classic = dict(init_kl_coef=init_kl_coef, kl_target=kl_target, kl_horizon=kl_horizon, ptx_coef=ptx_coef,
                       eps_clip=eps_clip, value_clip=value_clip)
        self.algo = dataclasses.replace(algo if algo is not None else AlgorithmConfig(init_kl_coef=0.001),
                                        **{k: v for k, v in classic.items() if v is not None})
        self.strategy = strategy
        self.actor, self.critic = actor, critic
        self.reward_model, self.initial_model, self.ema_model = reward_model, initial_model, ema_model
        self.actor_optim, self.critic_optim = actor_optim, critic_optim
        self.actor_scheduler, self.critic_scheduler = actor_scheduler, critic_scheduler
        self.ema_beta = ema_beta
        self.micro_train_batch_size = micro_train_batch_size
        self.max_epochs = max_epochs
        self.max_norm = max_norm
        self.tokenizer = tokenizer
        self.prompt_max_len = prompt_max_len
        self.dataloader_pin_memory = dataloader_pin_memory
        self.save_hf_ckpt, self.disable_ds_ckpt = save_hf_ckpt, disable_ds_ckpt
        self.gradient_checkpointing = gradient_checkpointing
        self.generate_kwargs = generate_kwargs
        self.eval_generate_kwargs = eval_generate_kwargs or {}
        self.callbacks = CallbackList(callbacks)
        self.tracker = tracker
        # Every step checks that the engine samples from the trained weights (`lightrft.rollout.checks`).
        self.engine_gap = EngineGapCheck(engine_gap_tolerance(strategy.config.bf16)[0]
                                         if engine_logprob_gap_threshold is None else engine_logprob_gap_threshold,
                                         engine_logprob_gap_action, lambda message: self.strategy.print(message))
        self.services = RunServices(strategy, preemption_grace=preemption_grace,
                                    max_nonfinite_steps=self.algo.max_nonfinite_steps, max_ckpt_num=max_ckpt_num)

        estimator = get_advantage_estimator(self.algo.advantage_estimator)
        if estimator.needs_critic and critic is None:
            raise ValueError(f"--advantage_estimator {self.algo.advantage_estimator} needs a critic: pass "
                             "--critic_pretrain, or pick a critic-free estimator such as group_norm or reinforce++")
        self.normalize_advantages_globally = estimator.normalize_globally
        algo = self.algo
        self.kl_ctl = make_kl_controller(algo.init_kl_coef, algo.kl_target or None, algo.kl_horizon)
        self.actor_loss_fn, self.critic_loss_fn = PolicyLoss.from_algorithm(algo), ValueLoss.from_algorithm(algo)
        self.ptx_loss_fn = GPTLMLoss()

        if rollout_engine is None:
            rollout_engine = build_hf_engine(strategy.unwrap_model(actor).model, tokenizer, eos_token_ids,
                                             micro_rollout_batch_size,
                                             synced_gpus=strategy.world_size > 1 and strategy.config.zero_stage == 3)
        self.rollout_engine = rollout_engine
        # The one owner of the engine's lifecycle: rollouts and evaluation both generate through it.
        # The actor's weights bucket by bucket: what syncs the engine, and what explorers are sent.
        # Bucket size: the engine's own (--vllm_sync_bucket_mb), else `sync_bucket_mb`, else 512 MB.
        bucket_mb = getattr(rollout_engine, "sync_bucket_mb", None) or sync_bucket_mb or 512.0
        self.weight_stream = WeightStream(strategy, actor, bucket_mb)
        self.rollout = RolloutManager.for_actor(rollout_engine, strategy, actor, stream=self.weight_stream)
        self.experience_maker = NaiveExperienceMaker.for_algorithm(
            algo, actor, critic, reward_model, initial_model, tokenizer, prompt_max_len, self.kl_ctl, strategy,
            remote_rm_url, reward_fn, rollout_engine=self.rollout, reward_sources=reward_sources,
            micro_rollout_batch_size=micro_rollout_batch_size, apply_chat_template=apply_chat_template,
            eos_token_ids=eos_token_ids)
        self.replay_buffer = NaiveReplayBuffer(micro_train_batch_size, buffer_limit, buffer_cpu_offload,
                                               packing_samples=packing_samples, pad_token_id=tokenizer.pad_token_id)
        self.global_step = 0           # optimizer-step groups completed (one per rollout batch)
        self.consumed_samples = 0      # prompts drawn from the dataset, over all ranks
        self.counters = {"skipped_steps": 0, "dropped_groups": 0, "sampling_rounds": 0}
        self.stop_reason = None
        self.pass_preempted = None     # whether any rank was asked to stop, from the last pass's metrics
        self._warned_no_aux_loss = False
        # Where each step's experience comes from (`lightrft.experience.sources`): the
        # colocated source over `fit`'s prompts unless one is given (recorded traffic, explorers).
        self.experience_source = experience_source
        self.resumed_state: dict = {}  # the checkpoint's client state, for the source to resume from
        self.last_timings: dict[str, float] = {}
        self.pretrain_iter = None
        self.args: Optional[PPORunConfig] = None     # the run config `fit` runs

    @classmethod
    def from_config(cls, config, strategy, actor, critic, reward_model, initial_model, ema_model, actor_optim,
                    critic_optim, actor_scheduler, critic_scheduler, *, tokenizer, **kwargs) -> "PPOTrainer":
        """A trainer whose every option comes from `config` (a `lightrft.config.PPORunConfig`);
        `kwargs` passes what a config cannot hold (rollout_engine, reward_sources, callbacks,
        tracker, eos_token_ids, reward_fn)."""
        r, a = config.rollout, config.algorithm
        return cls(strategy, actor, critic, reward_model, initial_model, ema_model, actor_optim, critic_optim,
                   actor_scheduler, critic_scheduler, ema_beta=config.model.ema_beta, init_kl_coef=a.init_kl_coef,
                   kl_target=a.kl_target, kl_horizon=a.kl_horizon, ptx_coef=a.ptx_coef, eps_clip=a.eps_clip,
                   value_clip=a.value_clip,
                   micro_train_batch_size=config.optim.micro_train_batch_size,
                   micro_rollout_batch_size=r.micro_rollout_batch_size,
                   gradient_checkpointing=config.distributed.gradient_checkpointing,
                   max_epochs=config.optim.max_epochs, max_norm=config.optim.max_norm, tokenizer=tokenizer,
                   prompt_max_len=config.data.prompt_max_len, save_hf_ckpt=config.checkpoint.save_hf_ckpt,
                   disable_ds_ckpt=config.checkpoint.disable_ds_ckpt, algo=config.algorithm,
                   packing_samples=config.model.packing_samples, preemption_grace=config.checkpoint.preemption_grace,
                   apply_chat_template=config.data.apply_chat_template, max_ckpt_num=config.checkpoint.max_ckpt_num,
                   max_new_tokens=r.generate_max_len, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                   engine_logprob_gap_threshold=r.engine_logprob_gap_threshold,
                   engine_logprob_gap_action=r.engine_logprob_gap_action, sync_bucket_mb=r.vllm_sync_bucket_mb,
                   **kwargs)

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
                # A signal that came during a save (which can take long) stops the run now, not a step later.
                self.stop_reason = self.services.stop_reason(
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
        self.experience_maker.reuse_policy_log_probs = self.on_policy(config)
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
            maker=self.experience_maker, strategy=self.strategy, algo=self.algo, generate_kwargs=self.generate_kwargs,
            prompts=sampler, consumed_samples=consumed_samples, rollout_batch_size=rollout.rollout_batch_size,
            total_steps=total_steps, first_step=self.global_step, preempted=lambda: self.services.preemption.raised,
            weight_buckets=self.weight_stream.buckets))
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
        logs.update(self.experience_source.after_step(self.global_step))
        logs.update(perf_metrics(self.last_timings, rollout_time, train_time,
                                 config.rollout.rollout_batch_size * self.algo.n_samples_per_prompt))
        return logs

    def make_experience(self, prompt_batches=None) -> Optional[list[Experience]]:
        """This step's experience from the experience source; None when it has no more. Counts
        the prompts it drew and its counters (dynamic sampling's dropped groups and rounds).
        Override to act around each rollout (`prompt_batches` is unused, kept for subclasses that
        pass it on)."""
        batch = self.experience_source.next(self.global_step)
        if batch is None:
            return None
        self.consumed_samples += batch.prompts
        for name, value in batch.counters.items():
            self.counters[name] += value
        self.last_timings = {**dict.fromkeys(("generate", "reward", "experience"), 0.0), **batch.timings}
        return batch.experiences

    def step(self, experiences: list[Experience], check_engine: bool = True) -> dict[str, float]:
        """One optimisation round on a rollout's experiences: the step `fit` repeats and
        `lightrft.cli.doctor` runs. The replay buffer takes them (advantages whitened over all
        ranks where the estimator asks), the PPO epochs train on them, the engine is marked stale
        and its log-prob gap checked (`check_engine=False` for samples drawn otherwise than
        training draws them, as the doctor's memory probe forces their lengths), and the KL
        controller follows the observed KL. Returns the step's rollout/* and train/* logs;
        `global_step` counts it."""
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
        rollout_logs = totals.result()
        # The controller counts the step's samples over all ranks (every rank holds as many).
        samples = sum(experience.batch_size for experience in experiences) * self.strategy.world_size
        self.kl_ctl.update(rollout_logs.get("rollout/kl", 0.0), samples)
        self.global_step += 1
        return {**rollout_logs, **train_logs, "train/kl_coef": self.kl_ctl.value}

    def start_step_totals(self, rollout_sums: dict[str, torch.Tensor]) -> PendingReduction:
        """The rollout's statistics over all ranks, in one all-reduce started now and read when
        the step ends (`lightrft.trainer.metrics.start_step_totals`)."""
        return start_step_totals(self.strategy, rollout_sums, self.experience_maker.nonfinite_counts,
                                 self.experience_maker.reward_sources)

    def set_pretrain_data(self, pretrain_dataloader=None) -> None:
        """The pretraining data stream of the PPO-ptx loss (`--pretrain_data`), cycled; None for
        none. `fit` sets it; `lightrft.cli.doctor` sets it to run steps outside `fit`."""
        self.pretrain_iter = self._cycle(pretrain_dataloader) if pretrain_dataloader is not None else None

    def on_policy(self, args) -> bool:
        """Whether the first optimizer step of each rollout is exactly on-policy (one epoch, no
        dropout), so its ratio is 1 and the old log-probs need no forward at rollout time: that step
        detaches its own, and `fill_old_log_probs` computes the later steps' before it updates."""
        if self.reuse_old_log_probs is not None:
            return self.reuse_old_log_probs
        modules = self.strategy.unwrap_model(self.actor).modules()
        dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in modules)
        return self.max_epochs == 1 and not dropout

    def planned_steps(self, args, dataloader) -> int:
        """Rollout steps of the run: prompts // rollout_batch_size per episode, times the
        episodes, capped by --max_steps. The LR schedule spans exactly these steps, and the run
        takes them all: with dynamic sampling, prompts are drawn past the last episode if needed."""
        return as_ppo_config(args).planned_steps(len(dataloader.dataset))

    # =========================================================================== training phase
    def ppo_train(self, global_steps: int) -> dict[str, float]:
        """`max_epochs` passes over the replay buffer; returns train/* metrics averaged over steps."""
        grad_accum = self.strategy.accumulated_gradient
        generator = torch.Generator().manual_seed(self.strategy.config.seed * 7919 + global_steps)
        drawn: list[list] = []          # each micro-batch's samples, in order

        def collate(samples):
            drawn.append(samples)
            return self.replay_buffer.collate_fn(samples)

        dataloader = DataLoader(self.replay_buffer, batch_size=self.micro_train_batch_size, shuffle=True,
                                drop_last=True, collate_fn=collate,
                                pin_memory=self.dataloader_pin_memory and torch.cuda.is_available(),
                                generator=generator)
        step_metrics = []
        for _ in range(self.max_epochs):
            drawn.clear()
            micro_batches = list(dataloader)
            groups = [micro_batches[start:start + grad_accum] for start in range(0, len(micro_batches), grad_accum)]
            counts = self.global_counts(groups)     # in flight until the first loss needs them
            self.fill_old_log_probs(micro_batches[grad_accum:], drawn[grad_accum:])
            local, grad_sources = [], []
            for group, group_counts in zip(groups, counts):
                local.append([self.training_step(exp, global_steps, group_counts) for exp in group])
                grad_sources.append(nonfinite_grad_norms(self.strategy, actor=self.actor, critic=self.critic))
            # One all-reduce for the metrics of every optimizer step of the pass: each is a barrier
            # between ranks, and none of them is needed before the pass ends. It also tells whether
            # any rank was asked to stop, so the step needs no collective of its own for that.
            reduced, self.pass_preempted = self.reduce_pass_metrics(local, self.services.preemption.raised)
            for metrics, sources in zip(reduced, grad_sources):
                self.check_step_finite(metrics, sources)
                self.callbacks.on_step_end(self, metrics)
                step_metrics.append(metrics)
        return combine_step_metrics(step_metrics)

    def check_engine_gap(self, logs: dict[str, float]) -> None:
        """Stops the run (or warns once) when this step's rollouts were sampled from other weights
        than the trainer's (`lightrft.rollout.checks.EngineGapCheck`). Only where the experience
        source's samples come from the trainer's own engine: explorers sample from a policy up to
        `--sync_offset` versions old on purpose, served traffic from whatever policy served it."""
        source = self.experience_source
        if source is None or source.checks_engine:
            self.engine_gap.check(logs, self.global_step + 1, type(self.rollout_engine).__name__, self.rollout)

    @torch.no_grad()
    def fill_old_log_probs(self, micro_batches: list[Experience], samples: list[list[Sample]]) -> None:
        """The old log-probs of the micro-batches the rollout left without them (see
        `reuse_old_log_probs`), from their `samples`: forwards in eval mode with the current weights
        over batches of `micro_rollout_batch_size` samples, as at rollout time, before any of this
        pass's updates."""
        missing = [k for k, exp in enumerate(micro_batches) if exp.action_log_probs is None]
        if not missing:
            return
        flat = [sample for k in missing for sample in samples[k]]
        chunk = self.experience_maker.micro_rollout_batch_size
        self.actor.eval()
        rows = []
        for i in range(0, len(flat), chunk):
            batch = collate_samples(flat[i:i + chunk], self.replay_buffer.pad_token_id,
                                    self.replay_buffer.packing_samples).to(self.strategy.device)
            log_probs = self._actor_forward(self.actor, batch)[0].float() * batch.action_mask.float()
            rows.extend(log_probs.cpu().unbind(0))
        log_probs, start = pad_sequence(rows, batch_first=True), 0      # (samples, widest chunk)
        for k in missing:
            exp = micro_batches[k]
            width = exp.action_mask.size(1)
            block = log_probs[start:start + exp.batch_size, :width]
            exp.action_log_probs = F.pad(block, (0, width - block.size(1))).to(exp.action_mask.device)
            start += exp.batch_size

    def check_step_finite(self, metrics: dict[str, float], grad_sources: Optional[list[str]] = None) -> None:
        """Counts an optimizer step whose loss or gradient norm was not finite (DeepSpeed's ZeRO
        optimizers then skip the update); a streak of `max_nonfinite_steps` stops the run.
        `grad_sources` names the models whose gradient norm was not finite at that step (read
        from the models now when not given)."""
        sources = [name.replace("train/nonfinite_", "") for name in
                   ("train/nonfinite_policy_loss", "train/nonfinite_critic_loss") if metrics.get(name, 0.0) > 0]
        if grad_sources is None:
            grad_sources = nonfinite_grad_norms(self.strategy, actor=self.actor, critic=self.critic)
        self.services.record_step(sources + grad_sources)
        self.counters["skipped_steps"] = self.services.guard.skipped

    def global_counts(self, groups: list[list[Experience]]) -> list[Mapping[str, float]]:
        """Action tokens and sequences of each optimizer step over all ranks, the loss
        normalisers (`lightrft.trainer.metrics.global_counts`)."""
        return global_counts(self.strategy, groups)

    def loss_scale(self) -> float:
        """DeepSpeed averages gradients over ranks and divides the loss by the accumulation steps;
        a loss already normalised by global counts is multiplied back so the summed gradient of all
        micro-batches is the gradient of the whole-batch loss."""
        return float(self.strategy.world_size * self.strategy.accumulated_gradient)

    def training_step(self, experience: Experience, global_steps: int, counts: dict) -> dict:
        experience = experience.to(self.strategy.device)
        metrics = {}
        if global_steps > self.algo.freezing_actor_steps:
            metrics.update(self.training_step_actor(experience, counts))
        if self.critic is not None:
            metrics.update(self.training_step_critic(experience, counts))
        return metrics

    def _train_mode(self, model) -> None:
        """`model.train()` unless the wrapper and the model it wraps are in training mode already
        (what lightrft switches to eval is one or the other): the call walks every submodule, about
        0.3 ms a micro-batch on a small model."""
        module = self.strategy.unwrap_model(model)
        inner = getattr(module, "model", None)
        if not module.training or (isinstance(inner, torch.nn.Module) and not inner.training):
            model.train()

    def _actor_forward(self, model, experience: Experience, return_entropy: bool = False):
        return model(experience.sequences, experience.num_actions, attention_mask=experience.attention_mask,
                     return_output=True, packed_seq_lens=experience.packed_seq_lens,
                     return_entropy=return_entropy, return_aux_loss=self.algo.aux_loss_coef > 0)

    def _aggregate(self, per_token: torch.Tensor, mask: torch.Tensor, counts: dict) -> torch.Tensor:
        return aggregate_loss(per_token, mask.float(), self.algo.loss_agg_mode, counts["tokens"], counts["seqs"],
                              self.algo.norm_len)

    def training_step_actor(self, experience: Experience, counts: dict) -> dict:
        self._train_mode(self.actor)
        mask = experience.loss_mask
        log_probs, output = self._actor_forward(self.actor, experience, return_entropy=self.algo.entropy_coef != 0)
        old_log_probs = experience.action_log_probs
        if old_log_probs is None:        # exactly on-policy: the old policy is this forward's
            old_log_probs = log_probs.detach()
        policy_loss, metrics = self.actor_loss_fn(
            log_probs, old_log_probs, experience.advantages, action_mask=mask,
            rollout_log_probs=experience.rollout_log_probs, return_metrics=True, global_num_tokens=counts["tokens"],
            global_num_seqs=counts["seqs"], norm_len=self.algo.norm_len)
        metrics["nonfinite_policy_loss"] = (~torch.isfinite(policy_loss.detach())).float()
        if experience.rollout_log_probs is not None:
            # The engine's log-prob of each sampled token against the trainer's at rollout time.
            gap_sum, gap_tokens, metrics["engine_logprob_gap_max"] = engine_logprob_gap(
                old_log_probs, experience.rollout_log_probs, mask)
            metrics["engine_logprob_gap_sum"], metrics["engine_logprob_gap_tokens"] = gap_sum, gap_tokens
        # A micro-batch with no token to train on has no extremes (the loss reports 0 for them):
        # NaN, which `combine_metric` skips, so they do not pass for the smallest ratio.
        trains = mask.any()
        for key in [k for k in metrics if k.endswith(EXTREME_SUFFIXES)]:
            metrics[key] = torch.where(trains, metrics[key].detach(), float("nan"))
        loss = policy_loss
        if self.algo.use_kl_loss and experience.base_action_log_probs is not None:
            kl = compute_approx_kl(log_probs, experience.base_action_log_probs, mask,
                                   kl_estimator=self.algo.kl_estimator, clamp=self.algo.kl_clamp)
            kl_loss = self._aggregate(kl, mask, counts)
            loss = loss + self.kl_ctl.value * kl_loss
            metrics["kl_loss"] = kl_loss.detach()
        if self.algo.entropy_coef != 0:
            entropy = self._aggregate(output["entropy"], mask, counts)
            loss = loss - self.algo.entropy_coef * entropy
            metrics["entropy"] = entropy.detach()
        aux_loss = self._aux_loss(output)
        if aux_loss is not None:
            metrics["aux_loss"] = aux_loss.detach()
            # The MoE load-balancing loss is already a per-rank mean: scale it like one.
            loss = loss + self.algo.aux_loss_coef * aux_loss / self.loss_scale()
        self.strategy.backward(loss * self.loss_scale(), self.actor, self.actor_optim)
        if self.pretrain_iter is not None and self.algo.ptx_coef > 0:
            metrics["ptx_loss"] = self.ptx_step()
        self.strategy.optimizer_step(self.actor_optim, self.actor, self.actor_scheduler)
        if self.ema_model is not None:
            self.strategy.moving_average(self.actor, self.ema_model, self.ema_beta)
        metrics["policy_loss"] = policy_loss.detach()
        metrics["actor_lr"] = torch.tensor(self._current_lr(self.actor_scheduler))
        return {f"train/{k}": v for k, v in metrics.items()}

    def _aux_loss(self, output) -> Optional[torch.Tensor]:
        """The MoE router load-balancing loss when --aux_loss_coef asks for it (warns once when the
        model gives none)."""
        if not self.algo.aux_loss_coef:
            return None
        aux_loss = output.get("aux_loss") if isinstance(output, dict) else getattr(output, "aux_loss", None)
        if aux_loss is None and not self._warned_no_aux_loss:
            self._warned_no_aux_loss = True
            self.strategy.print(f"warning: --aux_loss_coef {self.algo.aux_loss_coef} has no effect: the model gives no "
                                "router load-balancing loss (it is not a mixture-of-experts model)")
        return aux_loss

    def ptx_step(self) -> torch.Tensor:
        """One language-modelling micro-batch from the pretraining data, weighted by ptx_coef
        (InstructGPT's PPO-ptx objective)."""
        batch = next(self.pretrain_iter)
        device = self.strategy.device
        module = self.strategy.unwrap_model(self.actor)
        logits = module.model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                              use_cache=False).logits
        ptx_loss = self.ptx_loss_fn(logits, batch.labels.to(device))
        self.strategy.backward(self.algo.ptx_coef * ptx_loss, self.actor, self.actor_optim)
        return ptx_loss.detach()

    def training_step_critic(self, experience: Experience, counts: dict) -> dict:
        self._train_mode(self.critic)
        values = self.critic(experience.sequences, experience.num_actions, attention_mask=experience.attention_mask,
                             packed_seq_lens=experience.packed_seq_lens)
        loss, metrics = self.critic_loss_fn(values, experience.values, experience.returns,
                                            action_mask=experience.loss_mask, global_num_tokens=counts["tokens"],
                                            global_num_seqs=counts["seqs"], norm_len=self.algo.norm_len,
                                            return_metrics=True)
        self.strategy.backward(loss * self.loss_scale(), self.critic, self.critic_optim)
        self.strategy.optimizer_step(self.critic_optim, self.critic, self.critic_scheduler)
        metrics = {"critic_loss": loss.detach(), "nonfinite_critic_loss": (~torch.isfinite(loss.detach())).float(),
                   **metrics}
        return {f"train/{k}": v for k, v in metrics.items()}

    def reduce_pass_metrics(self, steps: list[list[dict]], preempted: bool = False) -> tuple[list[dict[str, float]], bool]:
        """Each optimizer step's metrics over micro-batches and ranks, and whether any rank was
        `preempted` (`lightrft.trainer.metrics.reduce_pass_metrics`)."""
        return reduce_pass_metrics(self.strategy, steps, preempted)

    @staticmethod
    def _current_lr(scheduler) -> float:
        return scheduler.get_last_lr()[0] if scheduler is not None else float("nan")

    @staticmethod
    def _cycle(dataloader):
        while True:
            yield from dataloader

    # ======================================================================= logs and checkpoints
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

    @staticmethod
    def saved_at_step(args, global_step: int) -> bool:
        """Whether `save_logs_and_checkpoints` writes a checkpoint at this step (every --save_steps)."""
        save_steps = as_ppo_config(args).checkpoint.save_steps
        return save_steps > 0 and global_step % save_steps == 0

    def pinned_options(self, args) -> dict:
        return pinned_options(args, PINNED_OPTIONS)

    def client_state(self) -> dict:
        source_state = self.experience_source.state_dict() if self.experience_source is not None else {}
        counters = {"global_step": self.global_step, "consumed_samples": self.consumed_samples,
                    "kl_ctl": self.kl_ctl.state_dict(), **source_state,
                    "counters": dict(self.counters), "failed_saves": self.services.failed_saves,
                    "nonfinite_counts": dict(self.experience_maker.nonfinite_counts),
                    "config": plain_options(self.args)}   # the resolved run config travels with every checkpoint
        return RunServices.client_state(counters, self.pinned_options(self.args))

    def checkpoint_parts(self, args, client_state: Optional[dict] = None) -> list[CheckpointPart]:
        """The engines of a checkpoint in write order: critic and EMA first, the actor last (its
        `latest` pointer is what makes the step resumable)."""
        ckpt_path = as_ppo_config(args).checkpoint.ckpt_path
        parts = [CheckpointPart(f"{ckpt_path}/{name}", model, {"global_step": self.global_step},
                                load_optimizer_states=name == "_critic")
                 for name, model in (("_critic", self.critic), ("_ema", self.ema_model)) if model is not None]
        return parts + [CheckpointPart(f"{ckpt_path}/_actor", self.actor, client_state)]

    def save_checkpoint(self, args) -> None:
        """Writes a resumable checkpoint and, with `save_hf_ckpt`, a Hugging Face export of the actor."""
        tag, ckpt_path = f"global_step{self.global_step}", as_ppo_config(args).checkpoint.ckpt_path
        if not self.disable_ds_ckpt and not self.services.save(self.checkpoint_parts(args, self.client_state()),
                                                               tag, ckpt_path):
            return
        if self.save_hf_ckpt:
            self.strategy.save_model(self.ema_model or self.actor, self.tokenizer, f"{ckpt_path}/{tag}_hf")
        self.callbacks.on_save(self, f"{ckpt_path}/_actor/{tag}")

    def load_checkpoint(self, args, required: bool = True) -> int:
        """Resumes weights, optimizer, scheduler, KL controller, counters and RNG from the newest
        complete checkpoint in `args.ckpt_path`; returns the consumed prompt count (0 if none)."""
        *others, actor = self.checkpoint_parts(args)
        state = self.services.load(actor, others, required=required, options=self.pinned_options(args),
                                   unit="prompts")
        if state is None:
            return 0
        self.global_step = state["global_step"]
        self.consumed_samples = state["consumed_samples"]
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.resumed_state = state       # the experience source resumes from it when the run starts
        self.counters.update(state.get("counters", {}))
        self.counters.pop("failed_saves", None)
        self.services.failed_saves = state.get("failed_saves", state.get("counters", {}).get("failed_saves", 0))
        self.services.guard.skipped = self.counters["skipped_steps"]
        self.experience_maker.nonfinite_counts.update(state.get("nonfinite_counts", {}))
        return self.consumed_samples

    # ================================================================================ evaluation
    def evaluate(self, eval_dataloader) -> dict[str, float]:
        """Mean reward of greedy decoding, and pass@k over k samples when `eval_n_samples` > 1
        (see `lightrft.trainer.evaluation.evaluate_policy`)."""
        return evaluate_policy(self.experience_maker, self.strategy, eval_dataloader,
                               {**self.generate_kwargs, **self.eval_generate_kwargs},
                               k=self.args.data.eval_n_samples if self.args is not None else 1)
