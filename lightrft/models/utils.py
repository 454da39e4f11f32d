"""Helpers the model wrappers and trainers share: log-probs from logits, masked means, KL
estimates (re-exported from `lightrft.algorithms`) and splitting packed rows."""

import functools
import inspect

from torch import Tensor, nn

from lightrft.algorithms.advantages import token_rewards_from_scores
from lightrft.algorithms.kl import compute_approx_kl
from lightrft.algorithms.logprobs import entropy_from_logits, log_probs_from_logits
from lightrft.algorithms.masked import masked_mean

__all__ = [
    "compute_approx_kl",
    "compute_reward",
    "entropy_from_logits",
    "log_probs_from_logits",
    "masked_mean",
    "unpacking_samples",
]


def unpacking_samples(values: Tensor, packed_seq_lens: list[int]) -> list[Tensor]:
    """Splits a packed row into its sequences: piece i holds the packed_seq_lens[i] values of
    sequence i, in order. Padding after the last sequence is dropped. Pieces are views.
    Shape: values (1, P) or (P,) -> list of N tensors (packed_seq_lens[i],)."""
    if values.dim() == 2 and values.shape[0] == 1:
        values = values[0]  # (1, P) -> (P,)
    if values.dim() != 1:
        raise ValueError(f"packed values must have shape (1, P) or (P,); got shape {tuple(values.shape)}")
    if any(length < 0 for length in packed_seq_lens):
        raise ValueError(f"packed_seq_lens must be non-negative; got {list(packed_seq_lens)}")
    total = sum(packed_seq_lens)
    if total > values.shape[0]:
        raise ValueError(
            f"packed_seq_lens sum to {total} but the packed row has only {values.shape[0]} values "
            f"(shape {tuple(values.shape)})"
        )
    return list(values[:total].split(list(packed_seq_lens)))


def compute_reward(
    r: Tensor, kl_coef: float, kl: Tensor | None = None, action_mask: Tensor | None = None
) -> Tensor:
    """Per-token rewards -kl_coef * kl_t with the sequence reward r added on the last action
    token (see `lightrft.algorithms.advantages.token_rewards_from_scores`).
    Shape: r (B,), kl, action_mask (B, A) -> (B, A)."""
    if action_mask is None:
        if kl is None:
            raise ValueError("compute_reward needs action_mask or kl to know the response length")
        action_mask = kl.new_ones(kl.shape, dtype=bool)
    return token_rewards_from_scores(r, action_mask, kl, kl_coef)


def accepts_keyword(model: nn.Module, name: str) -> bool:
    """Whether the forward of `model` (looked through DeepSpeed engines' `.module`) takes the
    keyword `name`, by name or through `**kwargs`: the trainers pass optional arguments such as
    `prompt_groups` only to models that take them, so a custom module keeps working."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    forward = model.forward
    return _accepts(getattr(forward, "__func__", forward), name)


@functools.lru_cache(maxsize=256)
def _accepts(forward, name: str) -> bool:
    parameters = inspect.signature(forward).parameters
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
