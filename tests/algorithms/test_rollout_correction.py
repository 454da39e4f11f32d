"""Rollout correction modes (`--rollout_correction`): each mode's weights on hand-computed ratios,
nothing changed when engine and trainer agree, the weight applied to every policy loss and
aggregation, the mismatch metrics, and bad settings refused naming the flag."""

import math

import pytest
import torch

from lightrft.algorithms.policy_loss import PolicyLossConfig, get_policy_loss, truncated_is_weight
from lightrft.algorithms.rollout_correction import (ROLLOUT_CORRECTIONS, CorrectionSpec, mismatch_metrics,
                                                    rollout_correction_weight)
from lightrft.cli import train_ppo
from lightrft.models.loss import PolicyLoss

# Two sequences: ratios pi_old / pi_rollout of 3, 1/4, 1 and 1.5 (the second's last slot is padding).
RATIOS = torch.tensor([[3.0, 0.25, 1.0], [1.5, 1.0, 1.0]], dtype=torch.float64)
MASK = torch.tensor([[True, True, True], [True, True, False]])
OLD = torch.log(torch.tensor([[0.6, 0.1, 0.5], [0.3, 0.2, 0.9]], dtype=torch.float64))
ROLLOUT = torch.where(MASK, OLD - torch.log(RATIOS), torch.tensor(-7.0, dtype=torch.float64))   # garbage in padding


def weights(mode: str, cap: float = 2.0, band=(0.5, 2.0)) -> tuple[torch.Tensor, dict]:
    return rollout_correction_weight(OLD, ROLLOUT, MASK, CorrectionSpec(mode, cap, band))


def test_each_mode_weighs_the_tokens_by_its_formula():
    # token_tis: min(r, 2); token_mask: r inside [0.5, 2], else 0.
    w, m = weights("token_tis")
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.25, 1.0], [1.5, 1.0, 1.0]], dtype=torch.float64))
    assert m["tis_clip_frac"].item() == pytest.approx(1 / 5) and m["rollout_corrected_seq_frac"].item() == 0.5
    w, m = weights("token_mask")
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 1.0], [1.5, 1.0, 1.0]], dtype=torch.float64))
    assert m["tis_clip_frac"].item() == pytest.approx(2 / 5) and m["tis_weight_mean"].item() == pytest.approx(3.5 / 5)
    # Sequence ratio R: 3 x 1/4 x 1 = 0.75 and 1.5; geometric mean G: 0.75^(1/3) = 0.9086 and 1.5^(1/2) = 1.2247.
    w, _ = weights("seq_tis", cap=1.2)
    torch.testing.assert_close(w, torch.tensor([[0.75] * 3, [1.2, 1.2, 1.0]], dtype=torch.float64))
    w, m = weights("seq_mask", band=(0.8, 1.25))
    torch.testing.assert_close(w, torch.tensor([[0.0] * 3, [0.0, 0.0, 1.0]], dtype=torch.float64))
    assert m["rollout_corrected_seq_frac"].item() == 1.0 and m["tis_clip_frac"].item() == 1.0
    w, _ = weights("geo_tis", cap=1.1)
    torch.testing.assert_close(w, torch.tensor([[0.75 ** (1 / 3)] * 3, [1.1, 1.1, 1.0]], dtype=torch.float64))
    w, m = weights("geo_mask", band=(0.8, 1.2))
    torch.testing.assert_close(w, torch.tensor([[1.0] * 3, [0.0, 0.0, 1.0]], dtype=torch.float64))
    assert m["rollout_corrected_seq_frac"].item() == 0.5 and m["tis_clip_frac"].item() == pytest.approx(2 / 5)
    # Padding is 1 whatever the rollout log-probs hold there.
    assert sorted(ROLLOUT_CORRECTIONS) == ["geo_mask", "geo_tis", "seq_mask", "seq_tis", "token_mask", "token_tis"]


def test_token_tis_is_the_truncated_weight_of_tis_cap():
    w, m = weights("token_tis", cap=1.5)
    old_w, old_m = truncated_is_weight(OLD, ROLLOUT, MASK, 1.5)
    torch.testing.assert_close(w, old_w)
    assert old_m.keys() == {"tis_weight_mean", "tis_clip_frac"} and old_m["tis_clip_frac"] == m["tis_clip_frac"]


