import math

import pytest
import torch

from lightrft.algorithms.aggregation import aggregate_loss
from lightrft.algorithms.policy_loss import POLICY_LOSSES, PolicyLossConfig, get_policy_loss

F64 = torch.float64


def t(rows):
    return torch.tensor(rows, dtype=F64)


def ppo(log_probs, old, adv, mask=None, **cfg):
    return get_policy_loss("ppo")(log_probs, old, adv, mask, PolicyLossConfig(**cfg))


# ratios r = exp(log_probs - old) with old = 0
RATIOS = t([[1.5, 0.9, 0.5, 1.1, 1.0, 5.0, 2.0]])
ADV = t([[1.0, 1.0, -1.0, -1.0, 2.0, -1.0, -1.0]])


def test_ppo_symmetric_clip_by_hand():
    log_probs = RATIOS.log().requires_grad_(True)
    loss, metrics = ppo(log_probs, torch.zeros_like(RATIOS), ADV)
    # -min(r A, clip(r, 0.8, 1.2) A):
    #   r=1.5 A=1: min(1.5, 1.2) -> -1.2      r=0.9 A=1: -0.9
    #   r=0.5 A=-1: min(-0.5, -0.8) -> 0.8    r=1.1 A=-1: min(-1.1, -1.1) -> 1.1
    #   r=1.0 A=2: -2                         r=5 A=-1: min(-5, -1.2) -> 5    r=2 A=-1: -> 2
    torch.testing.assert_close(loss, t([[-1.2, -0.9, 0.8, 1.1, -2.0, 5.0, 2.0]]))
    # d loss / d log r = -r A on the unclipped branch, 0 where the clipped branch is chosen
    loss.sum().backward()
    torch.testing.assert_close(log_probs.grad, t([[0.0, -0.9, 0.0, 1.1, -2.0, 5.0, 2.0]]))
    assert metrics["clip_frac_high"].item() == pytest.approx(1 / 7)  # r=1.5, A>0
    assert metrics["clip_frac_low"].item() == pytest.approx(1 / 7)  # r=0.5, A<0
    assert metrics["ratio_mean"].item() == pytest.approx(12.0 / 7)
    assert metrics["ratio_max"].item() == pytest.approx(5.0) and metrics["ratio_min"].item() == pytest.approx(0.5)
    # approx_kl: k3 of KL(pi_old || pi) = mean(r - 1 - log r)
    expected_kl = sum(r - 1 - math.log(r) for r in RATIOS[0].tolist()) / 7
    assert metrics["approx_kl"].item() == pytest.approx(expected_kl)
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())


def test_ppo_asymmetric_clip_higher_by_hand():
    loss, metrics = ppo(RATIOS.log(), torch.zeros_like(RATIOS), ADV, eps_clip_low=0.1, eps_clip_high=0.3)
    # clip range [0.9, 1.3]: r=1.5 A=1 -> -1.3; r=0.5 A=-1: min(-0.5, -0.9) -> 0.9; the rest as before
    torch.testing.assert_close(loss, t([[-1.3, -0.9, 0.9, 1.1, -2.0, 5.0, 2.0]]))
    assert metrics["clip_frac_low"].item() == pytest.approx(1 / 7)


def test_ppo_dual_clip_by_hand():
    log_probs = RATIOS.log().requires_grad_(True)
    loss, metrics = ppo(log_probs, torch.zeros_like(RATIOS), ADV, dual_clip=3.0)
    # A < 0 tokens are capped at -c A = 3: r=5 gives 5 -> 3; r=2 gives 2 (below the cap), unchanged
    torch.testing.assert_close(loss, t([[-1.2, -0.9, 0.8, 1.1, -2.0, 3.0, 2.0]]))
    loss.sum().backward()
    assert log_probs.grad[0, 5] == 0  # the cap is a constant
    assert metrics["dual_clip_frac"].item() == pytest.approx(1 / 7)


