"""ActorLanguage: action log-probs, packed == padded (values and gradients), entropy, LoRA."""

import pytest
import torch
from transformers import AutoModelForCausalLM, masking_utils

from lightrft.models import ActorLanguage
from lightrft.models.hf_utils import VARLEN_SDPA, positions_from_attention_mask
from lightrft.utils.tiny import build_char_tokenizer, build_tiny_arch

from .conftest import make_batch

ATOL = 1e-5


def naive_log_probs_and_entropy(actor, batch, temperature=1.0):
    """Full-vocabulary float64 reference: logits of every position from the plain HF model, then
    log softmax; the log-prob of token t is read at position t - 1. Shape: (B, A) each."""
    logits = actor.model(
        input_ids=batch.sequences,
        attention_mask=batch.attention_mask,
        position_ids=positions_from_attention_mask(batch.attention_mask),
        use_cache=False,
    ).logits.double() / temperature  # (B, T, V)
    log_p = torch.log_softmax(logits, dim=-1)[:, -batch.num_actions - 1 : -1]  # (B, A, V)
    tokens = batch.sequences[:, -batch.num_actions :]  # (B, A)
    entropy = -(log_p.exp() * log_p).sum(-1)  # (B, A)
    return log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), entropy


def weighted_loss(log_probs, batch, weights):
    """A loss touching every real action token with a different weight."""
    return (log_probs * weights * batch.action_mask()).sum()


def grads(module):
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("attn", [VARLEN_SDPA, "sdpa", "eager"])
def test_packed_equals_padded_log_probs_and_gradients(tiny_dirs, batch, arch, attn):
    actor = ActorLanguage(tiny_dirs[arch], attn_implementation=attn)
    assert actor.attn_implementation == attn
    weights = torch.linspace(0.5, 2.0, batch.num_actions * len(batch.response_lens)).view(-1, batch.num_actions)

    padded = actor(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    weighted_loss(padded, batch, weights).backward()
    padded_grads = grads(actor)
    actor.zero_grad()

    packed = actor(batch.packed_ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens)
    weighted_loss(packed, batch, weights).backward()
    packed_grads = grads(actor)

    assert packed.shape == padded.shape == (4, 5)
    mask = batch.action_mask().bool()
    torch.testing.assert_close(packed[mask], padded[mask], atol=ATOL, rtol=0)
    assert (packed[~mask] == 0).all()  # the packed layout is right-padded with zeros
    assert packed_grads.keys() == padded_grads.keys() and len(packed_grads) > 0
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=ATOL, rtol=1e-4, msg=name)


def test_log_probs_and_entropy_match_full_vocabulary_reference(tiny_dirs, batch):
    actor = ActorLanguage(tiny_dirs["qwen2"], temperature=0.7)
    log_probs, output = actor(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask,
                              return_output=True, return_entropy=True)
    ref_log_probs, ref_entropy = naive_log_probs_and_entropy(actor, batch, temperature=0.7)
    mask = batch.action_mask().bool()
    assert log_probs.dtype == torch.float32 and output["entropy"].dtype == torch.float32
    assert output.logits.shape == (4, batch.num_actions, 100)  # only the action-predicting positions
    torch.testing.assert_close(log_probs[mask].double(), ref_log_probs[mask], atol=ATOL, rtol=0)
    torch.testing.assert_close(output["entropy"][mask].double(), ref_entropy[mask], atol=ATOL, rtol=0)
    # A random 100-token model is close to uniform: entropy just under log(100) = 4.605
    assert ((ref_entropy[mask] > 4.0) & (ref_entropy[mask] < 4.6052)).all()

    packed_lp, packed_out = actor(batch.packed_ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens,
                                  return_output=True, return_entropy=True)
    torch.testing.assert_close(packed_out["entropy"][mask], output["entropy"][mask], atol=ATOL, rtol=0)
    torch.testing.assert_close(packed_lp[mask], log_probs[mask], atol=ATOL, rtol=0)


