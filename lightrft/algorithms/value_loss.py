"""Critic loss of PPO."""

import torch
from torch import Tensor

from lightrft.algorithms.checks import check_same_shape
from lightrft.algorithms.masked import as_bool_mask, fill_masked, masked_mean


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    value_clip: float | None,
    action_mask: Tensor | None = None,
    *,
    return_metrics: bool = False,
) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
    """Per-token clipped value loss (PPO; the value clipping of the OpenAI baselines PPO2
    implementation, analysed in Engstrom et al. 2020, "Implementation Matters in Deep Policy
    Gradients"):

        v_clip = old_v + clip(v - old_v, -c, c)
        loss   = 0.5 * max((v - R)^2, (v_clip - R)^2)

    value_clip=None gives the plain 0.5 * (v - R)^2. Positions outside action_mask are 0. With
    return_metrics, also {"value_clip_frac": share of kept tokens where the clipped term is the
    larger one} (detached).
    Shape: values, old_values, returns, action_mask (B, A) -> (B, A)."""
    check_same_shape("values", values, old_values=old_values, returns=returns, action_mask=action_mask)
    if value_clip is not None and value_clip <= 0:
        raise ValueError(f"--value_clip must be > 0 or unset; got {value_clip}")
    mask = as_bool_mask(action_mask, values)
    values, returns = fill_masked(values, mask), fill_masked(returns, mask)
    unclipped = (values - returns).square()
    if value_clip is None:
        loss, clipped_larger = 0.5 * unclipped, torch.zeros_like(mask)
    else:
        old_values = fill_masked(old_values, mask)
        clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped = (clipped_values - returns).square()
        loss, clipped_larger = 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped
    loss = fill_masked(loss, mask)
    if not return_metrics:
        return loss
    return loss, {"value_clip_frac": masked_mean(clipped_larger, mask).detach()}
