"""One prompt forward for the samples that share it, in padded batches and in packed rows.

GRPO-style runs sample G responses per prompt, and a padded micro-batch holds the G rows of a
prompt with identical prompt columns. `shared_prompt_forward` computes each distinct prompt once
(with a KV cache) and the responses of every row on top of its prompt's cache: the same function
as a forward over the whole rows, with the prompt's matrix work done once instead of G times, in
the training forward and its backward (the prompt's gradient sums over its rows) and in the
scoring forwards alike.

Rows are grouped by content, not by bookkeeping: rows whose first T - A columns (ids and
attention mask) are equal share, whatever order a shuffled replay buffer put them in, and a
micro-batch without repeats takes the plain forward.

Packed rows (`PackedPromptSharing`) need no cache: the row is rebuilt with each distinct prompt
once (`packing.SharedPromptLayout`) and the attention (`attention.varlen_attention`) lets every
response see its prompt, so it works with gradient checkpointing too. The groups come from the
sequences' contents on the host (`packing.prompt_group_ids`, at collate time).
"""

import logging
from collections.abc import Callable

import torch
from torch import nn

from lightrft.models.families import family_of
from lightrft.models.attention import VARLEN_ATTENTION, VARLEN_SDPA_LEGACY
from lightrft.models.packing import SharedPromptLayout, pack_padded, shared_prompt_layout
from lightrft.utils.hf_api import activation_checkpointing_on, cache_argument, recurrent_cache_layer, returned_cache

logger = logging.getLogger(__name__)


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


def shared_prompt_forward(model: nn.Module, kwargs: dict, num_actions: int, field: str = "logits"):
    """The model output over padded rows whose logits are those predicting the last `num_actions`
    tokens of each row ((B, A, V), like a plain forward with `logits_to_keep=A + 1` minus its last
    position), computed with one prompt forward per distinct prompt; None when no rows share a
    prompt (the caller runs the plain forward). Raises `PromptSharingUnsupported` when the model
    returns no cache it can index by row, or when the response forward did not continue the
    prompt's cache (a forward that swallows a cache argument it does not know would otherwise
    give the responses' log-probs without their prompts, with no error).

    With `field="last_hidden_state"`, `model` is a causal LM's decoder (`lm_head.LMHead.decoder`)
    and that field of its output holds the hidden states of the same positions, (B, A, H), for
    the fused log-prob head.

    `kwargs` are `ModelFamily.padded_inputs`: input_ids (B, T), attention_mask, position_ids.
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
    # A decoder computes every position's hidden state (it takes no `logits_to_keep`); the last are kept below.
    keep = (lambda count: {"logits_to_keep": count}) if field == "logits" else (lambda count: {})
    prompt = model(input_ids=input_ids[first, :prompt_len], attention_mask=attention_mask[first, :prompt_len],
                   position_ids=position_ids[first, :prompt_len], use_cache=True, **keep(1))
    cache = returned_cache(prompt, name)
    if cache is None or not hasattr(cache, "batch_select_indices"):
        raise PromptSharingUnsupported(f"{type(model).__name__} returned no KV cache that can be indexed by row")
    if any(recurrent_cache_layer(layer) for layer in getattr(cache, "layers", ())):
        raise PromptSharingUnsupported(f"{type(model).__name__} has recurrent cache layers")
    cache.batch_select_indices(inverse)  # (U, ...) -> (B, ...); the backward sums over a prompt's rows
    output = model(input_ids=input_ids[:, prompt_len:], attention_mask=attention_mask,
                   position_ids=position_ids[:, prompt_len:], use_cache=True, **keep(num_actions),
                   **{name: cache})
    if returned_cache(output, name) is not cache:
        raise PromptSharingUnsupported(f"{type(model).__name__}'s forward did not continue the prompt's KV cache "
                                       f"passed as `{name}`")
    # The prompt's last position predicts the first action; the response's positions the rest.
    predicting = [getattr(prompt, field)[inverse, -1:], getattr(output, field)[:, -num_actions:-1]]
    setattr(output, field, torch.cat(predicting, dim=1))  # (B, A, V) logits, or (B, A, H) hidden states
    setattr(output, name, None)
    return output


class PackedPromptSharing:
    """Packed forwards of one model with each distinct prompt computed once.

    `forward` returns the model output over the shared row (None: take the unshared packed
    forward). Sharing turns itself off for good, with the reason logged once (`reason`), when the
    model's attention cannot apply the layout: an attention other than VARLEN_ATTENTION
    (flash_attention_2, sdpa, eager, flex_attention build their own masks), or a model whose
    layers did not all receive the layout (its attention would have run across the whole row).
    """

    def __init__(self, model: nn.Module, flag: str):
        self.model = model
        self.flag = flag
        self.reason: str | None = None

    def _off(self, reason: str) -> None:
        self.reason = reason
        logger.warning("%s: prompts are not shared in packed rows: %s; packed rows hold every sample's prompt",
                       self.flag, reason)

    def forward(self, sequences: torch.Tensor, seq_lens: list[int], num_actions: list[int], groups: list[int],
                run: Callable[[dict, SharedPromptLayout], object]):
        """`run(kwargs, layout)` calls the model on the shared row; its output, or None."""
        if self.reason is not None:
            return None
        config = self.model.config
        if config._attn_implementation not in (VARLEN_ATTENTION, VARLEN_SDPA_LEGACY):
            self._off(f"attn_implementation {config._attn_implementation!r} has no shared-prompt layout "
                      f"(the default, {VARLEN_ATTENTION!r}, has)")
            return None
        layout = shared_prompt_layout(seq_lens, num_actions, groups, sequences.device)
        if layout is None:
            return None
        output = run(family_of(self.model).shared_inputs(self.model, sequences, layout), layout)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        layers = getattr(text, "num_hidden_layers", None)
        if layout.calls == 0 or (layers is not None and layout.calls != layers):
            self._off(f"{layout.calls} of its {layers} attention layers received the layout")
            return None
        return output


def padded_as_shared(sequences: torch.Tensor, attention_mask: torch.Tensor | None,
                     prompt_len: int) -> tuple[torch.Tensor, list[int], list[int], list[int]] | None:
    """A padded batch whose first `prompt_len` columns are the (left-padded) prompts, as a packed
    row with its prompt groups: (ids (1, P), seq_lens, response lengths, groups), for the value
    models' shared forward. None when no two rows share a prompt, a row has no prompt token, or
    the rows are not one contiguous run of real tokens each. Reads the lengths on the host.
    Shape: sequences, attention_mask (B, T)"""
    if attention_mask is None or not 0 < prompt_len < sequences.size(1) or sequences.size(0) < 2:
        return None
    groups = prompt_groups(sequences[:, :prompt_len], attention_mask[:, :prompt_len])
    if groups is None:
        return None
    _, inverse = groups
    mask = attention_mask.bool()
    counts = torch.stack([mask[:, :prompt_len].sum(dim=1), mask[:, prompt_len:].sum(dim=1), inverse], dim=1).tolist()
    if min(prompt for prompt, _, _ in counts) < 1:
        return None
    try:
        packed = pack_padded(sequences, attention_mask)
    except ValueError:      # real tokens with holes: not a prompt-then-response layout
        return None
    return packed.input_ids, packed.seq_lens, [actions for _, actions, _ in counts], [g for _, _, g in counts]
