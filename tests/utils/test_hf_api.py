"""The Hugging Face API names lightrft uses (`lightrft.utils.hf_api`) are decided from the model
and the installed transformers, and reading them makes no deprecated call."""

import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers.modeling_outputs import CausalLMOutputWithPast

from lightrft.models.hf_utils import enable_gradient_checkpointing
from lightrft.utils.hf_api import (activation_checkpointing_on, cache_argument, forward_parameters,
                                   installed_cache_name, returned_cache)
from lightrft.utils.tiny import build_tiny_arch


@pytest.fixture
def no_deprecations():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        yield


def test_a_real_model_takes_its_cache_under_the_installed_name(no_deprecations):
    model = build_tiny_arch("llama", seed=0).eval()
    name = cache_argument(model)
    assert name == installed_cache_name() and name in forward_parameters(model)
    assert name in CausalLMOutputWithPast.__dataclass_fields__
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=True)
        cache = returned_cache(out, name)
        assert cache is not None and cache.get_seq_length() == 3
        again = model(input_ids=torch.tensor([[8]]), use_cache=True, **{name: cache})
    assert returned_cache(again, name) is cache and cache.get_seq_length() == 4


def test_the_cache_name_follows_the_signature_then_the_installed_release():
    def old(input_ids, past_key_values=None): ...

    def new(input_ids, cache=None): ...

    def passes_on(**kwargs): ...

    def neither(input_ids): ...

    import inspect
    names = [cache_argument(inspect.signature(f).parameters) for f in (old, new, passes_on, neither)]
    assert names == ["past_key_values", "cache", installed_cache_name(), "past_key_values"]
    assert returned_cache({"cache": 1}, "cache") == 1 and returned_cache(object(), "cache") is None


def test_a_lora_model_is_looked_through():
    model = build_tiny_arch("llama", seed=0)
    lora = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    assert cache_argument(lora) == cache_argument(model)
    assert forward_parameters(lora) == forward_parameters(model)


@pytest.mark.parametrize("wrap", ["plain", "lora"])
def test_activation_checkpointing_is_read_without_a_deprecated_property(no_deprecations, wrap):
    model = build_tiny_arch("qwen2", seed=0)
    if wrap == "lora":
        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    assert activation_checkpointing_on(model) is False
    enable_gradient_checkpointing(model.get_base_model() if wrap == "lora" else model)
    assert activation_checkpointing_on(model) is True


def test_a_custom_module_reports_the_checkpointing_of_the_model_it_wraps():
    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

    inner = build_tiny_arch("llama", seed=0)
    assert activation_checkpointing_on(Wrapper(inner)) is False
    enable_gradient_checkpointing(inner)
    assert activation_checkpointing_on(Wrapper(inner)) is True
