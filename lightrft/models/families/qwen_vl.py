"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: a ViT whose merger turns each 2 x 2 block of patches into
one `<|image_pad|>` token of a Qwen decoder with multimodal rotary positions (M-RoPE); Qwen3-VL
also adds features of several vision layers in the first decoder layers ("deepstack").

M-RoPE gives each token three positions (time, height, width). A text token has the same value
in all three, counting on from the previous token; an image's tokens count their row and column
from the position where the image starts, and the text after an image continues from that start
plus the image's larger side (in merged patches), not plus its token count. Positions are
therefore a function of the tokens and the images' grids: `model_position_ids` computes them per
sequence, for padded batches and packed rows alike (a packed row restarts at each sequence), as
four rows: lightrft's own count (from which transformers would derive a packed row's mask) and
the three M-RoPE rows. With plain 1-D positions the model runs without an error and gets other
log-probs (up to 1.1 off in a log-prob on the tiny models), which is why this family exists.

The vision tower runs in its own call, its features replace the `<|image_pad|>` embeddings and the
decoder gets `inputs_embeds` (as for Idefics3: a packed row's attention arguments never reach the
image patches; a batch without images runs the tower on a blank image with weight 0, which
ZeRO-3 needs). The Hugging Face engine decodes each new token at the last prompt position + 1 in
all three rows (the prompt ends with text). `<|image_pad|>` and `<|video_pad|>` are never sampled.

