"""Samples that share a prompt share its forward (`lightrft.models.shared_prompts`).

For every tiny architecture, on a shuffled micro-batch of 3 prompts x 3 samples (prompts longer
than the sliding windows, left-padded to different lengths), the shared forward gives the plain
forward's log-probs, entropies and weight gradients, while the model sees each prompt's tokens
once. Micro-batches without repeats, gradient checkpointing, load-balancing losses and models
without a KV cache take the plain forward.
"""

import copy
import warnings

import pytest
import torch
from torch import nn

from lightrft.builders.models import model_kwargs, policy_model_kwargs
from lightrft.config import PPORunConfig
from lightrft.config.sections import DistributedConfig, PPOModelConfig
from lightrft.models import ActorLanguage
from lightrft.models.shared_prompts import prompt_groups
from lightrft.utils.tiny import TINY_ARCHS, TINY_WINDOW, build_tiny_arch

from .arch_zoo import ATOL

PROMPT_LENS = (TINY_WINDOW + 5, 4, TINY_WINDOW + 9)  # longer and shorter than the windows
SAMPLES = 3


def grouped_batch(prompt_lens=PROMPT_LENS, samples=SAMPLES, seed=0):
    """(sequences (B, T), attention_mask (B, T), A): `samples` rows per prompt with responses of
    different lengths, prompts left-padded, responses right-padded, rows shuffled."""
    gen = torch.Generator().manual_seed(seed)
    max_p, num_actions = max(prompt_lens), 9
    rows, masks = [], []
    for p in prompt_lens:
        prompt = torch.randint(4, 100, (p,), generator=gen)
        for i in range(samples):
            r = num_actions - 2 * i
            response = torch.randint(4, 100, (r,), generator=gen)
            rows.append(torch.cat([torch.zeros(max_p - p, dtype=torch.long), prompt, response,
                                   torch.zeros(num_actions - r, dtype=torch.long)]))
            masks.append(torch.cat([torch.zeros(max_p - p), torch.ones(p + r), torch.zeros(num_actions - r)]).long())
    order = torch.randperm(len(rows), generator=gen)
    return torch.stack(rows)[order], torch.stack(masks)[order], num_actions


def count_tokens(actor) -> list[int]:
    """A list that collects the number of token ids of each model forward."""
    seen = []
    actor.model.get_input_embeddings().register_forward_hook(lambda module, args, out: seen.append(args[0].numel()))
    return seen


def action_mask(mask, num_actions):
    return mask[:, -num_actions:].bool()


def forward_and_grads(actor, sequences, mask, num_actions):
    """(log-probs (B, A), entropy (B, A), {name: grad}) of a token-sum loss over the actions."""
    log_probs, output = actor(sequences, num_actions, attention_mask=mask, return_output=True, return_entropy=True)
    actions = action_mask(mask, num_actions)
    actor.zero_grad()
    (log_probs[actions].sum() + 0.1 * output["entropy"][actions].sum()).backward()
    grads = {name: param.grad.clone() for name, param in actor.named_parameters() if param.grad is not None}
    return log_probs.detach(), output["entropy"].detach(), grads


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_shared_prompt_forward_equals_the_plain_forward(arch):
    sequences, mask, num_actions = grouped_batch()
    model = build_tiny_arch(arch, seed=1)
    shared = ActorLanguage(copy.deepcopy(model)).train()
    plain = ActorLanguage(model, share_prompts=False).train()
    seen_shared, seen_plain = count_tokens(shared), count_tokens(plain)
    log_probs, entropy, grads = forward_and_grads(shared, sequences, mask, num_actions)
    ref_log_probs, ref_entropy, ref_grads = forward_and_grads(plain, sequences, mask, num_actions)
    # Each prompt's columns once (3 x 22), then every row's response columns (9 x 9).
    prompt_cols = sequences.size(1) - num_actions
    assert seen_shared == [len(PROMPT_LENS) * prompt_cols, sequences.size(0) * num_actions]
    assert seen_plain == [sequences.numel()]
    actions = action_mask(mask, num_actions)
    torch.testing.assert_close(log_probs[actions], ref_log_probs[actions], atol=ATOL, rtol=0)
    torch.testing.assert_close(entropy[actions], ref_entropy[actions], atol=ATOL, rtol=0)
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().clamp(min=1.0)
        torch.testing.assert_close(grad / scale, ref_grads[name] / scale, atol=1e-5, rtol=0, msg=name)
    # Log-probs of a 100-token model that vary: the comparison above is not between constants.
    assert log_probs[actions].std() > 0.05


