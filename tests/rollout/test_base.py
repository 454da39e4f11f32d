"""Sampling parameters, the output container and the per-step sampling functions, on hand-made
numbers."""

import math

import pytest
import torch

from lightrft.rollout import RolloutOutput, SamplingParams
from lightrft.rollout.sampling import filter_top_k_top_p, inverse_cdf_draw, sample_next_tokens


@pytest.mark.parametrize("field, value, words", [
    ("temperature", -0.1, "temperature must be >= 0"),
    ("top_p", 0.0, "top_p must be in"),
    ("top_p", 1.5, "top_p must be in"),
    ("top_k", -1, "top_k must be >= 0"),
    ("max_new_tokens", 0, "max_new_tokens must be >= 1"),
    ("n", 0, "n .samples per prompt. must be >= 1"),
    ("min_new_tokens", 65, "min_new_tokens must be in"),
])
def test_sampling_params_reject_bad_values(field, value, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**{field: value})


def test_greedy_flag():
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams(temperature=0.5).greedy


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    kept = filter_top_k_top_p(logits, top_k=2)
    assert torch.isfinite(kept).tolist() == [[False, True, True, False]]
    assert kept[0, 1] == 3.0 and kept[0, 2] == 2.0


@pytest.mark.parametrize("top_p, keep", [
    (1.0, [True, True, True]),
    # probabilities 0.5, 0.3, 0.2: mass before each token is 0, 0.5, 0.8
    (0.75, [True, True, False]),   # {0.5, 0.3} is the smallest set reaching 0.75
    (0.4, [True, False, False]),   # the top token alone reaches 0.4
    (1e-9, [True, False, False]),  # the top token is always kept
])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, keep):
    # Shuffled order checks that the mask is mapped back to vocabulary positions.
    logits = torch.tensor([[math.log(0.2), math.log(0.5), math.log(0.3)]])
    kept = torch.isfinite(filter_top_k_top_p(logits, top_p=top_p))
    assert kept.tolist() == [[keep[2], keep[0], keep[1]]]


def test_sample_next_tokens_greedy_reports_temperature_one_log_probs():
    # softmax([0, ln 3]) = [1/4, 3/4]
    logits = torch.tensor([[0.0, math.log(3.0)]])
    tokens, log_probs = sample_next_tokens(logits, 0.0, 0, 1.0, None)
    assert tokens.tolist() == [1]
    torch.testing.assert_close(log_probs, torch.tensor([math.log(0.75)]))


def test_sample_next_tokens_reports_the_tempered_distribution():
    # T = 2: softmax([0, ln 3 / 2]) = [1, sqrt 3] / (1 + sqrt 3); u = 0.9 lands on token 1.
    logits = torch.tensor([[0.0, math.log(3.0)]])
    tokens, log_probs = sample_next_tokens(logits, 2.0, 0, 1.0, torch.tensor([0.9]))
    assert tokens.tolist() == [1]
    torch.testing.assert_close(log_probs, torch.tensor([math.log(math.sqrt(3) / (1 + math.sqrt(3)))]))


def test_sample_next_tokens_reports_the_filtered_renormalised_distribution():
    # probabilities 0.5, 0.3, 0.2 at T = 1. top_k=2 keeps {0.5, 0.3}: renormalised 5/8 and 3/8.
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]]).expand(2, 3)
    tokens, log_probs = sample_next_tokens(logits, 1.0, 2, 1.0, torch.tensor([0.1, 0.7]))
    assert tokens.tolist() == [0, 1]  # 0.1 < 5/8 <= 0.7
    torch.testing.assert_close(log_probs, torch.tensor([math.log(5 / 8), math.log(3 / 8)]))
    # top_p=0.4 keeps the top token alone: probability 1.
    tokens, log_probs = sample_next_tokens(logits, 1.0, 0, 0.4, torch.tensor([0.1, 0.99]))
    assert tokens.tolist() == [0, 0]
    torch.testing.assert_close(log_probs, torch.zeros(2))


def test_banned_tokens_are_never_drawn_and_the_rest_is_renormalised():
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    tokens, log_probs = sample_next_tokens(logits, 0.0, 0, 1.0, None, banned_token_ids=torch.tensor([0]))
    assert tokens.tolist() == [1]
    torch.testing.assert_close(log_probs, torch.log_softmax(logits[:, 1:], -1)[:, 0])
    uniforms = torch.rand(500, generator=torch.Generator().manual_seed(0))
    drawn, _ = sample_next_tokens(logits.expand(500, 3), 1.0, 0, 1.0, uniforms, banned_token_ids=torch.tensor([0]))
    assert not drawn.eq(0).any() and drawn.eq(1).any() and drawn.eq(2).any()


