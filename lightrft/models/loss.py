"""Loss modules used by the trainers: thin `nn.Module` fronts over `lightrft.algorithms`.

They keep the call conventions of the original design (`PolicyLoss(eps_clip)(log_probs,
old_log_probs, advantages, action_mask)` ...) and add the algorithm choices as keyword options.
See `lightrft.algorithms.aggregation` for the global normalisers and the DeepSpeed scaling.
"""

from torch import Tensor, nn

from lightrft.algorithms.aggregation import aggregate_loss, check_loss_agg_mode
from lightrft.algorithms.checks import check_same_shape
from lightrft.algorithms.losses import pairwise_loss, sft_token_loss
from lightrft.algorithms.masked import as_bool_mask
from lightrft.algorithms.policy_loss import PolicyLossConfig, get_policy_loss
from lightrft.algorithms.rollout_correction import DEFAULT_BAND
from lightrft.algorithms.value_loss import clipped_value_loss


class PolicyLoss(nn.Module):
    """Actor loss: a `--policy_loss` variant (ppo, gspo, cispo), then `--loss_agg_mode`.

    eps_clip: symmetric clip range; eps_clip_low_high=(low, high) overrides it (DAPO clip-higher,
    `--eps_clip_low_high 0.2 0.28`). dual_clip: c > 1 bounds the loss of negative advantages by
    c * |A|. tis_cap: truncated importance-sampling cap against rollout-engine log-probs;
    rollout_correction: another correction mode (`lightrft.algorithms.rollout_correction`: token or
    sequence, truncated or masked, ratios or their geometric mean), rollout_mask_band the [L, H] of
    the masking modes."""

    def __init__(
        self,
        eps_clip: float = 0.2,
        *,
        policy_loss: str = "ppo",
        eps_clip_low_high: tuple[float, float] | None = None,
        dual_clip: float | None = None,
        loss_agg_mode: str = "token-mean",
        tis_cap: float | None = None,
        rollout_correction: str | None = None,
        rollout_mask_band: tuple[float, float] = DEFAULT_BAND,
    ):
        super().__init__()
        self.loss_fn = get_policy_loss(policy_loss)
        check_loss_agg_mode(loss_agg_mode)
        if eps_clip_low_high is None:
            eps_clip_low_high = (eps_clip, eps_clip)
        elif len(eps_clip_low_high) != 2:
            raise ValueError(f"--eps_clip_low_high takes two values, LOW HIGH; got {eps_clip_low_high!r}")
        if dual_clip is not None and not self.loss_fn.supports_dual_clip:
            raise ValueError(f"--dual_clip does not apply to --policy_loss {policy_loss}; unset it")
        self.policy_loss = policy_loss
        self.eps_clip_low, self.eps_clip_high = (float(e) for e in eps_clip_low_high)
        self.dual_clip = dual_clip
        self.loss_agg_mode = loss_agg_mode
        self.tis_cap = tis_cap
        self.rollout_correction, self.rollout_mask_band = rollout_correction, tuple(rollout_mask_band)
        self._config(None)  # invalid clip / dual clip / cap values fail here, at construction

    def _config(self, rollout_log_probs: Tensor | None) -> PolicyLossConfig:
        return PolicyLossConfig(
            eps_clip_low=self.eps_clip_low,
            eps_clip_high=self.eps_clip_high,
            dual_clip=self.dual_clip,
            rollout_log_probs=rollout_log_probs,
            tis_cap=self.tis_cap,
            rollout_correction=self.rollout_correction,
            rollout_mask_band=self.rollout_mask_band,
        )

    def forward(
        self,
        log_probs: Tensor,
        old_log_probs: Tensor,
        advantages: Tensor,
        action_mask: Tensor | None = None,
        entropy_mask: Tensor | None = None,
        *,
        rollout_log_probs: Tensor | None = None,
        global_num_tokens: Tensor | float | None = None,
        global_num_seqs: Tensor | float | None = None,
        norm_len: float | None = None,
        return_metrics: bool = False,
    ) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        """Scalar loss (and detached metrics with return_metrics).

        entropy_mask (B, A), optional: the tokens that train, on top of action_mask, e.g. the
        high-entropy "forking" tokens of Wang et al. 2025 (arXiv 2506.01939); global_num_tokens
        must then count the tokens kept by both masks.
        Shape: log_probs, old_log_probs, advantages, action_mask, entropy_mask,
        rollout_log_probs (B, A) -> scalar."""
        mask = as_bool_mask(action_mask, log_probs)
        if entropy_mask is not None:
            check_same_shape("log_probs", log_probs, entropy_mask=entropy_mask)
            mask = mask & as_bool_mask(entropy_mask, log_probs)
        per_token, metrics = self.loss_fn(
            log_probs, old_log_probs, advantages, mask, self._config(rollout_log_probs)
        )
        loss = aggregate_loss(per_token, mask, self.loss_agg_mode, global_num_tokens, global_num_seqs, norm_len)
        return (loss, metrics) if return_metrics else loss

    @classmethod
    def from_algorithm(cls, algo) -> "PolicyLoss":
        """The policy loss of an `AlgorithmConfig` (--policy_loss, clipping, --tis_cap, aggregation)."""
        return cls(algo.eps_clip, policy_loss=algo.policy_loss,
                   eps_clip_low_high=algo.eps_clip_low_high or (algo.eps_clip, algo.eps_clip), dual_clip=algo.dual_clip,
                   loss_agg_mode=algo.loss_agg_mode, tis_cap=algo.tis_cap,
                   rollout_correction=algo.rollout_correction, rollout_mask_band=algo.rollout_mask_band)


