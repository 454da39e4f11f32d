import math

import pytest
import torch

from lightrft.algorithms.aggregation import aggregate_loss
from lightrft.algorithms.policy_loss import PolicyLossConfig, get_policy_loss
from lightrft.models import GPTLMLoss, PairWiseLoss, PolicyLoss, ValueLoss
from lightrft.utils.tiny import build_char_tokenizer, build_tiny_causal_lm

F64 = torch.float64


def t(rows):
    return torch.tensor(rows, dtype=F64)


# ratio 1.5 with A = 2, ratio 0.5 with A = -1, and a padded position
LOG_PROBS = t([[math.log(1.5), math.log(0.5), 0.3]])
OLD = torch.zeros(1, 3, dtype=F64)
ADV = t([[2.0, -1.0, 5.0]])
MASK = torch.tensor([[1, 1, 0]])


def test_policy_loss_keeps_the_original_call_convention():
    # eps 0.2: -min(1.5*2, 1.2*2) = -2.4; -min(-0.5, -0.8) = 0.8; token-mean over 2 tokens
    assert PolicyLoss(0.2)(LOG_PROBS, OLD, ADV, MASK).item() == pytest.approx((-2.4 + 0.8) / 2)
    assert PolicyLoss(0.2)(LOG_PROBS, OLD, ADV, MASK, None).item() == pytest.approx((-2.4 + 0.8) / 2)


def test_eps_clip_low_high_overrides_eps_clip():
    # range [0.9, 1.3]: -min(3, 1.3*2) = -2.6; -min(-0.5, -0.9) = 0.9
    loss = PolicyLoss(0.2, eps_clip_low_high=(0.1, 0.3))(LOG_PROBS, OLD, ADV, MASK)
    assert loss.item() == pytest.approx((-2.6 + 0.9) / 2)


def test_options_reach_the_algorithms():
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 5, generator=gen, dtype=F64)
    log_probs = old + 0.3 * torch.randn(4, 5, generator=gen, dtype=F64)
    rollout = old + 0.3 * torch.randn(4, 5, generator=gen, dtype=F64)
    adv = torch.randn(4, 5, generator=gen, dtype=F64)
    mask = torch.rand(4, 5, generator=gen) < 0.8
    front = PolicyLoss(0.2, policy_loss="ppo", eps_clip_low_high=(0.2, 0.28), dual_clip=3.0,
                       loss_agg_mode="seq-mean-token-sum-norm", tis_cap=2.0)
    loss, metrics = front(log_probs, old, adv, mask, rollout_log_probs=rollout, global_num_seqs=10, norm_len=8,
                          return_metrics=True)
    cfg = PolicyLossConfig(0.2, 0.28, 3.0, rollout, 2.0)
    per_token, expected_metrics = get_policy_loss("ppo")(log_probs, old, adv, mask, cfg)
    expected = aggregate_loss(per_token, mask, "seq-mean-token-sum-norm", global_num_seqs=10, norm_len=8)
    torch.testing.assert_close(loss, expected)
    assert metrics.keys() == expected_metrics.keys() and "dual_clip_frac" in metrics and "tis_weight_mean" in metrics
    # global_num_tokens replaces the local count in token-mean
    local = PolicyLoss(0.2)(log_probs, old, adv, mask)
    scaled = PolicyLoss(0.2)(log_probs, old, adv, mask, global_num_tokens=2 * mask.sum())
    torch.testing.assert_close(scaled, local / 2)


def test_entropy_mask_trains_only_the_tokens_of_both_masks():
    entropy_mask = torch.tensor([[0, 1, 1]])
    log_probs = LOG_PROBS.clone().requires_grad_(True)
    loss = PolicyLoss(0.2)(log_probs, OLD, ADV, MASK, entropy_mask)
    assert loss.item() == pytest.approx(0.8)  # only token 1 is in both masks
    loss.backward()
    assert log_probs.grad[0, 0] == 0 and log_probs.grad[0, 2] == 0


