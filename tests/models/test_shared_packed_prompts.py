"""Packed rows that hold each distinct prompt once (`packing.SharedPromptLayout`,
`shared_prompts.PackedPromptSharing`).

For every tiny architecture, a shuffled packed row of 3 prompts x 3 samples (prompts longer and
shorter than the sliding windows, responses of different lengths) gives with `prompt_groups` the
unshared row's log-probs, entropies and weight gradients (the prompt's gradient summed over its
samples), while the model sees each prompt once; per segment on the CPU and, where the layers
allow it, in one varlen kernel call per layer (a CPU stand-in with the kernel's contract). The
critic shares the same way; attention that cannot apply the layout falls back with its reason.
"""

import logging

import pytest
import torch

from lightrft.experience.samples import Sample, collate_samples
from lightrft.models import ActorLanguage, Critic, RewardModel
from lightrft.models import attention
from lightrft.models.packing import pack_sequences, prompt_group_ids, shared_prompt_layout
from lightrft.models.utils import accepts_keyword
from lightrft.utils.tiny import TINY_ARCHS, TINY_WINDOW, build_tiny_arch, save_tiny_arch

from .arch_zoo import ATOL
from .test_shared_prompts import grouped_batch
from .test_varlen_kernel import SOFTCAPPED, ReferenceVarlen

PROMPT_LENS = (TINY_WINDOW + 5, 4, TINY_WINDOW + 9)
RESPONSE_LENS = (9, 1, 6)  # per sample of a prompt


def grouped_row(seed=0):
    """(packed ids (1, P), seq_lens, num_actions, groups): 3 samples per prompt, shuffled."""
    gen = torch.Generator().manual_seed(seed)
    sequences, actions = [], []
    for p in PROMPT_LENS:
        prompt = torch.randint(4, 100, (p,), generator=gen)
        for r in RESPONSE_LENS:
            sequences.append(torch.cat([prompt, torch.randint(4, 100, (r,), generator=gen)]))
            actions.append(r)
    order = torch.randperm(len(sequences), generator=gen).tolist()
    sequences, actions = [sequences[i] for i in order], [actions[i] for i in order]
    packed = pack_sequences(sequences)
    return packed.input_ids, packed.seq_lens, actions, prompt_group_ids(sequences, actions)


def count_tokens(actor) -> list[int]:
    seen = []
    actor.model.get_input_embeddings().register_forward_hook(lambda module, args, out: seen.append(args[0].numel()))
    return seen


def forward_and_grads(actor, ids, seq_lens, actions, groups=None):
    extra = {} if groups is None else {"prompt_groups": groups}
    log_probs, output = actor(ids, actions, packed_seq_lens=seq_lens, return_output=True, return_entropy=True, **extra)
    actor.zero_grad()
    (log_probs.sum() + 0.1 * output["entropy"].sum()).backward()
    grads = {name: param.grad.clone() for name, param in actor.named_parameters() if param.grad is not None}
    return log_probs.detach(), output["entropy"].detach(), grads


def assert_same(shared, plain):
    (log_probs, entropy, grads), (ref_log_probs, ref_entropy, ref_grads) = shared, plain
    torch.testing.assert_close(log_probs, ref_log_probs, atol=ATOL, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=ATOL, rtol=0)
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().clamp(min=1.0)
        torch.testing.assert_close(grad / scale, ref_grads[name] / scale, atol=1e-5, rtol=0, msg=name)
    assert log_probs[log_probs != 0].std() > 0.05  # log-probs that vary: not a comparison of constants


def test_layout_of_a_small_row_by_hand():
    layout = shared_prompt_layout([5, 4, 3], [2, 1, 1], [0, 0, 2])
    assert layout.source.tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1, 2]]
    assert layout.q_lens == [3, 2, 1, 2, 1]
    assert layout.kv_spans == [[(0, 3)], [(0, 3), (3, 5)], [(0, 3), (5, 6)], [(6, 8)], [(6, 8), (8, 9)]]
    assert layout.kv_index.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 6, 7, 8]
    assert layout.cu_seqlens_q.tolist() == [0, 3, 5, 6, 8, 9]
    assert layout.cu_seqlens_k.tolist() == [0, 3, 8, 12, 14, 17]
    # Sequence 0's actions (original 3, 4) are predicted from shared 2, 3; sequence 1's (original
    # 8) from the prompt's last token, 2; sequence 2's (original 11) from 7.
    assert layout.predict_positions.tolist() == [2, 3, 2, 7]
    assert (layout.max_q, layout.max_k, layout.length, layout.groups) == (3, 5, 9, 2)
    assert shared_prompt_layout([5, 4], [2, 1], [0, 1]) is None  # nothing shared
    with pytest.raises(ValueError, match="different lengths"):
        shared_prompt_layout([5, 4], [2, 2], [0, 0])