class ValueLoss(nn.Module):
    """Critic loss: clipped PPO value loss (value_clip=None: unclipped), then `--loss_agg_mode`."""

    def __init__(self, value_clip: float | None = None, *, loss_agg_mode: str = "token-mean"):
        super().__init__()
        check_loss_agg_mode(loss_agg_mode)
        if value_clip is not None and value_clip <= 0:
            raise ValueError(f"--value_clip must be > 0 or unset; got {value_clip}")
        self.value_clip = value_clip
        self.loss_agg_mode = loss_agg_mode

    def forward(
        self,
        values: Tensor,
        old_values: Tensor,
        returns: Tensor,
        action_mask: Tensor | None = None,
        *,
        global_num_tokens: Tensor | float | None = None,
        global_num_seqs: Tensor | float | None = None,
        norm_len: float | None = None,
        return_metrics: bool = False,
    ) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        """Scalar loss (and detached metrics with return_metrics).
        Shape: values, old_values, returns, action_mask (B, A) -> scalar."""
        per_token, metrics = clipped_value_loss(
            values, old_values, returns, self.value_clip, action_mask, return_metrics=True
        )
        loss = aggregate_loss(per_token, action_mask, self.loss_agg_mode, global_num_tokens, global_num_seqs, norm_len)
        return (loss, metrics) if return_metrics else loss

    @classmethod
    def from_algorithm(cls, algo) -> "ValueLoss":
        """The value loss of an `AlgorithmConfig` (--value_clip, aggregation)."""
        return cls(algo.value_clip, loss_agg_mode=algo.loss_agg_mode)


class GPTLMLoss(nn.Module):
    """Next-token language-model loss: logits[:, t] predicts labels[:, t + 1]; mean NLL over the
    labels that are not ignore_index (0 if none).
    Shape: logits (B, T, V), labels (B, T) -> scalar."""

    def __init__(self, ignore_index: int = -100):
        super().__init__()
        self.ignore_index = ignore_index

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        if tuple(labels.shape) != tuple(logits.shape[:-1]):
            raise ValueError(
                f"labels has shape {tuple(labels.shape)} but logits has shape {tuple(logits.shape)}; "
                f"labels must have shape {tuple(logits.shape[:-1])}"
            )
        # drop the last logit (nothing to predict) and the first label (nothing predicts it)
        return sft_token_loss(logits[:, :-1], labels[:, 1:], self.ignore_index)


class PairWiseLoss(nn.Module):
    """Reward-model loss mean -log sigmoid(chosen - rejected - margin).
    Shape: chosen, rejected, margin (B,) -> scalar."""

    def forward(self, chosen_reward: Tensor, reject_reward: Tensor, margin: Tensor | float | None = None) -> Tensor:
        return pairwise_loss(chosen_reward, reject_reward, margin)


__all__ = ["GPTLMLoss", "PairWiseLoss", "PolicyLoss", "ValueLoss"]
