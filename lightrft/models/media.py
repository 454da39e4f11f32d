"""Joining the media (images and the like) of a batch's samples for one forward. Pure torch, so
the experience containers can use it without importing transformers."""

from collections.abc import Sequence

import torch


def merge_media(samples: Sequence[dict[str, torch.Tensor] | None]) -> dict[str, torch.Tensor] | None:
    """The media of a batch or packed row from its samples' (None for a text-only sample): each
    key's tensors concatenated along dim 0 in sample order, the order of their placeholders in the
    row-major batch. None when no sample has any. Shape: per key, (n_i, ...) -> (sum n_i, ...)"""
    present = [sample for sample in samples if sample]
    if not present:
        return None
    keys = sorted(present[0])
    if any(sorted(sample) != keys for sample in present):
        fields = sorted({tuple(sorted(sample)) for sample in present})
        raise ValueError(f"the samples of one batch carry different media fields: {fields}")
    return {key: torch.cat([sample[key] for sample in present]) for key in keys}


def media_keywords(samples: Sequence[dict[str, torch.Tensor] | None] | None) -> dict:
    """`media=` with the samples' merged media (`merge_media`) for a forward that takes them, {}
    when there are none: what the experience forwards, scoring and training pass a model."""
    merged = merge_media(samples) if samples is not None else None
    return {"media": merged} if merged is not None else {}
