"""Global advantage whitening from moments that add up over the parts of a batch."""

import math

import pytest
import torch

from lightrft.algorithms.masked import masked_whiten
from lightrft.algorithms.whitening import whiten, whiten_with_moments, whitening_moments

F64 = torch.float64
X = torch.tensor([[1.0, 2.0, 9.0], [4.0, 7.0, 7.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_whiten_by_hand():
    # kept 1, 2, 4: mean 7/3, population variance 42/9/3 = 14/9; eps 1e-8
    out = whiten(X, MASK)
    scale = 1 / math.sqrt(14 / 9 + 1e-8)
    expected = torch.tensor([[(1 - 7 / 3) * scale, (2 - 7 / 3) * scale, 0], [(4 - 7 / 3) * scale, 0, 0]], dtype=F64)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(whitening_moments(X, MASK), torch.tensor([7.0, 21.0, 3.0], dtype=F64))
    torch.testing.assert_close(out, masked_whiten(X, MASK))


def test_parts_whitened_with_summed_moments_equal_the_whole_batch():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 7, generator=gen, dtype=F64) * 3 + 1
    mask = torch.rand(12, 7, generator=gen) < 0.7
    whole = whiten(x, mask)
    for parts in (2, 3, 4):
        xs, ms = x.chunk(parts), mask.chunk(parts)
        moments = sum(whitening_moments(p, m) for p, m in zip(xs, ms))      # what the all-reduce sums
        got = torch.cat([whiten_with_moments(p, m, moments) for p, m in zip(xs, ms)])
        torch.testing.assert_close(got, whole)
    kept = whole[mask]
    assert kept.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert kept.var(unbiased=False).item() == pytest.approx(1.0, rel=1e-6)


def test_masked_positions_never_count_and_stay_zero():
    dirty = X.masked_fill(~MASK.bool(), float("nan"))
    torch.testing.assert_close(whiten(dirty, MASK), whiten(X, MASK))
    assert torch.all(whiten(dirty, MASK)[~MASK.bool()] == 0)


def test_float32_in_float32_out_and_nothing_kept_gives_zero():
    x = torch.tensor([[0.5, 1.5]], dtype=torch.float32)
    out = whiten(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([[-1.0, 1.0]]) / math.sqrt(1 + 1e-8 / 0.25))
    empty = torch.zeros(1, 2, dtype=torch.bool)
    assert torch.equal(whiten(x, empty), torch.zeros(1, 2))
    with pytest.raises(ValueError, match=r"moments must have shape \(3,\)"):
        whiten_with_moments(x, None, torch.zeros(2))
