"""Hugging Face plumbing shared by the actor, critic and reward model wrappers.

- `resolve_pretrained`: a clear error for a model path that does not exist.
- `default_attn_implementation` and the `VARLEN_ATTENTION` attention registered with transformers:
  how packed sequences are kept apart without ever building a (P x P) mask, for every layer type
  (full, sliding window, soft-capped).
- `packing_problem`: why an architecture cannot be packed exactly (a model family refuses it at load).
- `zero_dropout`: zeroes every dropout probability, so training forwards equal scoring forwards.
- `padded_forward_kwargs` / `packed_forward_kwargs`: the keyword arguments of one forward call.
- `value_model_class`: a backbone (`AutoModel`, no LM head) plus a scalar value head, as a
  `PreTrainedModel` so it saves and loads as a Hugging Face folder.

Which attention runs where (details in docs/packing.md):

| device, flash-attn        | default implementation | packed sequences                                  |
|---------------------------|------------------------|---------------------------------------------------|
| CUDA, flash-attn present  | "flash_attention_2"    | varlen kernel, `cu_seq_lens_*` passed              |
| CUDA without flash-attn   | VARLEN_ATTENTION       | torch's varlen kernel, one call per layer (bf16)   |
| CPU, float32, soft-caps   | VARLEN_ATTENTION       | one causal attention per sequence (no row mask)    |
| user picks "sdpa"/"eager" | as given               | block-diagonal (P x P) mask from position ids      |
| user picks flex_attention | as given               | block-sparse mask from position ids                |
"""

import importlib.util
import inspect
import os
import re
import weakref
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch
from torch import nn
from transformers import AttentionInterface, AutoConfig, PretrainedConfig, PreTrainedModel
from transformers.dynamic_module_utils import get_class_from_dynamic_module
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.models.auto.modeling_auto import MODEL_MAPPING

from lightrft.models.packing import (SPLIT_KEYWORD, SharedPromptLayout, check_seq_lens, cu_seqlens,
                                     packed_position_ids)

VARLEN_ATTENTION = "lightrft_varlen"
# Earlier name, still registered. Names containing "sdpa" make transformers demand SDPA support
# from the model class, which some architectures do not declare; the current name avoids that.
VARLEN_SDPA_LEGACY = "lightrft_varlen_sdpa"
VARLEN_SDPA = VARLEN_ATTENTION  # the constant's earlier name, kept for imports
FLASH_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")
HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def resolve_pretrained(path: str | os.PathLike, flag: str) -> str:
    """Returns `path` as a string if it is an existing folder or a Hugging Face Hub id ("org/name",
    resolved later by transformers from the local cache or the Hub); otherwise raises an error that
    names the path and the command-line flag it came from. "org/name" whose "org" is a local
    folder is taken as a missing local path, not a Hub id."""
    path_str = os.fspath(path)
    if Path(path_str).expanduser().exists():
        return str(Path(path_str).expanduser())
    if HUB_REPO_ID.match(path_str) and not Path(path_str).parent.is_dir():
        return path_str
    raise FileNotFoundError(
        f"{flag} {path_str!r}: no such model folder. Pass a Hugging Face model folder "
        "(with config.json and weights) or a Hub id like 'Qwen/Qwen2.5-0.5B-Instruct'."
    )


class ModelLoadError(OSError):
    """A model or tokenizer could not be loaded from the path a flag gave (missing or invalid
    files, an unreachable Hub): the message names the flag and the path. Commands report it as a
    one-line error, as they do a missing file."""


@contextmanager
def explain_load_errors(path: str, flag: str):
    """Re-raises transformers' loading errors (missing or invalid files, an unreachable Hub) with
    the flag and path in front, keeping the error type."""
    try:
        yield
    except (OSError, ValueError) as err:
        error_type = ModelLoadError if isinstance(err, OSError) else ValueError
        raise error_type(
            f"{flag} {path!r} could not be loaded: {err} Pass a Hugging Face model folder (config.json and "
            "weights), or a Hub id that is in the local cache or reachable."
        ) from err


