"""On CUDA the chunked log-prob and entropy kernels match the float32 reference and need much less
peak memory than it (no float32 copy of bf16 logits, in forward or backward)."""

import functools

import pytest
import torch

from lightrft.algorithms.logprobs import entropy_from_logits, log_probs_from_logits

B, T, V = 4, 512, 32768


def naive_log_probs(logits, labels):
    return torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def naive_entropy(logits):
    log_p = torch.log_softmax(logits.float(), -1)
    return -(log_p.exp() * log_p).sum(-1)


def run_and_measure(fn, logits):
    """(peak bytes above the inputs during forward + backward, output, gradient)."""
    x = logits.clone().requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    out = fn(x)
    out.sum().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start, out.detach(), x.grad


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["log_probs", "entropy"])
def test_chunked_kernels_match_and_save_memory_on_cuda(which):
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (2 * torch.randn(B, T, V, device="cuda", generator=gen)).to(torch.bfloat16)
    labels = torch.randint(0, V, (B, T), device="cuda", generator=gen)
    if which == "log_probs":
        ours_fn = functools.partial(log_probs_from_logits, labels=labels, chunk_size=256)
        naive_fn = functools.partial(naive_log_probs, labels=labels)
    else:
        ours_fn = functools.partial(entropy_from_logits, chunk_size=256)
        naive_fn = naive_entropy
    ours_peak, ours_out, ours_grad = run_and_measure(ours_fn, logits)
    naive_peak, naive_out, naive_grad = run_and_measure(naive_fn, logits)
    assert ours_out.dtype == torch.float32
    torch.testing.assert_close(ours_out, naive_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours_grad, naive_grad)
    # the reference holds at least one float32 (B, T, V) tensor, twice the bf16 logits
    float32_copy = B * T * V * 4
    assert naive_peak >= float32_copy
    assert ours_peak < 0.6 * naive_peak, (ours_peak, naive_peak)