def test_huge_ratios_are_bounded_before_exp():
    old = torch.zeros(1, 3, dtype=torch.float64)
    rollout = torch.tensor([[-500.0, 500.0, 0.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    for mode in ROLLOUT_CORRECTIONS:
        w, m = rollout_correction_weight(old, rollout, mask, CorrectionSpec(mode))
        assert torch.isfinite(w).all() and all(torch.isfinite(v) for v in m.values()), mode
    w, _ = rollout_correction_weight(old, rollout, mask, CorrectionSpec("token_mask"))
    assert w.tolist() == [[0.0, 0.0, 1.0]]


@pytest.mark.parametrize("mode", sorted(ROLLOUT_CORRECTIONS))
@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "cispo"])
def test_a_mode_multiplies_every_policy_loss_and_changes_nothing_when_the_policies_agree(mode, policy_loss):
    g = torch.Generator().manual_seed(1)
    log_probs = (OLD + 0.1 * torch.randn(OLD.shape, generator=g, dtype=torch.float64)).requires_grad_()
    advantages = torch.randn(OLD.shape, generator=g, dtype=torch.float64)
    fn = get_policy_loss(policy_loss)
    plain, _ = fn(log_probs, OLD, advantages, MASK, PolicyLossConfig(rollout_log_probs=ROLLOUT))
    corrected, metrics = fn(log_probs, OLD, advantages, MASK, PolicyLossConfig(
        rollout_log_probs=ROLLOUT, rollout_correction=mode, tis_cap=1.2, rollout_mask_band=(0.8, 1.25)))
    weight, _ = rollout_correction_weight(OLD, ROLLOUT, MASK, CorrectionSpec(mode, 1.2, (0.8, 1.25)))
    torch.testing.assert_close(corrected, plain * weight * MASK)
    assert "tis_weight_mean" in metrics and "mismatch_kl_k3" in metrics
    # The same rollout log-probs as the trainer's: weight 1, loss and gradient as without a mode.
    agreed, _ = fn(log_probs, OLD, advantages, MASK, PolicyLossConfig(rollout_log_probs=OLD, rollout_correction=mode))
    torch.testing.assert_close(agreed, plain)
    grad_agreed = torch.autograd.grad(agreed.sum(), log_probs)[0]
    plain, _ = fn(log_probs, OLD, advantages, MASK, PolicyLossConfig(rollout_log_probs=OLD))
    torch.testing.assert_close(grad_agreed, torch.autograd.grad(plain.sum(), log_probs)[0])


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_the_policy_loss_module_takes_the_mode_with_any_aggregation(agg):
    g = torch.Generator().manual_seed(2)
    log_probs = OLD + 0.1 * torch.randn(OLD.shape, generator=g, dtype=torch.float64)
    advantages = torch.randn(OLD.shape, generator=g, dtype=torch.float64)
    masked = PolicyLoss(loss_agg_mode=agg, rollout_correction="token_mask", rollout_mask_band=(0.5, 2.0))
    loss = masked(log_probs, OLD, advantages, MASK, rollout_log_probs=ROLLOUT)
    # token_mask drops the first sequence's ratios 3 and 1/4: the same as a loss whose advantages
    # are 0 there (the token still counts in the normaliser), the other tokens weighted by r.
    w, _ = weights("token_mask")
    by_hand = PolicyLoss(loss_agg_mode=agg)(log_probs, OLD, advantages, MASK)
    plain_tokens, _ = get_policy_loss("ppo")(log_probs, OLD, advantages, MASK, PolicyLossConfig())
    from lightrft.algorithms.aggregation import aggregate_loss
    assert loss.item() == pytest.approx(aggregate_loss(plain_tokens * w, MASK, agg).item())
    assert loss.item() != pytest.approx(by_hand.item())


def test_mismatch_metrics_on_known_ratios():
    m = mismatch_metrics(OLD, ROLLOUT, MASK)
    d = torch.log(RATIOS)[MASK]
    assert m["mismatch_kl_k1"].item() == pytest.approx((-d).mean().item())
    assert m["mismatch_kl_k3"].item() == pytest.approx((d.exp() - 1 - d).mean().item())
    assert (m["rollout_ratio_max"].item(), m["rollout_ratio_min"].item()) == pytest.approx((3.0, 0.25))
    ratios = torch.tensor([0.25, 1.0, 1.0, 1.5, 3.0], dtype=torch.float64)
    assert m["rollout_ratio_p05"].item() == pytest.approx(torch.quantile(ratios, 0.05).item())
    assert m["rollout_ratio_p95"].item() == pytest.approx(torch.quantile(ratios, 0.95).item())
    agree = mismatch_metrics(OLD, OLD, MASK)
    assert agree["mismatch_kl_k1"].item() == 0.0 and agree["mismatch_kl_k3"].item() == 0.0
    assert agree["rollout_ratio_p05"].item() == agree["rollout_ratio_p95"].item() == 1.0
    # A micro-batch of padding only: neutral quantiles, every metric finite.
    empty = mismatch_metrics(OLD, ROLLOUT, torch.zeros_like(MASK))
    assert empty["rollout_ratio_p05"].item() == 1.0 and all(math.isfinite(v.item()) for v in empty.values())


BASE = ["--pretrain", "m", "--prompt_data", "p.jsonl", "--remote_rm_url", "math", "--advantage_estimator",
        "group_norm", "--n_samples_per_prompt", "4"]


def test_bad_settings_are_refused_naming_the_flag(capsys):
    for extra, message in ((["--rollout_correction", "bogus"], "--rollout_correction: invalid choice"),
                           (["--rollout_mask_band", "1.5", "2"], "--rollout_mask_band LOW HIGH needs 0 < LOW <= 1"),
                           (["--tis_cap", "0"], "--tis_cap")):
        with pytest.raises(SystemExit):
            train_ppo.parse_args(BASE + extra)
        assert message in capsys.readouterr().err, extra
    args = train_ppo.parse_args(BASE + ["--rollout_correction", "seq_mask", "--rollout_mask_band", "0.9", "1.1"])
    loss = PolicyLoss.from_algorithm(args.algorithm)
    assert (loss.rollout_correction, loss.rollout_mask_band) == ("seq_mask", (0.9, 1.1))
    with pytest.raises(ValueError, match="no rollout log-probs were given"):
        PolicyLoss(rollout_correction="geo_tis")(OLD, OLD, OLD, MASK)
