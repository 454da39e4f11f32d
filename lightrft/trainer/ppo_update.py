"""The update half of `PPOTrainer`: one rollout batch's optimisation.

`ppo_train` runs `max_epochs` passes of micro-batches over the replay buffer; each micro-batch goes
through `training_step` (`training_step_actor`: policy loss, KL loss, distillation loss, entropy,
MoE auxiliary loss, PPO-ptx; `training_step_critic`: value loss), normalised by the optimizer
step's global token and sequence counts so the update does not depend on how the batch is split
over ranks and micro-batches. Every method is meant to be overridden by research code (see
docs/extending.md).

`PPOUpdate` is a base class of `PPOTrainer`, not used alone: it reads the trainer's models,
optimizers, losses (`actor_loss_fn`, `critic_loss_fn`, `ptx_loss_fn`), `algo`, `strategy`,
`replay_buffer`, `services` and `callbacks`.
"""

from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

from lightrft.algorithms.aggregation import aggregate_loss
from lightrft.algorithms.distill import distill_loss_per_token
from lightrft.algorithms.kl import compute_approx_kl
from lightrft.config.sections import AlgorithmConfig
from lightrft.experience.samples import Experience, Sample, collate_samples, split_by_tokens, split_to_count
from lightrft.models.media import media_keywords
from lightrft.utils.routing import routing_of
from lightrft.models.utils import accepts_keyword
from lightrft.rollout.checks import engine_logprob_gap
from lightrft.trainer.guards import nonfinite_grad_norms
from lightrft.trainer.metrics import EXTREME_SUFFIXES, combine_step_metrics, global_counts, reduce_pass_metrics