def test_prompt_groups_compare_the_prompt_tokens():
    seqs = [torch.tensor([1, 2, 7]), torch.tensor([3, 9]), torch.tensor([1, 2, 5, 5]), torch.tensor([1, 2, 7])]
    assert prompt_group_ids(seqs, [1, 1, 2, 2]) == [0, 1, 0, 3]  # the last one's prompt is [1]


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
@pytest.mark.parametrize("path", ["per_segment", "one_kernel_call"])
def test_shared_packed_row_equals_the_unshared_row(arch, path, monkeypatch):
    kernel = ReferenceVarlen()
    monkeypatch.setattr(attention, "fused_varlen_kernel", lambda query: kernel if path == "one_kernel_call" else None)
    ids, seq_lens, actions, groups = grouped_row()
    model = build_tiny_arch(arch, seed=1)
    actor = ActorLanguage(model).train()
    seen = count_tokens(actor)
    shared = forward_and_grads(actor, ids, seq_lens, actions, groups)
    calls, kernel.calls = kernel.calls, 0
    plain = forward_and_grads(actor, ids, seq_lens, actions)
    assert actor.prompt_sharing.reason is None
    # Each prompt once, then every response: 3 x (prompt) + 3 x (9 + 1 + 6) tokens instead of P.
    assert seen == [sum(PROMPT_LENS) + len(PROMPT_LENS) * sum(RESPONSE_LENS), ids.size(1)]
    layers = model.config.get_text_config().num_hidden_layers
    if path == "one_kernel_call":
        assert calls == (0 if arch in SOFTCAPPED else layers)
        assert not any(kernel.same_starts[:calls])  # responses' keys include their prompts
    assert_same(shared, plain)


def test_gradient_checkpointing_keeps_sharing_exact():
    ids, seq_lens, actions, groups = grouped_row(seed=3)
    actor = ActorLanguage(build_tiny_arch("qwen2", seed=2), gradient_checkpointing=True).train()
    seen = count_tokens(actor)
    shared = forward_and_grads(actor, ids, seq_lens, actions, groups)
    plain = forward_and_grads(actor, ids, seq_lens, actions)
    assert seen[0] < seen[-1] == ids.size(1)  # the first forward (recomputed in the backward) is the shared row
    assert_same(shared, plain)


def test_the_critic_shares_prompts_exactly(tmp_path):
    ids, seq_lens, actions, groups = grouped_row(seed=1)
    critic = Critic(save_tiny_arch(tmp_path / "mistral", "mistral", seed=1)).train()
    seen = []
    critic.model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
    results = []
    for extra in ({"prompt_groups": groups}, {}):
        values = critic(ids, actions, packed_seq_lens=seq_lens, **extra)
        critic.zero_grad()
        (values ** 2).sum().backward()
        results.append((values.detach(), {n: p.grad.clone() for n, p in critic.named_parameters() if p.grad is not None}))
    (values, grads), (ref_values, ref_grads) = results
    assert seen == [sum(PROMPT_LENS) + len(PROMPT_LENS) * sum(RESPONSE_LENS), ids.size(1)]
    torch.testing.assert_close(values, ref_values, atol=ATOL, rtol=0)
    assert values.abs().max() > 0.01
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().clamp(min=1.0)
        torch.testing.assert_close(grad / scale, ref_grads[name] / scale, atol=1e-5, rtol=0, msg=name)


def test_attention_without_the_layout_falls_back_with_its_reason(caplog):
    ids, seq_lens, actions, groups = grouped_row()
    actor = ActorLanguage(build_tiny_arch("llama", seed=1), attn_implementation="sdpa").eval()
    with caplog.at_level(logging.WARNING), torch.no_grad():
        shared = actor(ids, actions, packed_seq_lens=seq_lens, prompt_groups=groups)
        plain = actor(ids, actions, packed_seq_lens=seq_lens)
    assert "'sdpa' has no shared-prompt layout" in actor.prompt_sharing.reason
    assert "--pretrain: prompts are not shared in packed rows" in caplog.text
    torch.testing.assert_close(shared, plain, atol=ATOL, rtol=0)


def test_a_model_that_drops_the_layout_is_never_trusted(monkeypatch):
    """An attention that never sees the layout would attend across the whole shared row: the
    forward notices (no layer applied it), discards that output and stops sharing."""
    ids, seq_lens, actions, groups = grouped_row()
    actor = ActorLanguage(build_tiny_arch("llama", seed=1)).eval()
    with torch.no_grad():
        plain = actor(ids, actions, packed_seq_lens=seq_lens)
        original = attention.varlen_attention

        def dropping(*args, shared_prompt_layout=None, **kwargs):
            return original(*args, **kwargs)

        monkeypatch.setitem(attention.AttentionInterface._global_mapping, attention.VARLEN_ATTENTION, dropping)
        shared = actor(ids, actions, packed_seq_lens=seq_lens, prompt_groups=groups)
    assert "0 of its 2 attention layers received the layout" in actor.prompt_sharing.reason
    torch.testing.assert_close(shared, plain, atol=ATOL, rtol=0)