def context_length(config: PretrainedConfig) -> int | None:
    """The most positions (prompt + answer tokens) a model's config says it takes:
    `max_position_embeddings` (GPT-2's `n_positions` answers to that name too); None when the
    config names none."""
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def model_dtype(bf16: bool) -> torch.dtype:
    return torch.bfloat16 if bf16 else torch.float32


def default_attn_implementation() -> str:
    """flash_attention_2 on CUDA when flash-attn is installed, else VARLEN_ATTENTION (exact packing
    on CPU and memory-efficient packing on CUDA without flash-attn)."""
    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return VARLEN_ATTENTION


def causal_band_mask(q_length: int, kv_length: int, window: int | None, device: torch.device,
                     end_aligned: bool = False) -> torch.Tensor:
    """Query i may see key j iff j <= i and i - j < window (no window: j <= i); upper-left aligned,
    as for a sequence that starts at position 0. The window convention is transformers'
    (`sliding_window_overlay`: kv_idx > q_idx - window) and flash-attention's (window_size=(window-1, 0)).
    `end_aligned`: the queries are the last q_length of the kv_length tokens (query i sits at
    position kv_length - q_length + i), flash-attention's alignment for unequal lengths.
    Shape: (1, 1, q_length, kv_length) bool
    """
    offset = kv_length - q_length if end_aligned else 0
    q = torch.arange(offset, offset + q_length, device=device).unsqueeze(1)  # (q, 1)
    k = torch.arange(kv_length, device=device).unsqueeze(0)  # (1, kv)
    allowed = k <= q
    if window is not None:
        allowed = allowed & (q - k < window)
    return allowed.view(1, 1, q_length, kv_length)


def softcapped_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    softcap: float,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention with logit soft-capping, softmax(softcap * tanh(q k^T * scaling / softcap)) v, as
    Gemma 2's eager attention computes it (SDPA kernels have no soft-capping). `attention_mask` is
    a bool mask (True = attend) or an additive float mask, or None for no mask.
    Shape: query (B, H, L, D), key/value (B, H_kv, S, D), mask (B or 1, 1, L, S) -> (B, L, H, D)
    """
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scaling = query.size(-1) ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, L, S)
    scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None  # (B, L, H, D)


def _attend(module, query, key, value, attention_mask, window, softcap, **kwargs) -> torch.Tensor:
    """One attention call honouring the layer's sliding window and soft-capping. A None mask means
    "causal from position 0" (what `varlen_attention_mask` returns for unpadded, uncached rows), so
    the window is applied here when it bites; otherwise the mask already holds it.
    Shape: query (B, H, L, D), key/value (B, H_kv, S, D) -> (B, L, H, D)"""
    q_length, kv_length = query.size(2), key.size(2)
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    if attention_mask is None and causal and q_length > 1:
        if (window is not None and q_length > window) or softcap is not None:
            attention_mask = causal_band_mask(q_length, kv_length, window, query.device)
    if softcap is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)[0]
    kwargs.pop("is_causal", None)
    return softcapped_attention(module, query, key, value, attention_mask, softcap, **kwargs)[0]


def fused_varlen_kernel(query: torch.Tensor):
    """PyTorch's varlen attention kernel (`torch.nn.attention.varlen.varlen_attn`: flash attention
    over every sequence of a packed row in one call) where it runs, or None: CUDA tensors in half
    precision, on a torch that ships it. Elsewhere (the CPU, float32) packed rows take one SDPA
    call per sequence."""
    if not (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)):
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@cache
def _kernel_keywords(kernel) -> frozenset:
    """The keyword arguments `kernel` accepts: torch 2.10's `varlen_attn` takes `is_causal`, later
    ones `window_size` and `enable_gqa` instead (read once per kernel, not per layer)."""
    return frozenset(inspect.signature(kernel).parameters)


def varlen_kernel_runs(kernel, window: int | None) -> bool:
    """Whether `kernel` can apply a layer's attention: a sliding window needs `window_size`."""
    return window is None or "window_size" in _kernel_keywords(kernel)


