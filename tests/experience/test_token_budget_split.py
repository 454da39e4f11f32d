"""Cutting an optimizer step's samples into micro-batches by tokens (--micro_train_max_tokens),
on hand-computed lengths."""

import pytest

from lightrft.experience.samples import split_by_tokens, split_to_count


def test_samples_fill_micro_batches_in_order_up_to_the_budget():
    assert split_by_tokens([5, 3, 7, 2, 9], 10) == [[0, 1], [2, 3], [4]]
    # a sample longer than the budget goes alone; the sample count still bounds a micro-batch
    assert split_by_tokens([12, 1, 1, 1, 30, 2], 10) == [[0], [1, 2, 3], [4], [5]]
    assert split_by_tokens([1, 1, 1, 1, 1], 10, max_samples=2) == [[0, 1], [2, 3], [4]]
    assert split_by_tokens([], 10) == []


def test_a_rank_with_fewer_micro_batches_halves_its_largest():
    lengths = [5, 3, 7, 2, 9]
    assert split_to_count([[0, 1], [2, 3], [4]], lengths, 4) == [[0, 1], [2], [3], [4]]
    assert split_to_count([[0, 1, 2, 3, 4]], lengths, 3) == [[0, 1], [2], [3, 4]]
    assert split_to_count([[0, 1], [2, 3], [4]], lengths, 3) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="5 samples into 6"):
        split_to_count([[0], [1], [2], [3], [4]], lengths, 6)
