"""`PromptRecord`: a prompt as it travels through a run, encoded once.

The prompt dataset builds one per row, once, and everything after it reads its fields by name:

- `text`: what reward sources, judges, workflows and logs read (for a truncated prompt, the
  text of the ids it kept);
- `token_ids`: the ids the engine and the trainer see, always set: the prompt encoded as rollouts
  encode it (the chat template's text with its special tokens, or the tokenizer's own around raw
  text), cut to `--prompt_max_len` where asked, with every image's placeholder run expanded by
  the model's processor (the text holds one marker per image);
- `images`: the decoded images (PIL), for engines that take raw images;
- `media`: the model inputs of those images (`pixel_values` and the family's other keys), the
  tensors the trainer's forward and the Hugging Face engine's prefill take;
- `marker_ids`: the ids with one image marker per image, unexpanded: what an engine that
  expands placeholders itself (vLLM) takes with the images.

It is frozen and no string: text operations go through `.text`, so nothing silently drops the
ids or the images. Records pickle whole (explorer channels carry them). Code that still hands a
plain string where a prompt goes (the classic `NaiveExperienceMaker` calls, a test) gets it
encoded where it is used (`lightrft.experience.generation.encode_rollout_prompts`).
"""

from dataclasses import dataclass
from typing import Any, Optional, Union

from torch import Tensor

from lightrft.rollout.base import PromptImages


@dataclass(frozen=True, eq=False)
class PromptRecord:
    """A prompt's text, its token ids and its images (module doc)."""

    text: str
    token_ids: tuple[int, ...]
    images: tuple[Any, ...] = ()
    media: Optional[dict[str, Tensor]] = None        # the images' model inputs; None without images
    marker_ids: Optional[tuple[int, ...]] = None     # the ids with one marker per image (vLLM's input)

    def __post_init__(self):
        if not isinstance(self.text, str):
            raise TypeError(f"PromptRecord.text must be a str, got {type(self.text).__name__}")
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        object.__setattr__(self, "images", tuple(self.images))
        object.__setattr__(self, "media", self.media or None)
        if self.marker_ids is not None:
            object.__setattr__(self, "marker_ids", tuple(int(t) for t in self.marker_ids))

    def __str__(self) -> str:
        return self.text

    def __eq__(self, other) -> bool:
        """Records are equal when their text, ids and images are (media follow from the images)."""
        if not isinstance(other, PromptRecord):
            return NotImplemented
        return (self.text, self.token_ids, self.marker_ids) == (other.text, other.token_ids, other.marker_ids) and \
            len(self.images) == len(other.images) and all(a is b or a == b for a, b in zip(self.images, other.images))

    __hash__ = None          # records hold images and tensors: not for sets or dict keys

    def __repr__(self) -> str:
        return f"PromptRecord({self.text!r}, {len(self.token_ids)} ids, {len(self.images)} image(s))"


Prompt = Union[PromptRecord, str]     # what a rollout takes: a record, or a text to encode where it is used


def prompt_text(prompt: Prompt) -> str:
    """The text of a prompt (a record's `text`, or the string itself)."""
    return prompt.text if isinstance(prompt, PromptRecord) else str(prompt)


def prompt_token_ids(prompt: Prompt) -> Optional[tuple[int, ...]]:
    """A record's ids, or None for a plain string (encode its text)."""
    return prompt.token_ids if isinstance(prompt, PromptRecord) else None


def prompt_images(prompt: Prompt) -> Optional[PromptImages]:
    """A prompt's images for an engine that expands placeholders itself (`PromptImages`), or None."""
    if not isinstance(prompt, PromptRecord) or not prompt.images:
        return None
    return PromptImages(prompt.images, prompt.marker_ids, prompt.token_ids)


def prompt_media(prompt: Prompt) -> Optional[dict[str, Tensor]]:
    """The model inputs a prompt carries beside its ids (images), or None for a text-only prompt."""
    return prompt.media if isinstance(prompt, PromptRecord) else None