def test_gspo_by_hand():
    log_probs = t([[0.1, 0.3, 0.0], [-0.05, 0.05, 0.0]]).requires_grad_(True)
    old = torch.zeros(2, 3, dtype=F64)
    adv = t([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    cfg = PolicyLossConfig(eps_clip_low=0.1, eps_clip_high=0.1)
    loss, metrics = get_policy_loss("gspo")(log_probs, old, adv, mask, cfg)
    # s_0 = exp((0.1 + 0.3) / 2) = exp(0.2) = 1.2214 > 1.1, A = 1: clipped -> -1.1 on both tokens
    # s_1 = exp((-0.05 + 0.05 + 0) / 3) = 1, A = -1: loss 1, d loss / d log pi_t = -A s_1 = 1
    torch.testing.assert_close(loss, t([[-1.1, -1.1, 0.0], [1.0, 1.0, 1.0]]))
    loss.sum().backward()
    torch.testing.assert_close(log_probs.grad, t([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]))
    assert metrics["clip_frac_high"].item() == pytest.approx(2 / 5)
    assert metrics["ratio_max"].item() == pytest.approx(math.exp(0.2))


def sequence_level_gspo(log_probs, old, seq_adv, mask, eps_low, eps_high):
    """GSPO's sequence objective: mean_i -min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log ratio)."""
    m = mask.to(F64)
    s = torch.exp(((log_probs - old) * m).sum(-1) / m.sum(-1))
    surrogate = torch.minimum(s * seq_adv, s.clamp(1 - eps_low, 1 + eps_high) * seq_adv)
    return -surrogate.mean()


@pytest.mark.parametrize("seed", range(3))
def test_gspo_token_form_has_the_sequence_level_gradient(seed):
    gen = torch.Generator().manual_seed(seed)
    B, A = 6, 5
    old = -torch.rand(B, A, generator=gen, dtype=F64) * 3
    log_probs = (old + 0.2 * torch.randn(B, A, generator=gen, dtype=F64)).requires_grad_(True)
    mask = torch.ones(B, A, dtype=torch.bool)
    mask[:, 3:] = torch.rand(B, 2, generator=gen) < 0.5
    seq_adv = torch.randn(B, generator=gen, dtype=F64)
    cfg = PolicyLossConfig(eps_clip_low=0.05, eps_clip_high=0.08)  # some sequences clip, some do not
    per_token, _ = get_policy_loss("gspo")(log_probs, old, seq_adv[:, None].expand(B, A), mask, cfg)
    token_form = aggregate_loss(per_token, mask, "seq-mean-token-mean")
    (grad_token,) = torch.autograd.grad(token_form, log_probs)
    reference = sequence_level_gspo(log_probs, old, seq_adv, mask, 0.05, 0.08)
    (grad_reference,) = torch.autograd.grad(reference, log_probs)
    torch.testing.assert_close(token_form, reference)
    torch.testing.assert_close(grad_token, grad_reference)


def test_cispo_by_hand():
    log_probs = t([[-1.0, -2.0]]).requires_grad_(True)
    old = t([[-1.5, -1.0]])  # r = exp(0.5) = 1.6487 -> 1.28; r = exp(-1) = 0.3679 -> 0.8
    adv = t([[1.0, 2.0]])
    cfg = PolicyLossConfig(eps_clip_low=0.2, eps_clip_high=0.28)
    loss, metrics = get_policy_loss("cispo")(log_probs, old, adv, None, cfg)
    # -sg[clip(r)] A log pi: -1.28 * 1 * -1 = 1.28; -0.8 * 2 * -2 = 3.2
    torch.testing.assert_close(loss, t([[1.28, 3.2]]))
    loss.sum().backward()
    # every token keeps a gradient, -clip(r) A, even where the weight is clipped
    torch.testing.assert_close(log_probs.grad, t([[-1.28, -1.6]]))
    assert metrics["clip_frac_high"].item() == 0.5 and metrics["clip_frac_low"].item() == 0.5


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_truncated_importance_sampling_by_hand(name):
    log_probs = t([[-1.0, -1.0, -1.0]])
    old = t([[-1.0, -1.0, -1.0]])
    rollout = t([[-1.5, -0.5, -3.0]])
    adv = t([[1.0, -1.0, 2.0]])
    # w = min(exp(old - rollout), 2) = [exp(0.5), exp(-0.5), min(exp(2), 2) = 2]
    weights = t([[math.exp(0.5), math.exp(-0.5), 2.0]])
    base, _ = get_policy_loss(name)(log_probs, old, adv, None, PolicyLossConfig())
    loss, metrics = get_policy_loss(name)(log_probs, old, adv, None,
                                          PolicyLossConfig(rollout_log_probs=rollout, tis_cap=2.0))
    torch.testing.assert_close(loss, base * weights)
    assert metrics["tis_weight_mean"].item() == pytest.approx(weights.mean().item())
    assert metrics["tis_clip_frac"].item() == pytest.approx(1 / 3)


def loop_ppo(log_probs, old, adv, eps_low, eps_high, dual):
    out = []
    for lp_row, old_row, a_row in zip(log_probs.tolist(), old.tolist(), adv.tolist()):
        row = []
        for lp, o, a in zip(lp_row, old_row, a_row):
            r = math.exp(lp - o)
            loss = -min(r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a)
            if dual is not None and a < 0:
                loss = min(loss, -dual * a)
            row.append(loss)
        out.append(row)
    return t(out)


@pytest.mark.parametrize("seed", range(3))
def test_ppo_vectorised_equals_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(8, 10, generator=gen, dtype=F64) * 4
    log_probs = old + torch.randn(8, 10, generator=gen, dtype=F64)
    adv = torch.randn(8, 10, generator=gen, dtype=F64)
    for eps_low, eps_high, dual in [(0.2, 0.2, None), (0.2, 0.28, 3.0), (0.05, 0.5, 1.5)]:
        loss, _ = ppo(log_probs, old, adv, eps_clip_low=eps_low, eps_clip_high=eps_high, dual_clip=dual)
        torch.testing.assert_close(loss, loop_ppo(log_probs, old, adv, eps_low, eps_high, dual), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("garbage", [1e4, float("nan"), float("inf")])
def test_garbage_outside_mask_changes_nothing(name, garbage):
    gen = torch.Generator().manual_seed(3)
    B, A = 4, 6
    mask = torch.rand(B, A, generator=gen) < 0.7
    mask[1] = False  # an empty row
    old = -torch.rand(B, A, generator=gen, dtype=F64)
    log_probs = old + 0.1 * torch.randn(B, A, generator=gen, dtype=F64)
    adv = torch.randn(B, A, generator=gen, dtype=F64)
    rollout = old + 0.1 * torch.randn(B, A, generator=gen, dtype=F64)

    def run(fill):
        lp = log_probs.masked_fill(~mask, fill) if fill is not None else log_probs.clone()
        lp.requires_grad_(True)
        dirty = (lambda x: x.masked_fill(~mask, fill)) if fill is not None else (lambda x: x)
        cfg = PolicyLossConfig(eps_clip_low=0.1, eps_clip_high=0.2, rollout_log_probs=dirty(rollout), tis_cap=1.5)
        loss, metrics = get_policy_loss(name)(lp, dirty(old), dirty(adv), mask, cfg)
        aggregate_loss(loss, mask, "token-mean").backward()
        return loss, metrics, lp.grad

    clean_loss, clean_metrics, clean_grad = run(None)
    loss, metrics, grad = run(garbage)
    torch.testing.assert_close(loss, clean_loss)
    torch.testing.assert_close(grad, clean_grad)
    assert torch.all(loss[~mask] == 0) and torch.all(grad[~mask] == 0)
    for key in clean_metrics:
        torch.testing.assert_close(metrics[key], clean_metrics[key])


def test_bad_input():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"unknown --policy_loss 'grpo'; choose one of: cispo, gspo, ppo"):
        get_policy_loss("grpo")
    with pytest.raises(ValueError, match=r"advantages has shape \(2, 4\) but log_probs has shape \(2, 3\)"):
        ppo(x, x, torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"old_log_probs has shape \(3,\) but log_probs has shape \(2, 3\)"):
        ppo(x, torch.zeros(3), x)
    with pytest.raises(ValueError, match=r"action_mask has shape \(2, 2\)"):
        ppo(x, x, x, torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"rollout_log_probs has shape \(2, 1\)"):
        ppo(x, x, x, rollout_log_probs=torch.zeros(2, 1), tis_cap=2.0)
    with pytest.raises(ValueError, match=r"--rollout_correction token_tis \(or --tis_cap\) is set but no rollout log-probs"):
        ppo(x, x, x, tis_cap=2.0)
    with pytest.raises(ValueError, match="--dual_clip does not apply to --policy_loss cispo"):
        get_policy_loss("cispo")(x, x, x, None, PolicyLossConfig(dual_clip=3.0))
    with pytest.raises(ValueError, match="--dual_clip must be > 1"):
        PolicyLossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="--tis_cap must be > 0"):
        PolicyLossConfig(tis_cap=0.0)
    with pytest.raises(ValueError, match="--eps_clip_low_high must be >= 0|low clip range"):
        PolicyLossConfig(eps_clip_low=-0.1)
