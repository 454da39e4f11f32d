import pytest
import torch

from lightrft.algorithms.value_loss import clipped_value_loss

F64 = torch.float64


def t(rows):
    return torch.tensor(rows, dtype=F64)


VALUES = t([[1.0, 2.0, 0.0, 1.2]])
OLD = t([[0.8, 2.5, 0.0, 1.0]])
RETURNS = t([[1.5, 1.0, 1.0, 0.0]])


def test_clipped_value_loss_by_hand():
    values = VALUES.clone().requires_grad_(True)
    loss, metrics = clipped_value_loss(values, OLD, RETURNS, value_clip=0.1, return_metrics=True)
    # v_clip = old + clip(v - old, -0.1, 0.1) = [0.9, 2.4, 0.0, 1.1]
    # (v - R)^2      = [0.25, 1.0, 1.0, 1.44]
    # (v_clip - R)^2 = [0.36, 1.96, 1.0, 1.21]
    # 0.5 * max      = [0.18, 0.98, 0.5, 0.72]
    torch.testing.assert_close(loss, t([[0.18, 0.98, 0.5, 0.72]]))
    assert metrics["value_clip_frac"].item() == pytest.approx(2 / 4)  # tokens 0 and 1
    loss.sum().backward()
    # tokens 0, 1: the clipped term wins and v - old is outside the range -> no gradient;
    # tokens 2, 3: d/dv 0.5 (v - R)^2 = v - R
    torch.testing.assert_close(values.grad, t([[0.0, 0.0, -1.0, 1.2]]))


def test_unclipped_value_loss_by_hand():
    loss = clipped_value_loss(VALUES, OLD, RETURNS, value_clip=None)
    torch.testing.assert_close(loss, t([[0.125, 0.5, 0.5, 0.72]]))


def test_mask_and_garbage():
    mask = torch.tensor([[1, 0, 1, 1]])
    dirty_values = VALUES.clone()
    dirty_values[0, 1] = float("nan")
    dirty_values.requires_grad_(True)
    dirty_old, dirty_returns = OLD.clone(), RETURNS.clone()
    dirty_old[0, 1], dirty_returns[0, 1] = float("inf"), 1e30
    loss = clipped_value_loss(dirty_values, dirty_old, dirty_returns, 0.1, mask)
    torch.testing.assert_close(loss, t([[0.18, 0.0, 0.5, 0.72]]))
    loss.sum().backward()
    torch.testing.assert_close(dirty_values.grad, t([[0.0, 0.0, -1.0, 1.2]]))


def test_bad_input():
    with pytest.raises(ValueError, match=r"returns has shape \(1, 3\) but values has shape \(1, 4\)"):
        clipped_value_loss(VALUES, OLD, RETURNS[:, :3], 0.2)
    with pytest.raises(ValueError, match="--value_clip must be > 0"):
        clipped_value_loss(VALUES, OLD, RETURNS, 0.0)
