"""Hugging Face plumbing shared by the actor, critic and reward model wrappers.

- `resolve_pretrained`: a clear error for a model path that does not exist.
- `default_attn_implementation` and the `VARLEN_SDPA` attention registered with transformers: how
  packed sequences are kept apart without ever building a (P x P) mask.
- `padded_forward_kwargs` / `packed_forward_kwargs`: the keyword arguments of one forward call.
- `value_model_class`: a backbone (`AutoModel`, no LM head) plus a scalar value head, as a
  `PreTrainedModel` so it saves and loads as a Hugging Face folder.

Which attention runs where (details in docs/packing.md):

| device, flash-attn        | default implementation | packed sequences                              |
|---------------------------|------------------------|-----------------------------------------------|
| CUDA, flash-attn present  | "flash_attention_2"    | varlen kernel, `cu_seq_lens_*` passed          |
| CUDA without flash-attn   | VARLEN_SDPA            | one causal SDPA call per sequence (no mask)    |
| CPU                       | VARLEN_SDPA            | one causal SDPA call per sequence (no mask)    |
| user picks "sdpa"/"eager" | as given               | block-diagonal (P x P) mask from position ids  |
| user picks flex_attention | as given               | block-sparse mask from position ids            |
"""

import importlib.util
import os
import re
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch
from torch import nn
from transformers import AttentionInterface, AutoConfig, PretrainedConfig, PreTrainedModel
from transformers.dynamic_module_utils import get_class_from_dynamic_module
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.models.auto.modeling_auto import MODEL_MAPPING

from lightrft.models.packing import check_seq_lens, cu_seqlens, packed_position_ids

VARLEN_SDPA = "lightrft_varlen_sdpa"
FLASH_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")
HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


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


@contextmanager
def explain_load_errors(path: str, flag: str):
    """Re-raises transformers' loading errors (missing or invalid files, an unreachable Hub) with
    the flag and path in front, keeping the error type."""
    try:
        yield
    except (OSError, ValueError) as err:
        error_type = OSError if isinstance(err, OSError) else ValueError
        raise error_type(
            f"{flag} {path!r} could not be loaded: {err} Pass a Hugging Face model folder (config.json and "
            "weights), or a Hub id that is in the local cache or reachable."
        ) from err


def model_dtype(bf16: bool) -> torch.dtype:
    return torch.bfloat16 if bf16 else torch.float32


def default_attn_implementation() -> str:
    """flash_attention_2 on CUDA when flash-attn is installed, else VARLEN_SDPA (exact packing on
    CPU and memory-efficient packing on CUDA without flash-attn)."""
    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return VARLEN_SDPA


def varlen_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    packed_seq_lens: list[int] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Scaled dot-product attention that keeps packed sequences apart without a mask.

    With `packed_seq_lens` (host-side lengths of the sequences in a packed row) it runs one causal
    SDPA call per sequence on slices of the row; nothing of size (P x P) is built, and on CUDA each
    call can use the flash / memory-efficient SDPA kernels. Otherwise it is transformers' SDPA.
    Shape: query (1, H, P, D), key/value (1, H_kv, P, D) -> output (1, P, H, D)
    """
    if packed_seq_lens is None or attention_mask is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    window = kwargs.get("sliding_window")
    if window is not None and max(packed_seq_lens) > window:
        raise ValueError(
            f"a packed sequence of {max(packed_seq_lens)} tokens exceeds this layer's sliding window of {window}; "
            f"{VARLEN_SDPA} has no sliding-window support: use attn_implementation='flash_attention_2' or 'sdpa'"
        )
    outputs, start = [], 0
    for length in packed_seq_lens:
        stop = start + length
        out, _ = sdpa_attention_forward(
            module, query[:, :, start:stop], key[:, :, start:stop], value[:, :, start:stop], None, **kwargs
        )
        outputs.append(out)  # (1, L_i, H, D)
        start = stop
    return torch.cat(outputs, dim=1), None


# Masks for VARLEN_SDPA are transformers' SDPA masks: packed forwards pass an all-ones padding mask,
# for which no mask is built (plain causal), and the attention splits the row by sequence. A caller
# that packs without `packed_seq_lens` still gets transformers' exact block-diagonal mask.
AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
AttentionMaskInterface.register(VARLEN_SDPA, sdpa_mask)


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


def packed_forward_kwargs(input_ids: torch.Tensor, seq_lens: list[int], attn_implementation: str) -> dict:
    """Keyword arguments for a forward over a packed row (1, P) of sequences with lengths `seq_lens`.

    - flash attention: `cu_seq_lens_*` / `max_length_*` select the varlen kernel (no mask at all).
    - VARLEN_SDPA: an all-ones padding mask makes transformers skip mask building; the attention
      splits the row by `packed_seq_lens`.
    - anything else (sdpa, eager, flex_attention): no padding mask and restarting position ids, from
      which transformers derives the block-diagonal mask. `use_cache=False` is required for that
      detection (transformers only looks for packing when there is no cache).
    """
    if input_ids.ndim != 2 or input_ids.size(0) != 1:
        raise ValueError(f"packed sequences must be one row of shape (1, P), got {tuple(input_ids.shape)}")
    seq_lens = check_seq_lens(seq_lens, input_ids.size(1))
    kwargs = {
        "input_ids": input_ids,
        "position_ids": packed_position_ids(seq_lens, input_ids.device),
        "use_cache": False,
    }
    if attn_implementation in FLASH_IMPLEMENTATIONS:
        starts = cu_seqlens(seq_lens, input_ids.device)
        kwargs.update(cu_seq_lens_q=starts, cu_seq_lens_k=starts, max_length_q=max(seq_lens), max_length_k=max(seq_lens))
    elif attn_implementation == VARLEN_SDPA:
        kwargs.update(attention_mask=torch.ones_like(input_ids), packed_seq_lens=seq_lens)
    return kwargs


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
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    saved_prefix = getattr(config, "value_head_prefix", None)
    if saved_prefix is not None and saved_prefix != value_head_prefix:
        raise ValueError(
            f"{flag} {path!r} was saved with value_head_prefix={saved_prefix!r} but {value_head_prefix!r} was asked "
            f"for; pass --value_head_prefix {saved_prefix}"
        )
    cls = value_model_class(backbone_class(config, path, trust_remote_code), value_head_prefix)
    with explain_load_errors(path, flag):
        model, info = cls.from_pretrained(
            path,
            config=config,
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


def value_forward_kwargs(
    model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor | None, packed_seq_lens: list[int] | None
) -> dict:
    """Forward keyword arguments of a value model for a padded batch or a packed row."""
    if packed_seq_lens is None:
        return padded_forward_kwargs(sequences, attention_mask)
    return packed_forward_kwargs(sequences, packed_seq_lens, model.config._attn_implementation)


def strip_prefix(state_dict: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries under `prefix`, with the prefix removed (a wrapper's state dict -> its model's)."""
    return {key[len(prefix) :]: value for key, value in state_dict.items() if key.startswith(prefix)}
