import pytest
import torch

from lightrft.algorithms.logprobs import entropy_from_logits, log_probs_from_logits

F64 = torch.float64


def naive_log_probs(logits, labels, temperature=1.0):
    return torch.log_softmax(logits / temperature, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def naive_entropy(logits, temperature=1.0):
    log_p = torch.log_softmax(logits / temperature, -1)
    return -(log_p.exp() * log_p).sum(-1)


def batch(seed, B=3, T=5, V=11, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(B, T, V, generator=gen, dtype=dtype)
    labels = torch.randint(0, V, (B, T), generator=gen)
    return logits, labels


@pytest.mark.parametrize("chunk_size", [1, 3, 5, 7, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_equal_naive_values_and_gradients(chunk_size, temperature):
    logits, labels = batch(0)
    upstream = torch.randn(3, 5, dtype=F64, generator=torch.Generator().manual_seed(1))
    ours_in, naive_in = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    ours = log_probs_from_logits(ours_in, labels, temperature, chunk_size=chunk_size)
    naive = naive_log_probs(naive_in, labels, temperature)
    torch.testing.assert_close(ours, naive)
    (ours * upstream).sum().backward()
    (naive * upstream).sum().backward()
    torch.testing.assert_close(ours_in.grad, naive_in.grad)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, None])
@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_entropy_equals_naive_values_and_gradients(chunk_size, temperature):
    logits, _ = batch(2)
    upstream = torch.randn(3, 5, dtype=F64, generator=torch.Generator().manual_seed(3))
    ours_in, naive_in = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    ours = entropy_from_logits(ours_in, temperature, chunk_size=chunk_size)
    naive = naive_entropy(naive_in, temperature)
    torch.testing.assert_close(ours, naive)
    (ours * upstream).sum().backward()
    (naive * upstream).sum().backward()
    torch.testing.assert_close(ours_in.grad, naive_in.grad)


def test_gradcheck():
    logits, labels = batch(4, B=2, T=3, V=5)
    logits.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: log_probs_from_logits(x, labels, 0.8, chunk_size=2), (logits,))
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, 0.8, chunk_size=2), (logits,))


def test_known_values():
    # logits [0, ln 3]: p = [1/4, 3/4]; entropy = -(1/4 ln 1/4 + 3/4 ln 3/4)
    logits = torch.tensor([[0.0, torch.log(torch.tensor(3.0)).item()]], dtype=F64)
    torch.testing.assert_close(log_probs_from_logits(logits, torch.tensor([1])),
                               torch.log(torch.tensor([0.75], dtype=F64)))
    expected = -(0.25 * torch.log(torch.tensor(0.25, dtype=F64)) + 0.75 * torch.log(torch.tensor(0.75, dtype=F64)))
    torch.testing.assert_close(entropy_from_logits(logits), expected.reshape(1))


def test_non_contiguous_slice_and_2d_input():
    logits, labels = batch(5, T=6)
    sliced = logits[:, :-1]  # what an actor does to drop the last position
    torch.testing.assert_close(log_probs_from_logits(sliced, labels[:, 1:], chunk_size=4),
                               naive_log_probs(sliced, labels[:, 1:]))
    flat = logits.reshape(-1, 11)
    flat_labels = labels.reshape(-1)
    torch.testing.assert_close(log_probs_from_logits(flat, flat_labels), naive_log_probs(flat, flat_labels))
    torch.testing.assert_close(entropy_from_logits(flat), naive_entropy(flat))


def test_bf16_logits_give_float32_close_to_float32_math():
    logits, labels = batch(6, dtype=torch.float32)
    low = logits.to(torch.bfloat16)
    out = log_probs_from_logits(low, labels)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, naive_log_probs(low.float(), labels))
    assert entropy_from_logits(low).dtype == torch.float32


def test_no_float32_copy_of_the_logits_is_kept_for_backward():
    """With bf16 logits, autograd saves the logits themselves and per-row numbers only; a naive
    log_softmax in float32 would save a (B, T, V) float32 tensor."""
    logits, labels = batch(7, B=2, T=16, V=64, dtype=torch.float32)
    logits = logits.to(torch.bfloat16).requires_grad_(True)
    full = logits.numel()
    chunked = (lambda x: log_probs_from_logits(x, labels, chunk_size=4), lambda x: entropy_from_logits(x, chunk_size=4))
    for fn in chunked:
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
            fn(logits)
        big = [s for s in saved if s.numel() >= full]
        assert big and all(s.dtype == torch.bfloat16 for s in big), [(s.dtype, s.shape) for s in saved]
        with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
            naive_log_probs(logits.float(), labels)
        assert any(s.dtype == torch.float32 and s.numel() >= full for s in saved)  # the check can fail


def test_bad_input():
    logits, labels = batch(8)
    with pytest.raises(ValueError, match=r"labels has shape \(3, 4\) but logits has shape \(3, 5, 11\)"):
        log_probs_from_logits(logits, labels[:, :4])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        log_probs_from_logits(logits, labels, temperature=0.0)
    with pytest.raises(ValueError, match=r"logits must have shape \(B, T, V\) or \(N, V\)"):
        entropy_from_logits(logits[0, 0])
