"""The Hugging Face model API under the names the installed transformers gives it.

transformers renames parts of its model API and keeps the old names as deprecated aliases for a
few releases: the KV cache argument and output field `past_key_values` became `cache`, and
`is_gradient_checkpointing` became `is_activation_checkpointing`. lightrft decides which name a
model takes here, once per model, from the model itself; every caller (the HF engine's decoding
loop, the shared-prompt forward, the actor's checks) asks these functions, so a rename is handled
in one place and no lightrft call goes through a deprecated alias.
"""

import functools
import inspect
from collections.abc import Mapping

from torch import nn


def base_model(model: nn.Module) -> nn.Module:
    """The causal LM inside a PEFT wrapper (whose own forward takes `**kwargs` and passes them on);
    any other model as it is."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def forward_parameters(model: nn.Module) -> Mapping[str, inspect.Parameter]:
    """The parameters of the causal LM's `forward`, looked through a PEFT wrapper."""
    return inspect.signature(base_model(model).forward).parameters


@functools.cache
def installed_cache_name() -> str:
    """The name the installed transformers' causal LM outputs give the KV cache."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_argument(model_or_parameters: nn.Module | Mapping[str, inspect.Parameter]) -> str:
    """The name under which a forward takes and returns its KV cache: the one its signature names
    (`cache` in transformers releases that renamed it, `past_key_values` before); for a forward
    that names neither and takes `**kwargs` (a wrapper passing them on), the installed
    transformers' name. Read once per forward function (cached), so callers may ask per call."""
    if isinstance(model_or_parameters, nn.Module):
        forward = base_model(model_or_parameters).forward
        # One signature read per forward function, not per call: the shared-prompt forward asks on every batch.
        return _cache_argument_of(getattr(forward, "__func__", forward))
    return _cache_argument_in(model_or_parameters)


@functools.lru_cache(maxsize=256)
def _cache_argument_of(forward) -> str:
    return _cache_argument_in(inspect.signature(forward).parameters)


def _cache_argument_in(parameters: Mapping[str, inspect.Parameter]) -> str:
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return installed_cache_name()
    return "past_key_values"


def returned_cache(output, name: str):
    """The KV cache a forward returned under `name` (see `cache_argument`), or None."""
    if isinstance(output, Mapping):
        return output.get(name)
    return getattr(output, name, None)


def recurrent_cache_layer(layer) -> bool:
    """Whether a transformers cache layer is recurrent (linear attention: one state per row
    rather than a slot per token), so its rows cannot be copied from one sample to another."""
    return hasattr(layer, "update_recurrent_state")


def activation_checkpointing_on(model: nn.Module) -> bool:
    """Whether the model recomputes activations in its backward (transformers' checkpointed
    layers), under the property's current name or, in releases before the rename, its old one."""
    model = base_model(model)
    if hasattr(type(model), "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    if hasattr(type(model), "is_gradient_checkpointing"):
        return bool(model.is_gradient_checkpointing)
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


# Keywords of every lightrft `from_pretrained` of a model. transformers 5.25 turns Hub kernels on
# by default and then refuses to load any model when the optional `kernels` package is missing;
# lightrft replaces no layers with Hub kernels, so it asks for none (every 5.x release takes it).
LOAD_OPTIONS = {"use_kernels": False}
