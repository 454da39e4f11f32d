"""The math of reinforcement fine-tuning as pure torch functions: masked reductions, KL
estimators and controllers, advantage estimators, policy and value losses, loss aggregation,
log-probs and entropies from logits, supervised losses, global advantage whitening.

Pluggable axes are registries with one signature each (ADVANTAGE_ESTIMATORS, POLICY_LOSSES,
KL_ESTIMATORS); `docs/algorithms.md` lists every option with its formula and paper.
This package imports torch only.
"""

from lightrft.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageInputs,
    AdvantageOutputs,
    compute_advantages,
    discounted_returns,
    generalized_advantage_estimation,
    get_advantage_estimator,
    register_advantage_estimator,
    token_rewards_from_scores,
    validate_group_size,
)
from lightrft.algorithms.aggregation import (
    LOSS_AGG_MODES,
    aggregate_loss,
    check_loss_agg_mode,
    dp_loss_scale,
    loss_normalizers,
)
from lightrft.algorithms.kl import (
    KL_CLAMPS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    compute_approx_kl,
    get_kl_estimator,
    make_kl_controller,
    register_kl_estimator,
)
from lightrft.algorithms.logprobs import entropy_from_logits, log_probs_from_logits
from lightrft.algorithms.losses import pairwise_loss, sft_token_loss
from lightrft.algorithms.masked import masked_max, masked_mean, masked_min, masked_sum, masked_var, masked_whiten
from lightrft.algorithms.policy_loss import (
    POLICY_LOSSES,
    PolicyLossConfig,
    get_policy_loss,
    register_policy_loss,
)
from lightrft.algorithms.value_loss import clipped_value_loss
from lightrft.algorithms.whitening import whiten, whiten_with_moments, whitening_moments

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "AdvantageInputs",
    "AdvantageOutputs",
    "FixedKLController",
    "KL_CLAMPS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "PolicyLossConfig",
    "aggregate_loss",
    "check_loss_agg_mode",
    "clipped_value_loss",
    "compute_advantages",
    "compute_approx_kl",
    "discounted_returns",
    "dp_loss_scale",
    "entropy_from_logits",
    "generalized_advantage_estimation",
    "get_advantage_estimator",
    "get_kl_estimator",
    "get_policy_loss",
    "log_probs_from_logits",
    "loss_normalizers",
    "make_kl_controller",
    "masked_max",
    "masked_mean",
    "masked_min",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "pairwise_loss",
    "register_advantage_estimator",
    "register_kl_estimator",
    "register_policy_loss",
    "sft_token_loss",
    "token_rewards_from_scores",
    "validate_group_size",
    "whiten",
    "whiten_with_moments",
    "whitening_moments",
]