def test_packed_micro_batches_carry_their_prompt_groups():
    seqs = [torch.tensor([5, 6, 7, 8]), torch.tensor([9, 6, 7]), torch.tensor([5, 6, 3])]
    samples = [Sample(sequence=s, num_actions=a, action_mask=torch.ones(a, dtype=torch.bool),
                      per_action={"advantages": torch.ones(a), "returns": torch.ones(a)}, info={"reward": torch.tensor(1.0)})
               for s, a in zip(seqs, [2, 1, 1])]
    assert collate_samples(samples, 0, packing=True).prompt_groups == [0, 1, 0]
    assert collate_samples(samples, 0, packing=False).prompt_groups is None


def value_model_grads(model, call):
    out = call()
    model.zero_grad()
    (out ** 2).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_padded_critic_and_reward_model_batches_share_prompts(arch, tmp_path):
    """Padded rows that repeat a prompt are valued and scored from a shared packed row: the
    unshared forward's values on the response slots (pad slots hold 0) and scores, and gradients."""
    sequences, mask, num_actions = grouped_batch()
    folder = save_tiny_arch(tmp_path / arch, arch, seed=1)
    slots = mask[:, -num_actions:].bool()
    for kind in ("critic", "reward"):
        seen, results = [], []
        for share in (True, False):
            torch.manual_seed(0)  # the same fresh value head for both
            if kind == "critic":
                model = Critic(folder, share_prompts=share).train()
                call = lambda m=model: m(sequences, num_actions, attention_mask=mask)[slots]  # noqa: E731
            else:
                model = RewardModel(folder, share_prompts=share, init_value_head=True).train()
                prompt_len = sequences.size(1) - num_actions
                call = lambda m=model: m(sequences, attention_mask=mask, prompt_len=prompt_len)  # noqa: E731
            model.model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
            results.append(value_model_grads(model, call))
        (values, grads), (ref_values, ref_grads) = results
        # 3 prompts once and 9 responses, against 9 padded rows.
        assert seen == [shared_tokens(sequences, mask, num_actions), sequences.numel()], kind
        torch.testing.assert_close(values, ref_values, atol=ATOL, rtol=0, msg=kind)
        assert values.std() > 0.01
        for name, grad in grads.items():
            scale = ref_grads[name].abs().max().clamp(min=1.0)
            torch.testing.assert_close(grad / scale, ref_grads[name] / scale, atol=1e-5, rtol=0, msg=f"{kind} {name}")
    if arch == "qwen2":
        torch.manual_seed(0)
        critic = Critic(folder).eval()
        with torch.no_grad():
            full = critic(sequences, num_actions, attention_mask=mask)
        assert (full[~slots] == 0).all()


def shared_tokens(sequences, mask, num_actions) -> int:
    """Tokens of the shared row: each distinct prompt's real tokens once, every row's response."""
    prompt = sequences.size(1) - num_actions
    distinct = {tuple(row[m.bool()].tolist()) for row, m in zip(sequences[:, :prompt], mask[:, :prompt])}
    return sum(len(p) for p in distinct) + int(mask[:, prompt:].sum())


def test_the_scorer_has_reward_models_share_prompts(tmp_path):
    from lightrft.experience.scorer import Scorer
    from lightrft.rollout.base import RolloutOutput

    sequences, mask, num_actions = grouped_batch()
    prompt_len = sequences.size(1) - num_actions
    model = RewardModel(save_tiny_arch(tmp_path / "llama", "llama", seed=1), init_value_head=True).eval()
    seen = []
    model.model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
    rollout = RolloutOutput(sequences=sequences, attention_mask=mask, action_mask=mask[:, prompt_len:].bool(),
                            rollout_log_probs=torch.zeros(sequences.size(0), num_actions), prompt_len=prompt_len)
    scores = Scorer(None, reward_models=[model], micro_batch_size=sequences.size(0), eos_token_ids=[2]).score(
        rollout, ["p"] * 3, None, n=3).scores
    with torch.no_grad():
        plain = model(sequences, attention_mask=mask)
    assert seen == [shared_tokens(sequences, mask, num_actions), sequences.numel()]
    torch.testing.assert_close(scores, plain, atol=ATOL, rtol=0)
    assert not accepts_keyword(torch.nn.Linear(2, 2), "prompt_len")