def one_call_varlen(kernel, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                    cu_seq_k: torch.Tensor, max_q: int, max_k: int, window: int | None,
                    scaling: float | None) -> torch.Tensor:
    """Causal attention within each segment of a packed row in one `kernel` call (the signature of
    `torch.nn.attention.varlen.varlen_attn`): segment i's queries `cu_seq_q[i]:cu_seq_q[i+1]`
    attend to its keys `cu_seq_k[i]:cu_seq_k[i+1]`, aligned to the end where the keys are more
    (the kernel's flash-attention convention; a shared prompt's response sees the prompt).
    transformers' window W lets query i see key j when i - W < j <= i, the kernel's window_size
    (W - 1, 0); grouped key/value heads are passed as they are (`enable_gqa`) where the kernel
    takes them, else repeated per query head. Callers check `varlen_kernel_runs` first.
    Shape: query (1, H, P, D), key/value (1, H_kv, P_k, D), cu_seq_q/k (M + 1,) int32 -> (1, P, H, D)"""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))        # (P, H, D): the projections' layout
    keywords = _kernel_keywords(kernel)
    options = {"scale": scaling}
    if "window_size" in keywords:
        options["window_size"] = (-1, 0) if window is None else (window - 1, 0)
    else:
        options["is_causal"] = True
    if q.size(1) != k.size(1):
        if "enable_gqa" in keywords:
            options["enable_gqa"] = True
        else:
            groups = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = kernel(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, **options)
    return out.unsqueeze(0)


