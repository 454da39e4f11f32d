import pytest
import torch

import lightrft.algorithms as algorithms
from lightrft.models.utils import (
    compute_approx_kl,
    compute_reward,
    log_probs_from_logits,
    masked_mean,
    unpacking_samples,
)
from lightrft.utils.tiny import build_char_tokenizer, build_tiny_causal_lm


def test_reexports_are_the_algorithms():
    assert masked_mean is algorithms.masked_mean
    assert compute_approx_kl is algorithms.compute_approx_kl
    assert log_probs_from_logits is algorithms.log_probs_from_logits
    # the original call conventions
    x = torch.tensor([[1.0, 2.0, 3.0]])
    assert masked_mean(x, torch.tensor([[1, 0, 1]]), dim=-1).item() == 2.0
    kl = compute_approx_kl(torch.tensor([[0.5]]), torch.tensor([[0.0]]), torch.ones(1, 1), kl_estimator="k2")
    assert kl.item() == pytest.approx(0.125)


def test_unpacking_samples():
    values = torch.arange(7.0)[None]  # (1, P) with one pad at the end
    pieces = unpacking_samples(values, [2, 3, 1])
    assert [p.tolist() for p in pieces] == [[0.0, 1.0], [2.0, 3.0, 4.0], [5.0]]
    assert [p.tolist() for p in unpacking_samples(values[0], [3, 4])] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0, 6.0]]
    with pytest.raises(ValueError, match=r"packed_seq_lens sum to 8 but the packed row has only 7 values"):
        unpacking_samples(values, [4, 4])
    with pytest.raises(ValueError, match=r"packed values must have shape \(1, P\) or \(P,\)"):
        unpacking_samples(torch.zeros(2, 3), [3])


def test_compute_reward_by_hand():
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # -0.5 kl, plus r on the last response token (t=2 in row 0, t=1 in row 1)
    out = compute_reward(torch.tensor([1.0, 2.0]), 0.5, kl, mask)
    torch.testing.assert_close(out, torch.tensor([[-0.05, -0.1, 0.85], [-0.2, 2 - 0.25, 0.0]]))


def test_log_probs_of_a_real_model_match_its_own_loss():
    """On a tiny Llama: the mean of -log p(next token) equals the model's own next-token loss."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, arch="llama", seed=3)
    input_ids = torch.randint(4, 100, (3, 7), generator=torch.Generator().manual_seed(1))
    output = model(input_ids=input_ids, labels=input_ids)
    log_probs = log_probs_from_logits(output.logits[:, :-1], input_ids[:, 1:], chunk_size=5)  # (3, 6)
    assert log_probs.shape == (3, 6) and log_probs.dtype == torch.float32
    torch.testing.assert_close(-log_probs.mean(), output.loss)
