"""AdapterDisabledReference: a LoRA run's reference policy is the actor with its adapter off."""

import pytest
import torch

from lightrft.models import ActorLanguage
from lightrft.models.reference import AdapterDisabledReference

from .conftest import make_batch


def test_reference_is_the_base_model_and_holds_no_weights(tiny_dirs):
    torch.manual_seed(0)
    actor = ActorLanguage(tiny_dirs["qwen2"], lora_rank=4, lora_alpha=8).eval()
    base = ActorLanguage(tiny_dirs["qwen2"]).eval()
    with torch.no_grad():
        for name, param in actor.named_parameters():
            if "lora_B" in name:  # B starts at 0: move it so the adapter changes the outputs
                param.normal_(std=0.5)
    reference = AdapterDisabledReference(actor)
    batch = make_batch([3, 5, 2], [4, 2, 3])
    with torch.no_grad():
        expected = base(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
        got = reference(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
        adapted = actor(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    assert got.shape == expected.shape == (batch.sequences.shape[0], batch.num_actions)
    assert torch.allclose(got, expected, atol=1e-6, rtol=0)
    assert (adapted - expected).abs().max() > 1e-2  # the adapter acts outside the context...
    with torch.no_grad():  # ...and is back on after it
        again = actor(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    assert torch.equal(again, adapted)
    # No second copy: the reference owns one scalar (for DeepSpeed), none of the actor's weights.
    assert [p.numel() for p in reference.parameters()] == [1]


def test_reference_needs_a_lora_actor(tiny_dirs):
    with pytest.raises(ValueError, match="--lora_rank > 0"):
        AdapterDisabledReference(ActorLanguage(tiny_dirs["qwen2"]))
