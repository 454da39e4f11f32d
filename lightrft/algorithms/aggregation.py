"""Reducing a per-token loss to the scalar that is back-propagated (`--loss_agg_mode`).

Split invariance. A global batch (all ranks, all gradient-accumulation micro-batches) is cut into
parts. When every part is reduced with the *global* normalisers (`global_num_tokens`,
`global_num_seqs`, summed over all parts with `loss_normalizers`) the part losses add up to the
whole-batch loss, and so do their gradients, whatever the split.

Scaling for DeepSpeed. DeepSpeed averages gradients over the data-parallel ranks (divides by
world_size) and divides each micro-batch loss by the gradient-accumulation steps (GAS). The sum of
the parts is what we want, so multiply each part's loss by `dp_loss_scale(world_size, GAS)` =
world_size * GAS before `strategy.backward`; log the unscaled value.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from lightrft.algorithms.checks import check_ndim, check_same_shape
from lightrft.algorithms.masked import as_bool_mask, fill_masked

Normaliser = Tensor | float | int


def loss_normalizers(mask: Tensor) -> tuple[Tensor, Tensor]:
    """(number of kept tokens, number of sequences with at least one kept token) of one part, as
    float tensors; sum them over micro-batches and all-reduce over ranks for the global values.
    Shape: mask (B, A) -> two scalars."""
    check_ndim("action_mask", mask, 2, "(B, A)")
    keep = as_bool_mask(mask, mask)
    return keep.sum().float(), keep.any(-1).sum().float()


def dp_loss_scale(world_size: int, grad_accum_steps: int) -> int:
    """Factor for a loss normalised by global counts so that DeepSpeed's mean over ranks and
    division by gradient-accumulation steps yield the whole-batch gradient: world_size * GAS."""
    if world_size < 1 or grad_accum_steps < 1:
        raise ValueError(
            f"world_size and grad_accum_steps must be >= 1; got {world_size} and {grad_accum_steps}"
        )
    return world_size * grad_accum_steps


def _divide(total: Tensor, normaliser: Normaliser) -> Tensor:
    """total / max(normaliser, 1): an empty batch gives 0, not NaN. A Python number stays one (no
    tensor made on the device from the host: on CUDA that copy would wait for the device)."""
    if not isinstance(normaliser, Tensor):
        return total / max(float(normaliser), 1.0)
    return total / normaliser.to(total.dtype).clamp(min=1)


def _token_sums(loss: Tensor, keep: Tensor, norm_len: float | None) -> Tensor:
    return loss.sum(-1)


def _token_means(loss: Tensor, keep: Tensor, norm_len: float | None) -> Tensor:
    return loss.sum(-1) / keep.sum(-1).clamp(min=1)


def _token_sums_over_norm_len(loss: Tensor, keep: Tensor, norm_len: float | None) -> Tensor:
    return loss.sum(-1) / (norm_len if norm_len is not None else loss.shape[-1])


# sequence-level modes: name -> per-sequence reduction (B, A) -> (B,), then a mean over sequences.
_SEQUENCE_REDUCTIONS: dict[str, Callable[[Tensor, Tensor, float | None], Tensor]] = {
    "seq-mean-token-mean": _token_means,
    "seq-mean-token-sum": _token_sums,
    "seq-mean-token-sum-norm": _token_sums_over_norm_len,
}
LOSS_AGG_MODES = ("token-mean", *_SEQUENCE_REDUCTIONS)


def check_loss_agg_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown --loss_agg_mode {mode!r}; choose one of: {', '.join(LOSS_AGG_MODES)}")


def aggregate_loss(
    loss: Tensor,
    mask: Tensor | None,
    mode: str = "token-mean",
    global_num_tokens: Normaliser | None = None,
    global_num_seqs: Normaliser | None = None,
    norm_len: float | None = None,
) -> Tensor:
    """Scalar loss from a per-token loss l (B, A) and mask m, with N_tok / N_seq the global
    normalisers (default: this part's own counts, `loss_normalizers`):

        token-mean               sum_{i,t} m l / N_tok              (DAPO token-level, Yu et al. 2025)
        seq-mean-token-mean      sum_i (sum_t m l / |y_i|) / N_seq  (GRPO, Shao et al. 2024)
        seq-mean-token-sum       sum_i (sum_t m l) / N_seq
        seq-mean-token-sum-norm  sum_i (sum_t m l) / (N_seq * L)    (Dr. GRPO, Liu et al. 2025)

    with L = norm_len, a constant such as the maximum response length (`--generate_max_len`);
    it defaults to A for an unsplit batch and is required when the batch is split (A may then
    differ between parts). Empty selections give 0.
    Shape: loss, mask (B, A) -> scalar."""
    check_loss_agg_mode(mode)
    check_ndim("loss", loss, 2, "(B, A)")
    check_same_shape("loss", loss, mask=mask)
    keep = as_bool_mask(mask, loss)
    loss = fill_masked(loss, keep)
    num_tokens, num_seqs = loss_normalizers(keep)
    if mode == "token-mean":
        return _divide(loss.sum(), num_tokens if global_num_tokens is None else global_num_tokens)
    if mode == "seq-mean-token-sum-norm" and norm_len is None and global_num_seqs is not None:
        raise ValueError(
            "--loss_agg_mode seq-mean-token-sum-norm over a split batch needs norm_len, a constant "
            "such as the maximum response length (--generate_max_len)"
        )
    per_sequence = _SEQUENCE_REDUCTIONS[mode](loss, keep, norm_len)  # (B,)
    return _divide(per_sequence.sum(), num_seqs if global_num_seqs is None else global_num_seqs)