def varlen_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    packed_seq_lens: list[int] | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention that keeps packed sequences apart without a (P x P) mask, honouring each layer's
    own attention: its sliding window (`sliding_window`, per layer as Gemma 2/3 and Qwen2 pass it),
    logit soft-capping (`softcap`), `scaling` and `dropout`.

    With `packed_seq_lens` (host-side lengths of the sequences in a packed row) it attends within
    each sequence's slice of the row, causally from that sequence's first token; a mask the model
    built over the whole row is cut into its diagonal blocks. Without it, it is transformers' SDPA
    (plus soft-capping, and the window where `varlen_attention_mask` built no mask).
    On CUDA each SDPA call can use the flash / memory-efficient kernels; memory grows with the
    longest sequence (times the window or soft-capping scores), never with P^2.
    Shape: query (1, H, P, D), key/value (1, H_kv, P, D) -> output (1, P, H, D)
    """
    split = kwargs.pop(SPLIT_KEYWORD, None)
    if split is not None:
        # A row split over a sequence-parallel group: the exchange gathers the whole row for this
        # rank's heads and calls this function again with it (`lightrft.models.sequence_parallel`).
        return split.attend(module, query, key, value, packed_seq_lens=packed_seq_lens,
                            sliding_window=sliding_window, softcap=softcap, **kwargs)
    for name in ("s_aux", "position_bias"):
        if kwargs.get(name) is not None and packed_seq_lens is not None:
            raise NotImplementedError(
                f"{type(module).__name__} passes {name!r} to its attention, which {VARLEN_ATTENTION} does not "
                "implement for packed rows; train without --packing_samples, or pass --attn_implementation eager"
            )
    packed_cu_seqlens = kwargs.pop("packed_cu_seqlens", None)
    layout = kwargs.pop("shared_prompt_layout", None)
    if layout is not None:
        return shared_prompt_attention(module, query, key, value, layout, sliding_window, softcap, **kwargs), None
    if packed_seq_lens is None:
        return _attend(module, query, key, value, attention_mask, sliding_window, softcap, **kwargs), None
    if query.size(0) != 1:
        raise ValueError(f"a packed forward takes one row (1, P), got a batch of {query.size(0)}")
    kernel = None
    if softcap is None and attention_mask is None and not kwargs.get("dropout"):
        kernel = fused_varlen_kernel(query)
    if kernel is not None and varlen_kernel_runs(kernel, sliding_window):
        if packed_cu_seqlens is None:
            packed_cu_seqlens = cu_seqlens(packed_seq_lens, query.device)
        longest = max(packed_seq_lens)
        return one_call_varlen(kernel, query, key, value, packed_cu_seqlens, packed_cu_seqlens, longest, longest,
                               sliding_window, kwargs.get("scaling")), None
    outputs, start = [], 0
    for length in packed_seq_lens:
        stop = start + length
        block = None if attention_mask is None else attention_mask[..., start:stop, start:stop]
        piece = slice(start, stop)
        outputs.append(_attend(module, query[:, :, piece], key[:, :, piece], value[:, :, piece], block,
                               sliding_window, softcap, **kwargs))  # (1, L_i, H, D)
        start = stop
    return torch.cat(outputs, dim=1), None


def shared_prompt_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            layout: SharedPromptLayout, window: int | None, softcap: float | None,
                            **kwargs) -> torch.Tensor:
    """Attention over a `SharedPromptLayout` row: each prompt causally over itself, each response
    over its prompt and causally over itself, with the layer's window and soft-cap. One varlen
    kernel call where it runs (keys gathered per segment); else one call per segment, a response's
    keys being its prompt's and its own, with an end-aligned band mask.
    Shape: query (1, H, S, D), key/value (1, H_kv, S, D) -> (1, S, H, D)"""
    if query.size(0) != 1:
        raise ValueError(f"a packed forward takes one row (1, S), got a batch of {query.size(0)}")
    layout.calls += 1
    kernel = fused_varlen_kernel(query) if softcap is None and not kwargs.get("dropout") else None
    if kernel is not None and varlen_kernel_runs(kernel, window):
        keys, values = key[:, :, layout.kv_index], value[:, :, layout.kv_index]  # (1, H_kv, sum of key lengths, D)
        return one_call_varlen(kernel, query, keys, values, layout.cu_seqlens_q, layout.cu_seqlens_k, layout.max_q,
                               layout.max_k, window, kwargs.get("scaling"))
    outputs, start = [], 0
    for q_length, spans in zip(layout.q_lens, layout.kv_spans):
        keys = torch.cat([key[:, :, a:b] for a, b in spans], dim=2) if len(spans) > 1 else key[:, :, spans[0][0]:spans[0][1]]
        values = (torch.cat([value[:, :, a:b] for a, b in spans], dim=2) if len(spans) > 1
                  else value[:, :, spans[0][0]:spans[0][1]])
        kv_length = keys.size(2)
        mask = None if kv_length == q_length else causal_band_mask(q_length, kv_length, window, query.device,
                                                                   end_aligned=True)
        outputs.append(_attend(module, query[:, :, start:start + q_length], keys, values, mask, window, softcap,
                               **kwargs))  # (1, q_length, H, D)
        start += q_length
    return torch.cat(outputs, dim=1)


# The all-ones padding masks `packed_forward_kwargs` made, by id: the mask function then knows a
# packed row is unpadded without reading the mask back from the device (a host sync per forward).
_ALL_ONES_MASKS: dict[int, weakref.ref] = {}


def all_ones_mask(like: torch.Tensor) -> torch.Tensor:
    """A bool padding mask of ones shaped like `like`, known to `known_all_ones` while it lives.
    Bool, so transformers' `attention_mask.to(dtype=torch.bool)` keeps the same tensor."""
    mask = torch.ones_like(like, dtype=torch.bool)
    key = id(mask)
    _ALL_ONES_MASKS[key] = weakref.ref(mask, lambda _, key=key: _ALL_ONES_MASKS.pop(key, None))
    return mask


def known_all_ones(mask: torch.Tensor) -> bool:
    ref = _ALL_ONES_MASKS.get(id(mask))
    return ref is not None and ref() is mask


