"""One prompt forward for the samples that share it.

GRPO-style runs sample G responses per prompt, and a padded micro-batch holds the G rows of a
prompt with identical prompt columns. `shared_prompt_forward` computes each distinct prompt once
(with a KV cache) and the responses of every row on top of its prompt's cache: the same function
as a forward over the whole rows, with the prompt's matrix work done once instead of G times, in
the training forward and its backward (the prompt's gradient sums over its rows) and in the
scoring forwards alike.

Rows are grouped by content, not by bookkeeping: rows whose first T - A columns (ids and
attention mask) are equal share, whatever order a shuffled replay buffer put them in, and a
micro-batch without repeats takes the plain forward.
"""

import torch
from torch import nn

from lightrft.utils.hf_api import activation_checkpointing_on, cache_argument, returned_cache


class PromptSharingUnsupported(RuntimeError):
    """The model returned no KV cache that can be indexed by row (a custom module, a model
    without a cache): its prompts cannot be shared."""


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(first, inverse): `first` (U,) the first row of each distinct prompt, `inverse` (B,) which
    distinct prompt each row has; None when no two rows share a prompt.
    Shape: prompt_ids, prompt_mask (B, P)"""
    keys = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)  # (B, 2P)
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)
    distinct = int(inverse.max()) + 1
    if distinct == keys.size(0):
        return None
    rows = torch.arange(keys.size(0), device=keys.device)
    first = torch.full((distinct,), keys.size(0), device=keys.device, dtype=rows.dtype)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")
    return first, inverse


def sharing_possible(model: nn.Module) -> bool:
    """False where a KV cache would be dropped: transformers' activation-checkpointed layers
    discard the cache in training mode."""
    return not (model.training and activation_checkpointing_on(model))


def shared_prompt_forward(model: nn.Module, kwargs: dict, num_actions: int):
    """The model output over padded rows whose logits are those predicting the last `num_actions`
    tokens of each row ((B, A, V), like a plain forward with `logits_to_keep=A + 1` minus its last
    position), computed with one prompt forward per distinct prompt; None when no rows share a
    prompt (the caller runs the plain forward). Raises `PromptSharingUnsupported` when the model
    returns no cache it can index by row, or when the response forward did not continue the
    prompt's cache (a forward that swallows a cache argument it does not know would otherwise
    give the responses' log-probs without their prompts, with no error).

    `kwargs` are `padded_forward_kwargs`: input_ids (B, T), attention_mask, position_ids.
    """
    input_ids = kwargs["input_ids"]
    prompt_len = input_ids.size(1) - num_actions
    if prompt_len < 1 or input_ids.size(0) < 2:
        return None
    attention_mask = kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(input_ids.size(1), device=input_ids.device).expand_as(input_ids)
    groups = prompt_groups(input_ids[:, :prompt_len], attention_mask[:, :prompt_len])
    if groups is None:
        return None
    first, inverse = groups
    name = cache_argument(model)
    prompt = model(input_ids=input_ids[first, :prompt_len], attention_mask=attention_mask[first, :prompt_len],
                   position_ids=position_ids[first, :prompt_len], use_cache=True, logits_to_keep=1)
    cache = returned_cache(prompt, name)
    if cache is None or not hasattr(cache, "batch_select_indices"):
        raise PromptSharingUnsupported(f"{type(model).__name__} returned no KV cache that can be indexed by row")
    cache.batch_select_indices(inverse)  # (U, ...) -> (B, ...); the backward sums over a prompt's rows
    output = model(input_ids=input_ids[:, prompt_len:], attention_mask=attention_mask,
                   position_ids=position_ids[:, prompt_len:], use_cache=True, logits_to_keep=num_actions,
                   **{name: cache})
    if returned_cache(output, name) is not cache:
        raise PromptSharingUnsupported(f"{type(model).__name__}'s forward did not continue the prompt's KV cache "
                                       f"passed as `{name}`")
    # The prompt's last position predicts the first action; the response's positions the rest.
    output.logits = torch.cat([prompt.logits[inverse], output.logits[:, :-1]], dim=1)  # (B, A, V)
    setattr(output, name, None)
    return output
