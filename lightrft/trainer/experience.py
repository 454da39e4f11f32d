"""The typed containers that carry a rollout from the experience maker to the losses.

An `Experience` is a batch of sequences with everything the PPO losses need. It comes in two
layouts that share the per-action tensors exactly:
- padded: `sequences` (B, T) with prompts left-padded and responses right-padded; the last A
  positions are the action slots, so `sequences[:, -A:]` are the responses.
- packed: `sequences` (1, P), the real tokens of B sequences concatenated with no padding,
  `packed_seq_lens` their B lengths and `num_actions` their B response lengths.
In both, per-action tensors are (B, A) with each row's actions left-aligned and zero-padded on
the right, and `action_mask` (B, A) marks the real ones.
"""

from dataclasses import dataclass, field, fields, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

PER_ACTION_FIELDS = ("action_log_probs", "base_action_log_probs", "rollout_log_probs", "values",
                     "returns", "advantages", "kl")


@dataclass
class Experience:
    sequences: Tensor                       # (B, T) padded or (1, P) packed
    attention_mask: Optional[Tensor]        # (B, T) padded; None when packed
    action_mask: Tensor                     # (B, A) bool
    num_actions: int | list[int]            # A when padded; B response lengths when packed
    packed_seq_lens: Optional[list[int]]    # B sequence lengths when packed, else None
    action_log_probs: Optional[Tensor]      # (B, A) policy log-probs at rollout time ("old"); None when the
                                            # update is exactly on-policy and reuses its own forward
    advantages: Tensor                      # (B, A)
    returns: Tensor                         # (B, A)
    base_action_log_probs: Optional[Tensor] = None   # (B, A) reference policy
    rollout_log_probs: Optional[Tensor] = None       # (B, A) from the rollout engine
    values: Optional[Tensor] = None                  # (B, A) critic at rollout time
    kl: Optional[Tensor] = None                      # (B, A) per-token KL estimate
    info: dict[str, Tensor] = field(default_factory=dict)  # each (B,): reward, response_length, ...

    @property
    def batch_size(self) -> int:
        return self.action_mask.size(0)

    @property
    def loss_mask(self) -> Tensor:
        """The action tokens the losses train on: `action_mask` without the samples marked invalid
        (a failed reward source, or non-finite values). Shape: (B, A)."""
        if "valid" not in self.info:
            return self.action_mask
        return self.action_mask & self.info["valid"].bool().unsqueeze(1)

    def to(self, device: torch.device | str) -> "Experience":
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                moved[f.name] = value.to(device, non_blocking=True)
        moved["info"] = {k: v.to(device, non_blocking=True) for k, v in self.info.items()}
        return replace(self, **moved)


@dataclass
class Sample:
    """One sequence of an Experience without padding: what the replay buffer stores."""

    sequence: Tensor                 # (L,) prompt + response tokens, no padding
    num_actions: int                 # response length A_i (the last A_i tokens of `sequence`)
    per_action: dict[str, Tensor]    # each (A_i,): action_log_probs, advantages, returns, ...
    info: dict[str, Tensor]          # each a 0-d tensor


def split_experience(exp: Experience) -> list[Sample]:
    """Splits a padded Experience into unpadded Samples (one per row)."""
    if exp.packed_seq_lens is not None:
        raise ValueError("split_experience takes a padded Experience; this one is packed")
    samples = []
    response_lens = exp.action_mask.sum(dim=1).tolist()
    num_actions = exp.action_mask.size(1)
    for i, a_i in enumerate(response_lens):
        a_i = int(a_i)
        prompt_part = exp.sequences[i, :-num_actions][exp.attention_mask[i, :-num_actions].bool()]
        response_part = exp.sequences[i, -num_actions:][:a_i]
        per_action = {name: getattr(exp, name)[i, :a_i] for name in PER_ACTION_FIELDS
                      if getattr(exp, name) is not None}
        samples.append(Sample(sequence=torch.cat([prompt_part, response_part]), num_actions=a_i,
                              per_action=per_action, info={k: v[i] for k, v in exp.info.items()}))
    return samples


def _pad_rows(rows: list[Tensor], length: int, value: float = 0.0) -> Tensor:
    """Stacks 1-D tensors right-padded to `length`. Shape: (B, length)."""
    return torch.stack([F.pad(r, (0, length - r.numel()), value=value) for r in rows])


def collate_samples(samples: list[Sample], pad_token_id: int, packing: bool) -> Experience:
    """Builds an Experience from Samples, padded or packed; per-action tensors are identical."""
    num_actions = [s.num_actions for s in samples]
    width = max(max(num_actions), 1)
    action_mask = _pad_rows([torch.ones(a, dtype=torch.bool) for a in num_actions], width, False)
    per_action = {}
    for name in PER_ACTION_FIELDS:
        if name in samples[0].per_action:
            per_action[name] = _pad_rows([s.per_action[name] for s in samples], width)
    per_action.setdefault("action_log_probs", None)
    info = {k: torch.stack([s.info[k] for s in samples]) for k in samples[0].info}
    if packing:
        sequences = torch.cat([s.sequence for s in samples]).unsqueeze(0)      # (1, P)
        return Experience(sequences=sequences, attention_mask=None, action_mask=action_mask,
                          num_actions=num_actions, packed_seq_lens=[s.sequence.numel() for s in samples],
                          info=info, **per_action)
    prompts = [s.sequence[: s.sequence.numel() - s.num_actions] for s in samples]
    responses = [s.sequence[s.sequence.numel() - s.num_actions:] for s in samples]
    prompt_width = max(p.numel() for p in prompts)
    # Left-pad prompts and right-pad responses so the last `width` positions are the action slots.
    left = torch.stack([F.pad(p, (prompt_width - p.numel(), 0), value=pad_token_id) for p in prompts])
    right = _pad_rows(responses, width, pad_token_id)
    prompt_mask = torch.stack([F.pad(torch.ones_like(p), (prompt_width - p.numel(), 0)) for p in prompts])
    sequences = torch.cat([left, right], dim=1)                                 # (B, T)
    attention_mask = torch.cat([prompt_mask, action_mask.long()], dim=1)        # (B, T)
    return Experience(sequences=sequences, attention_mask=attention_mask, action_mask=action_mask,
                      num_actions=width, packed_seq_lens=None, info=info, **per_action)
