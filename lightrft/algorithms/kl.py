"""KL penalty between the policy and the reference model: per-token estimators and the
controllers that set the penalty coefficient beta.

Estimators follow J. Schulman, "Approximating KL Divergence" (2020), on the per-token log-ratio
d = log pi(y_t) - log pi_ref(y_t) of tokens sampled from pi, estimating KL(pi || pi_ref):

    k1 = d                       unbiased, high variance, negative on some tokens
    k2 = d^2 / 2                 biased, low variance, always >= 0
    k3 = exp(-d) - 1 + d         unbiased, low variance, always >= 0 (r - 1 - log r with
                                 r = pi_ref / pi = exp(-d))

Clamps (`KL_CLAMPS`, `--kl_clamp`), all bounding one token's estimate to [-10, 10] except
`log_ratio`:

    scale       (default) the value is clamped to [-10, 10] as verl and OpenRLHF do, and where it is
                clamped the gradient is the estimator's, scaled by the same factor 10 / |k|: the most
                drifted tokens keep a bounded gradient that points back towards the reference
                (k3 at d = -5: value 10, gradient -10.35) instead of none.
    estimate    the value is clamped to [-10, 10] and the gradient is 0 beyond it: verl's
                `low_var_kl` (k3 only) and OpenRLHF's `compute_approx_kl` (k1, k2, k3). For k3 this
                drops the gradient of every token with pi_ref / pi > 13.6 (d < -2.61).
    log_ratio   d is clamped to [-10, 10] before the estimator: k3 reaches exp(10) - 11 = 22015 at
                d = -10, so one token can dominate a batch; the gradient is 0 beyond |d| = 10.

In every mode d is first clamped to [-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP] = [-20, 20] (verl's
numerical guard), so exp(-d) stays finite in float32. Values at d = -10, -5, 0, 5, 10 (docs/algorithms.md):

    k1  scale, estimate, log_ratio:  -10, -5, 0, 5, 10
    k2  scale, estimate:              10, 10, 0, 10, 10      log_ratio: 50, 12.5, 0, 12.5, 50
    k3  scale, estimate:              10, 10, 0, 4.0067, 9.0000   log_ratio: 22015.5, 142.41, 0, 4.0067, 9.0000
"""

from collections.abc import Callable

import torch
from torch import Tensor

from lightrft.algorithms.checks import check_same_shape
from lightrft.algorithms.masked import fill_masked

KL_LOG_RATIO_CLAMP = 20.0  # |d| bound of every mode (exp(-d) finite); `log_ratio` clamps d to KL_VALUE_CLAMP
KL_VALUE_CLAMP = 10.0  # |estimate| bound of `scale` and `estimate`; |d| bound of `log_ratio`
KL_CLAMPS = ("scale", "estimate", "log_ratio")

KLEstimatorFn = Callable[[Tensor], Tensor]

# name -> fn(log_ratio d (B, A)) -> per-token KL estimate (B, A); filled by register_kl_estimator.
KL_ESTIMATORS: dict[str, KLEstimatorFn] = {}


def register_kl_estimator(name: str) -> Callable[[KLEstimatorFn], KLEstimatorFn]:
    """Decorator adding `fn(d) -> estimate` (elementwise, d = log pi - log pi_ref) to KL_ESTIMATORS
    under `name`, selectable with `--kl_estimator name`."""

    def register(fn: KLEstimatorFn) -> KLEstimatorFn:
        if name in KL_ESTIMATORS:
            raise ValueError(f"a KL estimator named {name!r} is already registered")
        KL_ESTIMATORS[name] = fn
        return fn

    return register


def get_kl_estimator(name: str) -> KLEstimatorFn:
    if name not in KL_ESTIMATORS:
        raise ValueError(f"unknown --kl_estimator {name!r}; choose one of: {', '.join(sorted(KL_ESTIMATORS))}")
    return KL_ESTIMATORS[name]


@register_kl_estimator("k1")
def kl_k1(log_ratio: Tensor) -> Tensor:
    """k1 = d (Schulman 2020)."""
    return log_ratio


@register_kl_estimator("k2")
def kl_k2(log_ratio: Tensor) -> Tensor:
    """k2 = d^2 / 2 (Schulman 2020)."""
    return log_ratio.square() / 2


@register_kl_estimator("k3")
def kl_k3(log_ratio: Tensor) -> Tensor:
    """k3 = exp(-d) - 1 + d (Schulman 2020), written with expm1 for accuracy near d = 0."""
    return torch.expm1(-log_ratio) + log_ratio


def compute_approx_kl(
    log_probs: Tensor,
    base_log_probs: Tensor,
    action_mask: Tensor | None = None,
    kl_estimator: str = "k1",
    clamp: str = "scale",
) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi.

    d = log_probs - base_log_probs, then k1/k2/k3 bounded as `clamp` says (module docstring:
    `scale`, `estimate` or `log_ratio`); positions outside action_mask are 0. Differentiable in
    both inputs (use it as a KL loss as well).
    Shape: log_probs, base_log_probs, action_mask (B, A) -> (B, A)."""
    check_same_shape("log_probs", log_probs, base_log_probs=base_log_probs, action_mask=action_mask)
    estimator = get_kl_estimator(kl_estimator)
    if clamp not in KL_CLAMPS:
        raise ValueError(f"unknown --kl_clamp {clamp!r}; choose one of: {', '.join(KL_CLAMPS)}")
    log_ratio = fill_masked(log_probs, action_mask) - fill_masked(base_log_probs, action_mask)
    bound = KL_VALUE_CLAMP if clamp == "log_ratio" else KL_LOG_RATIO_CLAMP
    estimate = estimator(log_ratio.clamp(-bound, bound))
    if clamp == "estimate":
        estimate = estimate.clamp(-KL_VALUE_CLAMP, KL_VALUE_CLAMP)
    elif clamp == "scale":
        # k * sg[min(1, 10 / |k|)]: the value of the clamp, the gradient of k shrunk by the same factor.
        factor = (KL_VALUE_CLAMP / estimate.detach().abs().clamp(min=KL_VALUE_CLAMP))
        estimate = estimate * factor
    return fill_masked(estimate, action_mask)


class FixedKLController:
    """A constant KL coefficient beta = kl_coef (`--init_kl_coef` without `--kl_target`)."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"--init_kl_coef must be >= 0; got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt; present so both controllers are called the same way."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019, "Fine-Tuning Language Models from Human
    Preferences" (section 2.2): after a rollout of n_steps samples with measured KL,

        e = clip(KL / target - 1, -0.2, 0.2)
        beta <- beta * (1 + e * n_steps / horizon)

    so beta grows while the policy drifts further than `target` nats from the reference and
    shrinks while it stays closer. Flags: `--init_kl_coef`, `--kl_target`, `--kl_horizon`."""

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if init_kl_coef < 0:
            raise ValueError(f"--init_kl_coef must be >= 0; got {init_kl_coef}")
        if target <= 0:
            raise ValueError(f"--kl_target must be > 0 for the adaptive KL controller; got {target}")
        if horizon <= 0:
            raise ValueError(f"--kl_horizon must be > 0; got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        """The adapted coefficient; target and horizon are configuration and come from the flags
        of the resumed run (they are listed for inspection only)."""
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


def make_kl_controller(init_kl_coef: float, kl_target: float | None = None, kl_horizon: float = 10000):
    """The adaptive controller when `kl_target` is given, else the fixed one."""
    if kl_target is None:
        return FixedKLController(init_kl_coef)
    return AdaptiveKLController(init_kl_coef, kl_target, kl_horizon)
