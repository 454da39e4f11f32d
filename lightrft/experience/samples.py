"""The typed containers that carry a rollout from the experience maker to the losses.

An `Experience` is a batch of sequences with everything the PPO losses need. It comes in two
layouts that share the per-action tensors exactly:
- padded: `sequences` (B, T) with prompts left-padded and responses right-padded; the last A
  positions are the action slots, so `sequences[:, -A:]` are the responses.
- packed: `sequences` (1, P), the real tokens of B sequences concatenated with no padding,
  `packed_seq_lens` their B lengths and `num_actions` their B response lengths.
In both, per-action tensors are (B, A) with each row's response positions left-aligned and
zero-padded on the right. `action_mask` (B, A) is the per-token loss mask: it marks the response
tokens that are the policy's and train. It may have holes (tool or environment output between two
assistant turns): those positions are real tokens, attended to and kept in place, that neither
train nor enter the advantages and the KL. The response layout (which slots hold tokens) is the
attention mask's, separate from it.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Optional

import torch
from torch import Tensor

from lightrft.models.media import merge_media
from lightrft.models.packing import prompt_group_ids

PER_ACTION_FIELDS = ("action_log_probs", "base_action_log_probs", "rollout_log_probs", "values",
                     "returns", "advantages", "kl", "teacher_log_probs")


@dataclass
class Experience:
    sequences: Tensor                       # (B, T) padded or (1, P) packed
    attention_mask: Optional[Tensor]        # (B, T) padded; None when packed
    action_mask: Tensor                     # (B, A) bool per-token loss mask over the response slots (may have holes)
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
    teacher_log_probs: Optional[Tensor] = None       # (B, A) distillation teacher (--teacher_pretrain)
    info: dict[str, Tensor] = field(default_factory=dict)  # each (B,): reward, response_length, ...
    prompt_groups: Optional[list[int]] = None        # packed: B host-side ids, equal for equal prompts
                                                     # (`packing.prompt_group_ids`): the forwards share them
    media: Optional[list[Optional[dict[str, Tensor]]]] = None   # B entries: each sample's prompt's model
                                                     # inputs (images) or None; None when no sample has any
    routes: Optional[Tensor] = None                  # (B, T, L, K) padded or (1, P, L, K) packed: per token,
                                                     # the experts routing replay replays (`RolloutOutput.routes`)

    @property
    def batch_size(self) -> int:
        return self.action_mask.size(0)

    def select(self, rows: Tensor) -> "Experience":
        """This padded experience restricted to `rows` (a 1-D index tensor), widths kept."""
        picked = {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), Tensor)}
        picked = {name: value[rows] for name, value in picked.items()}
        media = None if self.media is None else [self.media[i] for i in rows.tolist()]
        return replace(self, **picked, info={k: v[rows] for k, v in self.info.items()}, media=media)

    @property
    def merged_media(self) -> Optional[dict[str, Tensor]]:
        """The media of the whole batch or packed row, in sample order (`merge_media`), for the
        forward; None when no sample has any."""
        return None if self.media is None else merge_media(self.media)

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
    num_actions: int                 # response length A_i (the last A_i tokens of `sequence`), every
                                     # response position up to the last trained one kept in place
    action_mask: Tensor              # (A_i,) bool per-token loss mask: False on response tokens that do
                                     # not train (tool or environment output between turns)
    per_action: dict[str, Tensor]    # each (A_i,): action_log_probs, advantages, returns, ...
    info: dict[str, Tensor]          # each a 0-d tensor
    media: Optional[dict[str, Tensor]] = None   # its prompt's model inputs (images), None for text only
    routes: Optional[Tensor] = None             # (L, layers, K): its tokens' experts for routing replay


def response_lengths(exp: Experience) -> Tensor:
    """Per row of a padded Experience, the number of response slots to keep: up to the last slot
    that is attended to or trains, so holes in `action_mask` stay in place. Shape: (B,)."""
    num_actions = exp.action_mask.size(1)
    occupied = exp.action_mask.bool() | exp.attention_mask[:, exp.attention_mask.size(1) - num_actions:].bool()
    slot = torch.arange(1, num_actions + 1, device=occupied.device)                              # (A,)
    return (occupied * slot).amax(dim=1) if num_actions else occupied.new_zeros(occupied.size(0), dtype=torch.long)


def split_experience(exp: Experience) -> list[Sample]:
    """Splits a padded Experience into unpadded Samples (one per row): row i keeps its real prompt
    tokens and its response slots up to the last one attended to or trained (`response_lengths`),
    holes included, with its loss mask `action_mask[i]` over them. The Samples' tensors are views
    of a few flat tensors (one gather per field), not per-row copies."""
    if exp.packed_seq_lens is not None:
        raise ValueError("split_experience takes a padded Experience; this one is packed")
    num_actions = exp.action_mask.size(1)
    response_lens = response_lengths(exp)                                                          # (B,)
    kept = torch.arange(num_actions, device=response_lens.device) < response_lens.unsqueeze(1)   # (B, A)
    prompt_mask = exp.attention_mask[:, :exp.attention_mask.size(1) - num_actions].bool()
    tokens = torch.cat([prompt_mask, kept], dim=1)                                                # (B, T)
    lens = response_lens.tolist()
    sequences = exp.sequences[tokens].split(tokens.sum(dim=1).tolist())
    masks = exp.action_mask.bool()[kept].split(lens)
    per_action = {name: getattr(exp, name)[kept].split(lens) for name in PER_ACTION_FIELDS
                  if getattr(exp, name) is not None}
    info = {k: v.unbind(0) for k, v in exp.info.items()}
    media = exp.media or [None] * len(lens)
    routes = [None] * len(lens) if exp.routes is None else exp.routes[tokens].split(tokens.sum(dim=1).tolist())
    return [Sample(sequence=sequences[i], num_actions=int(a_i), action_mask=masks[i],
                   per_action={name: rows[i] for name, rows in per_action.items()},
                   info={k: rows[i] for k, rows in info.items()}, media=media[i], routes=routes[i])
            for i, a_i in enumerate(lens)]


def _left_aligned(rows: list[Tensor], mask: Tensor) -> Tensor:
    """The 1-D `rows` placed left-aligned in a zero (B, W) tensor; `mask` (B, W) marks each row's
    first len(row) slots. One scatter, not a pad per row. Shape: (B, W)."""
    flat = torch.cat(rows)
    out = flat.new_zeros(mask.shape)
    out[mask] = flat
    return out


def collate_samples(samples: list[Sample], pad_token_id: int, packing: bool) -> Experience:
    """Builds an Experience from Samples, padded or packed; per-action tensors are identical. The
    samples' loss masks become `action_mask` (holes kept); every response slot of a sample is
    attended to."""
    num_actions = [s.num_actions for s in samples]
    width = max(max(num_actions), 1)
    device = samples[0].sequence.device
    actions = torch.tensor(num_actions, device=device)
    slots = torch.arange(width, device=device) < actions.unsqueeze(1)                          # (B, A) layout
    action_mask = _left_aligned([s.action_mask.bool() for s in samples], slots)                # (B, A) loss mask
    per_action = {name: _left_aligned([s.per_action[name] for s in samples], slots)
                  for name in PER_ACTION_FIELDS if name in samples[0].per_action}
    per_action.setdefault("action_log_probs", None)
    info = {k: torch.stack([s.info[k] for s in samples]) for k in samples[0].info}
    seq_lens = [s.sequence.numel() for s in samples]
    media = [s.media for s in samples] if any(s.media for s in samples) else None
    routes = _sample_routes(samples)
    if packing:
        sequences = torch.cat([s.sequence for s in samples]).unsqueeze(0)      # (1, P)
        groups = prompt_group_ids([s.sequence for s in samples], num_actions)
        return Experience(sequences=sequences, attention_mask=None, action_mask=action_mask,
                          num_actions=num_actions, packed_seq_lens=seq_lens, info=info, prompt_groups=groups,
                          media=media, routes=None if routes is None else routes.unsqueeze(0), **per_action)
    # Prompts left-padded and responses right-padded, so the last `width` positions are the action
    # slots: row i's real tokens are the positions [P - prompt_i, P + actions_i).
    prompt_lens = torch.tensor(seq_lens, device=device) - actions
    prompt_width = int(prompt_lens.max())
    positions = torch.arange(prompt_width + width, device=device) - prompt_width                # (T,)
    real = (positions >= -prompt_lens.unsqueeze(1)) & (positions < actions.unsqueeze(1))   # (B, T)
    tokens = torch.cat([s.sequence for s in samples])
    sequences = torch.full(real.shape, pad_token_id, dtype=tokens.dtype)
    sequences[real] = tokens
    padded_routes = None
    if routes is not None:
        padded_routes = routes.new_full((*real.shape, *routes.shape[1:]), -1)
        padded_routes[real] = routes
    return Experience(sequences=sequences, attention_mask=real.long(), action_mask=action_mask,
                      num_actions=width, packed_seq_lens=None, info=info, media=media, routes=padded_routes,
                      **per_action)


def _sample_routes(samples: list[Sample]) -> Optional[Tensor]:
    """The samples' routes one token after another (P, L, K), a sample without any all -1; None
    when no sample has routes."""
    shaped = next((s.routes for s in samples if s.routes is not None), None)
    if shaped is None:
        return None
    return torch.cat([s.routes if s.routes is not None else shaped.new_full((s.sequence.numel(), *shaped.shape[1:]), -1)
                      for s in samples])


def split_by_tokens(lengths: Sequence[int], max_tokens: int, max_samples: Optional[int] = None) -> list[list[int]]:
    """The indices of consecutive samples of `lengths` (tokens each) cut into micro-batches in
    their order: each takes the next sample while its tokens stay within `max_tokens` and it holds
    fewer than `max_samples` (no limit when None); a sample longer than `max_tokens` goes alone.
    E.g. lengths [5, 3, 7, 2, 9], max_tokens 10 -> [[0, 1], [2, 3], [4]]."""
    batches: list[list[int]] = []
    tokens = 0
    for i, length in enumerate(lengths):
        full = max_samples is not None and batches and len(batches[-1]) >= max_samples
        if not batches or full or tokens + length > max_tokens:
            batches.append([])
            tokens = 0
        batches[-1].append(i)
        tokens += length
    return batches


def split_to_count(batches: list[list[int]], lengths: Sequence[int], count: int) -> list[list[int]]:
    """`batches` (from `split_by_tokens`) cut further until there are `count` of them, so every rank
    runs the same number of micro-batches per optimizer step: the one with the most tokens among
    those of two samples or more is halved (by samples), the halves staying in place. Needs `count`
    <= the number of samples."""
    batches = [list(b) for b in batches]
    if count > len(lengths):
        raise ValueError(f"cannot cut {len(lengths)} samples into {count} micro-batches")
    while len(batches) < count:
        k = max((k for k, b in enumerate(batches) if len(b) > 1), key=lambda k: sum(lengths[i] for i in batches[k]))
        half = len(batches[k]) // 2
        batches[k:k + 1] = [batches[k][:half], batches[k][half:]]
    return batches
