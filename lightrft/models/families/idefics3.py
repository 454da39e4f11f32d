"""Idefics3, the architecture of SmolVLM: a SigLIP vision tower and a pixel-shuffle connector
whose image features take the places of the `<image>` tokens of a Llama decoder (1-D positions).

The vision tower runs in its own call (`media_inputs`), its features take the places of the
`<image>` tokens in the token embeddings, and the decoder gets `inputs_embeds`: the packed row's
attention arguments (`packed_seq_lens`) then reach the decoder's attention only, never the image
patches, and every rank runs the same modules in the same order whatever its batch holds (a batch
without images runs the tower on a blank image with weight 0), which ZeRO-3 needs. The Hugging
Face engine samples with images (they enter the prefill); `<image>` is never sampled, by any
engine, and the actor's distribution leaves it out too, so their log-probs agree. A run carries a prompt's
images from the data (`--image_key`) through the engine, the experience and the replay buffer to
the forwards. vLLM takes each prompt with one `<image>` marker per image and the images, and
expands them itself (its expansion is checked against the trainer's ids).
"""

import os

import torch
from torch import nn
from transformers import AutoModelForImageTextToText, PretrainedConfig, PreTrainedModel

from lightrft.utils.hf_api import LOAD_OPTIONS
from lightrft.models.families.base import ModelFamily, register_family


class Idefics3(ModelFamily):
    name = "Idefics3 (SmolVLM)"
    model_types = ("idefics3",)

    def load(self, path: str | os.PathLike, config: PretrainedConfig, **options) -> PreTrainedModel:
        return AutoModelForImageTextToText.from_pretrained(path, config=config, **options, **LOAD_OPTIONS)

    def banned_token_ids(self, config: PretrainedConfig) -> tuple[int, ...]:
        return (config.image_token_id,)

    def image_media(self, processor, images: list) -> dict[str, torch.Tensor]:
        """pixel_values (N, C, H, W) and pixel_attention_mask (N, H, W): the image processor pads a
        prompt's images (or their tiles, with image splitting) to one size."""
        out = processor.image_processor(images=[images], return_tensors="pt")
        return {key: out[key][0] for key in ("pixel_values", "pixel_attention_mask") if key in out}

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
        features = image_features(vision_model_of(model).get_image_features(
            pixels[None], None if mask is None else mask[None], return_dict=True))                 # (N * tokens, H)
        embeds = model.get_input_embeddings()(input_ids)                                          # (B, T, H)
        placeholders = (input_ids == config.image_token_id).unsqueeze(-1)                        # (B, T, 1)
        return {"inputs_embeds": embeds.masked_scatter(placeholders, features.to(embeds.dtype))}


    def vision_modules(self, model: nn.Module) -> tuple[str, ...]:
        return ("model.vision_model", "model.connector")

    def blank_media_inputs(self, model: nn.Module, input_ids: torch.Tensor) -> dict:
        """A uniform grey image through the vision tower (an all-zero one would be dropped as
        padding), its features added to the token embeddings with weight 0."""
        vision = vision_model_of(model)
        size = model.config.vision_config.image_size
        dtype = next(vision.vision_model.parameters()).dtype
        pixels = torch.full((1, 1, 3, size, size), 0.5, device=input_ids.device, dtype=dtype)
        features = image_features(vision.get_image_features(pixels, None, return_dict=True))  # (tokens, H)
        embeds = model.get_input_embeddings()(input_ids)                                    # (B, T, H)
        return {"inputs_embeds": embeds + 0.0 * features.sum().to(embeds.dtype)}


def image_features(output) -> torch.Tensor:
    """The image features of `get_image_features`, one row per image token in image order:
    transformers up to 5.23 returns them as one (N, tokens, H) tensor, later releases as a list of
    per-image tensors. Shape: (N * tokens, H)."""
    pooled = output.pooler_output
    parts = pooled if isinstance(pooled, (list, tuple)) else [pooled]
    return torch.cat([part.reshape(-1, part.size(-1)) for part in parts])


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
