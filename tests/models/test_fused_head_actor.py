"""ActorLanguage(fused_head_chunk=...): the decoder's hidden states through the fused log-prob head
give the plain actor's log-probs, entropies and parameter gradients, padded and packed, with and
without shared prompts, for every tiny architecture; and where the fused head cannot stand in for
the model's logits, the plain forward runs."""

import copy
import logging

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, CohereConfig

from lightrft.models import ActorLanguage
from lightrft.models.lm_head import FUSED_HEAD_MODEL_TYPES
from lightrft.utils.tiny import TINY_ARCHS, build_tiny_arch

from .conftest import assert_close_grads, make_batch
from .test_shared_packed_prompts import grouped_row
from .test_shared_prompts import count_tokens, grouped_batch

F64_ATOL = 1e-10
F32_ATOL = 1e-5
TEMPERATURE = 0.7


def twins(model, **kwargs):
    """(plain, fused) actors over equal copies of `model`."""
    plain = ActorLanguage(copy.deepcopy(model), temperature=TEMPERATURE, **kwargs)
    fused = ActorLanguage(model, temperature=TEMPERATURE, fused_head_chunk=5, **kwargs)
    return plain, fused


def run(actor, *args, **kwargs):
    """(log-probs, entropy, output, {name: grad}) of a loss that weights every action's log-prob
    and entropy differently; (0-padded) layout positions carry weight too, and must get none."""
    actor.zero_grad()
    log_probs, output = actor(*args, return_output=True, return_entropy=True, **kwargs)
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(2, *log_probs.shape, generator=gen, dtype=log_probs.dtype)
    ((weights[0] * log_probs).sum() + (weights[1] * output["entropy"]).sum()).backward()
    grads = {name: p.grad.clone() for name, p in actor.named_parameters() if p.grad is not None}
    return log_probs.detach(), output["entropy"].detach(), output, grads


def assert_same(fused, plain, atol):
    log_probs, entropy, output, grads = fused
    ref_log_probs, ref_entropy, ref_output, ref_grads = plain
    assert output.logits is None and ref_output.logits is not None  # the fused forward made no logits
    assert log_probs.std() > 0.05  # log-probs that vary: not a comparison between constants
    torch.testing.assert_close(log_probs, ref_log_probs, atol=atol, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=atol, rtol=0)
    assert_close_grads(grads, ref_grads, atol)



@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_fused_equals_plain_padded_and_packed_in_float64(arch):
    batch = make_batch(prompt_lens=[3, 6, 2, 4], response_lens=[4, 1, 5, 2], seed=0)
    model = build_tiny_arch(arch, seed=1).double()
    if hasattr(model.config, "output_router_logits"):
        model.set_experts_implementation("eager")  # the grouped-matmul experts take no float64
    # Gemma 2's eager attention takes its softmax in float32, where a float64 mask's minimum is
    # -inf: the left padding's rows come out NaN, and through the values every row after them
    # (float32 is fine). sdpa serves both actors alike where transformers offers it for Gemma 2;
    # where it does not (5.25 on), the padded form runs in float32.
    gemma_sdpa = arch == "gemma2" and type(model)._supports_sdpa
    plain, fused = twins(model, attn_implementation="sdpa" if gemma_sdpa else None)
    assert fused.lm_head is not None and plain.lm_head is None
    padded_plain, padded_fused, padded_atol = plain, fused, F64_ATOL
    if arch == "gemma2" and not gemma_sdpa:
        padded_plain, padded_fused = twins(build_tiny_arch(arch, seed=1))
        padded_atol = F32_ATOL
    padded = (batch.sequences, batch.num_actions)
    assert_same(run(padded_fused, *padded, attention_mask=batch.attention_mask),
                run(padded_plain, *padded, attention_mask=batch.attention_mask), padded_atol)
    packed = (batch.packed_ids, batch.response_lens)
    assert_same(run(fused, *packed, packed_seq_lens=batch.packed_seq_lens),
                run(plain, *packed, packed_seq_lens=batch.packed_seq_lens), F64_ATOL)


def test_bf16_actor_matches_within_bf16_rounding():
    batch = make_batch(prompt_lens=[3, 6, 2, 4], response_lens=[4, 1, 5, 2], seed=5)
    plain, fused = twins(build_tiny_arch("llama_tied", seed=5).to(torch.bfloat16))
    args = (batch.packed_ids, batch.response_lens)
    log_probs, entropy, output, grads = run(fused, *args, packed_seq_lens=batch.packed_seq_lens)
    ref_log_probs, ref_entropy, _, ref_grads = run(plain, *args, packed_seq_lens=batch.packed_seq_lens)
    assert log_probs.dtype == entropy.dtype == torch.float32 and output.logits is None
    torch.testing.assert_close(log_probs, ref_log_probs, atol=0.03, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=0.03, rtol=0)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        scale = ref_grads[name].float().abs().max()
        assert (grad.float() - ref_grads[name].float()).abs().max() <= 0.03 * scale, name


