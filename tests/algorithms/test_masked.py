import math

import pytest
import torch

from lightrft.algorithms.masked import masked_max, masked_mean, masked_min, masked_sum, masked_var, masked_whiten

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])  # keeps 1, 2 and 4


def test_sum_and_mean_by_hand():
    assert masked_sum(X, MASK).item() == 1 + 2 + 4
    assert masked_mean(X, MASK).item() == pytest.approx((1 + 2 + 4) / 3)
    torch.testing.assert_close(masked_mean(X, MASK, dim=-1), torch.tensor([(1 + 2) / 2, 4.0], dtype=torch.float64))
    torch.testing.assert_close(masked_sum(X, MASK, dim=0), torch.tensor([1 + 4, 2, 0], dtype=torch.float64))
    # mask None means every position
    assert masked_mean(X, None).item() == pytest.approx(21 / 6)


def test_empty_selection_gives_zero_not_nan():
    empty = torch.zeros_like(MASK)
    assert masked_mean(X, empty).item() == 0.0
    torch.testing.assert_close(masked_mean(X, MASK * torch.tensor([[1], [0]]), dim=-1),
                               torch.tensor([1.5, 0.0], dtype=torch.float64))
    assert masked_var(X, empty).item() == 0.0
    assert masked_max(X, empty).item() == 0.0 and masked_min(X, empty).item() == 0.0
    assert torch.all(masked_whiten(X, empty) == 0)


def test_var_by_hand():
    # kept 1, 2, 4: mean 7/3, squared deviations 16/9 + 1/9 + 25/9 = 42/9
    # the default is the population variance (/ n), the one masked_whiten uses
    assert masked_var(X, MASK).item() == pytest.approx(42 / 9 / 3)
    assert masked_var(X, MASK).item() == masked_var(X, MASK, unbiased=False).item()
    assert masked_var(X, MASK, unbiased=True).item() == pytest.approx(42 / 9 / 2)  # / (n - 1)
    # per row, unbiased: [1, 2] -> 0.5; [4] alone -> 0 (fewer than two values)
    torch.testing.assert_close(masked_var(X, MASK, unbiased=True, dim=-1),
                               torch.tensor([0.5, 0.0], dtype=torch.float64))
    # per row, population: [1, 2] -> 0.25; [4] alone -> 0
    torch.testing.assert_close(masked_var(X, MASK, dim=-1), torch.tensor([0.25, 0.0], dtype=torch.float64))
    torch.testing.assert_close(masked_var(X, None), X.reshape(-1).var(unbiased=False))


def test_whiten_divides_by_the_default_masked_var():
    # one convention: masked_whiten(x) == (x - mean) / sqrt(masked_var(x) + eps) with masked_var's default
    out = masked_whiten(X, MASK, eps=1e-8)
    mean = masked_mean(X, MASK)
    torch.testing.assert_close(out, ((X - mean) / torch.sqrt(masked_var(X, MASK) + 1e-8)) * MASK)


def test_whiten_by_hand():
    mean, var = 7 / 3, 42 / 9 / 3  # population variance of the kept 1, 2, 4
    out = masked_whiten(X, MASK, eps=0.0)
    expected = torch.tensor([[(1 - mean), (2 - mean), 0], [(4 - mean), 0, 0]], dtype=torch.float64) / math.sqrt(var)
    torch.testing.assert_close(out, expected)
    kept = out[MASK.bool()]
    assert kept.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert kept.var(unbiased=False).item() == pytest.approx(1.0)
    # shift_mean=False adds the mean back: only the scale changes
    unshifted = masked_whiten(X, MASK, shift_mean=False, eps=0.0)
    torch.testing.assert_close(unshifted[MASK.bool()], kept + mean)
    assert torch.all(unshifted[~MASK.bool()] == 0)


def test_whiten_with_given_statistics():
    # statistics of a larger (global) set: 0 and 4 -> (x - 0) / 2
    out = masked_whiten(X, MASK, mean=0.0, var=4.0, eps=0.0)
    torch.testing.assert_close(out, X * MASK / 2)


def test_max_min():
    assert masked_max(X, MASK).item() == 4.0
    assert masked_min(X, MASK).item() == 1.0
    assert masked_max(-X, MASK).item() == -1.0


@pytest.mark.parametrize("garbage", [1e30, float("inf"), float("nan")])
def test_garbage_outside_mask_changes_nothing(garbage):
    dirty = X.clone().masked_fill(~MASK.bool(), garbage).requires_grad_(True)
    clean = X.clone().requires_grad_(True)
    for fn in (masked_sum, masked_mean, masked_var, masked_max, masked_min):
        torch.testing.assert_close(fn(dirty, MASK), fn(clean, MASK))
    out_dirty, out_clean = masked_whiten(dirty, MASK), masked_whiten(clean, MASK)
    torch.testing.assert_close(out_dirty, out_clean)
    (out_dirty * torch.arange(6.0, dtype=torch.float64).reshape(2, 3)).sum().backward()
    (out_clean * torch.arange(6.0, dtype=torch.float64).reshape(2, 3)).sum().backward()
    assert torch.isfinite(dirty.grad).all()
    torch.testing.assert_close(dirty.grad, clean.grad)


def test_mask_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match=r"mask has shape \(2, 2\) but values has shape \(2, 3\)"):
        masked_mean(X, torch.ones(2, 2))
