"""Evidence that a rollout engine samples from the weights the trainer holds.

A rollout engine with its own copy of the weights (vLLM) receives them by a sync after every
optimizer phase. A sync that silently fails to arrive (a tied LM head left behind, a layer the
engine did not reload) leaves every later rollout sampled from other weights, and nothing in the
losses shows it: the PPO ratio compares the trainer with itself, and the mean truncated
importance weight stays near 1 by construction. What does show it is the gap between the log-prob
the engine reported for each sampled token and the trainer's log-prob of the same token, which
every update computes anyway (the "old" log-probs). `engine_logprob_gap` measures it per
micro-batch with no host sync; the trainer logs it every step as
`rollout/engine_logprob_gap_mean` and `_max` and stops past `--engine_logprob_gap_threshold`.

The tolerances are what a correct engine stays under: float32 engines agree with the trainer to
~1e-5 per token (docs/rollout.md), bfloat16 kernels differ more (their own rounding, another
reduction order). The doctor's engine check uses the same numbers.
"""

import torch
from torch import Tensor

# Largest mean / max gap per response token (nats) between engine and trainer log-probs.
ENGINE_GAP_TOLERANCE = {"float32": (1e-3, 2e-2), "bfloat16": (3e-2, 1.0)}


class EngineSyncError(RuntimeError):
    """The rollout engine's log-probs left the trainer's: its weights are not the trained ones."""


def engine_gap_tolerance(bf16: bool) -> tuple[float, float]:
    """(mean, max) tolerance of the engine-vs-trainer log-prob gap at the run's precision."""
    return ENGINE_GAP_TOLERANCE["bfloat16" if bf16 else "float32"]


def engine_logprob_gap(log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Sum, token count and max of |log_probs - rollout_log_probs| over the tokens of `mask`, as
    0-dim float32 tensors (no host sync); the max is NaN where the mask is empty. Sums and counts
    rather than a mean, so the mean over micro-batches and ranks weighs every token once.
    Shape: (B, A) each -> three scalars."""
    mask = mask.bool()
    gap = (log_probs.detach().float() - rollout_log_probs.float()).abs()
    gap = torch.where(mask, gap, torch.zeros_like(gap))
    tokens = mask.sum().float()
    largest = torch.where(tokens > 0, gap.max() if gap.numel() else gap.new_zeros(()), float("nan"))
    return gap.sum(), tokens, largest

