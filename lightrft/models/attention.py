"""lightrft's attention for packed rows, registered with transformers as `VARLEN_ATTENTION`: how
packed sequences are kept apart without ever building a (P x P) mask, for every layer type (full,
sliding window, soft-capped), rows that share their prompts (`SharedPromptLayout`) and rows split
over a sequence-parallel group. `default_attn_implementation` picks it (or flash-attn's).

Which attention runs where (details in docs/packing.md):

| device, flash-attn        | default implementation | packed sequences                                  |
|---------------------------|------------------------|---------------------------------------------------|
| CUDA, flash-attn present  | VARLEN_ATTENTION       | flash-attn's varlen kernel, one call per layer     |
| CUDA without flash-attn   | VARLEN_ATTENTION       | torch's varlen kernel, one call per layer (bf16)   |
| CPU, float32, soft-caps   | VARLEN_ATTENTION       | one causal attention per sequence (no row mask)    |
| user picks "sdpa"/"eager" | as given               | block-diagonal (P x P) mask from position ids      |
| user picks flex_attention | as given               | block-sparse mask from position ids                |
"""

import importlib.util
import inspect
import weakref
from functools import cache

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from lightrft.models.packing import (SPLIT_KEYWORD, SharedPromptLayout, cu_seqlens)

VARLEN_ATTENTION = "lightrft_varlen"
# Earlier name, still registered. Names containing "sdpa" make transformers demand SDPA support
# from the model class, which some architectures do not declare; the current name avoids that.
VARLEN_SDPA_LEGACY = "lightrft_varlen_sdpa"
VARLEN_SDPA = VARLEN_ATTENTION  # the constant's earlier name, kept for imports
FLASH_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def default_attn_implementation() -> str:
    """VARLEN_ATTENTION everywhere: exact packing on the CPU; on CUDA one varlen kernel call per
    layer, flash-attn's where it is installed (`fused_varlen_kernel`), with shared prompts kept
    (transformers' "flash_attention_2" builds its own varlen call, which cannot share them)."""
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


def flash_attn_kernel(flash_attn_varlen_func):
    """flash-attn's `flash_attn_varlen_func` behind the signature of torch's `varlen_attn`
    (`one_call_varlen` calls either): packed (total, heads, head_dim) queries and keys with their
    own int32 cumulative starts and longest lengths; causal, aligned to the bottom right where a
    segment has more keys than queries (a response after its shared prompt); `window_size=(left,
    right)` counted from that alignment; grouped key/value heads taken as they are."""
    def kernel(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, 0), enable_gqa=True):
        return flash_attn_varlen_func(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale,
                                      causal=True, window_size=tuple(window_size))
    return kernel


@cache
def _flash_attn_kernel():
    """flash-attn's varlen kernel (`flash_attn_kernel`) when flash-attn imports, else None."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_kernel(flash_attn_varlen_func)


def fused_varlen_kernel(query: torch.Tensor):
    """A varlen attention kernel (flash attention over every sequence of a packed row in one call)
    where one runs, or None: CUDA tensors in half precision, flash-attn's (`flash_attn_kernel`) when
    it is installed, else PyTorch's (`torch.nn.attention.varlen.varlen_attn`) on a torch that ships
    it. Elsewhere (the CPU, float32) packed rows take one SDPA call per sequence."""
    if not (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)):
        return None
    flash = _flash_attn_kernel()
    if flash is not None:
        return flash
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


# The keywords only the packed attention reads: host-side lengths, the shared-prompt layout, the
# sequence-parallel split and the sequence starts. A compiled decoder layer carries them through its
# graphs in one `HeldKeywords` (`lightrft.models.compiled_layers`).
PACKING_KEYWORDS = ("packed_seq_lens", "packed_cu_seqlens", "shared_prompt_layout", SPLIT_KEYWORD)
HELD_KEYWORD = "lightrft_held_keywords"


class HeldKeywords:
    """The packed attention's keywords, passed through a compiled decoder layer as one opaque
    object: torch.compile guards on what the traced code reads, and it never reads these, so
    micro-batches with other lengths, layouts or sequence counts reuse the same graphs (passed
    loose, a list of N lengths is guarded on N, and each new N compiles again)."""

    __slots__ = ("keywords",)

    def __init__(self, keywords: dict):
        self.keywords = keywords


def packed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """VARLEN_ATTENTION as registered with transformers: `varlen_attention`; called from a
    compiled decoder layer (which passes `HeldKeywords`), it runs outside the layer's graphs.
    Shape: as `varlen_attention`."""
    held = kwargs.pop(HELD_KEYWORD, None)
    if held is None:
        return varlen_attention(module, query, key, value, attention_mask, **kwargs)
    return _attention_outside_graphs(module, query, key, value, attention_mask, held, **kwargs)


@torch.compiler.disable
def _attention_outside_graphs(module, query, key, value, attention_mask, held: HeldKeywords, **kwargs):
    """`varlen_attention` with the held keywords put back, never traced by torch.compile: its
    Python loop over sequences, host-side lengths, varlen kernels, Ulysses exchange and
    shared-prompt layouts run as they do eagerly, and the compiled layer is split into the graph
    before the attention call and the graph after it."""
    return varlen_attention(module, query, key, value, attention_mask, **kwargs, **held.keywords)


for _name in (VARLEN_ATTENTION, VARLEN_SDPA_LEGACY):
    AttentionInterface.register(_name, packed_attention)
    AttentionMaskInterface.register(_name, varlen_attention_mask)
