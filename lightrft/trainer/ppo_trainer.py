"""PPOTrainer: the PPO / GRPO / REINFORCE++ / RLOO loop.

One step = one rollout batch: generate and score on every rank, put the experience in the
replay buffer, run `max_epochs` passes of micro-batches through the policy (and value) loss,
update the KL controller, log, and save when due. `fit` reads top to bottom; everything it calls
is a small method meant to be overridden by research code.
"""

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from lightrft.algorithms.advantages import get_advantage_estimator
from lightrft.algorithms.aggregation import aggregate_loss
from lightrft.algorithms.kl import AdaptiveKLController, FixedKLController, compute_approx_kl
from lightrft.models.loss import GPTLMLoss, PolicyLoss, ValueLoss
from lightrft.rollout.hf_engine import HFEngine
from lightrft.rollout.manager import RolloutManager
from lightrft.strategy.checkpoint_io import CheckpointSaveError
from lightrft.trainer.callbacks import CallbackList
from lightrft.trainer.checkpoint import PreemptionFlag, capture_rng_state, check_resume_options, restore_rng_state
from lightrft.trainer.experience import Experience
from lightrft.trainer.dynamic_sampling import fill_to_size, filter_informative_groups
from lightrft.trainer.evaluation import evaluate_policy
from lightrft.trainer.experience_maker import NaiveExperienceMaker
from lightrft.trainer.guards import NonFiniteGuard, nonfinite_grad_norms
from lightrft.trainer.replay_buffer import NaiveReplayBuffer
from lightrft.utils.faults import fault_now, nan_gradient, send_sigterm


# Aggregation each policy loss must use, where it has only one correct one: GSPO's ratio is per
# sequence, so only a mean over sequences of token means is the GSPO objective (as OpenRLHF and
# verl force it).
REQUIRED_LOSS_AGG = {"gspo": "seq-mean-token-mean"}


@dataclass(frozen=True)
class AlgorithmConfig:
    """Algorithm options beyond the classic PPO constructor arguments (see docs/algorithms.md).

    `None` defaults are resolved on construction: `loss_agg_mode` becomes the one the policy loss
    needs (`seq-mean-token-mean` for gspo, else `token-mean`); `kl_estimator` becomes `k3` for the
    KL loss (`use_kl_loss`) and `k1` for the KL penalty in the reward. k1 as a loss has zero
    expected gradient (E_pi[grad log pi] = 0), so it would silently do nothing."""

    advantage_estimator: str = "gae"
    n_samples_per_prompt: int = 1
    policy_loss: str = "ppo"
    loss_agg_mode: Optional[str] = None
    eps_clip_low_high: Optional[tuple[float, float]] = None
    dual_clip: Optional[float] = None
    tis_cap: Optional[float] = None
    kl_estimator: Optional[str] = None
    use_kl_loss: bool = False
    entropy_coef: float = 0.0
    aux_loss_coef: float = 0.0
    gamma: float = 1.0
    lambd: float = 0.95
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    mask_truncated_samples: bool = False    # responses cut at the length limit train on nothing
    freezing_actor_steps: int = -1
    norm_len: Optional[int] = None          # length constant of seq-mean-token-sum-norm
    max_nonfinite_steps: int = 3            # consecutive skipped steps before the run saves and stops

    def __post_init__(self):
        required = REQUIRED_LOSS_AGG.get(self.policy_loss)
        if self.loss_agg_mode is None:
            object.__setattr__(self, "loss_agg_mode", required or "token-mean")
        elif required is not None and self.loss_agg_mode != required:
            raise ValueError(f"--policy_loss {self.policy_loss} optimises a sequence-level ratio and needs "
                             f"--loss_agg_mode {required}; got --loss_agg_mode {self.loss_agg_mode} (drop the flag "
                             "to get the right one)")
        if self.kl_estimator is None:
            object.__setattr__(self, "kl_estimator", "k3" if self.use_kl_loss else "k1")
        elif self.use_kl_loss and self.kl_estimator == "k1":
            raise ValueError("--use_kl_loss with --kl_estimator k1 has zero expected gradient (E[grad log pi] = 0), "
                             "so the KL term would not act: use --kl_estimator k3 (gradient of KL(ref||pi)) or k2 "
                             "(gradient of KL(pi||ref)), or drop --kl_estimator for k3")