@pytest.mark.parametrize("policy_loss", ["gspo", "cispo"])
def test_other_policy_losses_through_the_front(policy_loss):
    loss = PolicyLoss(0.2, policy_loss=policy_loss, loss_agg_mode="seq-mean-token-mean")(LOG_PROBS, OLD, ADV, MASK)
    per_token, _ = get_policy_loss(policy_loss)(LOG_PROBS, OLD, ADV, MASK, PolicyLossConfig())
    torch.testing.assert_close(loss, aggregate_loss(per_token, MASK, "seq-mean-token-mean"))


def test_construction_errors_name_the_flag():
    with pytest.raises(ValueError, match=r"unknown --policy_loss 'dpo'; choose one of: cispo, gspo, ppo"):
        PolicyLoss(policy_loss="dpo")
    with pytest.raises(ValueError, match="unknown --loss_agg_mode 'sum'"):
        PolicyLoss(loss_agg_mode="sum")
    with pytest.raises(ValueError, match="--dual_clip does not apply to --policy_loss cispo"):
        PolicyLoss(policy_loss="cispo", dual_clip=3.0)
    with pytest.raises(ValueError, match="--dual_clip must be > 1"):
        PolicyLoss(dual_clip=1.0)
    with pytest.raises(ValueError, match="--eps_clip_low_high takes two values"):
        PolicyLoss(eps_clip_low_high=(0.1, 0.2, 0.3))
    with pytest.raises(ValueError, match="--tis_cap must be > 0"):
        PolicyLoss(tis_cap=-1.0)
    with pytest.raises(ValueError, match="--value_clip must be > 0"):
        ValueLoss(0.0)
    with pytest.raises(ValueError, match=r"entropy_mask has shape \(1, 2\) but log_probs has shape \(1, 3\)"):
        PolicyLoss()(LOG_PROBS, OLD, ADV, MASK, torch.ones(1, 2))


def test_value_loss_by_hand():
    values, old, returns = t([[1.0, 2.0, 0.0, 1.2]]), t([[0.8, 2.5, 0.0, 1.0]]), t([[1.5, 1.0, 1.0, 0.0]])
    # per token (see tests/algorithms/test_value_loss.py): [0.18, 0.98, 0.5, 0.72]
    assert ValueLoss(0.1)(values, old, returns).item() == pytest.approx((0.18 + 0.98 + 0.5 + 0.72) / 4)
    mask = torch.tensor([[1, 0, 1, 1]])
    loss, metrics = ValueLoss(0.1)(values, old, returns, mask, return_metrics=True)
    assert loss.item() == pytest.approx((0.18 + 0.5 + 0.72) / 3)
    assert metrics["value_clip_frac"].item() == pytest.approx(1 / 3)
    # unclipped: 0.5 (v - R)^2 = [0.125, -, 0.5, 0.72]; seq-mean-token-sum over one sequence
    unclipped = ValueLoss(None, loss_agg_mode="seq-mean-token-sum")(values, old, returns, mask)
    assert unclipped.item() == pytest.approx(0.125 + 0.5 + 0.72)


def test_gpt_lm_loss_equals_the_hugging_face_loss():
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, arch="qwen2", seed=0)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(4, 100, (2, 9), generator=gen)
    labels = input_ids.clone()
    labels[0, :4] = -100  # prompt tokens do not count
    output = model(input_ids=input_ids, labels=labels)
    ours = GPTLMLoss()(output.logits, labels)
    torch.testing.assert_close(ours, output.loss)
    (g_ours,) = torch.autograd.grad(ours, model.lm_head.weight, retain_graph=True)
    (g_hf,) = torch.autograd.grad(output.loss, model.lm_head.weight)
    torch.testing.assert_close(g_ours, g_hf)
    with pytest.raises(ValueError, match=r"labels has shape \(2, 8\) but logits has shape \(2, 9, 100\)"):
        GPTLMLoss()(output.logits, labels[:, :8])


def test_pairwise_loss_by_hand():
    chosen, rejected = t([2.0, 0.0]), t([1.0, 1.0])
    expected = (math.log(1 + math.exp(-1)) + math.log(1 + math.exp(1))) / 2  # -log sigmoid(+-1)
    assert PairWiseLoss()(chosen, rejected).item() == pytest.approx(expected)
    with_margin = (math.log(1 + math.exp(-0.5)) + math.log(1 + math.exp(1))) / 2
    assert PairWiseLoss()(chosen, rejected, t([0.5, 0.0])).item() == pytest.approx(with_margin)