def varlen_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    allow_is_causal_skip: bool = True,
    **kwargs,
) -> torch.Tensor | None:
    """The mask function of VARLEN_ATTENTION: transformers' SDPA mask, except that rows without
    padding and without a cache (every packed row, and unpadded training batches) get no mask at
    all, for full and sliding-window layers alike. `varlen_attention` then attends causally within
    each sequence and applies the layer's window itself, the way flash attention's varlen kernel
    does; a (P x P) mask over a packed row would ignore the sequence borders.
    Masks that cannot be skipped (padding, a KV cache, extra mask functions such as bidirectional
    image tokens, which set `allow_is_causal_skip=False`) are built as for SDPA.
    Shape: attention_mask (B, S) 2-D padding mask -> (B, 1, L, S) bool, or None
    """
    no_offset = isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == 0 and kv_offset == 0
    if not (no_offset and q_length == kv_length):
        # A step with a KV cache (decoding): the mask is built without first reading the padding
        # mask back to see whether it could be skipped, a host sync on every decoding step.
        allow_is_causal_skip = False
    elif allow_is_causal_skip and (attention_mask is None or (
            attention_mask.shape[-1] == kv_length
            and (known_all_ones(attention_mask) or bool(attention_mask.all())))):
        return None
    return sdpa_mask(
        batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset, attention_mask=attention_mask,
        allow_is_causal_skip=allow_is_causal_skip, **kwargs,
    )


for _name in (VARLEN_ATTENTION, VARLEN_SDPA_LEGACY):
    AttentionInterface.register(_name, varlen_attention)
    AttentionMaskInterface.register(_name, varlen_attention_mask)