A prompt marks an image with `<|vision_start|><|image_pad|><|vision_end|>` (what the model's chat
template writes for an `{"type": "image"}` part); a bare `<image>` in a prompt's text stands for
the same. Videos are not taken. transformers' Qwen-VL processors carry a video processor, which
needs torchvision; where it does not import (PyPI has no CPU build of it for this torch), the
folder's tokenizer and image processor (its PIL backend) are joined by
`lightrft.utils.qwen_vl_processor.QwenVLImageText`, which
expands the placeholders the same way. vLLM's Qwen-VL modules import torchvision too: without it
a run takes `--rollout_engine hf`.
"""

import copy
import importlib.util
import os

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForImageTextToText, PretrainedConfig, PreTrainedModel

from lightrft.utils.hf_api import LOAD_OPTIONS
from lightrft.models.families.base import ModelFamily, register_family
from lightrft.models.hf_utils import context_length
from lightrft.utils.qwen_vl_processor import IMAGE_PAD, PROCESSOR_CLASSES, QwenVLImageText

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


class QwenVL(ModelFamily):
    name = "Qwen2-VL / Qwen2.5-VL"
    model_types = ("qwen2_vl", "qwen2_5_vl")

    def load(self, path: str | os.PathLike, config: PretrainedConfig, **options) -> PreTrainedModel:
        return AutoModelForImageTextToText.from_pretrained(path, config=config, **options, **LOAD_OPTIONS)

    def load_processor(self, path: str | os.PathLike, tokenizer=None, trust_remote_code: bool = False):
        """The folder's `AutoProcessor`, or where its video processor cannot be built (no
        torchvision), its tokenizer (`tokenizer` if given) and image processor as `QwenVLImageText`."""
        try:
            return super().load_processor(path, tokenizer, trust_remote_code)
        except ImportError:
            from transformers import AutoImageProcessor, AutoTokenizer

            image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            model_type = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).model_type
            return QwenVLImageText(tokenizer, image_processor, PROCESSOR_CLASSES.get(model_type))

    def image_marker(self, processor) -> tuple[str, tuple[str, ...]]:
        return VISION_START + IMAGE_PAD + VISION_END, ("<image>",)

    # vLLM's Qwen-VL model modules import torchvision: without it only the Hugging Face engine serves them.
    rollout_engines = None if importlib.util.find_spec("torchvision") is not None else frozenset({"hf"})

    def engine_problem(self, engine: str) -> str | None:
        problem = super().engine_problem(engine)
        if problem and importlib.util.find_spec("torchvision") is None:
            return ("vLLM's Qwen-VL model modules import torchvision, which is not installed here (PyPI has no CPU "
                    f"build of it for this torch; install it on GPU machines): {problem}")
        return problem

    def context_length(self, config: PretrainedConfig) -> int | None:
        return context_length(config.get_text_config())

    def banned_token_ids(self, config: PretrainedConfig) -> tuple[int, ...]:
        return tuple(sorted({config.image_token_id, config.video_token_id}))

    def image_media(self, processor, images: list) -> dict[str, torch.Tensor]:
        """pixel_values (patches of all images, C x temporal patch x patch^2) and image_grid_thw
        (N, 3): each image's grid of patches (time, height, width) before the 2 x 2 merge."""
        out = processor.image_processor(images=list(images), return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"].long()}

    def media_inputs(self, model: nn.Module, input_ids: torch.Tensor, media: dict[str, torch.Tensor]) -> dict:
        """`media`: "pixel_values" (patches, D) and "image_grid_thw" (N, 3), the N images of the batch
        in the order of their `<|image_pad|>` runs."""
        config, inner, grids = model.config, inner_model(model), self._checked_grids(model, input_ids, media)
        features = torch.cat(inner.get_image_features(media["pixel_values"], grids, return_dict=True).pooler_output)
        embeds = model.get_input_embeddings()(input_ids)                                      # (B, T, H)
        where = (input_ids == config.image_token_id).unsqueeze(-1)                           # (B, T, 1)
        return {"inputs_embeds": embeds.masked_scatter(where, features.to(embeds.dtype))}

    def blank_media_inputs(self, model: nn.Module, input_ids: torch.Tensor) -> dict:
        """One grey image of a single merged token through the vision tower, added with weight 0."""
        features = torch.cat(self._blank_features(model, input_ids).pooler_output)
        embeds = model.get_input_embeddings()(input_ids)
        return {"inputs_embeds": embeds + 0.0 * features.sum().to(embeds.dtype)}

    @staticmethod
    def _blank_features(model: nn.Module, input_ids: torch.Tensor):
        """The vision tower's output for one grey image of a single merged token."""
        visual = inner_model(model).visual
        merge, vision = visual.spatial_merge_size, model.config.vision_config
        width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        dtype = next(visual.parameters()).dtype
        pixels = torch.full((merge * merge, width), 0.5, device=input_ids.device, dtype=dtype)
        grid = torch.tensor([[1, merge, merge]], device=input_ids.device)
        return inner_model(model).get_image_features(pixels, grid, return_dict=True)

    def _checked_grids(self, model: nn.Module, input_ids: torch.Tensor, media: dict[str, torch.Tensor]) -> torch.Tensor:
        """`media`'s image grids, once its keys and the batch's placeholder count are checked."""
        if sorted(media) != ["image_grid_thw", "pixel_values"]:
            raise ValueError(f"{self.name} takes media 'pixel_values' and 'image_grid_thw', got {sorted(media)}")
        grids, config = media["image_grid_thw"], model.config
        expected = int((grids.prod(-1) // inner_model(model).visual.spatial_merge_size ** 2).sum())
        placeholders = int((input_ids == config.image_token_id).sum())      # a host sync, once per forward
        if placeholders != expected:
            raise ValueError(f"the batch has {placeholders} {IMAGE_PAD} tokens (id {config.image_token_id}) for "
                             f"{grids.size(0)} images of {expected} tokens in all; each image needs its run of "
                             "placeholders in the prompt")
        return grids

    def model_position_ids(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                           media: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """(4, B, T): `positions` and the three M-RoPE rows (module doc) of every sequence."""
        grids = None if not media else media.get("image_grid_thw")
        rope = mrope_positions(input_ids, positions, grids, model.config.image_token_id,
                               model.config.vision_config.spatial_merge_size)
        return torch.cat([positions.unsqueeze(0), rope])

    def vision_modules(self, model: nn.Module) -> tuple[str, ...]:
        return ("model.visual",)


def mrope_positions(input_ids: torch.Tensor, positions: torch.Tensor, grids: torch.Tensor | None,
                    image_token_id: int, merge: int) -> torch.Tensor:
    """The three M-RoPE position rows (time, height, width) of a batch or packed row whose tokens
    lightrft counts at `positions` (0 at the first token of each sequence, +1 per token; pads 0),
    with the images of `grids` (time, height, width patches before the `merge` x `merge` merge) in
    the order of their `<|image_pad|>` runs, row by row. Computed on the host (a few image runs per
    batch). Shape: (B, T), (B, T), (N, 3) -> (3, B, T) long"""
    rope = positions.detach().to("cpu", torch.long).unsqueeze(0).repeat(3, 1, 1)      # (3, B, T)
    if grids is None or grids.numel() == 0:
        return rope.to(positions.device)
    where = (input_ids.detach().cpu() == image_token_id).nonzero().tolist()          # [(row, column)] row-major
    starts = positions.detach().cpu()
    grid_list = grids.detach().cpu().long().tolist()
    sizes = [t * (h // merge) * (w // merge) for t, h, w in grid_list]
    if len(where) != sum(sizes):
        raise ValueError(f"the batch has {len(where)} {IMAGE_PAD} tokens for {len(grid_list)} images of "
                         f"{sum(sizes)} tokens in all")
    consumed, length = 0, input_ids.size(-1)
    for (t, h, w), size in zip(grid_list, sizes):
        row, first = where[consumed]
        last_row, last = where[consumed + size - 1]
        if last_row != row or last - first + 1 != size:
            raise ValueError(f"an image of {size} tokens does not fill one run of {IMAGE_PAD} tokens "
                             f"(row {row}, column {first})")
        consumed += size
        h, w = h // merge, w // merge
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        rope[:, row, first:first + size] = rope[0, row, first] + grid.reshape(3, -1)
        # The rest of this sequence (up to the next one's first token, position 0) moves on by the
        # image's larger side instead of its token count.
        restarts = (starts[row, last + 1:] == 0).nonzero()
        end = last + 1 + (int(restarts[0]) if len(restarts) else length - last - 1)
        rope[:, row, last + 1:end] += max(h, w) - size
    return rope.to(positions.device)


def inner_model(model: nn.Module) -> nn.Module:
    """The `Qwen2VLModel` / `Qwen2_5_VLModel` inside the conditional-generation wrapper (or a peft model around it)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.model


class Qwen3VL(QwenVL):
    """Qwen3-VL: Qwen2.5-VL's positions and placeholders, and "deepstack": features from several
    vision layers are added to the image tokens' hidden states in the first decoder layers too.
    The tower still runs apart; its output (last-layer and deepstack features) goes to the model
    as `mm_encoder_outputs`, with the token ids, so the model scatters both."""

    name = "Qwen3-VL"
    model_types = ("qwen3_vl",)

    def media_inputs(self, model: nn.Module, input_ids: torch.Tensor, media: dict[str, torch.Tensor]) -> dict:
        grids = self._checked_grids(model, input_ids, media)
        features = inner_model(model).get_image_features(media["pixel_values"], grids, return_dict=True)
        return {"mm_encoder_outputs": {"image": features}}

    def blank_media_inputs(self, model: nn.Module, input_ids: torch.Tensor) -> dict:
        """The blank image's output as `mm_encoder_outputs` of no tokens (each an empty slice plus
        0 x the sum of all), so a batch without images takes the same path through the model as
        one with them (the token embedding looked up inside the forward: under ZeRO-3 a lookup
        outside it on one rank and inside on another hangs)."""
        features = self._blank_features(model, input_ids)
        pooled = torch.cat(features.pooler_output)
        deep = [torch.cat(f) for f in features.deepstack_features]
        total = 0.0 * (pooled.sum() + sum(f.sum() for f in deep))
        features.pooler_output = (pooled[:0] + total,)
        features.deepstack_features = [(f[:0] + total,) for f in deep]
        return {"mm_encoder_outputs": {"image": features}}

    def split_media_inputs(self, model: nn.Module, kwargs: dict, input_ids: torch.Tensor, start: int,
                           stop: int) -> dict:
        """The image features (last-layer and deepstack) of the placeholders among tokens
        `start:stop`, plus 0 x the sum of all of them: each rank's backward still reaches the whole
        vision tower (under ZeRO-3 every rank must run the same backward)."""
        encoded = kwargs.get("mm_encoder_outputs", {}).get("image")
        if encoded is None:
            return kwargs
        placeholders = (input_ids[0] == model.config.image_token_id).long()
        lo, hi = (int(n) for n in torch.stack([placeholders[:start].sum(), placeholders[:stop].sum()]).tolist())
        pooled = torch.cat(encoded.pooler_output)
        deep = [torch.cat(f) for f in encoded.deepstack_features]
        total = 0.0 * (pooled.sum() + sum(f.sum() for f in deep))
        part = copy.copy(encoded)
        part.pooler_output = (pooled[lo:hi] + total,)
        part.deepstack_features = [(f[lo:hi] + total,) for f in deep]
        return {**kwargs, "mm_encoder_outputs": {**kwargs["mm_encoder_outputs"], "image": part}}


register_family(QwenVL())
register_family(Qwen3VL())
