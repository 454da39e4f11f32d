"""`ModelFamily`, the default family `CAUSAL_LM` and the registry (the package's docstring says
what a family is; `lightrft.models.families` re-exports these names).
"""

import os
from collections.abc import Callable, Sequence

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from lightrft.utils.hf_api import LOAD_OPTIONS
from lightrft.models.hf_utils import (
    context_length,
    import_submodel_modules,
    packed_forward_kwargs,
    packing_problem,
    padded_forward_kwargs,
    shared_prompt_forward_kwargs,
)
from lightrft.models.media import merge_media
from lightrft.models.packing import SharedPromptLayout


class ModelFamily:
    """The decoder-only causal LMs of transformers (Llama, Qwen, Mistral, Gemma, GPT-2, ...), and
    the base of every other family: override the hooks (`load`, `check`, `position_ids`,
    `context_length`, `image_media`, `media_inputs`, `blank_media_inputs`, `vision_modules`,
    `banned_token_ids`, `packing_problem`) that differ; the input builders below are written on them.

    `name` is how messages and docs call the family; `model_types` the `config.model_type` values it
    serves (empty for the default family, which serves every type no family names);
    `rollout_engines` the engines that load it (a run with another `--rollout_engine` stops before
    building anything)."""

    name: str = "causal LM"
    model_types: tuple[str, ...] = ()
    # The rollout engines (registered names) that can serve this family; None: every engine.
    rollout_engines: frozenset[str] | None = None

    # ------------------------------------------------------------------ hooks
    def load(self, path: str | os.PathLike, config: PretrainedConfig, **options) -> PreTrainedModel:
        """The model of a checkpoint folder (or Hub id) whose config is `config`; `options` are
        `from_pretrained`'s (dtype, attn_implementation, trust_remote_code)."""
        return AutoModelForCausalLM.from_pretrained(path, config=config, **options, **LOAD_OPTIONS)

    def check(self, model: nn.Module, flag: str) -> None:
        """Raises, naming `flag` and the fix, for a model of this family lightrft cannot train."""

    def position_ids(self, config: PretrainedConfig, positions: torch.Tensor) -> torch.Tensor:
        """The position ids the model takes for tokens that lightrft counts at `positions` (0 for the
        first real token of each sequence, +1 per token; pads are masked out and may hold any value).
        Decoding continues a sequence by one position per new token.
        Shape: (B, T) long -> (B, T) long"""
        return positions

    def model_position_ids(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                           media: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """The position ids the model takes for a batch or packed row `input_ids` whose tokens
        lightrft counts at `positions` (as `position_ids`), given the batch's `media`: a family whose
        positions depend on the tokens and the images (Qwen-VL's multimodal rotary positions)
        overrides this one. Decoding continues each row of the result by one position per new token.
        Shape: input_ids, positions (B, T) -> (B, T), or (R, B, T) for R rows of positions"""
        return self.position_ids(model.config, positions)

    def context_length(self, config: PretrainedConfig) -> int | None:
        """The most tokens (prompt + answer) one sequence may hold, or None when the config names no limit."""
        return context_length(config)

    def image_media(self, processor, images: list) -> dict[str, torch.Tensor]:
        """The model inputs of one prompt's images (PIL), as `media_inputs` takes them, computed by
        the model folder's `processor`. The default family takes no images."""
        raise ValueError(f"{self.name} models take no images: train a vision-language model (docs/vlm.md) or drop "
                         "--image_key")

    def load_processor(self, path: str | os.PathLike, tokenizer=None, trust_remote_code: bool = False):
        """The processor of a vision-language model folder (`AutoProcessor`); `tokenizer`, when
        given, is the run's (the caller puts it in the processor)."""
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)

    def image_marker(self, processor) -> tuple[str, tuple[str, ...]]:
        """The text that marks one image in a prompt (what a `{"type": "image"}` chat part becomes),
        and other texts that stand for it in prompt data (replaced by it). Default: the processor's
        image token."""
        return processor.image_token, ()

    def engine_problem(self, engine: str) -> str | None:
        """Why the rollout engine registered as `engine` cannot serve this family's models here, or None."""
        if self.rollout_engines is None or engine in self.rollout_engines:
            return None
        if not self.rollout_engines:
            return "no rollout engine of lightrft serves it yet"
        return f"only {', '.join(sorted(self.rollout_engines))} can serve it; pass --rollout_engine {sorted(self.rollout_engines)[0]}"

    def media_inputs(self, model: nn.Module, input_ids: torch.Tensor, media: dict[str, torch.Tensor]) -> dict:
        """Forward keyword arguments that carry `media` (the images of a batch or packed row, in the
        order of their placeholder tokens in `input_ids`, row by row; keys as the family's processor
        names them), their features computed in a call of their own: the vision tower runs apart
        from the decoder, so a packed row's attention arguments never reach it. The default family
        takes token ids only."""
        raise ValueError(f"{self.name} models take token ids only; this batch also carries {', '.join(sorted(media))}")

    def vision_modules(self, model: nn.Module) -> tuple[str, ...]:
        """Names of the modules (in `model.named_modules()`) that turn images into features: the
        vision encoder and its connector, which --freeze_vision_tower freezes and LoRA leaves out.
        The default family has none."""
        return ()

    def blank_media_inputs(self, model: nn.Module, input_ids: torch.Tensor) -> dict:
        """Forward keyword arguments for a batch without media of a model that takes them: the
        vision tower still runs, on one blank image whose features enter with weight 0, so every
        rank runs the same modules in the same order whatever its batch holds (ZeRO-3 gathers each
        module's parameters with a collective; a rank skipping the tower hangs the others). The
        result may hold `inputs_embeds`, which then replaces `input_ids`. The default family: {}."""
        return {}

    def split_media_inputs(self, model: nn.Module, kwargs: dict, input_ids: torch.Tensor, start: int,
                           stop: int) -> dict:
        """`kwargs` (a whole packed row's forward arguments, `input_ids` its ids) with what carries
        its media cut to the tokens `start:stop`, for a row split over a sequence-parallel group
        (`SequenceParallel.split_row`, which cuts the ids, embeddings and positions itself). A
        family whose model takes the images' features beside the ids cuts them to the
        placeholders in the slice, keeping every rank's backward through the whole vision tower.
        The default family: `kwargs` as they are."""
        return kwargs

    def banned_token_ids(self, config: PretrainedConfig) -> tuple[int, ...]:
        """Token ids a rollout must never sample: a vision-language model's image placeholders
        (sampled, one would be taken for an image that is not there)."""
        return ()

    def packing_problem(self, model: nn.Module) -> tuple[str, bool] | None:
        """Why `model` cannot be packed exactly, as (reason, whether only padded batches help), or
        None (`hf_utils.packing_problem`: recurrent layers, ALiBi, chunked attention, ...)."""
        return packing_problem(model)

    # ------------------------------------------------------------------ built on the hooks
    def takes_media(self) -> bool:
        """Whether the family's models take media beside token ids (`media_inputs` is overridden)."""
        return type(self).media_inputs is not ModelFamily.media_inputs

    def media_kwargs(self, model: nn.Module, input_ids: torch.Tensor, media: dict[str, torch.Tensor] | None) -> dict:
        """The keyword arguments that carry a batch's media (`encode_media`), or for a model that
        takes media and a batch without any, the blank pass (`blank_media_inputs`). {} otherwise."""
        if media:
            return self.encode_media(model, input_ids, media)
        return self.blank_media_inputs(model, input_ids) if self.takes_media() else {}

    def with_media(self, model: nn.Module, kwargs: dict, input_ids: torch.Tensor, media) -> dict:
        """`kwargs` (forward arguments holding `input_ids`) with `media_kwargs` added; embeddings
        that carry the media replace the ids."""
        kwargs.update(self.media_kwargs(model, input_ids, media))
        if "inputs_embeds" in kwargs:
            kwargs.pop("input_ids", None)
        return kwargs

    def has_own_positions(self) -> bool:
        """Whether `position_ids` or `model_position_ids` maps lightrft's positions to others (False:
        the model takes them as they are)."""
        return (type(self).position_ids is not ModelFamily.position_ids
                or type(self).model_position_ids is not ModelFamily.model_position_ids)

    def check_packing(self, model: nn.Module, flag: str) -> None:
        """Raises, naming the model, its attention and the ways out, if `packing_problem` finds one."""
        found = self.packing_problem(model)
        if found is None:
            return
        problem, padded_only = found
        remedy = "train without --packing_samples (padded batches)"
        if not padded_only:
            remedy += (", or pass --attn_implementation eager or sdpa (packed rows then get a block-diagonal mask "
                       "built by transformers)")
        raise ValueError(
            f"{flag}: {problem}, so packed sequences would not get the log-probs and values they get alone "
            f"(attn_implementation={model.config._attn_implementation!r}); {remedy}"
        )

    def encode_media(self, model: nn.Module, input_ids: torch.Tensor, media: dict[str, torch.Tensor]) -> dict:
        """`media_inputs` on `media` moved to the device of `input_ids`: the one place a batch's
        images (from a dataset, an engine's caller, a replay buffer) reach the model's device."""
        media = {key: value.to(input_ids.device) for key, value in media.items()}
        return self.media_inputs(model, input_ids, media)

    def _mapped(self, model: nn.Module, kwargs: dict, input_ids: torch.Tensor, media=None) -> dict:
        if self.has_own_positions() and kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = self.model_position_ids(model, input_ids, kwargs["position_ids"], media)
        return kwargs

    def padded_inputs(self, model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor | None,
                      media: dict[str, torch.Tensor] | None = None) -> dict:
        """Forward keyword arguments for a padded batch, with the batch's `media` (`media_inputs`)
        when it has any. Shape: sequences, attention_mask (B, T)"""
        kwargs = padded_forward_kwargs(sequences, attention_mask)
        if attention_mask is None and self.has_own_positions():
            kwargs["position_ids"] = torch.arange(sequences.size(1), device=sequences.device).expand_as(sequences)
        return self._mapped(model, self.with_media(model, kwargs, sequences, media), sequences, media)

    def packed_inputs(self, model: nn.Module, input_ids: torch.Tensor, seq_lens: list[int],
                      media: dict[str, torch.Tensor] | None = None) -> dict:
        """Forward keyword arguments for a packed row of sequences with lengths `seq_lens`, with the
        row's `media` when it has any. Shape: (1, P)"""
        kwargs = packed_forward_kwargs(input_ids, seq_lens, model.config._attn_implementation)
        return self._mapped(model, self.with_media(model, kwargs, input_ids, media), input_ids, media)

    def shared_inputs(self, model: nn.Module, input_ids: torch.Tensor, layout: SharedPromptLayout) -> dict:
        """Forward keyword arguments for the shared-prompt row of `layout`, built from the packed row (1, P)."""
        kwargs = shared_prompt_forward_kwargs(input_ids, layout)
        return self._mapped(model, kwargs, kwargs["input_ids"])

    def value_inputs(self, model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor | None,
                     packed_seq_lens: list[int] | None, media: dict[str, torch.Tensor] | None = None) -> dict:
        """Forward keyword arguments of a value model for a padded batch or a packed row, with its
        `media` (a vision-language backbone's images) when it has any."""
        if packed_seq_lens is None:
            return self.padded_inputs(model, sequences, attention_mask, media)
        return self.packed_inputs(model, sequences, packed_seq_lens, media)

    @staticmethod
    def merge_media(samples: Sequence[dict[str, torch.Tensor] | None]) -> dict[str, torch.Tensor] | None:
        """`merge_media(samples)`, for code that holds a family but cannot import this module (the engines)."""
        return merge_media(samples)

    def decoding_positions(self, model: nn.Module) -> Callable[..., torch.Tensor] | None:
        """What the Hugging Face rollout engine applies to a prompt batch's positions, as
        `f(input_ids, positions, media)` (`model_position_ids`); None when they are the model's
        already."""
        if not self.has_own_positions():
            return None
        return lambda input_ids, positions, media: self.model_position_ids(model, input_ids, positions, media)

    def __repr__(self) -> str:
        return f"<model family {self.name!r}>"


