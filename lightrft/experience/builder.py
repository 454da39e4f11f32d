"""The experience-building service: a scored rollout in, training experience out.

    ExperienceBuilder.build(rollout, rewards, n)  ->  BuiltExperience(experiences, nonfinite counts)

The actor / reference / teacher / critic forwards (micro-batched), the KL, the advantages and
returns, and which samples may train. Colocated rollouts, explorers' rollouts and recorded traffic
all go through it, so an experience is the same whatever made the samples.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import Tensor

from lightrft.algorithms.advantages import (AdvantageInputs, AdvantageOutputs, compute_advantages,
                                            get_advantage_estimator)
from lightrft.algorithms.distill import distill_token_rewards
from lightrft.algorithms.kl import compute_approx_kl
from lightrft.algorithms.masked import masked_mean, masked_sum
from lightrft.config.sections import AlgorithmConfig, RolloutConfig
from lightrft.experience.placement import arrive
from lightrft.experience.samples import Experience, split_to_count
from lightrft.models.media import media_keywords
from lightrft.utils.routing import NO_ROUTE, routing_of
from lightrft.experience.scorer import RewardBatch, truncated_rows
from lightrft.rollout.base import RolloutOutput


NONFINITE_SOURCES = ("reward", "logprob", "advantage")


@dataclass
class BuiltExperience:
    """What one `ExperienceBuilder.build` made: the experiences, and per source the samples it
    dropped (kept in place, training on nothing) for a non-finite value. The counts go back to
    whoever draws the batch (the experience source's `SourceBatch.nonfinite`), not into the builder."""

    experiences: list[Experience]
    nonfinite: dict[str, int] = field(default_factory=lambda: dict.fromkeys(NONFINITE_SOURCES, 0))


class ExperienceBuilder:
    """Turns a scored rollout into training experience on this rank: the actor, reference,
    teacher and critic forwards (micro-batched), the KL, the advantages and returns, and which
    samples may train. Used alike for colocated rollouts, explorers' rollouts and recorded traffic.

    Models may be DeepSpeed engines or plain modules; `critic`, `initial_model` and `teacher` may
    be None (critic-free methods, no KL, no distillation). A `teacher` (on-policy distillation,
    `lightrft.algorithms.distill`) scores the student's sampled tokens like the reference does;
    with `distill_mode` "reward" its signal `distill_coef` x (log p_teacher - log p_student) joins
    the token rewards before the returns, with "loss" its log-probs travel in the experience for
    the trainer's reverse-KL loss. It keeps no state between calls: `build` returns what it
    dropped with what it made."""

    def __init__(self, actor, critic, initial_model, kl_controller, strategy, *, advantage_estimator: str = "gae",
                 kl_estimator: str = "k1", use_kl_loss: bool = False, gamma: float = AlgorithmConfig.gamma,
                 lambd: float = AlgorithmConfig.lambd, kl_clamp: str = "scale",
                 micro_rollout_batch_size: int = RolloutConfig.micro_rollout_batch_size,
                 mask_truncated_samples: bool = False, eos_token_ids: Sequence[int] = (), teacher=None,
                 distill_coef: float = AlgorithmConfig.distill_coef, distill_mode: str = AlgorithmConfig.distill_mode,
                 reuse_policy_log_probs: bool = False, micro_rollout_max_tokens: Optional[int] = None):
        self.actor, self.critic, self.initial_model = actor, critic, initial_model
        self.teacher, self.distill_coef, self.distill_mode = teacher, distill_coef, distill_mode
        self.kl_ctl = kl_controller
        self.strategy = strategy
        self.estimator = get_advantage_estimator(advantage_estimator)
        self.kl_estimator, self.kl_clamp = kl_estimator, kl_clamp
        self.use_kl_loss = use_kl_loss
        self.gamma = gamma
        self.lambd = lambd
        self.micro_rollout_batch_size = micro_rollout_batch_size
        self.micro_rollout_max_tokens = micro_rollout_max_tokens   # see `forward_chunks`
        self.mask_truncated_samples = mask_truncated_samples
        self.eos_token_ids = list(eos_token_ids)
        # Whether the trainer provides the old log-probs itself (its first update is exactly
        # on-policy: `PPOTrainer.on_policy`), so the rollout-time actor forward can be skipped.
        self.reuse_policy_log_probs = reuse_policy_log_probs

    @classmethod
    def for_algorithm(cls, algo: AlgorithmConfig, actor, critic, initial_model, kl_controller, strategy,
                      **kwargs) -> "ExperienceBuilder":
        """A builder with the estimator, KL, truncation and distillation options of `algo`;
        `kwargs` are the other keywords (micro_rollout_batch_size, eos_token_ids, teacher)."""
        return cls(actor, critic, initial_model, kl_controller, strategy, advantage_estimator=algo.advantage_estimator,
                   kl_estimator=algo.kl_estimator, use_kl_loss=algo.use_kl_loss, gamma=algo.gamma, lambd=algo.lambd,
                   kl_clamp=algo.kl_clamp, mask_truncated_samples=algo.mask_truncated_samples,
                   distill_coef=algo.distill_coef, distill_mode=algo.distill_mode, **kwargs)

    # ----------------------------------------------------------------------------------- forwards
    def _to_device(self, *tensors: Tensor) -> tuple[Tensor, ...]:
        return tuple(t.to(self.strategy.device) for t in tensors)

    @torch.no_grad()
    def forward(self, model, rollout: RolloutOutput) -> Tensor:
        """`model`'s per-action values over the rollout (log-probs of a policy, values of a
        critic), in micro-batches of `micro_rollout_batch_size`, on the host, 0 outside the
        action mask. A policy with routing replay replays the rollout's routes (`RolloutOutput.routes`).
        Shape: (B, A)."""
        a = rollout.action_mask.size(1)
        prompt_width = rollout.sequences.size(1) - a
        replays = routing_of(model) is not None
        outs = []
        for rows, (first, end) in self.forward_chunks(rollout):
            columns = slice(first, end)
            seq, mask = self._to_device(rollout.sequences[rows, columns], rollout.attention_mask[rows, columns])
            extra = media_keywords(rollout.media[rows] if rollout.media is not None else None)
            if replays:
                extra["routes"] = None if rollout.routes is None else rollout.routes[rows, columns].to(seq.device)
            out = model(seq, end - prompt_width, attention_mask=mask, **extra).float().cpu()
            outs.append(torch.nn.functional.pad(out, (0, a - out.size(1))))   # the responses' padding cut off
        return torch.cat(outs) * rollout.action_mask.to(torch.float32)

    def forward_chunks(self, rollout: RolloutOutput) -> list[tuple[slice, tuple[int, int]]]:
        """The micro-batches of the rollout-time forwards: (rows, (first column, end column)).
        Without a token budget, `micro_rollout_batch_size` rows over every column. With
        `micro_rollout_max_tokens` (--micro_rollout_max_tokens), consecutive rows while rows x
        columns stays within the budget (a row longer than it goes alone; at most
        `micro_rollout_batch_size` rows), each micro-batch cut to the columns where one of its rows
        has a token: the prompts' left padding and the responses' right padding that all its rows
        share are not computed (left whole for rollouts with media). Every rank runs as many
        micro-batches as the rank with the most (one all-reduce per forward; ZeRO-3 gathers
        parameters in every forward), splitting its largest."""
        batch, width = rollout.sequences.shape
        size = self.micro_rollout_batch_size
        if self.micro_rollout_max_tokens is None:
            return [(slice(i, min(i + size, batch)), (0, width)) for i in range(0, batch, size)]
        prompt_width = width - rollout.action_mask.size(1)
        present = rollout.attention_mask.bool()
        if rollout.media is not None:
            present = torch.ones_like(present)
        columns = torch.arange(width)
        starts = torch.where(present, columns, width).min(dim=1).values.tolist()
        # Every micro-batch keeps at least the prompt's last column and one action column.
        ends = torch.where(present, columns + 1, 0).max(dim=1).values.clamp(min=prompt_width + 1).tolist()
        cuts: list[list[int]] = []
        for i in range(batch):
            if cuts:
                rows = cuts[-1] + [i]
                cost = len(rows) * (max(ends[r] for r in rows) - min(starts[r] for r in rows))
                if len(rows) <= size and cost <= self.micro_rollout_max_tokens:
                    cuts[-1] = rows
                    continue
            cuts.append([i])
        if self.strategy is not None and getattr(self.strategy, "world_size", 1) > 1:
            most = int(self.strategy.all_reduce(torch.tensor([len(cuts)]), "max").item())
            if most > batch:
                raise RuntimeError(f"--micro_rollout_max_tokens: another rank runs {most} rollout micro-batches "
                                   f"and this one has {batch} samples; ranks must hold rollouts of one size")
            cuts = split_to_count(cuts, [e - s for s, e in zip(starts, ends)], most)
        return [(slice(rows[0], rows[-1] + 1), (min(starts[r] for r in rows), max(ends[r] for r in rows)))
                for rows in cuts]

    @torch.no_grad()
    def old_policy_forward(self, rollout: RolloutOutput) -> tuple[Tensor, RolloutOutput, dict[str, Tensor]]:
        """The actor's log-probs of the rollout, the rollout as the update sees it, and routing
        statistics per sample (`info`). With --routing_replay rollout the forward replays the
        engine's routes; with old it routes live, records its choices, and the rollout leaves with
        them as its routes (what the update and the reference then replay).

        Statistics (rollout mode): `route_pairs`, the (token, MoE layer) pairs replayed, and
        `route_flips`, those where the live router would have chosen another expert set; and over
        the first micro-batch (one more forward of it, routed live), the mean absolute gap between
        the engine's log-probs and the actor's with the routes replayed and live
        (`route_gap_replayed`, `route_gap_live`), the same value on every sample."""
        routing = routing_of(self.actor)
        if routing is None:
            return self.forward(self.actor, rollout), rollout, {}
        if not routing.record_rollouts:     # --routing_replay old: the old policy's own routes
            routing.start_recording()
            try:
                log_probs = self.forward(self.actor, dataclasses.replace(rollout, routes=None))
                rows = [r.view(-1, rollout.sequences.size(1), *r.shape[1:]) for r in routing.take()]
            finally:
                routing.stop_recording()
            routes = torch.cat(rows).cpu()
            routes[~rollout.attention_mask.bool()] = NO_ROUTE
            return log_probs, dataclasses.replace(rollout, routes=routes), {}
        if rollout.routes is None:
            return self.forward(self.actor, rollout), rollout, {}
        routing.count_per_token(True)
        try:
            log_probs = self.forward(self.actor, rollout)
            flips, pairs = routing.take_token_counts()                         # (B*T,) each
        finally:
            routing.count_per_token(False)
        batch = rollout.sequences.size(0)
        stats = {"route_flips": flips.view(batch, -1).sum(dim=1).float().cpu(),
                 "route_pairs": pairs.view(batch, -1).sum(dim=1).float().cpu()}
        first = rollout.select(range(min(self.micro_rollout_batch_size, batch)))
        live = self.forward(self.actor, dataclasses.replace(first, routes=None))
        mask = first.action_mask.float()
        for name, values in (("route_gap_replayed", log_probs[:mask.size(0)]), ("route_gap_live", live)):
            gap = masked_mean((values - first.rollout_log_probs).abs(), mask)
            stats[name] = torch.full((batch,), float(gap))
        return log_probs, rollout, stats

    def eval_models(self) -> None:
        """The models that make experience, in eval mode (no dropout in the rollout forwards)."""
        for model in (self.actor, self.critic, self.initial_model, self.teacher):
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

    @staticmethod
    def _count_invalid(counts: dict[str, int], source: str, before: Tensor, after: Tensor) -> None:
        counts[source] += int((before & ~after).sum())

    def kl_in_use(self) -> bool:
        """Whether a KL term can reach the loss: a reference model and a non-zero coefficient
        (the adaptive controller keeps a zero coefficient at zero). Otherwise the reference
        forward is skipped."""
        return self.initial_model is not None and self.kl_ctl.value != 0.0

    def truncated_rows(self, rollout: RolloutOutput) -> Tensor:
        """Which responses were cut at the length limit (`lightrft.experience.scorer.truncated_rows`)."""
        return truncated_rows(rollout, self.eos_token_ids)

    def experience_from_rollout(self, rollout: RolloutOutput, rewards: RewardBatch, n: int) -> list[Experience]:
        """The experiences of `build`, without its counts (the classic call)."""
        return self.build(rollout, rewards, n).experiences

    @torch.no_grad()
    def build(self, rollout: RolloutOutput, rewards: RewardBatch, n: int) -> BuiltExperience:
        """The training experience of a scored rollout (`n` samples per prompt in contiguous
        rows): the forwards, the KL, the advantages and returns, which samples train; and per
        source the samples dropped for a non-finite value."""
        built = BuiltExperience([])
        rollout, rewards = arrive(rollout, rewards)
        action_mask = rollout.action_mask.bool()
        mask_f = action_mask.float()
        # With one epoch (see PPOTrainer.reuse_old_log_probs) the trainer provides the "old"
        # log-probs itself: the first optimizer step from its own forward, the later ones from a
        # forward before the first update, so none runs here. Distillation needs them at rollout time.
        # Routing replay's old mode records the routes in the actor's forward here, so it runs.
        reuse = (self.reuse_policy_log_probs and not self.kl_in_use() and self.teacher is None
                 and routing_of(self.actor) is None)
        action_log_probs, routing_stats = None, {}
        if not reuse:
            action_log_probs, rollout, routing_stats = self.old_policy_forward(rollout)
        base_log_probs = self.forward(self.initial_model, rollout) if self.kl_in_use() else None
        teacher_log_probs = self.forward(self.teacher, rollout) if self.teacher is not None else None
        values = self.forward(self.critic, rollout) if self.critic is not None else None
        scores = rewards.scores.clone()
        token_rewards = rewards.token_rewards
        if token_rewards is not None and not self.estimator.uses_token_rewards:
            scores, token_rewards = scores + (token_rewards * mask_f).sum(dim=1), None
        truncated = self.truncated_rows(rollout)

        valid = self._valid_samples(built.nonfinite, rewards.valid, scores, action_mask, n, action_log_probs,
                                    base_log_probs, values, teacher_log_probs, rollout.rollout_log_probs)
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
        self._count_invalid(built.nonfinite, "advantage", valid, checked)
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
            # The sampling policy's per-token entropy, estimated without the logits: the mean
            # negative log-prob of the sampled tokens (E[-log p(x)] = H); the entropy monitor reads it.
            "entropy": masked_mean(-rollout.rollout_log_probs.float(), mask_f, dim=1),
            **{k: v.float() for k, v in rewards.info.items()},
            **routing_stats,
        }
        if teacher_log_probs is not None:
            info.update(self.distill_info(action_log_probs, teacher_log_probs, action_mask & keep))
        exp = Experience(
            sequences=rollout.sequences, attention_mask=rollout.attention_mask, action_mask=action_mask,
            num_actions=action_mask.size(1), packed_seq_lens=None, action_log_probs=action_log_probs,
            advantages=advantages, returns=returns, base_action_log_probs=base_log_probs,
            rollout_log_probs=torch.where(keep, rollout.rollout_log_probs.float(), 0.0),
            values=values, kl=kl, teacher_log_probs=teacher_log_probs, info=info, media=rollout.media,
            routes=rollout.routes)
        built.experiences.append(exp)
        return built

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

    def _valid_samples(self, counts: dict[str, int], reward_valid: Tensor, scores: Tensor, action_mask: Tensor,
                       n: int, *per_action: Optional[Tensor]) -> Tensor:
        """Samples that may train: a reward source scored them, and their reward and every given
        per-action tensor are finite. A group estimator's baseline needs the whole group, so one
        bad sample invalidates its group. Invalid samples keep their place in the batch (every
        rank must run the same number of micro-batches) but count in no loss or normaliser; the
        samples dropped are added to `counts` per source. Shape: (B,) bool."""
        valid = reward_valid.clone()
        checked = valid & torch.isfinite(scores)
        self._count_invalid(counts, "reward", valid, checked)
        valid = checked
        checked = valid & self._finite_rows(action_mask, *per_action)
        self._count_invalid(counts, "logprob", valid, checked)
        valid = checked
        if self.estimator.group:
            valid = valid.view(-1, n).all(dim=1).repeat_interleave(n)
        return valid
