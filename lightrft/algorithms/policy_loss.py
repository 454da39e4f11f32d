"""Policy losses, one registry entry per `--policy_loss` value.

One signature for every variant:

    fn(log_probs, old_log_probs, advantages, action_mask, cfg: PolicyLossConfig)
        -> (per_token_loss (B, A), metrics: dict[str, Tensor])

`per_token_loss` is 0 outside `action_mask` and is reduced by `aggregate_loss`. Metrics are
detached scalar tensors averaged over the kept tokens (no host sync); they always include
`approx_kl` (k3 estimate of KL(pi_old || pi) from the sampled tokens), the clip fractions, and
the ratio mean/max/min, plus `tis_weight_mean`/`tis_clip_frac` when truncated importance
sampling is on.

A variant registered with `register_policy_loss` computes only its core loss; the registry adds
what every variant shares: shape checks, masking (garbage in padding cannot reach the loss or its
gradient), the truncated IS correction and the common metrics.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightrft.algorithms.checks import check_ndim, check_same_shape
from lightrft.algorithms.kl import compute_approx_kl
from lightrft.algorithms.masked import as_bool_mask, fill_masked, masked_max, masked_mean, masked_min
from lightrft.algorithms.rollout_correction import (DEFAULT_BAND, DEFAULT_CAP, CorrectionSpec, mismatch_metrics,
                                                    rollout_correction_weight)

# exp() of a per-token log-ratio is taken after clamping it to [-20, 20]: e^20 ~ 4.9e8 lies far
# outside any clip range, so the clipped branches are unaffected, and exp cannot overflow.
LOG_RATIO_CLAMP = 20.0


@dataclass
class PolicyLossConfig:
    eps_clip_low: float = 0.2  # ratio lower bound 1 - eps_clip_low (`--eps_clip_low_high LOW HIGH`)
    eps_clip_high: float = 0.2  # ratio upper bound 1 + eps_clip_high (DAPO clip-higher: HIGH > LOW)
    dual_clip: float | None = None  # c > 1: loss <= c * |A| for A < 0 (`--dual_clip`)
    rollout_log_probs: Tensor | None = None  # (B, A) log-probs the rollout engine sampled with
    tis_cap: float | None = None  # truncated IS cap (`--tis_cap`); alone: token_tis; None and no mode: no correction
    rollout_correction: str | None = None  # a mode of `lightrft.algorithms.rollout_correction` (`--rollout_correction`)
    rollout_mask_band: tuple[float, float] = DEFAULT_BAND  # [L, H] of the masking modes (`--rollout_mask_band`)

    def __post_init__(self):
        if self.eps_clip_low < 0.0:
            raise ValueError(
                f"the low clip range (--eps_clip or the first value of --eps_clip_low_high) must be >= 0; "
                f"got {self.eps_clip_low}"
            )
        if self.eps_clip_high < 0.0:
            raise ValueError(
                f"the high clip range (--eps_clip or the second value of --eps_clip_low_high) must be >= 0; "
                f"got {self.eps_clip_high}"
            )
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"--dual_clip must be > 1 (Ye et al. 2020 use 3) or unset; got {self.dual_clip}")
        if self.tis_cap is not None and self.tis_cap <= 0.0:
            raise ValueError(f"--tis_cap must be > 0 (typically 2) or unset; got {self.tis_cap}")
        self.correction = None if self.rollout_correction is None and self.tis_cap is None else CorrectionSpec(
            self.rollout_correction or "token_tis", DEFAULT_CAP if self.tis_cap is None else self.tis_cap,
            tuple(self.rollout_mask_band))


PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor | None, PolicyLossConfig], tuple[Tensor, dict[str, Tensor]]]

# name -> policy loss function (already wrapped with the shared checks); filled by register_policy_loss.
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str, *, supports_dual_clip: bool = True) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator adding a policy loss to POLICY_LOSSES under `name` (`--policy_loss name`).

    The decorated core receives log_probs, old_log_probs and advantages already zeroed outside
    the mask and a bool mask (B, A), and returns (per-token loss, its own metrics). The stored
    function adds the shape checks, the final masking, the rollout correction (a detached weight
    per token multiplying the loss: `--tis_cap` alone is token-level truncated importance
    sampling, w = min(exp(old_log_probs - rollout_log_probs), tis_cap), Yao et al. 2025;
    `--rollout_correction` picks another mode of `lightrft.algorithms.rollout_correction`), the
    engine/trainer mismatch metrics when rollout log-probs are given, and the metric `approx_kl`.
    `supports_dual_clip=False` makes `cfg.dual_clip` an error."""

    def register(core: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"a policy loss named {name!r} is already registered")

        @functools.wraps(core)
        def policy_loss(log_probs, old_log_probs, advantages, action_mask, cfg):
            check_ndim("log_probs", log_probs, 2, "(B, A)")
            check_same_shape(
                "log_probs", log_probs, old_log_probs=old_log_probs, advantages=advantages,
                action_mask=action_mask, rollout_log_probs=cfg.rollout_log_probs,
            )
            if cfg.dual_clip is not None and not supports_dual_clip:
                raise ValueError(f"--dual_clip does not apply to --policy_loss {name}; unset it")
            mask = as_bool_mask(action_mask, log_probs)
            log_probs, old_log_probs = fill_masked(log_probs, mask), fill_masked(old_log_probs, mask)
            advantages = fill_masked(advantages, mask)
            loss, metrics = core(log_probs, old_log_probs, advantages, mask, cfg)
            if cfg.correction is not None:
                weight, corrected = rollout_correction_weight(old_log_probs, cfg.rollout_log_probs, mask,
                                                              cfg.correction)
                loss = loss * weight
                metrics.update(corrected)
            if cfg.rollout_log_probs is not None:
                metrics.update(mismatch_metrics(old_log_probs, cfg.rollout_log_probs, mask))
            metrics["approx_kl"] = masked_mean(compute_approx_kl(old_log_probs, log_probs, mask, "k3"), mask)
            return fill_masked(loss, mask), {key: value.detach() for key, value in metrics.items()}

        policy_loss.supports_dual_clip = supports_dual_clip
        POLICY_LOSSES[name] = policy_loss
        return policy_loss

    return register


