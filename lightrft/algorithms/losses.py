"""Supervised losses: next-token NLL for SFT / pretraining mix-in, and the pairwise reward-model
loss."""

import torch.nn.functional as F
from torch import Tensor

from lightrft.algorithms.aggregation import Normaliser, aggregate_loss
from lightrft.algorithms.checks import check_ndim, check_same_shape
from lightrft.algorithms.logprobs import log_probs_from_logits


def sft_token_loss(
    logits: Tensor, labels: Tensor, ignore_index: int = -100, *, global_num_tokens: Normaliser | None = None
) -> Tensor:
    """Mean negative log-likelihood over the positions whose label is not `ignore_index`:
    -(1 / N) sum_t log p(labels_t), N = number of such positions (or `global_num_tokens` when a
    batch is split; see aggregation). No shift: logits[:, t] scores labels[:, t]. No position
    kept gives 0. Computed with the chunked `log_probs_from_logits` (no float32 logits copy).
    Shape: logits (B, T, V), labels (B, T) -> scalar."""
    check_ndim("logits", logits, 3, "(B, T, V)")
    keep = labels != ignore_index
    safe_labels = labels.masked_fill(~keep, 0)  # any valid id; these positions are dropped below
    log_probs = log_probs_from_logits(logits, safe_labels)
    return aggregate_loss(-log_probs, keep, "token-mean", global_num_tokens=global_num_tokens)


def pairwise_loss(chosen: Tensor, rejected: Tensor, margin: Tensor | float | None = None) -> Tensor:
    """Bradley-Terry reward-model loss (Ouyang et al. 2022, eq. 1), with the optional margin of
    Llama 2 (Touvron et al. 2023, eq. 2): mean_i -log sigmoid(r_chosen_i - r_rejected_i - m_i).
    Shape: chosen, rejected, margin (B,) -> scalar."""
    check_same_shape("chosen", chosen, rejected=rejected)
    difference = chosen - rejected
    if margin is not None:
        if isinstance(margin, Tensor):
            check_same_shape("chosen", chosen, margin=margin)
        difference = difference - margin
    return -F.logsigmoid(difference).mean()