def test_sampling_needs_uniforms():
    with pytest.raises(ValueError, match="one uniform draw per row"):
        sample_next_tokens(torch.zeros(1, 3), 1.0, 0, 1.0, None)


@pytest.mark.parametrize("u, token", [(0.0, 0), (0.24, 0), (0.25, 2), (0.74, 2), (0.75, 3), (0.999999, 3)])
def test_inverse_cdf_draw_picks_the_interval_holding_the_draw(u, token):
    # cumulative sums 0.25, 0.25, 0.75, 1.0 (exact in binary): token 1 has probability 0 and is
    # never drawn; a draw on a boundary belongs to the next interval.
    probs = torch.tensor([[0.25, 0.0, 0.5, 0.25]])
    assert inverse_cdf_draw(probs, torch.tensor([u])).tolist() == [token]


def test_inverse_cdf_draw_never_returns_a_zero_probability_tail_token():
    # Unnormalised probabilities and a draw at the very top: rounding may put the target past
    # the last positive entry; the zero-probability tail must still not be drawn.
    probs = torch.tensor([[0.3, 0.7, 0.0, 0.0]])
    assert inverse_cdf_draw(probs, torch.tensor([1.0 - 1e-17])).tolist() == [1]
    assert inverse_cdf_draw(probs, torch.tensor([1.0])).tolist() == [1]


def test_from_token_lists_pads_and_cuts_after_the_first_eos():
    out = RolloutOutput.from_token_lists(
        prompts=[[7, 8, 9], [5]],
        responses=[[10, 2, 11], [12, 13]],  # the first response ends at EOS=2; 11 is dropped
        log_probs=[[-0.1, -0.2, -0.3], [-0.4, -0.5]],
        pad_token_id=0, eos_token_ids=[2])
    assert out.prompt_len == 3 and out.num_actions == 2
    assert out.sequences.tolist() == [[7, 8, 9, 10, 2], [0, 0, 5, 12, 13]]
    assert out.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]
    assert out.action_mask.tolist() == [[True, True], [True, True]]
    torch.testing.assert_close(out.rollout_log_probs, torch.tensor([[-0.1, -0.2], [-0.4, -0.5]]))
    assert out.response_lengths.tolist() == [2, 2]
    assert out.truncated.tolist() == [False, True]  # the second never reached EOS

    ragged = RolloutOutput.from_token_lists([[4], [4]], [[2], [6, 6, 6]], [[-1.0], [-1.0, -2.0, -3.0]], 0, [2])
    assert ragged.sequences.tolist() == [[4, 2, 0, 0], [4, 6, 6, 6]]
    assert ragged.action_mask.tolist() == [[True, False, False], [True, True, True]]
    assert ragged.rollout_log_probs[0].tolist() == [-1.0, 0.0, 0.0]


def test_from_token_lists_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="one entry per sample"):
        RolloutOutput.from_token_lists([[1]], [[2], [3]], [[0.0], [0.0]], 0, [2])
    with pytest.raises(ValueError, match="sample 0: 2 response tokens but 1 log-probs"):
        RolloutOutput.from_token_lists([[1]], [[3, 2]], [[0.0]], 0, [2])


def test_concat_pads_prompts_left_and_responses_right():
    first = RolloutOutput.from_token_lists([[7, 8, 9]], [[10, 2]], [[-0.1, -0.2]], 0, [2])
    second = RolloutOutput.from_token_lists([[5], [6]], [[12, 13, 14], [2]], [[-0.4, -0.5, -0.6], [-0.7]], 0, [2])
    out = RolloutOutput.concat([first, second], pad_token_id=0)
    assert out.prompt_len == 3 and out.num_actions == 3
    assert out.sequences.tolist() == [[7, 8, 9, 10, 2, 0], [0, 0, 5, 12, 13, 14], [0, 0, 6, 2, 0, 0]]
    assert out.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0]]
    assert out.action_mask.tolist() == [[True, True, False], [True, True, True], [True, False, False]]
    torch.testing.assert_close(out.rollout_log_probs,
                               torch.tensor([[-0.1, -0.2, 0.0], [-0.4, -0.5, -0.6], [-0.7, 0.0, 0.0]]))
    assert out.truncated.tolist() == [False, True, False]
    assert torch.equal(out.responses, out.sequences[:, 3:])
    assert RolloutOutput.concat([first], 0) is first
    with pytest.raises(ValueError, match="at least one part"):
        RolloutOutput.concat([], 0)
