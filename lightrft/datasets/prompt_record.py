"""`PromptRecord`: a prompt's text together with what the model takes beside it.

A run's prompts travel as strings (reward functions, judges, logs and ledgers read the text). A
vision-language prompt is a `PromptRecord`, a string that also carries

- `token_ids`: the ids the engine and the trainer see, with every image's placeholder run
  already expanded by the model's processor (the text holds one marker per image);
- `marker_ids`: the same prompt's ids with one image marker per image, unexpanded: what an
  engine that expands placeholders itself (vLLM) takes with the images;
- `images`: the decoded images (PIL), for engines that take raw images;
- `media`: the model inputs of those images (`pixel_values` and the family's other keys), the
  tensors the trainer's forward and the Hugging Face engine's prefill take.

Text prompts stay plain strings; `prompt_token_ids` and `prompt_media` read either kind. Pickling
keeps the fields (explorer channels and checkpoints carry records whole); string operations
(`+`, `.strip()`) return plain strings, as a record's text is only its text.
"""

from typing import Any, Optional

from torch import Tensor

from lightrft.rollout.base import PromptImages


class PromptRecord(str):
    """A prompt text (the string itself) with its `token_ids`, `images` and `media` (module doc)."""

    token_ids: Optional[tuple[int, ...]]
    images: tuple[Any, ...]
    media: Optional[dict[str, Tensor]]
    marker_ids: Optional[tuple[int, ...]]

    def __new__(cls, text: str, token_ids=None, images=(), media: Optional[dict[str, Tensor]] = None,
                marker_ids=None):
        record = super().__new__(cls, text)
        record.token_ids = None if token_ids is None else tuple(int(t) for t in token_ids)
        record.images = tuple(images)
        record.media = media or None
        record.marker_ids = None if marker_ids is None else tuple(int(t) for t in marker_ids)
        return record

    def __repr__(self) -> str:
        return f"PromptRecord({str.__repr__(self)}, {len(self.images)} image(s))"


def prompt_token_ids(prompt: str) -> Optional[tuple[int, ...]]:
    """The ids a `PromptRecord` was tokenised to, or None for a plain string (tokenise its text)."""
    return getattr(prompt, "token_ids", None)


def prompt_images(prompt: str):
    """A prompt's images for an engine that expands placeholders itself (`PromptImages`), or None."""
    images = getattr(prompt, "images", ())
    if not images:
        return None
    return PromptImages(tuple(images), prompt.marker_ids, prompt.token_ids)


def prompt_media(prompt: str) -> Optional[dict[str, Tensor]]:
    """The model inputs a prompt carries beside its ids (images), or None for a text-only prompt."""
    return getattr(prompt, "media", None)