def test_the_checked_architectures_are_the_tiny_ones():
    """Every model type the fused head is on for is one the test above checks, and the other way round."""
    types = {build_tiny_arch(arch).config.model_type for arch in TINY_ARCHS}
    assert types == FUSED_HEAD_MODEL_TYPES


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_shared_prompts_use_the_fused_head(arch):
    plain, fused = twins(build_tiny_arch(arch, seed=2))
    sequences, mask, num_actions = grouped_batch()
    seen = count_tokens(fused)
    assert_same(run(fused, sequences, num_actions, attention_mask=mask),
                run(plain, sequences, num_actions, attention_mask=mask), 1e-5)
    assert seen[0] < sequences.numel()  # the prompt forward of the shared batch: each prompt once
    ids, seq_lens, actions, groups = grouped_row()
    seen.clear()
    assert_same(run(fused, ids, actions, packed_seq_lens=seq_lens, prompt_groups=groups),
                run(plain, ids, actions, packed_seq_lens=seq_lens, prompt_groups=groups), 1e-5)
    prompts = {group: length - count for group, length, count in zip(groups, seq_lens, actions)}
    repeated = sum(prompts[group] for group in groups) - sum(prompts.values())
    assert seen == [ids.numel() - repeated]  # the shared row: each prompt's tokens once


def test_lora_actor_and_its_adapter_disabled_reference():
    torch.manual_seed(0)
    plain = ActorLanguage(build_tiny_arch("qwen2", seed=3), temperature=TEMPERATURE, lora_rank=4)
    torch.manual_seed(0)
    fused = ActorLanguage(build_tiny_arch("qwen2", seed=3), temperature=TEMPERATURE, lora_rank=4,
                          fused_head_chunk=4)
    assert fused.lm_head is not None
    batch = make_batch(prompt_lens=[3, 6, 2], response_lens=[4, 1, 5], seed=1)
    args = (batch.packed_ids, batch.response_lens)
    fused_run = run(fused, *args, packed_seq_lens=batch.packed_seq_lens)
    assert fused_run[3] and all("lora_" in name for name in fused_run[3])  # only the adapters train
    assert_same(fused_run, run(plain, *args, packed_seq_lens=batch.packed_seq_lens), 1e-5)
    with torch.no_grad():
        reference = fused.adapter_disabled()(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
        expected = plain.adapter_disabled()(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    torch.testing.assert_close(reference, expected, atol=1e-5, rtol=0)


def test_an_unchecked_architecture_keeps_the_plain_forward(caplog):
    # Cohere multiplies its logits by `logit_scale` after the head: a split at the head would miss it.
    config = CohereConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, logit_scale=0.5, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with caplog.at_level(logging.WARNING, logger="lightrft.models.actor"):
        fused = ActorLanguage(copy.deepcopy(model), fused_head_chunk=4)
    assert fused.lm_head is None
    assert "fused log-prob head is off" in caplog.text and "'cohere'" in caplog.text
    batch = make_batch(prompt_lens=[3, 6], response_lens=[4, 2], seed=2)
    log_probs, output = fused(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask,
                              return_output=True)
    expected = ActorLanguage(model)(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    assert output.logits is not None
    torch.testing.assert_close(log_probs, expected, atol=1e-6, rtol=0)


def test_router_logits_and_full_logits_take_the_plain_forward():
    plain, fused = twins(build_tiny_arch("qwen3_moe", seed=4))
    batch = make_batch(prompt_lens=[3, 6], response_lens=[4, 2], seed=3)
    kwargs = dict(attention_mask=batch.attention_mask, return_output=True, return_aux_loss=True)
    log_probs, output = fused(batch.sequences, batch.num_actions, **kwargs)
    ref_log_probs, ref_output = plain(batch.sequences, batch.num_actions, **kwargs)
    assert output.logits is not None and output["aux_loss"] is not None
    torch.testing.assert_close(output["aux_loss"], ref_output["aux_loss"])
    torch.testing.assert_close(log_probs, ref_log_probs, atol=1e-6, rtol=0)
    full = fused(batch.sequences, None, attention_mask=batch.attention_mask)
    assert full.logits.shape == (*batch.sequences.shape, 100)


@pytest.mark.parametrize("chunk", [0, -3, 2.0, True])
def test_bad_chunk_is_refused(chunk):
    with pytest.raises(ValueError, match="fused_head_chunk must be None"):
        ActorLanguage(build_tiny_arch("llama"), fused_head_chunk=chunk)


def test_train_ppo_with_the_fused_head_trains_as_the_plain_head(tmp_path):
    """`--fused_logprob_head` through train_ppo's own wiring: two GRPO steps (KL reference on, so
    the reference takes the fused head too) end with the plain run's weights to float32 rounding,
    and a 4-token chunk changes nothing either."""
    from tests.trainer.ppo_harness import make_task, max_weight_change, run

    task = make_task(tmp_path)
    flags = dict(init_kl_coef=0.01, use_kl_loss=True, packing_samples=True)
    plain_logs, plain = run(task, tmp_path / "plain", **flags)
    fused_logs, fused = run(task, tmp_path / "fused", fused_logprob_head=4, **flags)
    assert max_weight_change(plain, fused) < 1e-5
    for key in ("train/policy_loss", "train/kl_loss", "rollout/kl"):
        assert fused_logs[key] == pytest.approx(plain_logs[key], rel=1e-4, abs=1e-6), key
    started = load_file(str(task["model"] / "model.safetensors"))
    assert max_weight_change(started, plain) > 1e-3          # the runs did train
