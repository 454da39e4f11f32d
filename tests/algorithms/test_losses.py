import math

import pytest
import torch
import torch.nn.functional as F

from lightrft.algorithms.losses import pairwise_loss, sft_token_loss

F64 = torch.float64


def test_sft_token_loss_by_hand():
    # every position: logits [0, ln 3] -> p(0) = 1/4, p(1) = 3/4
    logits = torch.tensor([[[0.0, math.log(3)]] * 3], dtype=F64)
    labels = torch.tensor([[1, 0, -100]])
    expected = (-math.log(0.75) - math.log(0.25)) / 2  # the ignored position does not count
    assert sft_token_loss(logits, labels).item() == pytest.approx(expected)
    assert sft_token_loss(logits, torch.full((1, 3), -100)).item() == 0.0  # nothing to learn: 0, not NaN


def test_sft_token_loss_equals_cross_entropy():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 13, generator=gen, dtype=F64, requires_grad=True)
    labels = torch.randint(0, 13, (3, 6), generator=gen)
    labels[0, :2] = -100
    ours = sft_token_loss(logits, labels)
    reference = F.cross_entropy(logits.reshape(-1, 13), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(ours, reference)
    (g_ours,) = torch.autograd.grad(ours, logits)
    (g_ref,) = torch.autograd.grad(reference, logits)
    torch.testing.assert_close(g_ours, g_ref)


def test_pairwise_loss_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.0], dtype=F64), torch.tensor([1.0, 1.0], dtype=F64)
    # -log sigmoid(1) = log(1 + e^-1); -log sigmoid(-1) = log(1 + e)
    expected = (math.log(1 + math.exp(-1)) + math.log(1 + math.exp(1))) / 2
    assert pairwise_loss(chosen, rejected).item() == pytest.approx(expected)
    # margin 0.5 on the first pair: -log sigmoid(0.5)
    with_margin = (math.log(1 + math.exp(-0.5)) + math.log(1 + math.exp(1))) / 2
    assert pairwise_loss(chosen, rejected, torch.tensor([0.5, 0.0], dtype=F64)).item() == pytest.approx(with_margin)
    with pytest.raises(ValueError, match=r"rejected has shape \(3,\) but chosen has shape \(2,\)"):
        pairwise_loss(chosen, torch.zeros(3))
