"""Packed rows on CUDA without flash-attn: one varlen kernel call per layer per micro-batch
(`lightrft.models.attention.one_call_varlen`, PyTorch's `varlen_attn`), not one SDPA call per
sequence.

PyTorch's kernel runs on CUDA in half precision only. Here a CPU stand-in with the kernel's
documented contract (packed (P, H, D) layout, cumulative starts, `window_size=(left, right)`,
`scale`, `enable_gqa`), written independently as one masked SDPA over the whole row, takes its
place: every architecture whose layers the kernel can run (no soft-capping) gives the per-sequence
path's log-probs and gradients with exactly one call per layer, and the others keep that path."""

import copy

import pytest
import torch
import torch.nn.functional as F

from lightrft.models import ActorLanguage, Critic
from lightrft.models import attention
from lightrft.utils.tiny import TINY_ARCHS, build_tiny_arch, save_tiny_arch

from .arch_zoo import ATOL, PROMPT_LENS, RESPONSE_LENS
from .conftest import make_batch

SOFTCAPPED = {"gemma2"}      # attention logit soft-capping: the kernel has none


class ReferenceVarlen:
    """`varlen_attn`'s contract on the CPU, counting its calls. Segment i's queries attend to its
    keys; where the keys are more, the queries are the last ones (flash-attention's alignment)."""

    def __init__(self):
        self.calls = 0
        self.starts = set()        # the sequence-start tensors it was given: one per forward
        self.same_starts = []      # per call, whether queries and keys had the same segments

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        self.calls += 1
        self.starts.add(id(cu_q))
        self.same_starts.append(cu_q is cu_k)
        assert q.dim() == 3 and cu_q.dtype == cu_k.dtype == torch.int32
        q_lens, k_lens = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
        assert int(q_lens.max()) == max_q and int(k_lens.max()) == max_k
        assert int(q_lens.sum()) == q.size(0) and int(k_lens.sum()) == k.size(0)
        q_seg = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)              # (P_q,)
        k_seg = torch.repeat_interleave(torch.arange(len(k_lens)), k_lens)              # (P_k,)
        q_pos = torch.arange(q.size(0)) - cu_q[q_seg] + (k_lens - q_lens)[q_seg]      # end-aligned
        k_pos = torch.arange(k.size(0)) - cu_k[k_seg]
        left, right = window_size
        allowed = q_seg[:, None] == k_seg[None, :]
        if left >= 0:
            allowed &= k_pos[None, :] >= q_pos[:, None] - left
        if right >= 0:
            allowed &= k_pos[None, :] <= q_pos[:, None] + right
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             attn_mask=allowed, scale=scale, enable_gqa=enable_gqa)
        return out[0].transpose(0, 1)          # (P_q, H, D)


@pytest.fixture
def kernel(monkeypatch):
    reference = ReferenceVarlen()
    monkeypatch.setattr(attention, "fused_varlen_kernel", lambda query: reference)
    return reference


def packed_forward_and_grads(actor, batch):
    log_probs = actor(batch.packed_ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens)
    actor.zero_grad()
    log_probs.sum().backward()
    return log_probs.detach(), {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_one_kernel_call_per_layer_gives_the_per_sequence_attention(arch, kernel, monkeypatch):
    batch = make_batch(PROMPT_LENS, RESPONSE_LENS, seed=0)
    model = build_tiny_arch(arch, seed=1)
    one_call = ActorLanguage(copy.deepcopy(model)).train()
    log_probs, grads = packed_forward_and_grads(one_call, batch)
    calls = kernel.calls
    monkeypatch.setattr(attention, "fused_varlen_kernel", lambda query: None)
    per_sequence = ActorLanguage(model).train()
    ref_log_probs, ref_grads = packed_forward_and_grads(per_sequence, batch)
    layers = model.config.get_text_config().num_hidden_layers
    if arch in SOFTCAPPED:
        assert calls == 0          # soft-capped layers keep one SDPA call per sequence
        return
    assert calls == layers, (calls, layers)     # one call per layer for the 4 sequences of the row
    assert all(kernel.same_starts)               # unshared sequences: queries and keys alike
    assert len(kernel.starts) == 1                # the sequence starts were built once for the forward
    torch.testing.assert_close(log_probs, ref_log_probs, atol=ATOL, rtol=0)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().clamp(min=1e-12)
        torch.testing.assert_close(grad / scale, ref_grads[name] / scale, atol=ATOL, rtol=0, msg=name)


def test_the_critic_and_padded_batches(kernel, tmp_path):
    batch = make_batch(PROMPT_LENS, RESPONSE_LENS, seed=0)
    critic = Critic(save_tiny_arch(tmp_path / "qwen2", "qwen2", seed=1)).eval()
    with torch.no_grad():
        critic(batch.packed_ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens)
        assert kernel.calls == critic.model.config.num_hidden_layers
        critic(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    assert kernel.calls == critic.model.config.num_hidden_layers      # padded rows never take it


def test_the_kernel_is_only_asked_for_on_cuda_in_half_precision():
    assert attention.fused_varlen_kernel(torch.zeros(1, 2, 3, 4)) is None
    assert attention.fused_varlen_kernel(torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16)) is None


class OlderReferenceVarlen(ReferenceVarlen):
    """torch 2.10's `varlen_attn`: `is_causal` instead of `window_size`, and no `enable_gqa` (key and
    value heads must equal the query heads)."""

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, scale=None):
        assert q.size(1) == k.size(1) == v.size(1)
        return super().__call__(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale,
                                window_size=(-1, 0) if is_causal else (-1, -1))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_a_kernel_without_windows_or_grouped_heads_runs_the_layers_it_can(arch, monkeypatch):
    """Grouped key/value heads are repeated for it; layers with a sliding window keep one SDPA call per
    sequence (qwen2 here has one full and one windowed layer, mistral windows every layer)."""
    older = OlderReferenceVarlen()
    monkeypatch.setattr(attention, "fused_varlen_kernel", lambda query: older)
    batch = make_batch(PROMPT_LENS, RESPONSE_LENS, seed=0)
    model = build_tiny_arch(arch, seed=1)
    log_probs, grads = packed_forward_and_grads(ActorLanguage(copy.deepcopy(model)).train(), batch)
    monkeypatch.setattr(attention, "fused_varlen_kernel", lambda query: None)
    ref_log_probs, ref_grads = packed_forward_and_grads(ActorLanguage(model).train(), batch)
    layers = model.config.num_hidden_layers
    assert older.calls == {"llama": layers, "qwen2": 1, "mistral": 0}[arch]
    torch.testing.assert_close(log_probs, ref_log_probs, atol=ATOL, rtol=0)
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().clamp(min=1e-12)
        torch.testing.assert_close(grad / scale, ref_grads[name] / scale, atol=ATOL, rtol=0, msg=name)