class PPOUpdate:
    """PPO epochs, micro-batch steps and losses of `PPOTrainer` (see the module docstring).

    What it reads from the trainer it is part of is declared below (`PPOTrainer.assign` sets each;
    tests/trainer/test_trainer_options.py checks that nothing else is read)."""

    # the models and their optimisation (prepared by the strategy)
    strategy: Any
    actor: Any
    critic: Any
    ema_model: Any
    actor_optim: Any
    critic_optim: Any
    actor_scheduler: Any
    critic_scheduler: Any
    # the algorithm and its losses
    algo: AlgorithmConfig
    kl_ctl: Any
    actor_loss_fn: Any
    critic_loss_fn: Any
    ptx_loss_fn: Any
    # the options of an update
    ema_beta: float
    max_epochs: int
    micro_train_batch_size: int
    micro_train_max_tokens: Optional[int]    # most tokens per packed micro-batch (None: no budget)
    dataloader_pin_memory: bool
    # what a step trains on, and where its counts go
    replay_buffer: Any
    experience_services: Any           # its builder was told whether the update is on-policy
    micro_rollout_batch_size: int      # samples per old log-prob forward, as at rollout time
    pretrain_iter: Any                 # the PTX stream, or None
    counters: dict
    callbacks: Any
    services: Any                      # the run services: preemption flag, non-finite guard

    # Whether the old log-probs skip the separate forward at rollout time: None decides per run
    # (yes with one epoch, no KL term needing the policy's log-probs at rollout time, and no active
    # dropout); False always runs the separate forward. When skipped, the first optimizer step of a
    # rollout, exactly on-policy, takes them from its own forward, detached, and the samples of the
    # later steps get theirs from a forward before the first update, with the same weights the
    # rollout-time forward would have used.
    reuse_old_log_probs: Optional[bool] = None

    def on_policy(self, args=None) -> bool:
        """Whether the first optimizer step of each rollout is exactly on-policy (one epoch, no
        dropout), so its ratio is 1 and the old log-probs need no forward at rollout time: that step
        detaches its own, and `fill_old_log_probs` computes the later steps' before it updates.
        Decided when the trainer is built (`lightrft.trainer.assembly.decide_on_policy`, which
        `reuse_old_log_probs` overrides); `args` is unused, kept for callers that pass it."""
        return self.experience_services.builder.reuse_policy_log_probs

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
            if self.micro_train_max_tokens is not None:
                groups = self.token_budget_groups(drawn, grad_accum)
                micro_batches = [exp for group in groups for exp in group]
            counts = self.global_counts(groups)     # in flight until the first loss needs them
            first = len(groups[0]) if groups else 0     # the micro-batches of the first optimizer step
            self.fill_old_log_probs(micro_batches[first:], drawn[first:])
            local, grad_sources, norms = [], [], []
            trains_actor = global_steps > self.algo.freezing_actor_steps
            for group, group_counts in zip(groups, counts):
                local.append([self.micro_step(exp, global_steps, group_counts, k, len(group), grad_accum)
                              for k, exp in enumerate(group)])
                grad_sources.append(nonfinite_grad_norms(self.strategy, actor=self.actor, critic=self.critic))
                norms.append(self.strategy.grad_norm(self.actor) if trains_actor else None)
            # One all-reduce for the metrics of every optimizer step of the pass: each is a barrier
            # between ranks, and none of them is needed before the pass ends. It also tells whether
            # any rank was asked to stop, so the step needs no collective of its own for that.
            reduced, self.pass_preempted = self.reduce_pass_metrics(local, self.services.preemption.raised)
            for metrics, sources, norm in zip(reduced, grad_sources, norms):
                if norm is not None:
                    # The actor's global gradient norm before clipping (the same on every rank).
                    metrics["train/actor_grad_norm"] = norm
                self.check_step_finite(metrics, sources)
                self.callbacks.on_step_end(self, metrics)
                step_metrics.append(metrics)
        return combine_step_metrics(step_metrics)

    def token_budget_groups(self, drawn: list[list[Sample]], grad_accum: int) -> list[list[Experience]]:
        """Each optimizer step's micro-batches under `micro_train_max_tokens`: the samples of its
        `grad_accum` drawn micro-batches (`drawn`, replaced in place by the new split), in the same
        order, cut by `split_by_tokens` (at most `micro_train_batch_size` samples each). DeepSpeed
        ZeRO reduces gradients over ranks per micro-batch, so every rank runs the most micro-batches
        any rank has for that step: one all-reduce (max) of the counts of the pass, and a rank with
        fewer halves its largest micro-batches (`split_to_count`)."""
        steps = [[s for batch in drawn[start:start + grad_accum] for s in batch]
                 for start in range(0, len(drawn), grad_accum)]
        lengths = [[s.sequence.numel() for s in samples] for samples in steps]
        cuts = [split_by_tokens(step_lengths, self.micro_train_max_tokens, self.micro_train_batch_size)
                for step_lengths in lengths]
        if self.strategy.world_size > 1 and cuts:
            most = self.strategy.all_reduce(torch.tensor([len(c) for c in cuts]), "max")
            cuts = [split_to_count(c, step_lengths, int(n)) for c, step_lengths, n in zip(cuts, lengths, most.tolist())]
        drawn[:] = [[samples[i] for i in batch] for samples, cut in zip(steps, cuts) for batch in cut]
        batches = iter(self.replay_buffer.collate_fn(batch) for batch in drawn)
        return [[next(batches) for _ in cut] for cut in cuts]

    # The metrics that are a micro-batch's share of the optimizer step's loss (normalised by its
    # global counts): their logged mean over the step's micro-batches is the step's loss over
    # `accumulated_gradient`, whatever the number of micro-batches a token budget made.
    LOSS_SHARE_METRICS = ("train/policy_loss", "train/critic_loss", "train/kl_loss", "train/distill_loss",
                          "train/entropy")

    def micro_step(self, experience: Experience, global_steps: int, counts: dict, index: int, size: int,
                   grad_accum: int) -> dict:
        """`training_step` on micro-batch `index` of the `size` of an optimizer step. With a token
        budget `size` varies, so DeepSpeed is told whether this one ends the step, and the loss
        shares are scaled by size / grad_accum so their mean is what `grad_accum` would give."""
        if self.micro_train_max_tokens is None:
            return self.training_step(experience, global_steps, counts)
        self.strategy.set_accumulation_boundary(index == size - 1, self.actor, self.critic)
        metrics = self.training_step(experience, global_steps, counts)
        for key in self.LOSS_SHARE_METRICS:
            if key in metrics:
                metrics[key] = metrics[key] * (size / grad_accum)
        return metrics

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
        chunk = self.micro_rollout_batch_size
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
        # A policy with routing replay sends each token through the experts it recorded.
        routes = {"routes": experience.routes} if routing_of(model) is not None else {}
        return model(experience.sequences, experience.num_actions, attention_mask=experience.attention_mask,
                     return_output=True, packed_seq_lens=experience.packed_seq_lens,
                     return_entropy=return_entropy, return_aux_loss=self.algo.aux_loss_coef > 0,
                     **self._prompt_groups(model, experience), **media_keywords(experience.media), **routes)

    def _prompt_groups(self, model, experience: Experience) -> dict:
        """`prompt_groups=` for a packed micro-batch, so its forward computes each prompt once; {}
        for a padded one, and for a model whose forward does not take it (a custom module)."""
        if experience.prompt_groups is None or not accepts_keyword(model, "prompt_groups"):
            return {}
        return {"prompt_groups": experience.prompt_groups}

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
        if self.algo.distill_mode == "loss" and experience.teacher_log_probs is not None:
            # On-policy distillation as a loss: the teacher's reverse KL on the current log-probs.
            distill_loss = self._aggregate(distill_loss_per_token(log_probs, experience.teacher_log_probs, mask,
                                                                  self.algo.kl_clamp), mask, counts)
            loss = loss + self.algo.distill_coef * distill_loss
            metrics["distill_loss"] = distill_loss.detach()
        if self.algo.entropy_coef != 0:
            entropy = self._aggregate(output["entropy"], mask, counts)
            loss = loss - self.algo.entropy_coef * entropy
            metrics["entropy"] = entropy.detach()
        aux_loss = self._aux_loss(output)
        if aux_loss is not None:
            metrics["aux_loss"] = aux_loss.detach()
            # The MoE load-balancing loss is already a per-rank mean: scale it like one. A row split
            # over a sequence-parallel group is one row on all N of its ranks, each back-propagating
            # its part (`RowShard.load_balancing_loss`): N times the part, as the group holds N
            # times fewer rows than its ranks' micro-batches.
            repeats = getattr(self.strategy, "sequence_parallel_size", 1)
            loss = loss + self.algo.aux_loss_coef * aux_loss * repeats / self.loss_scale()
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
        # a vision-language critic sees the samples' images
        values = self.critic(experience.sequences, experience.num_actions, attention_mask=experience.attention_mask,
                             packed_seq_lens=experience.packed_seq_lens, **self._prompt_groups(self.critic, experience),
                             **media_keywords(experience.media))
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