def positions_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids counting real tokens only, so a left-padded row gets the same positions as
    the same row without padding. Pad positions get 0.
    Shape: (B, T) -> (B, T)
    """
    mask = attention_mask.long()
    return ((mask.cumsum(dim=1) - 1) * mask).clamp(min=0)


def padded_forward_kwargs(sequences: torch.Tensor, attention_mask: torch.Tensor | None) -> dict:
    """Keyword arguments for a forward over a padded batch (B, T)."""
    if attention_mask is None:
        return {"input_ids": sequences, "use_cache": False}
    return {
        "input_ids": sequences,
        "attention_mask": attention_mask,
        "position_ids": positions_from_attention_mask(attention_mask),
        "use_cache": False,
    }


def check_packed_row(input_ids: torch.Tensor, seq_lens: list[int]) -> list[int]:
    """Refuses a packed row that is not (1, P) or lengths that do not cover it; the lengths as ints."""
    if input_ids.ndim != 2 or input_ids.size(0) != 1:
        raise ValueError(f"packed sequences must be one row of shape (1, P), got {tuple(input_ids.shape)}")
    return check_seq_lens(seq_lens, input_ids.size(1))


def packed_forward_kwargs(input_ids: torch.Tensor, seq_lens: list[int], attn_implementation: str) -> dict:
    """Keyword arguments for a forward over a packed row (1, P) of sequences with lengths `seq_lens`.

    - flash attention: `cu_seq_lens_*` / `max_length_*` select the varlen kernel (no mask at all).
    - VARLEN_ATTENTION: an all-ones padding mask makes `varlen_attention_mask` skip mask building;
      the attention splits the row by `packed_seq_lens`.
    - anything else (sdpa, eager, flex_attention): no padding mask and restarting position ids, from
      which transformers derives the block-diagonal mask. `use_cache=False` is required for that
      detection (transformers only looks for packing when there is no cache).
    """
    seq_lens = check_packed_row(input_ids, seq_lens)
    kwargs = {
        "input_ids": input_ids,
        "position_ids": packed_position_ids(seq_lens, input_ids.device),
        "use_cache": False,
    }
    if attn_implementation in FLASH_IMPLEMENTATIONS:
        starts = cu_seqlens(seq_lens, input_ids.device)
        kwargs.update(cu_seq_lens_q=starts, cu_seq_lens_k=starts, max_length_q=max(seq_lens), max_length_k=max(seq_lens))
    elif attn_implementation in (VARLEN_ATTENTION, VARLEN_SDPA_LEGACY):
        # The sequence starts for the one-call kernel (`one_call_varlen`), built once per forward, not per layer.
        kwargs.update(attention_mask=all_ones_mask(input_ids), packed_seq_lens=seq_lens,
                      packed_cu_seqlens=cu_seqlens(seq_lens, input_ids.device))
    return kwargs


def shared_prompt_forward_kwargs(input_ids: torch.Tensor, layout: SharedPromptLayout) -> dict:
    """Keyword arguments for a forward over the shared row of `layout`, built from the packed row
    `input_ids` (1, P); only VARLEN_ATTENTION applies the layout (`varlen_attention`)."""
    shared_ids = input_ids[:, layout.source]  # (1, S)
    layout.calls = 0
    return {"input_ids": shared_ids, "position_ids": layout.position_ids, "use_cache": False,
            "attention_mask": all_ones_mask(shared_ids), "shared_prompt_layout": layout}


def packing_problem(model: nn.Module) -> tuple[str, bool] | None:
    """Why `model` cannot be packed exactly with its attention implementation, as (reason,
    whether only padded batches help), or None if it can.

    Packing is exact when attention runs through transformers' attention interface and masks (so
    the chosen implementation sees the sequence borders, and each layer's window and soft-capping
    are applied per sequence) and every layer mixes tokens only through attention: a recurrent or
    convolutional layer would carry state across the border of two packed sequences.
    """
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = f"{type(model).__name__} (model_type {getattr(text, 'model_type', '?')!r})"
    other_layers = sorted({t for t in (getattr(text, "layer_types", None) or []) if t not in ATTENTION_LAYER_TYPES})
    if other_layers:
        return f"{name} has {', '.join(other_layers)} layers, which carry state across packed sequences", True
    if getattr(model, "_supports_attention_backend", True) is False:
        return f"{name} does not run its attention through transformers' attention interface", True
    if getattr(text, "alibi", False):
        return f"{name} uses ALiBi position biases", True
    if config._attn_implementation in (VARLEN_ATTENTION, VARLEN_SDPA_LEGACY):
        if getattr(text, "attention_chunk_size", None):
            return f"{name} uses chunked attention (attention_chunk_size={text.attention_chunk_size})", False
        if getattr(text, "use_bidirectional_attention", False):
            return f"{name} uses bidirectional attention", False
    return None


DROPOUT_ATTRIBUTE = re.compile(r"(dropout|pdrop|jitter_noise)$|dropout_(p|prob|rate)$")


def zero_dropout(model: nn.Module) -> None:
    """Sets every dropout probability of `model` to 0: `nn.Dropout` modules, float attributes of
    modules and of the config (and its sub-configs) whose name ends in "dropout", "pdrop" or
    "jitter_noise" (attention dropout is usually read from such an attribute at every forward;
    MoE router jitter is multiplicative noise on the router input).

    Why: RL needs the training forward of the policy to compute the same function the rollout
    and the old log-probs came from; with dropout on, the first, on-policy update already has an
    importance ratio away from 1 (TRL disables dropout in its RL trainers for the same reason).
    """
    configs = [model.config] if isinstance(getattr(model, "config", None), PretrainedConfig) else []
    for config in configs:
        configs.extend(value for value in vars(config).values() if isinstance(value, PretrainedConfig))
        for key, value in list(vars(config).items()):
            if DROPOUT_ATTRIBUTE.search(key) and isinstance(value, float):
                setattr(config, key, 0.0)
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for key, value in list(vars(module).items()):
            if DROPOUT_ATTRIBUTE.search(key) and isinstance(value, float):
                setattr(module, key, 0.0)


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Activation checkpointing with the non-reentrant torch checkpoint (works with frozen inputs,
    LoRA and ZeRO-3)."""
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def backbone_class(config: PretrainedConfig, path: str | None, trust_remote_code: bool) -> type[PreTrainedModel]:
    """The `AutoModel` class (a transformer without LM head) for `config`."""
    if type(config) in MODEL_MAPPING:
        return MODEL_MAPPING[type(config)]
    auto_map = getattr(config, "auto_map", None) or {}
    if trust_remote_code and "AutoModel" in auto_map and path is not None:
        return get_class_from_dynamic_module(auto_map["AutoModel"], path)
    raise ValueError(
        f"no AutoModel backbone is known for model_type {config.model_type!r}; "
        "if the model folder ships its own code, pass --trust_remote_code"
    )


