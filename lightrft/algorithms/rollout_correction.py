"""Rollout correction: weights (or masks) for tokens sampled by a policy other than the trainer's.

The rollout engine samples from pi_rollout (vLLM's kernels, bf16, or an explorer's older weights);
the update's "old" policy is the trainer's, pi_old. With the per-token log-ratio

    d_t = log pi_old(y_t) - log pi_rollout(y_t)        r_t = exp(d_t)

each mode of `--rollout_correction` turns the ratios into a detached weight w per token that
multiplies the policy loss of that token (any `--policy_loss`, any `--loss_agg_mode`; a weight of
0 removes the token from the gradient and keeps its place in the normaliser):

    token_tis   w_t = min(r_t, C)                                   (Yao et al. 2025; --tis_cap)
    token_mask  w_t = r_t if L <= r_t <= H, else 0                  (IcePop)
    seq_tis     w_t = min(R, C),  R = exp(sum_t d_t)                (sequence importance weight)
    seq_mask    w_t = R if L <= R <= H, else 0 for the whole sequence
    geo_tis     w_t = min(G, C),  G = exp(mean_t d_t)               (geometric mean of the ratios)
    geo_mask    w_t = 1 if L <= G <= H, else 0 for the whole sequence (masked importance sampling)

C is `--tis_cap` (2 when unset), [L, H] `--rollout_mask_band` (0.5 2 by default). Log-ratios and
their sums are clamped to [-20, 20] before exp. When engine and trainer agree (d = 0) every mode's
weight is 1 and nothing changes.

`mismatch_metrics` reports, whenever the engine's log-probs are known: the mismatch KL between
engine and trainer (k1 = mean(-d), k3 = mean(r - 1 - d), estimates of KL(pi_rollout || pi_old) on
the engine's samples), the ratio's tails (min, max, 5th and 95th percentiles over the tokens), and
each mode's share of tokens and of sequences it truncated or masked.

A mode is `fn(log_ratio, mask, spec) -> (weight, truncated_or_masked)`, registered with
`register_rollout_correction`; docs/algorithms.md gives the formulas.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightrft.algorithms.masked import masked_max, masked_mean, masked_min

# exp() is taken of log-ratios (and their sums) clamped to this bound, as the policy losses do.
LOG_RATIO_BOUND = 20.0
DEFAULT_CAP = 2.0
DEFAULT_BAND = (0.5, 2.0)


@dataclass(frozen=True)
class CorrectionSpec:
    """A mode and its constants: `cap` C of the truncating modes, `band` [L, H] of the masking ones."""

    mode: str
    cap: float = DEFAULT_CAP
    band: tuple[float, float] = DEFAULT_BAND

    def __post_init__(self):
        if self.mode not in ROLLOUT_CORRECTIONS:
            raise ValueError(f"unknown --rollout_correction {self.mode!r}; choose one of: "
                             f"{', '.join(sorted(ROLLOUT_CORRECTIONS))}")
        if not self.cap > 0:
            raise ValueError(f"--tis_cap must be > 0 (typically 2), got {self.cap}")
        low, high = self.band
        if not 0 < low <= 1 <= high:
            raise ValueError(f"--rollout_mask_band LOW HIGH needs 0 < LOW <= 1 <= HIGH (a band around the ratio 1 "
                             f"of agreeing policies), got {low} {high}")


CorrectionFn = Callable[[Tensor, Tensor, CorrectionSpec], tuple[Tensor, Tensor]]
ROLLOUT_CORRECTIONS: dict[str, CorrectionFn] = {}


def register_rollout_correction(name: str) -> Callable[[CorrectionFn], CorrectionFn]:
    """Adds a mode under `name` (`--rollout_correction name`). It receives the log-ratio d (B, A),
    0 outside the bool mask (B, A), and returns the weight (B, A) and which tokens it truncated or
    masked (bool, B, A); the caller detaches, sets the weight to 1 outside the mask and counts."""

    def register(fn: CorrectionFn) -> CorrectionFn:
        if name in ROLLOUT_CORRECTIONS:
            raise ValueError(f"a rollout correction named {name!r} is already registered")
        ROLLOUT_CORRECTIONS[name] = fn
        return fn

    return register


def _sequence_log_ratio(log_ratio: Tensor, mask: Tensor, mean: bool) -> Tensor:
    """Per sequence, the sum (or mean over its tokens) of d, clamped, broadcast to its tokens. Shape: (B, A)"""
    total = (log_ratio * mask).sum(dim=-1, keepdim=True)
    if mean:
        total = total / mask.sum(dim=-1, keepdim=True).clamp(min=1)
    return total.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).expand_as(log_ratio)


def _in_band(log_value: Tensor, band: tuple[float, float]) -> Tensor:
    low, high = band
    return (log_value >= math.log(low)) & (log_value <= math.log(high))


@register_rollout_correction("token_tis")
def token_tis(log_ratio, mask, spec):
    log_cap = math.log(spec.cap)
    clamped = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.exp(clamped.clamp(max=log_cap)), clamped > log_cap


@register_rollout_correction("token_mask")
def token_mask(log_ratio, mask, spec):
    clamped = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    kept = _in_band(clamped, spec.band)
    return torch.where(kept, torch.exp(clamped), torch.zeros_like(clamped)), ~kept


@register_rollout_correction("seq_tis")
def seq_tis(log_ratio, mask, spec):
    return token_tis(_sequence_log_ratio(log_ratio, mask, mean=False), mask, spec)


@register_rollout_correction("seq_mask")
def seq_mask(log_ratio, mask, spec):
    return token_mask(_sequence_log_ratio(log_ratio, mask, mean=False), mask, spec)


@register_rollout_correction("geo_tis")
def geo_tis(log_ratio, mask, spec):
    return token_tis(_sequence_log_ratio(log_ratio, mask, mean=True), mask, spec)


@register_rollout_correction("geo_mask")
def geo_mask(log_ratio, mask, spec):
    kept = _in_band(_sequence_log_ratio(log_ratio, mask, mean=True), spec.band)
    return kept.to(log_ratio.dtype), ~kept


def rollout_correction_weight(old_log_probs: Tensor, rollout_log_probs: Tensor | None, mask: Tensor,
                              spec: CorrectionSpec) -> tuple[Tensor, dict[str, Tensor]]:
    """The detached weight (B, A) of `spec`'s mode (1 outside `mask`) and its metrics:
    `tis_weight_mean` (mean weight over the tokens), `tis_clip_frac` (share of tokens truncated
    or masked) and `rollout_corrected_seq_frac` (share of sequences with any).
    Shape: old_log_probs, rollout_log_probs, mask (bool) (B, A)"""
    if rollout_log_probs is None:
        raise ValueError(f"--rollout_correction {spec.mode} (or --tis_cap) is set but no rollout log-probs were given; "
                         "the rollout engine must return them (RolloutOutput.rollout_log_probs), or unset it")
    log_ratio = torch.where(mask, old_log_probs.detach() - rollout_log_probs.to(old_log_probs.dtype),
                            torch.zeros((), dtype=old_log_probs.dtype, device=old_log_probs.device))
    weight, corrected = ROLLOUT_CORRECTIONS[spec.mode](log_ratio, mask, spec)
    weight = torch.where(mask, weight, torch.ones((), dtype=weight.dtype, device=weight.device)).detach()
    corrected = corrected & mask
    sequences = mask.any(dim=-1)
    seq_frac = (corrected.any(dim=-1) & sequences).sum() / sequences.sum().clamp(min=1)
    return weight, {"tis_weight_mean": masked_mean(weight, mask), "tis_clip_frac": masked_mean(corrected, mask),
                    "rollout_corrected_seq_frac": seq_frac.to(weight.dtype)}


def mismatch_metrics(old_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far the engine's log-probs are from the trainer's on the sampled tokens (module doc):
    `mismatch_kl_k1`, `mismatch_kl_k3`, `rollout_ratio_max`, `rollout_ratio_min`, `rollout_ratio_p05`,
    `rollout_ratio_p95` (r = pi_old / pi_rollout), detached, without a host sync."""
    raw = old_log_probs.detach() - rollout_log_probs.to(old_log_probs.dtype)
    d = raw.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)         # before exp (k1 takes the log-ratio as it is)
    ratio = torch.exp(d)
    values = torch.where(mask, ratio, torch.full((), float("nan"), dtype=ratio.dtype, device=ratio.device)).flatten()
    if values.dtype not in (torch.float32, torch.float64):
        values = values.float()
    quantiles = torch.nanquantile(values, torch.tensor([0.05, 0.95], dtype=values.dtype, device=values.device))
    quantiles = torch.nan_to_num(quantiles, nan=1.0)          # no token: the ratio of agreeing policies
    return {"mismatch_kl_k1": masked_mean(-raw, mask), "mismatch_kl_k3": masked_mean(ratio - 1 - d, mask),
            "rollout_ratio_max": masked_max(ratio, mask), "rollout_ratio_min": masked_min(ratio, mask),
            "rollout_ratio_p05": quantiles[0].to(ratio.dtype), "rollout_ratio_p95": quantiles[1].to(ratio.dtype)}
