"""Idefics3, the architecture of SmolVLM: a SigLIP vision tower and a pixel-shuffle connector
whose image features take the places of the `<image>` tokens of a Llama decoder (1-D positions).

The vision tower runs in its own call (`media_inputs`), and the decoder gets the features as
`mm_encoder_outputs`: the packed row's attention arguments (`packed_seq_lens`) then reach the
decoder's attention only, never the image patches. The Hugging Face engine samples with images
(they enter the prefill; `<image>` is never sampled) and its log-probs are the actor's; the run
pipeline does not carry images from the data to the engine and the experience yet, so a run with
an Idefics3 policy stops before building its engine (tests/models/test_families.py).
"""

import os

import torch
from torch import nn
from transformers import AutoModelForImageTextToText, PretrainedConfig, PreTrainedModel

from lightrft.models.families.base import ModelFamily, register_family


class Idefics3(ModelFamily):
    name = "Idefics3 (SmolVLM)"
    model_types = ("idefics3",)
    rollout_engines = frozenset()           # no run carries images to an engine yet

    def load(self, path: str | os.PathLike, config: PretrainedConfig, **options) -> PreTrainedModel:
        return AutoModelForImageTextToText.from_pretrained(path, config=config, **options)

    def banned_token_ids(self, config: PretrainedConfig) -> tuple[int, ...]:
        return (config.image_token_id,)

    def media_inputs(self, model: nn.Module, input_ids: torch.Tensor, media: dict[str, torch.Tensor]) -> dict:
        """`media`: "pixel_values" (N, C, H, W) and optionally "pixel_attention_mask" (N, H, W), the
        N images of the batch in the order of their `<image>` runs."""
        unknown = sorted(set(media) - {"pixel_values", "pixel_attention_mask"})
        if unknown or "pixel_values" not in media:
            raise ValueError(f"Idefics3 takes media 'pixel_values' (and 'pixel_attention_mask'), got {sorted(media)}")
        pixels, mask = media["pixel_values"], media.get("pixel_attention_mask")
        config = model.config
        placeholders = int((input_ids == config.image_token_id).sum())      # a host sync, once per forward
        expected = pixels.size(0) * image_tokens(config)
        if placeholders != expected:
            raise ValueError(f"the batch has {placeholders} <image> tokens (id {config.image_token_id}) for "
                             f"{pixels.size(0)} images of {image_tokens(config)} tokens each ({expected}); "
                             "each image needs its run of placeholders in the prompt")
        features = vision_model_of(model).get_image_features(
            pixels[None], None if mask is None else mask[None], return_dict=True)   # pooler_output (N, tokens, H)
        return {"mm_encoder_outputs": {"image": features}}


def image_tokens(config: PretrainedConfig) -> int:
    """The `<image>` tokens one image becomes: (image_size / patch_size)^2 patches, pixel-shuffled
    by scale_factor^2."""
    vision = config.vision_config
    return (vision.image_size // vision.patch_size) ** 2 // config.scale_factor ** 2


def vision_model_of(model: nn.Module) -> nn.Module:
    """The `Idefics3Model` inside a causal-LM wrapper (or a peft model around it)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.model


register_family(Idefics3())
