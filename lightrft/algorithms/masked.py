"""Reductions over the positions a mask keeps.

A mask has the shape of the values (typically `(B, A)`, 1/True on response tokens). Positions
outside the mask never reach a result: they are replaced by 0 before any arithmetic, so padding
holding garbage (even inf or nan) leaks neither into values nor into gradients. An empty
selection gives 0, never NaN.
"""

import torch
from torch import Tensor

from lightrft.algorithms.checks import check_same_shape


def as_bool_mask(mask: Tensor | None, like: Tensor) -> Tensor:
    """`mask` as a bool tensor of `like`'s shape (all True when `mask` is None)."""
    if mask is None:
        return torch.ones_like(like, dtype=torch.bool)
    check_same_shape("values", like, mask=mask)
    return mask if mask.dtype == torch.bool else mask != 0


def fill_masked(x: Tensor, mask: Tensor | None, value: float = 0.0) -> Tensor:
    """`x` with the positions outside `mask` set to `value` (autograd-safe: no gradient flows to
    them, whatever they held)."""
    if mask is None:
        return x
    return torch.where(as_bool_mask(mask, x), x, torch.full((), value, dtype=x.dtype, device=x.device))


def _floating(x: Tensor) -> Tensor:
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())


def masked_sum(x: Tensor, mask: Tensor | None = None, dim: int | None = None) -> Tensor:
    """sum of x over the kept positions, over all dims (dim=None) or along `dim`."""
    kept = fill_masked(x, mask)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: Tensor, mask: Tensor | None = None, dim: int | None = None) -> Tensor:
    """mean of x over the kept positions: sum(x * m) / max(sum(m), 1).

    mask=None means all positions; a row (or tensor) with nothing kept gives 0.
    Shape: x, mask (..., ) -> scalar (dim=None) or x with `dim` reduced."""
    x = _floating(x)
    if mask is None:
        return x.mean() if dim is None else x.mean(dim)
    keep = as_bool_mask(mask, x)
    count = keep.sum() if dim is None else keep.sum(dim)
    return masked_sum(x, keep, dim) / count.clamp(min=1).to(x.dtype)


def masked_var(x: Tensor, mask: Tensor | None = None, unbiased: bool = False, dim: int | None = None) -> Tensor:
    """variance of x over the kept positions.

    The default is the population variance (divide the squared deviations by n), the one that
    `masked_whiten` and the global whitening of advantages use, as OpenRLHF does (verl's
    `masked_var` defaults to the unbiased one; group_norm's group std is unbiased, as in GRPO).
    unbiased=True divides by (n - 1) (Bessel). Nothing kept (fewer than two values for
    unbiased=True) gives 0 rather than NaN.
    Shape: x, mask (..., ) -> scalar (dim=None) or x with `dim` reduced."""
    x = _floating(x)
    keep = as_bool_mask(mask, x)
    if dim is None:
        x, keep, dim = x.reshape(-1), keep.reshape(-1), 0  # one flat row: reduce over everything
    x = fill_masked(x, keep)
    count = keep.sum(dim, keepdim=True).to(x.dtype)
    mean = x.sum(dim, keepdim=True) / count.clamp(min=1)
    squared = fill_masked((x - mean).square(), keep).sum(dim, keepdim=True)
    denominator = count - 1 if unbiased else count
    return (squared / denominator.clamp(min=1)).squeeze(dim)


def masked_whiten(
    x: Tensor,
    mask: Tensor | None = None,
    shift_mean: bool = True,
    eps: float = 1e-8,
    *,
    mean: Tensor | float | None = None,
    var: Tensor | float | None = None,
) -> Tensor:
    """Whitening over the kept positions: (x - mu) / sqrt(sigma^2 + eps); with shift_mean=False
    the mean is added back, (x - mu) / sqrt(sigma^2 + eps) + mu, so only the scale changes.

    mu and sigma^2 are the masked mean and the population (biased, divide by n) variance of x,
    unless given: pass `mean`/`var` computed over a larger set (e.g. the global batch over all
    ranks) to whiten this part with those statistics. Positions outside the mask are 0.
    Shape: x, mask (B, A) -> (B, A)."""
    x = fill_masked(_floating(x), mask)
    if mean is None:
        mean = masked_mean(x, mask)
    if var is None:
        var = masked_var(x, mask, unbiased=False)
    # A Python variance stays a number: no tensor made on the device from the host (a CUDA sync).
    scale = (float(var) + eps) ** -0.5 if not isinstance(var, torch.Tensor) else torch.rsqrt(var.to(x.dtype) + eps)
    whitened = (x - mean) * scale
    if not shift_mean:
        whitened = whitened + mean
    return fill_masked(whitened, mask)


def masked_max(x: Tensor, mask: Tensor | None = None) -> Tensor:
    """max of x over the kept positions (a scalar); 0 when nothing is kept."""
    keep = as_bool_mask(mask, x)
    best = torch.where(keep, x, torch.full((), float("-inf"), dtype=x.dtype, device=x.device)).max()
    return torch.where(keep.any(), best, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_min(x: Tensor, mask: Tensor | None = None) -> Tensor:
    """min of x over the kept positions (a scalar); 0 when nothing is kept."""
    return -masked_max(-x, mask)