def test_lora_actor_shares_prompts_exactly():
    sequences, mask, num_actions = grouped_batch()
    actor = ActorLanguage(build_tiny_arch("qwen2", seed=1), lora_rank=4, lora_alpha=8).train()
    with torch.no_grad():  # LoRA's B starts at zero; make the adapters count
        for name, param in actor.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(2))
    plain = copy.deepcopy(actor)
    plain.share_prompts = False
    actors = [actor, plain]
    seen = count_tokens(actors[0])
    (log_probs, _, grads), (ref_log_probs, _, ref_grads) = (forward_and_grads(a, sequences, mask, num_actions)
                                                             for a in actors)
    assert len(seen) == 2
    actions = action_mask(mask, num_actions)
    torch.testing.assert_close(log_probs[actions], ref_log_probs[actions], atol=ATOL, rtol=0)
    assert any("lora" in name for name in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_rows_without_a_repeated_prompt_take_the_plain_forward():
    sequences, mask, num_actions = grouped_batch(samples=1)
    actor = ActorLanguage(build_tiny_arch("llama", seed=1)).eval()
    seen = count_tokens(actor)
    with torch.no_grad():
        actor(sequences, num_actions, attention_mask=mask)
    assert seen == [sequences.numel()]
    assert prompt_groups(sequences[:, :-num_actions], mask[:, :-num_actions]) is None


def test_prompt_groups_compare_ids_and_padding():
    ids = torch.tensor([[0, 5, 6], [5, 6, 7], [0, 5, 6], [0, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]])  # row 3: same ids, 0 is a real token
    first, inverse = prompt_groups(ids, mask)
    assert inverse[0] == inverse[2] and len({int(inverse[0]), int(inverse[1]), int(inverse[3])}) == 3
    assert sorted(first.tolist()) == [0, 1, 3]
    assert all(int(inverse[int(row)]) == group for group, row in enumerate(first))


def test_gradient_checkpointing_and_aux_losses_take_the_plain_forward():
    sequences, mask, num_actions = grouped_batch()
    checkpointed = ActorLanguage(build_tiny_arch("llama", seed=1), gradient_checkpointing=True).train()
    seen = count_tokens(checkpointed)
    reference = ActorLanguage(build_tiny_arch("llama", seed=1), share_prompts=False).train()
    actions = action_mask(mask, num_actions)
    torch.testing.assert_close(checkpointed(sequences, num_actions, attention_mask=mask)[actions],
                               reference(sequences, num_actions, attention_mask=mask)[actions], atol=ATOL, rtol=0)
    assert seen == [sequences.numel()]
    moe = ActorLanguage(build_tiny_arch("qwen3_moe", seed=1)).train()
    seen = count_tokens(moe)
    _, output = moe(sequences, num_actions, attention_mask=mask, return_output=True, return_aux_loss=True)
    assert seen == [sequences.numel()] and output["aux_loss"] is not None


class WrappedLM(nn.Module):
    """A causal LM around another, with the Hugging Face forward signature (subclasses' forward)."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()


class NoCacheLM(WrappedLM):
    """A causal LM that never returns a KV cache."""

    def forward(self, **kwargs):
        kwargs.pop("past_key_values", None)
        output = self.inner(**{**kwargs, "use_cache": False})
        output.past_key_values = None
        return output


def wrapped_against_plain(wrap, calls: int = 1):
    """An actor over `wrap(model)` called `calls` times (deprecation warnings raised as errors) and
    a plain actor over the same weights without sharing: (actor, its outputs, the plain output,
    the token counts of each of its model forwards, prompt columns, action mask)."""
    sequences, mask, num_actions = grouped_batch()
    model = build_tiny_arch("llama", seed=1)
    actor = ActorLanguage(wrap(copy.deepcopy(model))).eval()
    reference = ActorLanguage(model, share_prompts=False).eval()
    seen = count_tokens(actor)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", FutureWarning)
        outputs = [actor(sequences, num_actions, attention_mask=mask) for _ in range(calls)]
    with torch.no_grad():
        expected = reference(sequences, num_actions, attention_mask=mask)
    actions = action_mask(mask, num_actions)
    for got in outputs:
        torch.testing.assert_close(got[actions], expected[actions], atol=ATOL, rtol=0)
    return actor, outputs, seen, sequences.size(1) - num_actions, (sequences.size(0), num_actions)


def test_a_model_without_a_cache_falls_back_to_the_plain_forward_for_good():
    actor, (first, second), seen, prompt_cols, (rows, num_actions) = wrapped_against_plain(NoCacheLM, calls=2)
    torch.testing.assert_close(second, first, atol=0, rtol=0)
    # The first call tried the prompt forward once, then the plain one; the second only the plain.
    total = rows * (prompt_cols + num_actions)
    assert seen == [len(PROMPT_LENS) * prompt_cols, total, total]
    assert actor.share_prompts is False


class CacheDroppingLM(WrappedLM):
    """A causal LM wrapper whose forward takes `**kwargs` and passes on only the names it knows: a
    KV cache under the name the installed transformers uses is dropped, so a response forward
    would run without its prompt (what a forward does with a cache name a release removed)."""

    def forward(self, **kwargs):
        known = ("input_ids", "attention_mask", "position_ids", "use_cache", "logits_to_keep")
        return self.inner(**{k: v for k, v in kwargs.items() if k in known})


def test_a_response_forward_that_dropped_the_prompt_cache_is_never_used():
    actor, _, seen, prompt_cols, (rows, num_actions) = wrapped_against_plain(CacheDroppingLM)
    # Prompt pass, response pass (its cache was not continued: discarded), then the plain forward.
    assert seen == [len(PROMPT_LENS) * prompt_cols, rows * num_actions, rows * (prompt_cols + num_actions)]
    assert actor.share_prompts is False


def test_a_forward_that_takes_the_cache_as_cache_shares_without_a_deprecated_name():
    """The forward of newer transformers releases (`cache` in and out, `past_key_values` a
    deprecated alias): the shared forward passes and reads `cache` and gives the plain log-probs."""
    from tests.rollout.test_hf_engine import RenamedCacheLM

    def renamed(model):
        lm = RenamedCacheLM(model)
        lm.get_input_embeddings = model.get_input_embeddings
        return lm

    actor, _, seen, prompt_cols, (rows, num_actions) = wrapped_against_plain(renamed)
    assert seen == [len(PROMPT_LENS) * prompt_cols, rows * num_actions]
    assert actor.share_prompts is True


def test_no_prompt_sharing_flag_reaches_every_policy_model():
    parser = PPORunConfig.build_parser("train_ppo")
    flags = parser.parse_args(["--pretrain", "m", "--critic_pretrain", "m", "--prompt_data", "p",
                               "--remote_rm_url", "math", "--no_prompt_sharing"])
    off = PPORunConfig.from_namespace(flags).model
    assert off.no_prompt_sharing is True and PPOModelConfig(pretrain="m").no_prompt_sharing is False
    distributed = DistributedConfig()
    assert policy_model_kwargs(PPOModelConfig(pretrain="m"), distributed)["share_prompts"] is True
    assert policy_model_kwargs(off, distributed)["share_prompts"] is False
    assert model_kwargs(off, distributed)["share_prompts"] is False  # critic and reward models too
