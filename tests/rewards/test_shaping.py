"""DAPO overlong penalty (arXiv 2503.14476, eq. 13) on hand-computed numbers."""

import pytest
import torch

from lightrft.rewards import overlong_penalty


def test_overlong_penalty_hand_computed():
    # L_max = 20, L_cache = 5, so the penalty starts after L_max - L_cache = 15 tokens:
    #   |y| = 10, 15 -> 0;  16 -> (15 - 16) / 5 = -0.2;  18 -> -0.6;  20 -> -1.0;  21 -> -1 (past L_max)
    lengths = torch.tensor([10, 15, 16, 18, 20, 21])
    torch.testing.assert_close(overlong_penalty(lengths, max_len=20, buffer_len=5),
                               torch.tensor([0.0, 0.0, -0.2, -0.6, -1.0, -1.0]))
    # penalty_factor scales every value: 0.5 * the above
    torch.testing.assert_close(overlong_penalty(lengths, max_len=20, buffer_len=5, penalty_factor=0.5),
                               torch.tensor([0.0, 0.0, -0.1, -0.3, -0.5, -0.5]))


def test_buffer_as_long_as_the_limit_penalises_from_the_first_token():
    # L_cache = L_max = 4: (0 - |y|) / 4
    torch.testing.assert_close(overlong_penalty(torch.tensor([0, 1, 2, 4]), 4, 4),
                               torch.tensor([0.0, -0.25, -0.5, -1.0]))


def test_output_is_float32_and_shaped_like_the_input():
    out = overlong_penalty(torch.tensor([3, 9], dtype=torch.long), 10, 2)
    assert out.dtype == torch.float32 and out.shape == (2,)


@pytest.mark.parametrize("kwargs, words", [
    ({"buffer_len": 0}, "--overlong_buffer_len"),
    ({"buffer_len": 11}, r"max_len=10"),
    ({"buffer_len": 2, "penalty_factor": -1.0}, "--overlong_penalty_factor"),
])
def test_bad_settings_raise(kwargs, words):
    with pytest.raises(ValueError, match=words):
        overlong_penalty(torch.tensor([1]), max_len=10, **kwargs)
