"""Packed sequences: several sequences concatenated in one row, with no attention across borders.

A packed batch of N sequences with lengths L_1..L_N is one row of P = sum(L_i) tokens. Position
ids restart at 0 for every sequence, and the attention implementation (see
`lightrft.models.hf_utils.packed_forward_kwargs`) keeps each token from attending to tokens of
other sequences, so every sequence gets exactly the activations it would get alone. Compared with
a padded (N, max L_i) batch, no compute is spent on pad tokens.

The helpers here are pure index arithmetic on host-side lengths (Python lists), so building a
packed batch never waits on the accelerator.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

import torch


@dataclass
class PackedBatch:
    """Sequences concatenated in one row."""

    input_ids: torch.Tensor  # (1, P) token ids of all sequences, back to back
    position_ids: torch.Tensor  # (1, P) restart at 0 at every sequence start
    seq_lens: list[int]  # N lengths, sum(seq_lens) == P


# The forward keyword that carries a row split over a sequence-parallel group to the attention
# (`lightrft.models.sequence_parallel.RowSplit`, read by `attention.varlen_attention`).
SPLIT_KEYWORD = "sequence_split"


def check_seq_lens(seq_lens: Sequence[int], total: int) -> list[int]:
    """Validates packed lengths against the packed row length and returns them as a list of ints."""
    seq_lens = [int(n) for n in seq_lens]
    if not seq_lens or min(seq_lens) < 1:
        raise ValueError(f"packed_seq_lens must be a non-empty list of positive lengths, got {seq_lens}")
    if sum(seq_lens) != total:
        raise ValueError(
            f"packed_seq_lens sum to {sum(seq_lens)} but the packed row has {total} tokens; "
            "pass one length per packed sequence, covering the whole row"
        )
    return seq_lens


def check_num_actions(num_actions, sequences: torch.Tensor, packed_seq_lens: Sequence[int] | None) -> None:
    """Padded batches take one int A in [1, T - 1]; packed rows take one count per sequence."""
    if packed_seq_lens is None:
        if isinstance(num_actions, bool) or not isinstance(num_actions, Integral) or not 0 < num_actions < sequences.size(1):
            raise ValueError(
                f"num_actions must be an int in [1, T - 1] for a padded batch of length T={sequences.size(1)}, "
                f"got {num_actions!r}"
            )
    elif isinstance(num_actions, Integral) or len(num_actions) != len(packed_seq_lens):
        raise ValueError(
            f"a packed row of {len(packed_seq_lens)} sequences needs num_actions as a list of "
            f"{len(packed_seq_lens)} counts, got {num_actions!r}"
        )


def upload(tensor: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """A tensor built on the host, copied to `device` without waiting for the device: a plain
    `.to(device)` makes PyTorch synchronise the CUDA stream after the copy, which stalled every
    packed micro-batch five times on the first GPU profile. The source is a fresh host tensor that
    nothing writes afterwards, so the asynchronous copy reads what it was given."""
    return tensor.to(device, non_blocking=True)


def packed_position_ids(seq_lens: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """Position ids that restart at 0 at every sequence start.

    Example: lengths [2, 3, 1] give [[0, 1, 0, 1, 2, 0]].
    Shape: (1, P)
    """
    return upload(torch.cat([torch.arange(n) for n in seq_lens]).unsqueeze(0), device)


def cu_seqlens(seq_lens: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """Cumulative sequence starts in the format of flash-attention's varlen kernels.

    Example: lengths [2, 3, 1] give [0, 2, 5, 6] (int32).
    Shape: (N + 1,)
    """
    starts = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(list(seq_lens), dtype=torch.int32).cumsum(0)
    return upload(starts, device)


def pack_sequences(sequences: Sequence[torch.Tensor]) -> PackedBatch:
    """Concatenates 1-D token tensors into one row with restarting position ids.

    Shape: N tensors (L_i,) -> input_ids (1, P), position_ids (1, P), with P = sum(L_i)
    """
    if len(sequences) == 0:
        raise ValueError("pack_sequences needs at least one sequence")
    for i, seq in enumerate(sequences):
        if seq.ndim != 1 or seq.numel() == 0:
            raise ValueError(f"sequence {i} must be a non-empty 1-D tensor of token ids, got shape {tuple(seq.shape)}")
    seq_lens = [int(seq.numel()) for seq in sequences]
    input_ids = torch.cat(list(sequences)).unsqueeze(0)  # (1, P)
    return PackedBatch(input_ids, packed_position_ids(seq_lens, input_ids.device), seq_lens)


def pack_padded(sequences: torch.Tensor, attention_mask: torch.Tensor) -> PackedBatch:
    """Packs a padded batch by dropping its pad tokens.

    Each row's real tokens must be contiguous (prompts left-padded, responses right-padded, as the
    rollout engines produce them). Reads the lengths back to the host once.
    Shape: sequences (B, T), attention_mask (B, T) -> input_ids (1, P), P = attention_mask.sum()
    """
    if sequences.shape != attention_mask.shape or sequences.ndim != 2:
        raise ValueError(
            f"sequences {tuple(sequences.shape)} and attention_mask {tuple(attention_mask.shape)} must be the same (B, T)"
        )
    mask = attention_mask.bool()
    seq_lens = mask.sum(dim=1).tolist()
    if min(seq_lens) < 1:
        raise ValueError("every row of attention_mask needs at least one real token to be packed")
    first = mask.long().argmax(dim=1)  # (B,) first real token of each row
    span = torch.arange(mask.size(1), device=mask.device).unsqueeze(0)  # (1, T)
    contiguous = (span >= first.unsqueeze(1)) & (span < (first + mask.sum(dim=1)).unsqueeze(1))  # (B, T)
    if not torch.equal(contiguous, mask):
        raise ValueError("pack_padded needs the real tokens of each row to be contiguous (pads only on the sides)")
    input_ids = sequences[mask].unsqueeze(0)  # (1, P), row-major order keeps each sequence in order
    return PackedBatch(input_ids, packed_position_ids(seq_lens, input_ids.device), seq_lens)


@dataclass
class ActionIndex:
    """Where the action tokens of packed sequences sit, and where they go in the (N, A) layout.

    For sequence i starting at offset o_i with length L_i and a_i actions, its action tokens are
    at o_i + L_i - a_i ... o_i + L_i - 1; the logits that predict them are one position earlier.
    """

    predict_positions: torch.Tensor  # (K,) positions in the packed row whose outputs predict an action token
    rows: torch.Tensor  # (K,) row of each action in the (N, A) layout
    cols: torch.Tensor  # (K,) column of each action in the (N, A) layout (actions left-aligned)
    num_rows: int  # N
    num_cols: int  # A = max(num_actions)

    @property
    def token_positions(self) -> torch.Tensor:
        """Positions of the action tokens themselves. Shape: (K,)"""
        return self.predict_positions + 1

    def to_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """Scatters per-action values into the right-padded (N, A) layout, padding with 0.

        Differentiable with respect to `flat`.
        Shape: (K,) -> (N, A)
        """
        out = flat.new_zeros(self.num_rows, self.num_cols)
        return out.index_put((self.rows, self.cols), flat)


def packed_action_index(
    seq_lens: Sequence[int], num_actions: Sequence[int], device: torch.device | str | None = None
) -> ActionIndex:
    """Index of the action tokens of packed sequences; each sequence needs at least one non-action token
    before its actions (the prompt), since the first token of a sequence is predicted by nothing.

    Example: lengths [4, 3], actions [2, 1] -> action tokens at [2, 3, 6], predicted from [1, 2, 5],
    placed at (row, col) (0, 0), (0, 1), (1, 0) of a (2, 2) layout.
    """
    seq_lens, num_actions = list(seq_lens), [int(a) for a in num_actions]
    if len(num_actions) != len(seq_lens):
        raise ValueError(f"num_actions has {len(num_actions)} entries but there are {len(seq_lens)} packed sequences")
    for i, (length, actions) in enumerate(zip(seq_lens, num_actions)):
        if not 0 <= actions < length:
            raise ValueError(
                f"packed sequence {i} has length {length} and {actions} actions; "
                "the actions must leave at least one prompt token before them"
            )
    lens = torch.tensor(seq_lens)  # (N,)
    acts = torch.tensor(num_actions)  # (N,)
    ends = lens.cumsum(0)  # (N,) one past the last token of each sequence
    rows = torch.repeat_interleave(torch.arange(len(seq_lens)), acts)  # (K,)
    first_action = torch.repeat_interleave(acts.cumsum(0) - acts, acts)  # (K,) index in the flat list where each row starts
    cols = torch.arange(sum(num_actions)) - first_action  # (K,) (the count from the host list: no tensor read)
    token_positions = (ends - acts)[rows] + cols  # (K,)
    return ActionIndex(
        predict_positions=upload(token_positions - 1, device),
        rows=upload(rows, device),
        cols=upload(cols, device),
        num_rows=len(seq_lens),
        num_cols=max(num_actions),
    )


@dataclass
class SharedPromptLayout:
    """A packed row in which the sequences that share a prompt hold it once.

    Sequences with the same prompt (their first L_i - a_i tokens) form a group. The shared row
    holds, group after group, the prompt's tokens once and then each member's response tokens;
    positions continue the prompt's in every response, so each token gets the position it has
    alone. Attention runs over segments: a prompt attends causally to itself, a response to its
    prompt and causally to itself (keys `prompt + response`, queries aligned to the end, as
    flash-attention aligns unequal lengths). The segments' queries are the shared row in order;
    their keys are gathered with `kv_index`, so the backward of that gather sums each prompt's
    key and value gradients over its responses.

    Host-side lists (`q_lens`, `kv_spans`) serve the per-segment loop on the CPU; the uploaded
    tensors serve the one-call varlen kernel. `calls` counts the attention layers that applied
    the layout in the last forward: a model that dropped it would silently attend across the row.
    """

    source: torch.Tensor  # (S,) position in the original packed row of each shared-row token
    position_ids: torch.Tensor  # (1, S)
    predict_positions: torch.Tensor  # (K,) shared-row positions whose outputs predict each action (original order)
    last_positions: torch.Tensor  # (N,) shared-row position of each sequence's last token
    kv_index: torch.Tensor  # (sum of key lengths,) shared-row positions of every segment's keys
    cu_seqlens_q: torch.Tensor  # (M + 1,) int32 segment starts in the shared row
    cu_seqlens_k: torch.Tensor  # (M + 1,) int32 segment starts in `kv_index`
    max_q: int
    max_k: int
    q_lens: list[int]  # M segment lengths (queries)
    kv_spans: list[list[tuple[int, int]]]  # per segment, the (start, stop) spans of the shared row it attends to
    length: int  # S
    groups: int  # distinct prompts
    multiplicity: torch.Tensor = None  # (S,) float: the sequences each shared-row token stands for
    calls: int = 0


def shared_prompt_layout(seq_lens: Sequence[int], num_actions: Sequence[int], groups: Sequence[int],
                         device: torch.device | str | None = None) -> SharedPromptLayout | None:
    """The `SharedPromptLayout` of a packed row whose sequence i belongs to prompt group
    `groups[i]` (equal ids: equal prompt tokens), or None when no two sequences share a prompt.
    Pure index arithmetic on host lists; the tensors are uploaded without waiting.

    Example: lengths [5, 4], actions [2, 1], groups [0, 0] (prompt of 3 tokens) -> shared row
    = original positions [0, 1, 2, 3, 4, 8] with positions [0, 1, 2, 3, 4, 3]; segments: prompt
    (queries 0-2, keys 0-2), response 1 (queries 3-4, keys 0-4), response 2 (query 5, keys 0-2, 5).
    """
    seq_lens, num_actions, groups = list(seq_lens), [int(a) for a in num_actions], list(groups)
    if not len(seq_lens) == len(num_actions) == len(groups):
        raise ValueError(f"{len(seq_lens)} packed sequences need as many action counts and prompt groups, got "
                         f"{len(num_actions)} and {len(groups)}")
    members: dict = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    if len(members) == len(seq_lens):
        return None
    starts = [0]
    for length in seq_lens[:-1]:
        starts.append(starts[-1] + length)
    source, positions, q_lens, kv_spans, multiplicity = [], [], [], [], []
    predict = [0] * len(seq_lens)  # per sequence, the shared-row position predicting its first action
    response_start = [0] * len(seq_lens)
    for rows in members.values():
        prompt = seq_lens[rows[0]] - num_actions[rows[0]]
        if prompt < 1:
            raise ValueError(f"packed sequence {rows[0]} has no prompt token before its {num_actions[rows[0]]} actions")
        if any(seq_lens[i] - num_actions[i] != prompt for i in rows):
            raise ValueError(f"packed sequences {rows} are in one prompt group but their prompts have different lengths")
        prompt_start = len(source)
        multiplicity.extend([len(rows)] * prompt)
        source.extend(range(starts[rows[0]], starts[rows[0]] + prompt))
        positions.extend(range(prompt))
        q_lens.append(prompt)
        kv_spans.append([(prompt_start, prompt_start + prompt)])
        for i in rows:
            predict[i] = prompt_start + prompt - 1
            response_start[i] = len(source)
            if num_actions[i] == 0:
                continue
            multiplicity.extend([1] * num_actions[i])
            source.extend(range(starts[i] + prompt, starts[i] + seq_lens[i]))
            positions.extend(range(prompt, seq_lens[i]))
            q_lens.append(num_actions[i])
            kv_spans.append([(prompt_start, prompt_start + prompt), (response_start[i], len(source))])
    last_positions = [response_start[i] + num_actions[i] - 1 if num_actions[i] else predict[i]
                      for i in range(len(seq_lens))]
    predict_positions = [p for i in range(len(seq_lens)) for p in
                         [predict[i]] + list(range(response_start[i], response_start[i] + num_actions[i] - 1))
                         if num_actions[i] > 0]
    kv_index = [p for spans in kv_spans for start, stop in spans for p in range(start, stop)]
    k_lens = [sum(stop - start for start, stop in spans) for spans in kv_spans]
    return SharedPromptLayout(
        source=upload(torch.tensor(source), device),
        position_ids=upload(torch.tensor(positions).unsqueeze(0), device),
        predict_positions=upload(torch.tensor(predict_positions, dtype=torch.long), device),
        last_positions=upload(torch.tensor(last_positions, dtype=torch.long), device),
        kv_index=upload(torch.tensor(kv_index), device),
        cu_seqlens_q=cu_seqlens(q_lens, device),
        cu_seqlens_k=cu_seqlens(k_lens, device),
        max_q=max(q_lens),
        max_k=max(k_lens),
        q_lens=q_lens,
        kv_spans=kv_spans,
        length=len(source),
        groups=len(members),
        multiplicity=upload(torch.tensor(multiplicity, dtype=torch.float32), device),
    )


def prompt_group_ids(sequences: Sequence[torch.Tensor], num_actions: Sequence[int]) -> list[int]:
    """For each 1-D token sequence, the index of the first sequence with the same prompt (its first
    len - num_actions tokens, compared by value): equal ids, equal prompts. Reads the tokens on
    the host (a device copy for sequences that live on an accelerator).

    Example: prompts [1, 2], [3], [1, 2] -> [0, 1, 0]."""
    first: dict[bytes, int] = {}
    ids = []
    for i, (seq, actions) in enumerate(zip(sequences, num_actions)):
        prompt = seq[:seq.numel() - int(actions)].cpu().numpy()
        ids.append(first.setdefault(prompt.tobytes() + str(prompt.dtype).encode(), i))
    return ids
