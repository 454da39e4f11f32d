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


class FlashVarlenStandIn:
    """flash-attn's `flash_attn_varlen_func` on the CPU, written from its documented contract, not
    from the torch kernel's: q (total_q, nheads, d), k and v (total_k, nheads_k, d) with nheads a
    multiple of nheads_k; int32 `cu_seqlens_q/k`; `causal` aligned to the bottom right where a
    segment's keys outnumber its queries; query i of a segment sees the keys in
    [i + sk - sq - window_size[0], i + sk - sq + window_size[1]] (-1: unbounded). Counts its calls."""

    def __init__(self):
        self.calls, self.separate_offsets = 0, []

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                 softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                 deterministic=False, return_attn_probs=False, block_table=None):
        self.calls += 1
        self.separate_offsets.append(not torch.equal(cu_seqlens_q, cu_seqlens_k))
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and dropout_p == 0.0
        assert q.size(1) % k.size(1) == 0
        scale = q.size(-1) ** -0.5 if softmax_scale is None else softmax_scale
        out = torch.empty_like(q)
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
        v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
        for i in range(len(cu_seqlens_q) - 1):
            qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
            ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
            sq, sk = qe - qs, ke - ks
            assert sq <= max_seqlen_q and sk <= max_seqlen_k
            rows = torch.arange(sq)[:, None] + (sk - sq)          # the key index each query is aligned to
            cols = torch.arange(sk)[None, :]
            allowed = torch.ones(sq, sk, dtype=torch.bool)
            if causal:
                allowed &= cols <= rows
            if window_size[0] >= 0:
                allowed &= cols >= rows - window_size[0]
            if window_size[1] >= 0:
                allowed &= cols <= rows + window_size[1]
            scores = torch.einsum("qhd,khd->hqk", q[qs:qe], k[ks:ke]) * scale
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[qs:qe] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v[ks:ke])
        return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3_moe"])
def test_flash_attn_kernel_keeps_shared_prompts(arch, monkeypatch):
    """With flash-attn installed the default attention stays lightrft's, whose varlen path calls
    flash-attn's kernel (here its stand-in) once per layer: a packed row sharing its prompts passes
    separate query and key offsets and gives the per-segment path's log-probs and gradients."""
    import importlib.machinery
    import sys
    import types

    stand_in = FlashVarlenStandIn()
    fake = types.ModuleType("flash_attn")
    fake.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    fake.flash_attn_varlen_func = stand_in
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    attention._flash_attn_kernel.cache_clear()
    try:
        kernel = attention._flash_attn_kernel()
        assert kernel is not None and attention.default_attn_implementation() == attention.VARLEN_ATTENTION
    finally:
        attention._flash_attn_kernel.cache_clear()
    batch = make_batch([5, 5, 9, 9], [6, 3, 4, 8], seed=2)
    groups = [0, 0, 2, 2]
    ids = batch.packed_ids.clone()
    # The two pairs of sequences share their prompts.
    starts = [0] + list(torch.tensor(batch.packed_seq_lens).cumsum(0)[:-1].tolist())
    for first, second in ((0, 1), (2, 3)):
        prompt = batch.packed_seq_lens[first] - batch.response_lens[first]
        ids[0, starts[second]:starts[second] + prompt] = ids[0, starts[first]:starts[first] + prompt]
    model = build_tiny_arch(arch, seed=1)

    def forward(actor, shared):
        log_probs = actor(ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens,
                          prompt_groups=groups if shared else None)
        actor.zero_grad()
        log_probs.sum().backward()
        return log_probs.detach(), {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}

    monkeypatch.setattr(attention, "fused_varlen_kernel", lambda query: kernel)
    flash = ActorLanguage(copy.deepcopy(model)).train()
    log_probs, grads = forward(flash, True)
    assert flash.prompt_sharing.reason is None
    assert stand_in.calls == model.config.num_hidden_layers and all(stand_in.separate_offsets)
    monkeypatch.setattr(attention, "fused_varlen_kernel", lambda query: None)
    ref_log_probs, ref_grads = forward(ActorLanguage(model).train(), False)
    torch.testing.assert_close(log_probs, ref_log_probs, atol=ATOL, rtol=0)
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().clamp(min=1e-12)
        torch.testing.assert_close(grad / scale, ref_grads[name] / scale, atol=ATOL, rtol=0, msg=name)
