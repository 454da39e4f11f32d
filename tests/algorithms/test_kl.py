import math

import pytest
import torch

from lightrft.algorithms.kl import (
    KL_CLAMPS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    compute_approx_kl,
    make_kl_controller,
)

F64 = torch.float64
# d = log_probs - base = [0.5, -0.5, 0, 12]; the default clamp bounds each estimate to [-10, 10]
LOG_PROBS = torch.tensor([[0.5, -0.2, 0.0, 3.0]], dtype=F64)
BASE = torch.tensor([[0.0, 0.3, 0.0, -9.0]], dtype=F64)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("k1", [0.5, -0.5, 0.0, 10.0]),
        ("k2", [0.5**2 / 2, 0.5**2 / 2, 0.0, 10.0]),  # 12^2 / 2 = 72 -> 10
        # exp(-d) - 1 + d; 11.000006 at d = 12 -> 10
        ("k3", [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5, 0.0, 10.0]),
    ],
)
def test_estimators_by_hand(name, expected):
    out = compute_approx_kl(LOG_PROBS, BASE, kl_estimator=name)
    torch.testing.assert_close(out, torch.tensor([expected], dtype=F64))


# Values and gradients d/dd at d = -10, -5, 0, 5, 10 for every clamp, written out by hand
# (the table of docs/algorithms.md). k3 = e^-d - 1 + d, k3' = 1 - e^-d; k2 = d^2 / 2, k2' = d.
E5, E10 = math.exp(5), math.exp(10)
K3 = [E10 - 11, E5 - 6, 0.0, math.exp(-5) + 4, math.exp(-10) + 9]
K3_GRAD = [1 - E10, 1 - E5, 0.0, 1 - math.exp(-5), 1 - math.exp(-10)]
CLAMP_TABLE = {
    ("k1", "log_ratio"): ([-10, -5, 0, 5, 10], [1, 1, 1, 1, 1]),
    ("k1", "estimate"): ([-10, -5, 0, 5, 10], [1, 1, 1, 1, 1]),
    ("k1", "scale"): ([-10, -5, 0, 5, 10], [1, 1, 1, 1, 1]),
    ("k2", "log_ratio"): ([50, 12.5, 0, 12.5, 50], [-10, -5, 0, 5, 10]),
    # OpenRLHF clamps k2 at 10 (verl does not clamp it): no gradient past |d| = sqrt(20)
    ("k2", "estimate"): ([10, 10, 0, 10, 10], [0, 0, 0, 0, 0]),
    # the gradient of k2 times 10 / k2: -10 * 10/50 = -2, -5 * 10/12.5 = -4
    ("k2", "scale"): ([10, 10, 0, 10, 10], [-2, -4, 0, 4, 2]),
    ("k3", "log_ratio"): (K3, K3_GRAD),
    # verl's low_var_kl and OpenRLHF: 10 with gradient 0 wherever pi_ref / pi > 13.6
    ("k3", "estimate"): ([10, 10, 0, K3[3], K3[4]], [0, 0, 0, K3_GRAD[3], K3_GRAD[4]]),
    ("k3", "scale"): ([10, 10, 0, K3[3], K3[4]],
                      [K3_GRAD[0] * 10 / K3[0], K3_GRAD[1] * 10 / K3[1], 0, K3_GRAD[3], K3_GRAD[4]]),
}


@pytest.mark.parametrize("name, clamp", sorted(CLAMP_TABLE))
def test_clamp_values_and_gradients_at_the_documented_points(name, clamp):
    value, grad = CLAMP_TABLE[(name, clamp)]
    log_probs = torch.tensor([[-10.0, -5.0, 0.0, 5.0, 10.0]], dtype=F64, requires_grad=True)
    out = compute_approx_kl(log_probs, torch.zeros(1, 5, dtype=F64), kl_estimator=name, clamp=clamp)
    out.sum().backward()
    torch.testing.assert_close(out.detach(), torch.tensor([value], dtype=F64))
    torch.testing.assert_close(log_probs.grad, torch.tensor([grad], dtype=F64))


def test_default_clamp_bounds_the_k3_value_and_keeps_a_restoring_gradient():
    # k3 at d = -5 was 142.4 with gradient -147.4 (d clamped at 10 only); the default is bounded at 10
    # like the peers' and, unlike theirs, keeps a gradient of the right sign: -147.41 * 10 / 142.41.
    log_probs = torch.tensor([[-5.0]], dtype=F64, requires_grad=True)
    out = compute_approx_kl(log_probs, torch.zeros(1, 1, dtype=F64), kl_estimator="k3")
    out.sum().backward()
    assert out.item() == pytest.approx(10.0)
    assert log_probs.grad.item() == pytest.approx(-10.3511, abs=1e-4)
    assert KL_CLAMPS == ("scale", "estimate", "log_ratio")
    with pytest.raises(ValueError, match=r"unknown --kl_clamp 'value'; choose one of: scale, estimate, log_ratio"):
        compute_approx_kl(log_probs, log_probs, kl_estimator="k3", clamp="value")


