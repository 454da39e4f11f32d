"""Packed sequences on CUDA: the same numbers as padded batches, and no (P x P) mask in memory."""

import functools
import importlib.util

import pytest
import torch

from lightrft.models import ActorLanguage, Critic
from lightrft.models import attention
from lightrft.models.hf_utils import VARLEN_SDPA, default_attn_implementation
from lightrft.models.packing import pack_sequences, prompt_group_ids, shared_prompt_layout

from .conftest import make_batch

pytestmark = pytest.mark.gpu

HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
PACKED_IMPLEMENTATIONS = [
    pytest.param("flash_attention_2", marks=pytest.mark.skipif(not HAS_FLASH_ATTN, reason="flash-attn not installed")),
    VARLEN_SDPA,
]


def to_cuda(batch):
    batch.sequences, batch.attention_mask = batch.sequences.cuda(), batch.attention_mask.cuda()
    batch.packed_ids = batch.packed_ids.cuda()
    return batch


def test_default_attention_on_cuda_never_masks_packed_rows():
    # With flash-attn too: lightrft's attention calls its varlen kernel and keeps shared prompts.
    assert default_attn_implementation() == VARLEN_SDPA


@pytest.mark.parametrize("attn", PACKED_IMPLEMENTATIONS)
def test_packed_equals_padded_bf16(tiny_dirs, attn):
    batch = to_cuda(make_batch([5, 9, 3, 7], [6, 2, 8, 4], seed=0))
    mask = batch.action_mask().bool().cuda()
    actor = ActorLanguage(tiny_dirs["qwen2"], bf16=True, attn_implementation=attn).cuda()
    padded = actor(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    packed = actor(batch.packed_ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens)
    # bf16 activations: both paths round differently, log-probs ~ -4.6 agree to a few bf16 ulps
    torch.testing.assert_close(packed[mask], padded[mask], atol=5e-2, rtol=0)

    critic = Critic(tiny_dirs["llama"], bf16=True, attn_implementation=attn).cuda()
    padded_values = critic(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    packed_values = critic(batch.packed_ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens)
    torch.testing.assert_close(packed_values[mask], padded_values[mask], atol=5e-2, rtol=0)


def test_varlen_sdpa_float32_matches_padded_tightly(tiny_dirs):
    batch = to_cuda(make_batch([5, 9, 3, 7], [6, 2, 8, 4], seed=1))
    mask = batch.action_mask().bool().cuda()
    actor = ActorLanguage(tiny_dirs["llama"], attn_implementation=VARLEN_SDPA).cuda()
    padded = actor(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    packed = actor(batch.packed_ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens)
    torch.testing.assert_close(packed[mask], padded[mask], atol=1e-4, rtol=0)


def peak_forward_bytes(actor, packed, num_actions):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with torch.no_grad():
        actor(packed.input_ids, num_actions, packed_seq_lens=packed.seq_lens)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


@pytest.mark.parametrize("attn", PACKED_IMPLEMENTATIONS)
def test_packed_forward_builds_no_quadratic_mask(tiny_dirs, attn):
    """32 sequences of 512 tokens, P = 16384: a (P x P) bool mask alone would take 256 MiB. The
    packed paths stay far below that; plain "sdpa" (the negative control) does not."""
    gen = torch.Generator().manual_seed(0)
    packed = pack_sequences([torch.randint(4, 100, (512,), generator=gen) for _ in range(32)])
    packed.input_ids = packed.input_ids.cuda()
    num_actions = [16] * 32
    quadratic = packed.input_ids.size(1) ** 2

    actor = ActorLanguage(tiny_dirs["qwen2"], bf16=True, attn_implementation=attn).cuda()
    assert peak_forward_bytes(actor, packed, num_actions) < quadratic // 4

    control = ActorLanguage(tiny_dirs["qwen2"], bf16=True, attn_implementation="sdpa").cuda()
    assert peak_forward_bytes(control, packed, num_actions) >= quadratic


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_rows_take_one_varlen_kernel_call_per_layer(tiny_dirs, arch, monkeypatch):
    """Without flash-attn, PyTorch's varlen kernel runs every sequence of a packed row in one call
    per layer (qwen2's tiny config also has a sliding-window layer), with the per-sequence SDPA
    path's log-probs and gradients."""
    kernel = attention.fused_varlen_kernel(torch.zeros(1, 1, 1, 1, device="cuda", dtype=torch.bfloat16))
    assert kernel is not None, "this torch has no torch.nn.attention.varlen.varlen_attn"
    calls = []

    @functools.wraps(kernel)
    def counting(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    batch = to_cuda(make_batch([5, 9, 3, 7], [6, 2, 8, 4], seed=2))
    mask = batch.action_mask().bool().cuda()

    def forward_and_grads():
        actor = ActorLanguage(tiny_dirs[arch], bf16=True, attn_implementation=VARLEN_SDPA).cuda()
        log_probs = actor(batch.packed_ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens)
        log_probs[mask].float().sum().backward()
        return log_probs.detach(), {n: p.grad.float() for n, p in actor.named_parameters() if p.grad is not None}, actor

    monkeypatch.setattr(attention, "fused_varlen_kernel", lambda query: counting)
    one_call, grads, actor = forward_and_grads()
    layers = actor.model.config.num_hidden_layers
    layer_types = getattr(actor.model.config, "layer_types", None) or []
    windowed = 0 if attention.varlen_kernel_runs(kernel, 8) else layer_types.count("sliding_attention")
    assert len(calls) == layers - windowed, (len(calls), layers, windowed)   # one per layer the kernel can run
    monkeypatch.setattr(attention, "fused_varlen_kernel", lambda query: None)
    per_sequence, ref_grads, _ = forward_and_grads()
    torch.testing.assert_close(one_call[mask], per_sequence[mask], atol=5e-2, rtol=0)
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().clamp(min=1e-6)
        torch.testing.assert_close(grad / scale, ref_grads[name] / scale, atol=5e-2, rtol=0, msg=name)


class AttentionLayer(torch.nn.Module):
    """What the attention functions read from a layer."""

    def __init__(self, heads: int, kv_heads: int):
        super().__init__()
        self.is_causal, self.num_key_value_groups = True, heads // kv_heads


@pytest.mark.parametrize("window", [None, 8])
def test_shared_prompt_segments_on_the_varlen_kernel(window):
    """PyTorch's varlen kernel given a response's queries and its prompt + response keys aligns
    them to the end (flash-attention's convention), as the shared-prompt layout needs: its output
    equals the per-segment float32 attention with end-aligned masks."""
    kernel = attention.fused_varlen_kernel(torch.zeros(1, 1, 1, 1, device="cuda", dtype=torch.bfloat16))
    assert kernel is not None, "this torch has no torch.nn.attention.varlen.varlen_attn"
    if not attention.varlen_kernel_runs(kernel, window):
        pytest.skip("this torch's varlen kernel takes no window")
    layout = shared_prompt_layout([40, 23, 37, 25, 30], [9, 4, 6, 6, 11], [0, 1, 0, 1, 4], "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, heads, layout.length, 64, device="cuda", generator=gen).to(torch.bfloat16)
               for heads in (8, 2, 2))
    layer = AttentionLayer(8, 2)
    fused = attention.shared_prompt_attention(layer, q, k, v, layout, window, None, scaling=0.125)
    assert layout.calls == 1
    # float32 takes the per-segment path (the kernel runs in half precision only)
    reference = attention.shared_prompt_attention(layer, q.float(), k.float(), v.float(), layout, window, None,
                                                 scaling=0.125)
    torch.testing.assert_close(fused.float(), reference, atol=2e-2, rtol=0)
    # The first response with start-aligned queries (seeing only the first keys) is another
    # function: the comparison above can fail.
    start, (q_len, spans) = layout.q_lens[0], (layout.q_lens[1], layout.kv_spans[1])
    keys, values = (torch.cat([t[:, :, a:b] for a, b in spans], dim=2).float() for t in (k, v))
    mask = attention.causal_band_mask(q_len, keys.size(2), window, q.device, end_aligned=False)
    start_aligned = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, start:start + q_len].float(), keys, values, attn_mask=mask, scale=0.125, enable_gqa=True)
    assert (start_aligned.transpose(1, 2) - reference[:, start:start + q_len]).abs().max() > 0.1


def test_shared_prompt_packed_rows_on_cuda_equal_unshared(tiny_dirs, monkeypatch):
    """bf16 on CUDA: a packed row with prompt groups (each prompt once) gives the unshared row's
    log-probs and gradients, one varlen kernel call per layer the kernel runs."""
    kernel = attention.fused_varlen_kernel(torch.zeros(1, 1, 1, 1, device="cuda", dtype=torch.bfloat16))
    calls = []

    @functools.wraps(kernel)
    def counting(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(attention, "fused_varlen_kernel", lambda query: counting)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 100, (n,), generator=gen) for n in (11, 5, 17)]
    sequences, actions = [], []
    for prompt in prompts:
        for r in (7, 2, 12, 5):
            sequences.append(torch.cat([prompt, torch.randint(4, 100, (r,), generator=gen)]))
            actions.append(r)
    packed = pack_sequences(sequences)
    ids, groups = packed.input_ids.cuda(), prompt_group_ids(sequences, actions)
    actor = ActorLanguage(tiny_dirs["llama"], bf16=True, attn_implementation=VARLEN_SDPA).cuda()
    results = []
    for extra in ({"prompt_groups": groups}, {}):
        log_probs = actor(ids, actions, packed_seq_lens=packed.seq_lens, **extra)
        actor.zero_grad()
        log_probs.float().sum().backward()
        results.append((log_probs.detach().float(), {n: p.grad.float().clone() for n, p in actor.named_parameters()
                                                     if p.grad is not None}))
    layers = actor.model.config.num_hidden_layers
    assert len(calls) == 2 * layers and actor.prompt_sharing.reason is None
    (shared, grads), (plain, ref_grads) = results
    torch.testing.assert_close(shared, plain, atol=5e-2, rtol=0)
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().clamp(min=1e-6)
        torch.testing.assert_close(grad / scale, ref_grads[name] / scale, atol=5e-2, rtol=0, msg=name)