def test_temperature_divides_logits(tiny_dirs, batch):
    cold = ActorLanguage(tiny_dirs["qwen2"], temperature=0.5)
    plain = ActorLanguage(tiny_dirs["qwen2"])
    _, out = plain(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask, return_output=True)
    tokens = batch.sequences[:, -batch.num_actions :]
    expected = torch.log_softmax(out.logits / 0.5, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    got = cold(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_packed_sequences_do_not_see_each_other(tiny_dirs):
    """Changing every token of sequence 0 leaves the log-probs of sequences 1 and 2 untouched."""
    actor = ActorLanguage(tiny_dirs["llama"])
    batch = make_batch([3, 4, 2], [3, 2, 4], seed=1)
    first = actor(batch.packed_ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens)
    changed = batch.packed_ids.clone()
    changed[0, : batch.packed_seq_lens[0]] = (changed[0, : batch.packed_seq_lens[0]] + 7 - 4) % 96 + 4
    second = actor(changed, batch.response_lens, packed_seq_lens=batch.packed_seq_lens)
    assert not torch.allclose(first[0], second[0])
    torch.testing.assert_close(second[1:], first[1:], atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_varlen_attention_builds_no_mask_for_packed_rows(tiny_dirs, batch, monkeypatch, arch):
    """The default attention never materialises a (P x P) mask for a packed row, for full and
    sliding-window layers alike (Mistral's window of 8 is shorter than the row), while the padded
    batch does get its (B, 1, T, T) padding mask."""
    built = []
    registered = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[VARLEN_SDPA]

    def recording_mask(*args, **kwargs):
        mask = registered(*args, **kwargs)
        built.append(None if mask is None else tuple(mask.shape))
        return mask

    monkeypatch.setitem(masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, VARLEN_SDPA, recording_mask)
    actor = ActorLanguage(tiny_dirs[arch] if arch in tiny_dirs else build_tiny_arch(arch, seed=1))
    assert batch.packed_ids.size(1) > 8
    actor(batch.packed_ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens)
    assert built and all(shape is None for shape in built)
    built.clear()
    actor(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    assert built and built[0] == (4, 1, batch.sequences.size(1), batch.sequences.size(1))


def test_gradient_checkpointing_gives_the_same_gradients(tiny_dirs, batch):
    weights = torch.ones(4, batch.num_actions)
    results = []
    for checkpointing in (False, True):
        actor = ActorLanguage(tiny_dirs["qwen2"], gradient_checkpointing=checkpointing)
        actor.train()
        log_probs = actor(batch.packed_ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens)
        weighted_loss(log_probs, batch, weights).backward()
        results.append(grads(actor))
    assert results[1]["model.model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0
    for name, grad in results[0].items():
        torch.testing.assert_close(results[1][name], grad, atol=ATOL, rtol=1e-4, msg=name)


def test_bf16_weights_still_give_float32_log_probs(tiny_dirs, batch):
    actor = ActorLanguage(tiny_dirs["qwen2"], bf16=True)
    assert actor.model.dtype == torch.bfloat16
    log_probs = actor(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    reference = ActorLanguage(tiny_dirs["qwen2"])(batch.sequences, batch.num_actions,
                                                 attention_mask=batch.attention_mask)
    assert log_probs.dtype == torch.float32
    mask = batch.action_mask().bool()
    torch.testing.assert_close(log_probs[mask], reference[mask], atol=5e-2, rtol=0)


def test_num_actions_none_returns_full_logits(tiny_dirs, batch):
    actor = ActorLanguage(tiny_dirs["qwen2"])
    output = actor(batch.sequences, attention_mask=batch.attention_mask)
    assert output.logits.shape == (*batch.sequences.shape, 100)
    packed_output = actor(batch.packed_ids, packed_seq_lens=batch.packed_seq_lens)
    assert packed_output.logits.shape == (1, sum(batch.packed_seq_lens), 100)
    # Row 1's real tokens (offset 0 of the packed row after sequence 0) match the padded row
    start, length = batch.packed_seq_lens[0], batch.packed_seq_lens[1]
    padded_row = output.logits[1][batch.attention_mask[1].bool()]
    torch.testing.assert_close(packed_output.logits[0, start : start + length], padded_row, atol=ATOL, rtol=0)


def test_lora_trains_only_adapters_and_exports_a_plain_model(tiny_dirs, batch, tmp_path):
    torch.manual_seed(0)
    actor = ActorLanguage(tiny_dirs["qwen2"], lora_rank=4, lora_alpha=8)
    trainable = {n for n, p in actor.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert any("mlp.down_proj.lora_A" in n for n in trainable)  # default targets every linear layer
    assert not any("lm_head" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in actor.named_parameters()}

    optimizer = torch.optim.Adam([p for p in actor.parameters() if p.requires_grad], lr=1e-2)
    log_probs = actor(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    (-(log_probs * batch.action_mask()).sum()).backward()
    optimizer.step()

    changed = {n for n, p in actor.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable
    assert any("lora_B" in n for n in changed)  # B starts at 0 and must move for the adapter to act

    trained = actor(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask).detach()
    actor.merged_model().save_pretrained(tmp_path / "merged")
    after_export = actor(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask).detach()
    torch.testing.assert_close(after_export, trained, atol=0, rtol=0)  # export did not touch the live model

    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in n for n, _ in plain.named_parameters())
    exported = ActorLanguage(plain)(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    base = ActorLanguage(tiny_dirs["qwen2"])(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    mask = batch.action_mask().bool()
    torch.testing.assert_close(exported[mask], trained[mask], atol=ATOL, rtol=0)
    assert (exported[mask] - base[mask]).abs().max() > 1e-3  # the merged adapter changed the model


def test_missing_model_path_names_the_path_and_flag(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match=r"--pretrain '.*no_such_model': no such model folder"):
        ActorLanguage(missing)


def test_bad_packed_arguments_are_explained(tiny_dirs, batch):
    actor = ActorLanguage(tiny_dirs["qwen2"])
    with pytest.raises(ValueError, match="packed_seq_lens sum to"):
        actor(batch.packed_ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens[:-1] + [1])
    with pytest.raises(ValueError, match="needs num_actions as a list of 4 counts"):
        actor(batch.packed_ids, 2, packed_seq_lens=batch.packed_seq_lens)
    with pytest.raises(ValueError, match=r"num_actions must be an int in \[1, T - 1\]"):
        actor(batch.sequences, batch.sequences.size(1), attention_mask=batch.attention_mask)


def test_generation_with_the_default_attention_equals_sdpa(tiny_dirs):
    """The rollout engine generates with `actor.model`; the packing-aware attention must behave as
    plain SDPA there (left-padded prompts, KV cache)."""
    prompts = build_char_tokenizer()(["hello there", "hi"], return_tensors="pt", padding=True)
    outputs = [
        ActorLanguage(tiny_dirs["llama"], attn_implementation=attn).model.generate(
            **prompts, max_new_tokens=6, do_sample=False, pad_token_id=0
        )
        for attn in (VARLEN_SDPA, "sdpa")
    ]
    assert outputs[0].shape == (2, prompts["input_ids"].size(1) + 6)
    assert torch.equal(outputs[0], outputs[1])


def test_folder_without_weights_names_the_flag(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"--pretrain '.*empty' could not be loaded: Unrecognized model"):
        ActorLanguage(tmp_path / "empty")


def test_a_teacher_folder_without_weights_names_the_teacher_flag(tmp_path):
    # The same policy builder serves the reference (--pretrain) and the teacher: a teacher that
    # cannot load names --teacher_pretrain, not --pretrain (the run's own model builder, one rank).
    import contextlib
    from types import SimpleNamespace

    from lightrft.builders.ppo_run import build_ppo_models
    from lightrft.cli.train_ppo import parse_args
    from lightrft.models.hf_utils import ModelLoadError
    from lightrft.utils.tiny import save_tiny_model

    student, teacher = save_tiny_model(tmp_path / "student"), save_tiny_model(tmp_path / "teacher")
    for weights in teacher.glob("*.safetensors"):
        weights.unlink()
    config = parse_args(["--pretrain", str(student), "--prompt_data", "p.jsonl", "--teacher_pretrain", str(teacher),
                         "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2", "--distill_mode",
                         "loss", "--prompt_max_len", "16", "--generate_max_len", "8"])
    strategy = SimpleNamespace(zero3_init_context=contextlib.nullcontext, sequence_parallel=None, print=print)
    with pytest.raises(ModelLoadError, match=f"^--teacher_pretrain '{teacher}' could not be loaded"):
        build_ppo_models(config, strategy)
