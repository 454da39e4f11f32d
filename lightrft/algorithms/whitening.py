"""Global advantage whitening: A <- (A - mu) / sqrt(sigma^2 + eps) over the kept tokens of the whole
global batch, for the estimators flagged `normalize_globally` (gae, reinforce, reinforce_baseline,
reinforce++).

The statistics are split into moments that add up over parts of the batch, so a caller holding
one part (a rank's replay buffer) sums them over all parts (one all-reduce) and whitens its own
part with the global statistics:

    moments = whitening_moments(x_part, mask_part)          # (3,): sum, sum of squares, count
    moments = all_reduce(moments, op="sum")
    x_part  = whiten_with_moments(x_part, mask_part, moments)

Conventions: sigma^2 is the population variance (divide by n), eps = 1e-8 is added to it. OpenRLHF
uses the population variance too but clamps it, rsqrt(max(sigma^2, 1e-8)); verl's `masked_whiten`
uses the unbiased variance (divide by n - 1) plus 1e-8. The moments are float64, where
E[x^2] - E[x]^2 loses nothing that matters for advantages of order 1.
"""

import torch
from torch import Tensor

from lightrft.algorithms.checks import check_same_shape
from lightrft.algorithms.masked import as_bool_mask, fill_masked

WHITEN_EPS = 1e-8


def whitening_moments(x: Tensor, mask: Tensor | None = None) -> Tensor:
    """sum(x), sum(x^2) and the count over the kept positions, as one float64 tensor. Moments of
    disjoint parts add up to the moments of their union. Shape: x, mask (...) -> (3,)."""
    keep = as_bool_mask(mask, x)
    kept = fill_masked(x.double(), keep)
    return torch.stack([kept.sum(), kept.square().sum(), keep.sum().double()])


def whiten_with_moments(x: Tensor, mask: Tensor | None, moments: Tensor, eps: float = WHITEN_EPS) -> Tensor:
    """(x - mu) / sqrt(sigma^2 + eps) with mu = sum / n and the population variance
    sigma^2 = sum_sq / n - mu^2 from `moments` (`whitening_moments`, possibly summed over a larger
    set), computed in float64 and returned in x's dtype. Positions outside the mask are 0; with
    n = 0 nothing is kept and the result is 0 everywhere. Shape: x, mask (...) -> (...); moments (3,)."""
    check_same_shape("x", x, mask=mask)
    if moments.shape != (3,):
        raise ValueError(f"moments must have shape (3,) (sum, sum of squares, count); got {tuple(moments.shape)}")
    total, total_sq, count = moments.double().tolist()
    if count == 0:
        return torch.zeros_like(x)
    mean = total / count
    var = max(total_sq / count - mean * mean, 0.0)
    whitened = (x.double() - mean) / (var + eps) ** 0.5
    return fill_masked(whitened, mask).to(x.dtype)


def whiten(x: Tensor, mask: Tensor | None = None, eps: float = WHITEN_EPS) -> Tensor:
    """Whitening of x over its own kept positions (one part holding the whole batch).
    Shape: x, mask (...) -> (...)."""
    return whiten_with_moments(x, mask, whitening_moments(x, mask), eps)
