"""Index arithmetic of packed sequences, checked against hand-computed positions."""

import pytest
import torch

from lightrft.models.packing import (
    cu_seqlens,
    pack_padded,
    pack_sequences,
    packed_action_index,
    packed_position_ids,
)


def test_pack_sequences_concatenates_and_restarts_positions():
    packed = pack_sequences([torch.tensor([5, 6]), torch.tensor([7, 8, 9]), torch.tensor([10])])
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert packed.position_ids.tolist() == [[0, 1, 0, 1, 2, 0]]
    assert packed.seq_lens == [2, 3, 1]


def test_cu_seqlens_are_cumulative_starts():
    # lengths 2, 3, 1 -> starts 0, 0+2, 2+3, 5+1
    assert cu_seqlens([2, 3, 1]).tolist() == [0, 2, 5, 6]
    assert cu_seqlens([2, 3, 1]).dtype == torch.int32
    assert packed_position_ids([1, 1]).tolist() == [[0, 0]]


def test_pack_padded_drops_left_and_right_pads():
    sequences = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 4, 0, 0], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    packed = pack_padded(sequences, mask)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 4, 1, 2, 3, 4, 5]]
    assert packed.seq_lens == [3, 3, 5]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 4]]


def test_pack_padded_rejects_holes_and_empty_rows():
    with pytest.raises(ValueError, match="contiguous"):
        pack_padded(torch.tensor([[5, 0, 6]]), torch.tensor([[1, 0, 1]]))
    with pytest.raises(ValueError, match="at least one real token"):
        pack_padded(torch.tensor([[5, 6], [0, 0]]), torch.tensor([[1, 1], [0, 0]]))


def test_action_index_by_hand():
    # Sequence 0: offsets 0..3, last 2 tokens (2, 3) are actions, predicted from positions 1, 2.
    # Sequence 1: offsets 4..6, last token (6) is the action, predicted from position 5.
    index = packed_action_index([4, 3], [2, 1])
    assert index.token_positions.tolist() == [2, 3, 6]
    assert index.predict_positions.tolist() == [1, 2, 5]
    assert index.rows.tolist() == [0, 0, 1]
    assert index.cols.tolist() == [0, 1, 0]
    assert index.to_rows(torch.tensor([1.0, 2.0, 3.0])).tolist() == [[1.0, 2.0], [3.0, 0.0]]


def test_action_index_scatter_is_differentiable():
    flat = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    out = packed_action_index([4, 3], [2, 1]).to_rows(flat)
    (out * torch.tensor([[10.0, 20.0], [30.0, 40.0]])).sum().backward()
    # d/dflat = the weights at the (row, col) each value lands on; the pad slot (1, 1) is dropped
    assert flat.grad.tolist() == [10.0, 20.0, 30.0]


def test_action_index_needs_a_prompt_token():
    with pytest.raises(ValueError, match="packed sequence 1 has length 3 and 3 actions"):
        packed_action_index([4, 3], [2, 3])
    with pytest.raises(ValueError, match="num_actions has 1 entries but there are 2"):
        packed_action_index([4, 3], [2])
