"""Right padding of variable-length id sequences into a batch."""

import torch


def right_pad(seqs: list[torch.Tensor], pad_value: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacks 1-D long tensors, padding each on the right with `pad_value` to `width` (default: the
    longest). Returns (values, attention_mask), both (B, width); the mask is 1 on real tokens."""
    width = width or max(len(s) for s in seqs)
    values = torch.full((len(seqs), width), pad_value, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, seq in enumerate(seqs):
        values[i, : len(seq)] = seq
        mask[i, : len(seq)] = 1
    return values, mask