CAUSAL_LM = ModelFamily()
MODEL_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Makes `family` serve the configs whose `model_type` it names. Returns it."""
    if not isinstance(family, ModelFamily):
        raise TypeError(f"register_family needs a ModelFamily instance, got {type(family).__name__}")
    if not family.model_types:
        raise ValueError(f"model family {family.name!r} names no model_types to serve")
    taken = [t for t in family.model_types if t in MODEL_FAMILIES]
    if taken:
        raise ValueError(f"model_type {taken[0]!r} is already served by the {MODEL_FAMILIES[taken[0]].name!r} family")
    for model_type in family.model_types:
        MODEL_FAMILIES[model_type] = family
    return family


def family_for(config: PretrainedConfig) -> ModelFamily:
    """The family serving `config.model_type`; `CAUSAL_LM` for a type no family names."""
    return MODEL_FAMILIES.get(getattr(config, "model_type", None), CAUSAL_LM)


def family_of(model: nn.Module) -> ModelFamily:
    """The family of a Hugging Face model (a peft model answers for its base model)."""
    config = getattr(model, "config", None)
    return family_for(config) if isinstance(config, PretrainedConfig) else CAUSAL_LM



def load_model(path: str | os.PathLike, *, trust_remote_code: bool = False, **options) -> PreTrainedModel:
    """The model of a checkpoint folder (or Hub id), loaded by the family of its config;
    `options` are `from_pretrained`'s (dtype, attn_implementation)."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    import_submodel_modules(config)
    return family_for(config).load(path, config, trust_remote_code=trust_remote_code, **options)