# Options that define the experiment: resuming with a different value is an error.
PINNED_OPTIONS = ("pretrain", "advantage_estimator", "n_samples_per_prompt", "rollout_batch_size",
                  "train_batch_size", "micro_train_batch_size", "policy_loss", "loss_agg_mode",
                  "kl_estimator", "use_kl_loss", "seed", "prompt_data", "max_epochs")


class PPOTrainer:
    """Trains `actor` with PPO-family updates. `critic=None` selects a critic-free method.

    Models are DeepSpeed engines from `strategy.prepare` (or plain modules for frozen ones).
    `reward_model` may be a list, combined by `reward_fn` ((K, B) -> (B,)); `remote_rm_url` adds
    HTTP reward servers, reward files and builtin rules. `generate_kwargs` (temperature, top_p,
    top_k, max_new_tokens) are the rollout sampling parameters. `reward_sources` takes ready-made
    reward sources (objects with `__call__(queries, prompts, labels)`); `packing_samples` packs the
    training micro-batches."""

    def __init__(self, strategy, actor, critic, reward_model, initial_model, ema_model, actor_optim,
                 critic_optim, actor_scheduler, critic_scheduler, ema_beta: float = 0.992,
                 init_kl_coef: float = 0.001, kl_target: Optional[float] = None, kl_horizon: int = 10000,
                 ptx_coef: float = 0, micro_train_batch_size: int = 8, buffer_limit: int = 0,
                 buffer_cpu_offload: bool = True, eps_clip: float = 0.2, value_clip: float = 0.2,
                 micro_rollout_batch_size: int = 8, gradient_checkpointing: bool = False,
                 max_epochs: int = 1, max_norm: float = 1.0, tokenizer=None, prompt_max_len: int = 128,
                 dataloader_pin_memory: bool = True, remote_rm_url=None, reward_fn=None,
                 save_hf_ckpt: bool = False, disable_ds_ckpt: bool = False, *,
                 algo: Optional[AlgorithmConfig] = None, rollout_engine=None, reward_sources: Sequence = (),
                 packing_samples: bool = False, callbacks: Sequence = (), tracker=None,
                 preemption_grace: float = 600.0, apply_chat_template: bool = False,
                 eos_token_ids: Optional[Sequence[int]] = None,
                 eval_generate_kwargs: Optional[dict] = None, **generate_kwargs):
        self.strategy = strategy
        self.actor, self.critic = actor, critic
        self.reward_model, self.initial_model, self.ema_model = reward_model, initial_model, ema_model
        self.actor_optim, self.critic_optim = actor_optim, critic_optim
        self.actor_scheduler, self.critic_scheduler = actor_scheduler, critic_scheduler
        self.ema_beta = ema_beta
        self.ptx_coef = ptx_coef
        self.micro_train_batch_size = micro_train_batch_size
        self.max_epochs = max_epochs
        self.max_norm = max_norm
        self.tokenizer = tokenizer
        self.prompt_max_len = prompt_max_len
        self.dataloader_pin_memory = dataloader_pin_memory
        self.save_hf_ckpt = save_hf_ckpt
        self.disable_ds_ckpt = disable_ds_ckpt
        self.gradient_checkpointing = gradient_checkpointing
        self.algo = algo or AlgorithmConfig()
        self.generate_kwargs = generate_kwargs
        self.eval_generate_kwargs = eval_generate_kwargs or {}
        self.callbacks = CallbackList(callbacks)
        self.tracker = tracker
        self.init_kl_coef = init_kl_coef

        estimator = get_advantage_estimator(self.algo.advantage_estimator)
        if estimator.needs_critic and critic is None:
            raise ValueError(f"--advantage_estimator {self.algo.advantage_estimator} needs a critic: pass "
                             "--critic_pretrain, or pick a critic-free estimator such as group_norm or reinforce++")
        self.normalize_advantages_globally = estimator.normalize_globally

        self.kl_ctl = (AdaptiveKLController(init_kl_coef, kl_target, kl_horizon) if kl_target
                       else FixedKLController(init_kl_coef))
        eps_low, eps_high = self.algo.eps_clip_low_high or (eps_clip, eps_clip)
        self.actor_loss_fn = PolicyLoss(eps_clip, policy_loss=self.algo.policy_loss,
                                        eps_clip_low_high=(eps_low, eps_high), dual_clip=self.algo.dual_clip,
                                        loss_agg_mode=self.algo.loss_agg_mode, tis_cap=self.algo.tis_cap)
        self.critic_loss_fn = ValueLoss(value_clip, loss_agg_mode=self.algo.loss_agg_mode)
        self.ptx_loss_fn = GPTLMLoss()

        if rollout_engine is None:
            module = strategy.unwrap_model(actor)
            rollout_engine = HFEngine(module.model, pad_token_id=tokenizer.pad_token_id,
                                      eos_token_id=list(eos_token_ids or [tokenizer.eos_token_id]),
                                      micro_batch_size=micro_rollout_batch_size,
                                      synced_gpus=strategy.world_size > 1 and strategy.config.zero_stage == 3)
        self.rollout_engine = rollout_engine
        # The one owner of the engine's lifecycle: rollouts and evaluation both generate through it.
        self.rollout = RolloutManager.for_actor(rollout_engine, strategy, actor)
        self.experience_maker = NaiveExperienceMaker(
            actor, critic, reward_model, initial_model, tokenizer, prompt_max_len, self.kl_ctl, strategy,
            remote_rm_url, reward_fn, rollout_engine=self.rollout, reward_sources=reward_sources,
            advantage_estimator=self.algo.advantage_estimator, n_samples_per_prompt=self.algo.n_samples_per_prompt,
            kl_estimator=self.algo.kl_estimator, use_kl_loss=self.algo.use_kl_loss, gamma=self.algo.gamma,
            lambd=self.algo.lambd, micro_rollout_batch_size=micro_rollout_batch_size,
            overlong_buffer_len=self.algo.overlong_buffer_len,
            overlong_penalty_factor=self.algo.overlong_penalty_factor, seed=strategy.config.seed,
            apply_chat_template=apply_chat_template, mask_truncated_samples=self.algo.mask_truncated_samples,
            eos_token_ids=eos_token_ids)
        self.replay_buffer = NaiveReplayBuffer(micro_train_batch_size, buffer_limit, buffer_cpu_offload,
                                               packing_samples=packing_samples,
                                               pad_token_id=tokenizer.pad_token_id)
        self.global_step = 0           # optimizer-step groups completed (one per rollout batch)
        self.consumed_samples = 0      # prompts drawn from the dataset, over all ranks
        self.counters = {"skipped_steps": 0, "dropped_groups": 0, "sampling_rounds": 0, "failed_saves": 0}
        self.guard = NonFiniteGuard(self.algo.max_nonfinite_steps)
        self.inject_nan = False        # fault hook: the first micro-batch of a step
        self.preemption = PreemptionFlag(preemption_grace)
        self.stop_reason = None
        self._warned_no_aux_loss = False

    # ====================================================================================== fit
    def fit(self, args, prompts_dataloader, pretrain_dataloader=None, consumed_samples: int = 0,
            num_update_steps_per_episodes: int = 1, eval_dataloader=None) -> None:
        """Runs `args.num_episodes` passes over the prompts (resuming after `consumed_samples`)."""
        self.args = args
        self.prompts_dataloader = prompts_dataloader
        self.pretrain_iter = self._cycle(pretrain_dataloader) if pretrain_dataloader is not None else None
        self.consumed_samples = consumed_samples
        batches_per_episode = len(prompts_dataloader.dataset) // args.rollout_batch_size
        total_steps = batches_per_episode * args.num_episodes
        prompt_batches = self._prompt_batches(args, prompts_dataloader, batches_per_episode)
        self.preemption.install()
        self.callbacks.on_train_begin(self)
        bar = tqdm(total=total_steps, initial=self.global_step, desc="PPO steps",
                   disable=not self.strategy.is_rank_0(), dynamic_ncols=True)
        try:
            while True:
                # 1. Rollout: generate, score and forward (refilling dropped groups if asked).
                started = time.time()
                self.experience_maker.step = self.global_step + 1
                self.experience_maker.timings = dict.fromkeys(self.experience_maker.timings, 0.0)
                if fault_now("sigterm-rollout", self.global_step + 1):
                    send_sigterm()
                experiences = self.make_experience(prompt_batches)
                self.rollout.sleep()
                if experiences is None:
                    break
                rollout_time = time.time() - started
                self.callbacks.on_rollout_end(self, experiences)
                # 2. Replay buffer, with global advantage whitening where the estimator needs it.
                for experience in experiences:
                    self.replay_buffer.append(experience)
                if self.normalize_advantages_globally:
                    self.replay_buffer.normalize("advantages", self.strategy)
                rollout_logs = self.rollout_metrics()
                # 3. Optimise: epochs x micro-batches.
                started = time.time()
                train_logs = self.ppo_train(self.global_step)
                self.rollout.mark_stale()
                train_time = time.time() - started
                self.replay_buffer.clear()
                # 4. KL controller follows the observed KL (adaptive) or stays fixed.
                self.kl_ctl.update(rollout_logs.get("rollout/kl", 0.0),
                                   args.rollout_batch_size * self.algo.n_samples_per_prompt)
                self.global_step += 1
                bar.update(1)
                bar.set_postfix(reward=f"{rollout_logs.get('rollout/reward', float('nan')):.3f}")
                # 5. Logs, evaluation, checkpoints; stop early on preemption, failures or --max_steps.
                logs = {**rollout_logs, **train_logs, **self.perf_metrics(args, rollout_time, train_time)}
                self.save_logs_and_checkpoints(args, self.global_step, bar, logs, eval_dataloader=eval_dataloader)
                self.stop_reason = self.stop_reason_now(args)
                if self.stop_reason is not None:
                    break
            # However the loop ended, the last completed step is resumable.
            if self.global_step > 0 and not self.saved_at_step(args, self.global_step):
                self.save_checkpoint(args)
        finally:
            bar.close()
            self.preemption.restore()
        self.callbacks.on_train_end(self)

    def perf_metrics(self, args, rollout_time: float, train_time: float) -> dict[str, float]:
        samples = args.rollout_batch_size * self.algo.n_samples_per_prompt
        return {"train/kl_coef": self.kl_ctl.value, "perf/rollout_time": rollout_time, "perf/train_time": train_time,
                **{f"perf/{k}_time": v for k, v in self.experience_maker.timings.items()},
                "perf/samples_per_sec": samples / max(rollout_time + train_time, 1e-9)}

    def stop_reason_now(self, args) -> Optional[str]:
        """Why the run stops after this step, if it does: a signal on any rank, too many skipped
        steps in a row, or --max_steps reached."""
        if self.preempted():
            return "preempted"
        if self.guard.exhausted:
            self.strategy.print(self.guard.message(args.ckpt_path))
            return "nonfinite"
        if 0 < getattr(args, "max_steps", -1) <= self.global_step:
            return "max_steps"
        return None

    # ============================================================================ rollout phase
    def _prompt_batches(self, args, dataloader, batches_per_episode: int):
        """Yields (prompts, labels) from where `consumed_samples` left off, episode after episode."""
        per_episode = batches_per_episode * args.rollout_batch_size
        start_episode, consumed_in_episode = divmod(self.consumed_samples, per_episode)
        for episode in range(start_episode, args.num_episodes):
            dataloader.sampler.set_epoch(episode, consumed_samples=consumed_in_episode if episode == start_episode else 0)
            for prompts, labels in dataloader:
                self.consumed_samples += args.rollout_batch_size
                yield list(prompts), list(labels)

    def make_experience(self, prompt_batches) -> Optional[list[Experience]]:
        """One rollout batch of experience; None when the prompts are exhausted.

        With dynamic sampling (DAPO), groups whose rewards are all equal carry no GRPO signal:
        they are dropped and more prompts are drawn, up to `max_sampling_rounds` batches."""
        batch = next(prompt_batches, None)
        if batch is None:
            return None
        experiences = self.experience_maker.make_experience_list(batch[0], batch[1], **self.generate_kwargs)
        if not self.algo.dynamic_sampling:
            return experiences
        target = len(batch[0]) * self.algo.n_samples_per_prompt
        kept, rest = filter_informative_groups(experiences, self.algo.n_samples_per_prompt)
        rounds = 1
        # Every rank draws the same number of extra batches so collective calls stay matched.
        while rounds < self.algo.max_sampling_rounds and self._any_rank_short(kept, target):
            more = next(prompt_batches, None)
            if more is None:
                break
            extra = self.experience_maker.make_experience_list(more[0], more[1], **self.generate_kwargs)
            new_kept, new_rest = filter_informative_groups(extra, self.algo.n_samples_per_prompt)
            kept, rest, rounds = kept + new_kept, rest + new_rest, rounds + 1
        self.counters["dropped_groups"] += sum(e.batch_size for e in rest) // self.algo.n_samples_per_prompt
        self.counters["sampling_rounds"] += rounds
        return fill_to_size(kept, rest, target, self.algo.n_samples_per_prompt)

    def _any_rank_short(self, kept: list[Experience], target: int) -> bool:
        have = sum(e.batch_size for e in kept)
        short = torch.tensor([1.0 if have < target else 0.0])
        return self.strategy.all_reduce(short, op="max").item() > 0

    def rollout_metrics(self) -> dict[str, float]:
        means = self.replay_buffer.mean_info(self.strategy)
        return {f"rollout/{k}": v for k, v in means.items()}

    # =========================================================================== training phase
    def ppo_train(self, global_steps: int) -> dict[str, float]:
        """`max_epochs` passes over the replay buffer; returns train/* metrics averaged over steps."""
        grad_accum = self.strategy.accumulated_gradient
        generator = torch.Generator().manual_seed(self.strategy.config.seed * 7919 + global_steps)
        dataloader = DataLoader(self.replay_buffer, batch_size=self.micro_train_batch_size, shuffle=True,
                                drop_last=True, collate_fn=self.replay_buffer.collate_fn,
                                pin_memory=self.dataloader_pin_memory and torch.cuda.is_available(),
                                generator=generator)
        step_metrics = []
        for epoch in range(self.max_epochs):
            micro_batches = list(dataloader)
            for start in range(0, len(micro_batches), grad_accum):
                group = micro_batches[start:start + grad_accum]
                counts = self.global_counts(group)
                if start == 0 and epoch == 0 and fault_now("sigterm-train", global_steps + 1):
                    send_sigterm()
                self.inject_nan = start == 0 and epoch == 0
                metrics = [self.training_step(exp, global_steps, counts) for exp in group]
                step_metrics.append(self.reduce_step_metrics(metrics))
                self.check_step_finite(step_metrics[-1])
                self.callbacks.on_step_end(self, step_metrics[-1])
        if not step_metrics:
            return {}
        return {k: sum(m[k] for m in step_metrics) / len(step_metrics) for k in step_metrics[0]}

    def check_step_finite(self, metrics: dict[str, float]) -> None:
        """Counts an optimizer step whose loss or gradient norm was not finite (DeepSpeed's ZeRO
        optimizers then skip the update); a streak of `max_nonfinite_steps` stops the run."""
        sources = [name.replace("train/nonfinite_", "") for name in
                   ("train/nonfinite_policy_loss", "train/nonfinite_critic_loss") if metrics.get(name, 0.0) > 0]
        self.guard.record(sources + nonfinite_grad_norms(actor=self.actor, critic=self.critic))
        self.counters["skipped_steps"] = self.guard.skipped

    def global_counts(self, group: list[Experience]) -> dict[str, float]:
        """Action tokens and sequences of one optimizer step over all ranks (one all-reduce): the
        normalisers that make the loss independent of how the batch is split. Samples that train
        on nothing (invalid, filler or masked-out) count in neither."""
        local = torch.tensor([sum(float(e.loss_mask.sum()) for e in group),
                              sum(float(e.loss_mask.any(dim=1).sum()) for e in group)], dtype=torch.float64)
        tokens, seqs = self.strategy.all_reduce(local, op="sum").tolist()
        return {"tokens": tokens, "seqs": seqs}

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

    def _actor_forward(self, model, experience: Experience, return_entropy: bool = False):
        return model(experience.sequences, experience.num_actions, attention_mask=experience.attention_mask,
                     return_output=True, packed_seq_lens=experience.packed_seq_lens,
                     return_entropy=return_entropy, return_aux_loss=self.algo.aux_loss_coef > 0)

    def training_step_actor(self, experience: Experience, counts: dict) -> dict:
        self.actor.train()
        mask = experience.loss_mask
        log_probs, output = self._actor_forward(self.actor, experience, return_entropy=self.algo.entropy_coef != 0)
        inject = self.inject_nan
        if inject and fault_now("nan-grad", self.global_step + 1):
            log_probs = nan_gradient(log_probs)
        agg = dict(global_num_tokens=counts["tokens"], global_num_seqs=counts["seqs"], norm_len=self.algo.norm_len)
        policy_loss, metrics = self.actor_loss_fn(log_probs, experience.action_log_probs, experience.advantages,
                                                  action_mask=mask, rollout_log_probs=experience.rollout_log_probs,
                                                  return_metrics=True, **agg)
        if inject and fault_now("nan-loss", self.global_step + 1):
            policy_loss = policy_loss * float("nan")
        self.inject_nan = False
        metrics["nonfinite_policy_loss"] = (~torch.isfinite(policy_loss.detach())).float()
        loss = policy_loss
        if self.algo.use_kl_loss and experience.base_action_log_probs is not None:
            kl = compute_approx_kl(log_probs, experience.base_action_log_probs, mask,
                                   kl_estimator=self.algo.kl_estimator)
            kl_loss = aggregate_loss(kl, mask.float(), self.algo.loss_agg_mode, counts["tokens"], counts["seqs"],
                                     self.algo.norm_len)
            loss = loss + self.kl_ctl.value * kl_loss
            metrics["kl_loss"] = kl_loss.detach()
        if self.algo.entropy_coef != 0:
            entropy = aggregate_loss(output["entropy"], mask.float(), self.algo.loss_agg_mode, counts["tokens"],
                                     counts["seqs"], self.algo.norm_len)
            loss = loss - self.algo.entropy_coef * entropy
            metrics["entropy"] = entropy.detach()
        aux_loss = output.get("aux_loss") if isinstance(output, dict) else getattr(output, "aux_loss", None)
        if self.algo.aux_loss_coef and aux_loss is None and not self._warned_no_aux_loss:
            self._warned_no_aux_loss = True
            self.strategy.print(f"warning: --aux_loss_coef {self.algo.aux_loss_coef} has no effect: the model gives no "
                                "router load-balancing loss (it is not a mixture-of-experts model)")
        if self.algo.aux_loss_coef and aux_loss is not None:
            metrics["aux_loss"] = aux_loss.detach()
            # The MoE load-balancing loss is already a per-rank mean: scale it like one.
            loss = loss + self.algo.aux_loss_coef * aux_loss / self.loss_scale()
        self.strategy.backward(loss * self.loss_scale(), self.actor, self.actor_optim)
        if self.pretrain_iter is not None and self.ptx_coef > 0:
            metrics["ptx_loss"] = self.ptx_step()
        self.strategy.optimizer_step(self.actor_optim, self.actor, self.actor_scheduler)
        if self.ema_model is not None:
            self.strategy.moving_average(self.actor, self.ema_model, self.ema_beta)
        metrics["policy_loss"] = policy_loss.detach()
        metrics["actor_lr"] = torch.tensor(self._current_lr(self.actor_scheduler))
        return {f"train/{k}": v for k, v in metrics.items()}

    def ptx_step(self) -> torch.Tensor:
        """One language-modelling micro-batch from the pretraining data, weighted by ptx_coef
        (InstructGPT's PPO-ptx objective)."""
        batch = next(self.pretrain_iter)
        device = self.strategy.device
        module = self.strategy.unwrap_model(self.actor)
        logits = module.model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                              use_cache=False).logits
        ptx_loss = self.ptx_loss_fn(logits, batch.labels.to(device))
        self.strategy.backward(self.ptx_coef * ptx_loss, self.actor, self.actor_optim)
        return ptx_loss.detach()

    def training_step_critic(self, experience: Experience, counts: dict) -> dict:
        self.critic.train()
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

    def reduce_step_metrics(self, micro_metrics: list[dict]) -> dict[str, float]:
        """Averages one optimizer step's micro-batch metrics over micro-batches and ranks with a
        single all-reduce (the only host sync of the step)."""
        if not micro_metrics or not micro_metrics[0]:
            return {}
        keys = sorted(micro_metrics[0])
        local = torch.stack([torch.stack([m[k].detach().float().cpu() for m in micro_metrics]).mean() for k in keys])
        reduced = self.strategy.all_reduce(local, op="mean").tolist()
        return dict(zip(keys, reduced))

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
        # Save first, so this step's logs already count a save that failed.
        if self.saved_at_step(args, global_step):
            self.save_checkpoint(args)
        nonfinite = self.experience_maker.nonfinite_counts
        totals = self.strategy.all_reduce(torch.tensor([float(nonfinite[k]) for k in sorted(nonfinite)]), op="sum")
        logs_dict = {**logs_dict, **{f"train/{k}": float(v) for k, v in self.counters.items()},
                     **{f"rollout/nonfinite_{k}_samples": v for k, v in zip(sorted(nonfinite), totals.tolist())},
                     **self.reward_source_metrics()}
        if eval_dataloader is not None and getattr(args, "eval_steps", 0) > 0 and global_step % args.eval_steps == 0:
            logs_dict.update(self.evaluate(eval_dataloader))
        if self.tracker is not None and global_step % max(getattr(args, "logging_steps", 1), 1) == 0:
            self.tracker.log(logs_dict, step=global_step)
        self.last_logs = logs_dict

    def reward_source_metrics(self) -> dict[str, float]:
        """Request, retry, timeout, failure and drop counters of the HTTP reward servers and reward
        files (numbered in --remote_rm_url order), summed over ranks, and per-call failure rates."""
        sources = self.experience_maker.reward_sources
        names = [(i, k) for i, source in enumerate(sources) if hasattr(source, "stats")
                 for k in sorted(source.stats.as_dict())]
        if not names:
            return {}
        local = torch.tensor([float(sources[i].stats.as_dict()[k]) for i, k in names], dtype=torch.float64)
        totals = self.strategy.all_reduce(local, op="sum").tolist()
        metrics = {f"rollout/reward_source{i}_{k}": v for (i, k), v in zip(names, totals)}
        # Failure rates per call, so a slow or flaky source shows up whatever the run length.
        for i in sorted({i for i, _ in names}):
            calls = metrics.get(f"rollout/reward_source{i}_calls")
            for k in ("timeouts", "errors", "crashes"):
                if calls and f"rollout/reward_source{i}_{k}" in metrics:
                    metrics[f"rollout/reward_source{i}_{k}_rate"] = metrics[f"rollout/reward_source{i}_{k}"] / calls
        return metrics

    @staticmethod
    def saved_at_step(args, global_step: int) -> bool:
        """Whether `save_logs_and_checkpoints` writes a checkpoint at this step (every --save_steps)."""
        return args.save_steps > 0 and global_step % args.save_steps == 0

    def client_state(self) -> dict:
        return {"global_step": self.global_step, "consumed_samples": self.consumed_samples,
                "kl_ctl": self.kl_ctl.state_dict(), "rng": capture_rng_state(),
                "rollout_calls": self.experience_maker.calls, "counters": dict(self.counters),
                "nonfinite_counts": dict(self.experience_maker.nonfinite_counts),
                "options": {k: self._plain(getattr(self.args, k)) for k in PINNED_OPTIONS if hasattr(self.args, k)},
                # The resolved run config travels with every checkpoint (plain values only).
                "config": {k: self._plain(v) for k, v in sorted(vars(self.args).items())
                           if isinstance(v, (str, int, float, bool, list, tuple, type(None)))}}

    @staticmethod
    def _plain(value):
        return list(value) if isinstance(value, tuple) else value

    def save_checkpoint(self, args) -> None:
        """Writes a resumable checkpoint (critic first, then actor, whose `latest` pointer marks the
        step as resumable) and, with `save_hf_ckpt`, a Hugging Face export of the actor."""
        tag = f"global_step{self.global_step}"
        if fault_now("sigterm-save", self.global_step):
            send_sigterm()
        state = self.client_state()
        if not self.disable_ds_ckpt:
            try:
                # The actor goes last: its `latest` pointer is what makes this step resumable.
                for name, model in (("_critic", self.critic), ("_ema", self.ema_model)):
                    if model is not None:
                        self.strategy.save_ckpt(model, f"{args.ckpt_path}/{name}", tag, args.max_ckpt_num,
                                                client_state={"global_step": self.global_step})
                self.strategy.save_ckpt(self.actor, f"{args.ckpt_path}/_actor", tag, args.max_ckpt_num,
                                        client_state=state)
            except CheckpointSaveError as err:
                # The earlier checkpoints are intact; a full disk may clear up before the next save.
                self.counters["failed_saves"] += 1
                self.strategy.print(f"checkpoint {tag} was not saved: {err}. The previous checkpoints in "
                                    f"{args.ckpt_path} are intact; training continues (failed saves so far: "
                                    f"{self.counters['failed_saves']})")
                return
        if self.save_hf_ckpt:
            self.strategy.save_model(self.ema_model or self.actor, self.tokenizer, f"{args.ckpt_path}/{tag}_hf")
        self.callbacks.on_save(self, f"{args.ckpt_path}/_actor/{tag}")

    def load_checkpoint(self, args, required: bool = True) -> int:
        """Resumes weights, optimizer, scheduler, KL controller, counters and RNG from the newest
        complete checkpoint in `args.ckpt_path`; returns the consumed prompt count (0 if none)."""
        path, state = self.strategy.load_ckpt(self.actor, f"{args.ckpt_path}/_actor")
        if path is None:
            if required:
                raise FileNotFoundError(f"--load_checkpoint: no complete checkpoint under {args.ckpt_path}/_actor; "
                                        "pass --load_checkpoint if_present to start fresh when none exists")
            return 0
        check_resume_options(state.get("options", {}),
                             {k: self._plain(getattr(args, k)) for k in PINNED_OPTIONS if hasattr(args, k)}, path)
        tag = f"global_step{state['global_step']}"
        for name, model, optimizer_states in (("_critic", self.critic, True), ("_ema", self.ema_model, False)):
            if model is None:
                continue
            try:
                self.strategy.load_ckpt(model, f"{args.ckpt_path}/{name}", tag=tag,
                                        load_optimizer_states=optimizer_states,
                                        load_lr_scheduler_states=optimizer_states)
            except FileNotFoundError as err:
                raise FileNotFoundError(f"the actor checkpoint {path} has no matching complete checkpoint {tag} "
                                        f"under {args.ckpt_path}/{name}: {err}") from err
        self.global_step = state["global_step"]
        self.consumed_samples = state["consumed_samples"]
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.experience_maker.calls = state.get("rollout_calls", 0)
        self.counters.update(state.get("counters", {}))
        self.guard.skipped = self.counters["skipped_steps"]
        self.experience_maker.nonfinite_counts.update(state.get("nonfinite_counts", {}))
        restore_rng_state(state["rng"])
        self.strategy.print(f"resumed from {path}: step {self.global_step}, {self.consumed_samples} prompts consumed")
        return self.consumed_samples

    def preempted(self) -> bool:
        """True on every rank once any rank has received SIGTERM/SIGUSR1 (one all-reduce)."""
        flag = torch.tensor([1.0 if self.preemption.raised else 0.0])
        return self.strategy.all_reduce(flag, op="max").item() > 0

    # ================================================================================ evaluation
    def evaluate(self, eval_dataloader) -> dict[str, float]:
        """Mean reward of greedy decoding, and pass@k over k samples when `eval_n_samples` > 1
        (see `lightrft.trainer.evaluation.evaluate_policy`)."""
        return evaluate_policy(self.experience_maker, self.strategy, eval_dataloader,
                               {**self.generate_kwargs, **self.eval_generate_kwargs},
                               k=getattr(self.args, "eval_n_samples", 1))