def get_policy_loss(name: str) -> PolicyLossFn:
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown --policy_loss {name!r}; choose one of: {', '.join(sorted(POLICY_LOSSES))}")
    return POLICY_LOSSES[name]


def truncated_is_weight(
    old_log_probs: Tensor, rollout_log_probs: Tensor | None, mask: Tensor, tis_cap: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """w_t = min(pi_old(y_t) / pi_rollout(y_t), tis_cap), detached: corrects for the rollout engine
    (e.g. vLLM) sampling from slightly different probabilities than the trainer computes.
    Shape: old_log_probs, rollout_log_probs, mask (B, A) -> (B, A), 1 outside the mask."""
    weight, metrics = rollout_correction_weight(old_log_probs, rollout_log_probs, as_bool_mask(mask, old_log_probs),
                                                CorrectionSpec("token_tis", tis_cap))
    metrics.pop("rollout_corrected_seq_frac")
    return weight, metrics


def _ratio_metrics(ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    return {
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": masked_max(ratio, mask),
        "ratio_min": masked_min(ratio, mask),
    }


def clipped_surrogate(ratio: Tensor, advantages: Tensor, mask: Tensor, cfg: PolicyLossConfig) -> tuple[Tensor, dict]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7) with separate low/high ranges (DAPO
    clip-higher, Yu et al. 2025, arXiv 2503.14476) and optional dual clip (Ye et al. 2020,
    "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning"):

        loss = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
        A < 0 and dual_clip c:  loss = min(loss, -c * A)

    Shape: ratio, advantages, mask (B, A) -> (B, A)."""
    clipped = ratio.clamp(1.0 - cfg.eps_clip_low, 1.0 + cfg.eps_clip_high)
    loss = -torch.minimum(ratio * advantages, clipped * advantages)
    negative = advantages < 0
    metrics = {
        "clip_frac_low": masked_mean(negative & (ratio < 1.0 - cfg.eps_clip_low), mask),
        "clip_frac_high": masked_mean((advantages > 0) & (ratio > 1.0 + cfg.eps_clip_high), mask),
    }
    if cfg.dual_clip is not None:
        bound = -cfg.dual_clip * advantages
        dual_active = negative & (loss > bound)
        loss = torch.where(dual_active, bound, loss)
        metrics["dual_clip_frac"] = masked_mean(dual_active, mask)
    metrics.update(_ratio_metrics(ratio, mask))
    return loss, metrics


@register_policy_loss("ppo")
def ppo_loss(log_probs, old_log_probs, advantages, mask, cfg):
    """PPO: token ratio r_t = exp(log pi(y_t) - log pi_old(y_t)) in the clipped surrogate."""
    ratio = torch.exp((log_probs - old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return clipped_surrogate(ratio, advantages, mask, cfg)


@register_policy_loss("gspo")
def gspo_loss(log_probs, old_log_probs, advantages, mask, cfg):
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071): the
    length-normalised sequence ratio

        s_i = exp((1 / |y_i|) sum_t (log pi(y_t) - log pi_old(y_t)))

    in the clipped surrogate, in its token form (GSPO-token)
    s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)], whose value is s_i and whose gradient is
    s_i * grad log pi(y_t); with equal advantages over a sequence and `seq-mean-token-mean`
    aggregation this is exactly the sequence-level GSPO gradient.
    Clip ranges are about 1000x smaller than PPO's: the paper uses eps_low = 3e-4,
    eps_high = 4e-4 (`--eps_clip_low_high 3e-4 4e-4`)."""
    log_ratio = log_probs - old_log_probs
    sequence_log_ratio = masked_mean(log_ratio, mask, dim=-1)  # (B,) log s_i
    token_log_ratio = sequence_log_ratio.detach()[:, None] + log_probs - log_probs.detach()  # (B, A)
    ratio = torch.exp(token_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return clipped_surrogate(ratio, advantages, mask, cfg)


@register_policy_loss("cispo", supports_dual_clip=False)
def cispo_loss(log_probs, old_log_probs, advantages, mask, cfg):
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, not the update,

        loss = -sg[clip(r, 1 - eps_low, 1 + eps_high)] * A * log pi(y_t)

    so every token keeps a gradient. The paper leaves the lower bound open (eps_low >= 1 disables
    it, as a ratio is never negative) and tunes only eps_high."""
    ratio = torch.exp((log_probs - old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weight = ratio.clamp(1.0 - cfg.eps_clip_low, 1.0 + cfg.eps_clip_high).detach()
    loss = -weight * advantages * log_probs
    metrics = {
        "clip_frac_low": masked_mean(ratio < 1.0 - cfg.eps_clip_low, mask),
        "clip_frac_high": masked_mean(ratio > 1.0 + cfg.eps_clip_high, mask),
    }
    metrics.update(_ratio_metrics(ratio, mask))
    return loss, metrics
