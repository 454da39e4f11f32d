"""Hugging Face plumbing shared by the actor, critic and reward model wrappers.

- `resolve_pretrained`: a clear error for a model path that does not exist.
- `packing_problem`: why an architecture cannot be packed exactly (a model family refuses it at load).
- `zero_dropout`: zeroes every dropout probability, so training forwards equal scoring forwards.
- `padded_forward_kwargs` / `packed_forward_kwargs`: the keyword arguments of one forward call.
- `value_model_class`: a backbone (`AutoModel`, no LM head) plus a scalar value head, as a
  `PreTrainedModel` so it saves and loads as a Hugging Face folder.

The attention for packed rows (`VARLEN_ATTENTION`, `default_attn_implementation`) lives in
`lightrft.models.attention`; its names are importable from here too.
"""

import os
import re
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
from transformers.dynamic_module_utils import get_class_from_dynamic_module
from transformers.models.auto.modeling_auto import MODEL_MAPPING

# The attention for packed rows, importable from here as before (its home: lightrft.models.attention).
from lightrft.utils.hf_api import LOAD_OPTIONS
from lightrft.models.attention import (ATTENTION_LAYER_TYPES, FLASH_IMPLEMENTATIONS, VARLEN_ATTENTION,  # noqa: F401
                                       VARLEN_SDPA, VARLEN_SDPA_LEGACY, all_ones_mask, causal_band_mask,
                                       default_attn_implementation, fused_varlen_kernel, known_all_ones,
                                       one_call_varlen, shared_prompt_attention, softcapped_attention,
                                       varlen_attention, varlen_attention_mask, varlen_kernel_runs)
from lightrft.models.packing import (SharedPromptLayout, check_seq_lens, cu_seqlens,
                                     packed_position_ids)

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
        # a vision-language config keeps its decoder's width in its text config
        setattr(self, value_head_prefix, nn.Linear(config.get_text_config().hidden_size, 1, bias=False))
        self.post_init()

    def forward(self, input_ids: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Per-position scalar values. Shape: (B, T) -> (B, T). A vision-language backbone may get
        `inputs_embeds` (the images' features in place) instead of `input_ids`."""
        hidden = getattr(self, self.base_model_prefix)(input_ids=input_ids, **kwargs).last_hidden_state  # (B, T, H)
        return getattr(self, value_head_prefix)(hidden).squeeze(-1)  # (B, T)

    name = f"{backbone.__name__}WithValueHead"
    return type(name, (pretrained_base,), {"__init__": __init__, "forward": forward, "__module__": __name__})


def import_submodel_modules(config: PretrainedConfig) -> None:
    """Imports the modeling module of each sub-model `config` names (a vision-language model's
    text model, say) before `from_pretrained` builds it. Under ZeRO-3 the build runs inside
    DeepSpeed's `zero.Init`, which wraps the `__init__` of every module class created meanwhile and
    puts back, on leaving, the one it wrapped. A class that transformers decorates after creating
    it (its hub-kernel layers, with the `kernels` package installed) then loses the decorated
    `__init__`, and every instance built later (a reference model, an EMA copy) fails in forward
    ("'LlamaAttention' object has no attribute '_kernel_funcs'"). Imported first, the class is
    whole before zero.Init sees it."""
    for name in getattr(config, "sub_configs", None) or {}:
        sub_config = getattr(config, name, None)
        if not isinstance(sub_config, PretrainedConfig):
            continue
        try:
            MODEL_MAPPING[type(sub_config)]       # imports the module that defines its model
        except Exception:   # not in the mapping (its parent's module defines it), remote code, ...:
            pass            # a head start only; the load that follows builds it and raises what is wrong
        import_submodel_modules(sub_config)


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
    import_submodel_modules(hf_config)
    with explain_load_errors(path, flag):
        model, info = cls.from_pretrained(
            path,
            config=hf_config,
            dtype=model_dtype(bf16),
            attn_implementation=attn_implementation or default_attn_implementation(),
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
            **LOAD_OPTIONS,
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