@cache
def value_model_class(backbone: type[PreTrainedModel], value_head_prefix: str) -> type[PreTrainedModel]:
    """A `PreTrainedModel` class holding `backbone` under its usual prefix (e.g. `model.`) and a value
    head `nn.Linear(hidden_size, 1, bias=False)` under `value_head_prefix`.

    Because the backbone sits where a causal LM keeps it, `from_pretrained` on a causal-LM folder
    loads the transformer and leaves the head freshly initialised (the LM head is ignored); on a
    folder saved by this class it loads both.
    """
    pretrained_base = backbone.__base__
    if not issubclass(pretrained_base, PreTrainedModel):
        pretrained_base = PreTrainedModel

    def __init__(self, config):
        pretrained_base.__init__(self, config)
        setattr(self, self.base_model_prefix, backbone(config))
        setattr(self, value_head_prefix, nn.Linear(config.hidden_size, 1, bias=False))
        self.post_init()

    def forward(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """Per-position scalar values. Shape: (B, T) -> (B, T)"""
        hidden = getattr(self, self.base_model_prefix)(input_ids=input_ids, **kwargs).last_hidden_state  # (B, T, H)
        return getattr(self, value_head_prefix)(hidden).squeeze(-1)  # (B, T)

    name = f"{backbone.__name__}WithValueHead"
    return type(name, (pretrained_base,), {"__init__": __init__, "forward": forward, "__module__": __name__})


def load_value_model(
    pretrain: str,
    *,
    value_head_prefix: str,
    flag: str,
    bf16: bool,
    attn_implementation: str | None,
    trust_remote_code: bool,
) -> tuple[PreTrainedModel, bool]:
    """Loads a backbone plus value head from a folder (or Hub id) as `value_model_class`.

    Returns the model and whether the folder held value-head weights (False: a causal-LM or plain
    backbone folder, head freshly initialised). A folder saved with a different `value_head_prefix`
    is an error rather than a silently fresh head.
    """
    path = resolve_pretrained(pretrain, flag)
    with explain_load_errors(path, flag):
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    saved_prefix = getattr(hf_config, "value_head_prefix", None)
    if saved_prefix is not None and saved_prefix != value_head_prefix:
        raise ValueError(
            f"{flag} {path!r} was saved with value_head_prefix={saved_prefix!r} but {value_head_prefix!r} was asked "
            f"for; pass --value_head_prefix {saved_prefix}"
        )
    cls = value_model_class(backbone_class(hf_config, path, trust_remote_code), value_head_prefix)
    with explain_load_errors(path, flag):
        model, info = cls.from_pretrained(
            path,
            config=hf_config,
            dtype=model_dtype(bf16),
            attn_implementation=attn_implementation or default_attn_implementation(),
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
        )
    head_loaded = not any(key.startswith(f"{value_head_prefix}.") for key in info["missing_keys"])
    model.config.value_head_prefix = value_head_prefix
    return model, head_loaded


def value_model_from(
    pretrain_or_model: str | os.PathLike | nn.Module,
    *,
    value_head_prefix: str,
    flag: str,
    bf16: bool,
    attn_implementation: str | None,
    trust_remote_code: bool,
    gradient_checkpointing: bool,
) -> tuple[nn.Module, bool]:
    """The value model of a Critic or RewardModel: loaded with `load_value_model`, or a given module
    that must already carry its head under `value_head_prefix`. Returns (model, head_loaded)."""
    if isinstance(pretrain_or_model, nn.Module):
        model = pretrain_or_model
        if not isinstance(getattr(model, value_head_prefix, None), nn.Linear):
            raise TypeError(
                f"the given {type(model).__name__} has no value head nn.Linear named {value_head_prefix!r}; "
                "pass a model folder instead (the head is then created), or the matching value_head_prefix"
            )
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(attn_implementation or default_attn_implementation())
        model.config.value_head_prefix = value_head_prefix
        head_loaded = True
    else:
        model, head_loaded = load_value_model(
            pretrain_or_model,
            value_head_prefix=value_head_prefix,
            flag=flag,
            bf16=bf16,
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
        )
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model, head_loaded


def strip_prefix(state_dict: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries under `prefix`, with the prefix removed (a wrapper's state dict -> its model's)."""
    return {key[len(prefix) :]: value for key, value in state_dict.items() if key.startswith(prefix)}