def test_k1_and_k3_are_unbiased_estimators_of_kl_pi_to_ref():
    """E_{y~pi}[k(d(y))] over a categorical distribution, computed exactly, equals
    KL(pi || pi_ref) for k1 and k3; a sign error in k3 (exp(d) - 1 - d) would give KL(pi_ref || pi)
    weighted wrongly and fail this."""
    gen = torch.Generator().manual_seed(0)
    log_pi = torch.log_softmax(torch.randn(7, generator=gen, dtype=F64), -1)
    log_ref = torch.log_softmax(torch.randn(7, generator=gen, dtype=F64), -1)
    kl = (log_pi.exp() * (log_pi - log_ref)).sum()
    for name in ("k1", "k3"):
        estimate = compute_approx_kl(log_pi[None], log_ref[None], kl_estimator=name)[0]
        torch.testing.assert_close((log_pi.exp() * estimate).sum(), kl)
    k2 = compute_approx_kl(log_pi[None], log_ref[None], kl_estimator="k2")[0]
    assert (k2 >= 0).all() and (log_pi.exp() * k2).sum() != pytest.approx(kl.item())


def test_k3_gradient():
    # d/dlog_probs (exp(-d) - 1 + d) = 1 - exp(-d)
    log_probs = LOG_PROBS[:, :3].clone().requires_grad_(True)
    compute_approx_kl(log_probs, BASE[:, :3], kl_estimator="k3").sum().backward()
    d = torch.tensor([[0.5, -0.5, 0.0]], dtype=F64)
    torch.testing.assert_close(log_probs.grad, 1 - torch.exp(-d))


def test_masked_positions_are_zero_and_garbage_changes_nothing():
    mask = torch.tensor([[1, 0, 1, 0]])
    dirty_lp = LOG_PROBS.masked_fill(~mask.bool(), float("nan")).requires_grad_(True)
    dirty_base = BASE.masked_fill(~mask.bool(), float("inf"))
    for name in KL_ESTIMATORS:
        out = compute_approx_kl(dirty_lp, dirty_base, mask, name)
        assert out[0, 1] == 0 and out[0, 3] == 0
        torch.testing.assert_close(out[mask.bool()], compute_approx_kl(LOG_PROBS, BASE, None, name)[mask.bool()])
        out.sum().backward()
        assert torch.isfinite(dirty_lp.grad).all()


def test_bad_input():
    with pytest.raises(ValueError, match=r"unknown --kl_estimator 'k4'; choose one of: k1, k2, k3"):
        compute_approx_kl(LOG_PROBS, BASE, kl_estimator="k4")
    with pytest.raises(ValueError, match=r"base_log_probs has shape \(1, 3\) but log_probs has shape \(1, 4\)"):
        compute_approx_kl(LOG_PROBS, BASE[:, :3])


def test_fixed_controller():
    controller = FixedKLController(0.05)
    controller.update(current_kl=100.0, n_steps=1000)
    assert controller.value == 0.05
    restored = FixedKLController(1.0)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == 0.05


def test_adaptive_controller_by_hand():
    controller = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    controller.update(current_kl=9.0, n_steps=256)  # 9/6 - 1 = 0.5 -> clipped to 0.2
    assert controller.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    controller.update(current_kl=5.4, n_steps=1000)  # 5.4/6 - 1 = -0.1
    assert controller.value == pytest.approx(0.1 * 1.00512 * (1 - 0.1 * 1000 / 10000))
    controller.update(current_kl=0.0, n_steps=500)  # -1 -> clipped to -0.2
    assert controller.value == pytest.approx(0.1 * 1.00512 * 0.99 * (1 - 0.2 * 500 / 10000))


def test_adaptive_controller_state_round_trip():
    controller = AdaptiveKLController(0.1, 6.0, 10000)
    for kl in (9.0, 3.0, 7.0):
        controller.update(kl, 128)
    restored = AdaptiveKLController(0.1, 6.0, 10000)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == controller.value != 0.1
    controller.update(8.0, 64)
    restored.update(8.0, 64)
    assert restored.value == controller.value


def test_controller_factory_and_errors():
    assert isinstance(make_kl_controller(0.01), FixedKLController)
    assert isinstance(make_kl_controller(0.01, kl_target=6.0, kl_horizon=100), AdaptiveKLController)
    with pytest.raises(ValueError, match="--kl_target must be > 0"):
        AdaptiveKLController(0.1, 0.0, 100)
    with pytest.raises(ValueError, match="--kl_horizon must be > 0"):
        AdaptiveKLController(0.1, 1.0, 0)
    with pytest.raises(ValueError, match="--init_kl_coef must be >= 0"):
        FixedKLController(-1.0)


def test_trainer_reexports_the_controllers():
    import lightrft.trainer

    assert lightrft.trainer.AdaptiveKLController is AdaptiveKLController
    assert lightrft.trainer.FixedKLController is FixedKLController
