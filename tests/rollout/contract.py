"""The contract every `RolloutEngine` passes, written once and run against each engine.

A test module subclasses `RolloutEngineContract` and defines a class-scoped fixture `case`
returning an `EngineCase`: the engine under test and a reference Hugging Face model with the same
weights, which the tests run by hand (full forwards, no cache) to get the expected tokens and
log-probs.
"""

import copy
from dataclasses import dataclass

import pytest
import torch

from lightrft.rollout import SamplingParams
from lightrft.rollout.sampling import filter_top_k_top_p
from lightrft.utils.tiny import build_char_tokenizer, build_tiny_causal_lm

PROMPTS = ["1+1=", "hello world", "abc"]
LM_HEAD_SCALE = 6.0
EOS_LOGIT_SCALE = 3.0


def build_contract_model(arch: str = "qwen2", seed: int = 0, **sizes):
    """The character tokenizer and a tiny causal LM reshaped for rollout tests.

    A freshly initialised model is close to uniform over 100 tokens and almost never ends a
    response. Scaling the output layer makes its distributions peaked (so greedy chains are far
    from ties), and pointing the EOS row along the mean final hidden state gives EOS a sizeable
    probability, so responses end at different lengths and the padding rules get exercised.
    """
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, arch=arch, seed=seed, **sizes)
    with torch.no_grad():
        probe = torch.randint(4, len(tokenizer), (16, 12), generator=torch.Generator().manual_seed(seed))
        hidden = model.model(input_ids=probe).last_hidden_state.reshape(-1, model.config.hidden_size)
        mean = hidden.mean(dim=0)
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
        # The EOS logit is EOS_LOGIT_SCALE * <h, mean> / |mean|^2, about EOS_LOGIT_SCALE on average.
        model.lm_head.weight[tokenizer.eos_token_id] = mean / mean.norm() ** 2 * EOS_LOGIT_SCALE
    return tokenizer, model.eval()


@dataclass
class EngineCase:
    engine: object  # the RolloutEngine under test
    reference: torch.nn.Module  # HF causal LM with the engine's weights
    prompt_ids: list  # list[list[int]], PROMPTS tokenised
    pad_token_id: int
    eos_token_id: int


def reference_logits(model: torch.nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Teacher-forced float32 logits with position ids that follow the left padding.
    Shape: (B, T) -> (B, T, V)."""
    device = next(model.parameters()).device
    sequences, attention_mask = sequences.to(device), attention_mask.to(device)
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids).logits
    return logits.float().cpu()


def greedy_chain(model: torch.nn.Module, prompt: list, max_new_tokens: int, eos_token_id: int) -> tuple[list, list]:
    """Greedy decoding one prompt at a time by full forwards (no cache, no padding): the tokens
    and their log-probs at temperature 1."""
    ids = list(prompt)
    tokens, log_probs = [], []
    for _ in range(max_new_tokens):
        seq = torch.tensor([ids])
        logits = reference_logits(model, seq, torch.ones_like(seq))[0, -1]
        token = int(logits.argmax())
        tokens.append(token)
        log_probs.append(float(torch.log_softmax(logits, dim=-1)[token]))
        ids.append(token)
        if token == eos_token_id:
            break
    return tokens, log_probs


def response_of(out, row: int) -> list:
    """Row's response tokens (EOS included, padding excluded)."""
    length = int(out.action_mask[row].sum())
    return out.responses[row, :length].tolist()


class RolloutEngineContract:
    """Tests shared by all rollout engines. Subclasses set `logprob_atol` and the `case` fixture."""

    logprob_atol = 1e-5

    def test_shapes_masks_and_padding(self, case):
        n, max_new = 3, 12
        out = case.engine.generate(case.prompt_ids, SamplingParams(max_new_tokens=max_new, n=n, seed=0))
        batch = len(case.prompt_ids) * n
        prompt_len = max(len(p) for p in case.prompt_ids)
        lengths = out.action_mask.sum(dim=-1)
        assert out.prompt_len == prompt_len
        assert out.sequences.shape == out.attention_mask.shape == (batch, prompt_len + out.num_actions)
        assert out.action_mask.shape == out.rollout_log_probs.shape == (batch, out.num_actions)
        assert out.sequences.dtype == torch.long and out.action_mask.dtype == torch.bool
        assert out.rollout_log_probs.dtype == torch.float32
        assert out.num_actions == int(lengths.max()) <= max_new
        assert out.truncated.shape == (batch,) and out.truncated.dtype == torch.bool
        # The model is built so that some responses end early and some run to the limit.
        assert (lengths < max_new).any() and (lengths == max_new).any(), lengths

        for row in range(batch):
            prompt = case.prompt_ids[row // n]
            pad = prompt_len - len(prompt)
            assert out.sequences[row, pad:prompt_len].tolist() == prompt
            assert out.sequences[row, :pad].eq(case.pad_token_id).all()
            assert out.attention_mask[row, :prompt_len].tolist() == [0] * pad + [1] * len(prompt)
            length = int(lengths[row])
            # The action mask is a prefix; the response ends with EOS unless it hit the limit.
            assert out.action_mask[row].tolist() == [True] * length + [False] * (out.num_actions - length)
            response = response_of(out, row)
            assert case.eos_token_id not in response[:-1]
            assert response[-1] == case.eos_token_id or length == max_new
            # `truncated` says which: cut at the limit without EOS.
            assert bool(out.truncated[row]) == (response[-1] != case.eos_token_id)
            # After the response: padding, masked out, log-prob 0.
            assert out.responses[row, length:].eq(case.pad_token_id).all()
            assert out.attention_mask[row, prompt_len:].tolist() == out.action_mask[row].long().tolist()
            assert out.rollout_log_probs[row, length:].eq(0).all()
            assert (out.rollout_log_probs[row, :length] < 0).all()

    def test_samples_of_a_prompt_are_contiguous(self, case):
        n = 4
        out = case.engine.generate(case.prompt_ids, SamplingParams(max_new_tokens=6, n=n, seed=1))
        prompt_len = out.prompt_len
        for i, prompt in enumerate(case.prompt_ids):
            group = range(i * n, (i + 1) * n)
            for row in group:
                assert out.sequences[row, prompt_len - len(prompt):prompt_len].tolist() == prompt
            # Independent samples of one prompt are not copies of each other.
            assert len({tuple(response_of(out, row)) for row in group}) > 1

    def test_same_seed_same_samples_other_seed_other_samples(self, case):
        params = SamplingParams(max_new_tokens=10, n=2, seed=123)
        first = case.engine.generate(case.prompt_ids, params)
        again = case.engine.generate(case.prompt_ids, params)
        other = case.engine.generate(case.prompt_ids, SamplingParams(max_new_tokens=10, n=2, seed=124))
        assert torch.equal(first.sequences, again.sequences)
        assert torch.equal(first.rollout_log_probs, again.rollout_log_probs)
        assert not torch.equal(first.sequences, other.sequences)

    def test_greedy_equals_argmax_chain(self, case):
        max_new = 12
        out = case.engine.generate(case.prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=max_new))
        for row, prompt in enumerate(case.prompt_ids):
            tokens, log_probs = greedy_chain(case.reference, prompt, max_new, case.eos_token_id)
            assert response_of(out, row) == tokens
            length = len(tokens)
            # Greedy log-probs are reported at temperature 1.
            torch.testing.assert_close(out.rollout_log_probs[row, :length], torch.tensor(log_probs),
                                       atol=self.logprob_atol, rtol=0)

    @pytest.mark.parametrize("temperature, top_k, top_p, min_new", [
        (0.7, 0, 1.0, 0), (1.3, 5, 0.9, 0), (1.0, 0, 0.8, 0), (0.9, 0, 1.0, 4)])
    def test_log_probs_are_those_of_the_sampling_distribution(self, case, temperature, top_k, top_p, min_new):
        """log softmax(filter((logits, EOS banned before min_new tokens) / T)) of the sampled
        token under a full forward of the same weights: the distribution it was drawn from, top-k
        then top-p renormalised (docs/rollout.md). Without filters: log softmax(logits / T)."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=10,
                                min_new_tokens=min_new, n=2, seed=7)
        out = case.engine.generate(case.prompt_ids, params)
        logits = reference_logits(case.reference, out.sequences, out.attention_mask)
        # Logits at position t predict token t + 1: the response starts at prompt_len.
        action_logits = logits[:, out.prompt_len - 1:-1].clone()  # (B, A, V)
        action_logits[:, :min_new, case.eos_token_id] = float("-inf")
        batch, width, vocab = action_logits.shape
        filtered = filter_top_k_top_p(action_logits.reshape(-1, vocab) / temperature, top_k, top_p)
        expected = torch.log_softmax(filtered, dim=-1).reshape(batch, width, vocab)
        expected = expected.gather(-1, out.responses.unsqueeze(-1)).squeeze(-1)
        mask = out.action_mask
        torch.testing.assert_close(out.rollout_log_probs[mask], expected[mask], atol=self.logprob_atol, rtol=0)

    def test_max_and_min_new_tokens(self, case):
        short = case.engine.generate(case.prompt_ids, SamplingParams(max_new_tokens=3, n=3, seed=2))
        assert short.num_actions <= 3 and (short.response_lengths <= 3).all()

        exact = case.engine.generate(case.prompt_ids, SamplingParams(max_new_tokens=6, min_new_tokens=6, n=3, seed=2))
        assert (exact.response_lengths == 6).all()
        assert not exact.responses.eq(case.eos_token_id).any()

        min_new = 6
        at_least = case.engine.generate(
            case.prompt_ids, SamplingParams(max_new_tokens=12, min_new_tokens=min_new, n=4, seed=0))
        assert (at_least.response_lengths >= min_new).all()
        assert not at_least.responses[:, :min_new].eq(case.eos_token_id).any()
        # Without the constraint the same seed ends some responses earlier.
        free = case.engine.generate(case.prompt_ids, SamplingParams(max_new_tokens=12, n=4, seed=0))
        assert (free.response_lengths < min_new).any()

    @pytest.mark.parametrize("top_k, top_p", [(1, 1.0), (0, 1e-6)])
    def test_top_k_one_and_tiny_top_p_equal_greedy(self, case, top_k, top_p):
        greedy = case.engine.generate(case.prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=10))
        narrow = case.engine.generate(
            case.prompt_ids, SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, max_new_tokens=10, seed=99))
        assert torch.equal(narrow.sequences, greedy.sequences)
        # One token kept: it had probability 1 under the distribution it was drawn from.
        torch.testing.assert_close(narrow.rollout_log_probs, torch.zeros_like(narrow.rollout_log_probs),
                                   atol=self.logprob_atol, rtol=0)
        assert (greedy.rollout_log_probs[greedy.action_mask] < -1e-3).any()

    @pytest.mark.parametrize("top_k", [0, 3])
    def test_first_token_frequencies_follow_the_distribution(self, case, top_k):
        """4000 draws of the first token against softmax(logits / T), renormalised over the top-k
        tokens when top_k is set: every observed frequency within 5 standard errors."""
        draws, temperature = 4000, 0.8
        prompt = case.prompt_ids[1]
        out = case.engine.generate([prompt], SamplingParams(temperature=temperature, top_k=top_k,
                                                            max_new_tokens=1, n=draws, seed=5))
        seq = torch.tensor([prompt])
        logits = reference_logits(case.reference, seq, torch.ones_like(seq))[0, -1] / temperature
        if top_k:
            kth = logits.topk(top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        counts = torch.bincount(out.responses[:, 0], minlength=probs.numel()).double()
        freq = counts / draws
        stderr = (probs * (1 - probs) / draws).sqrt().double()
        assert (counts[probs == 0] == 0).all()
        assert ((freq - probs.double()).abs() <= 5 * stderr + 1e-3).all()
        assert probs.max() < 0.9  # the check compares a spread-out distribution, not one token

    def test_sleep_and_wake_up_keep_the_model(self, case):
        params = SamplingParams(temperature=0.0, max_new_tokens=8)
        before = case.engine.generate(case.prompt_ids, params)
        case.engine.sleep()
        case.engine.wake_up()
        after = case.engine.generate(case.prompt_ids, params)
        assert torch.equal(before.sequences, after.sequences)

    def test_per_request_seeds_make_samples_independent_of_the_batch(self, case):
        """With one seed per prompt, a prompt's samples depend on its seed only: the same rows
        come out whether it is sampled alone or among other prompts, and in any position."""
        params = SamplingParams(temperature=1.0, max_new_tokens=8, n=3)
        seeds = [1001, 1002, 1003]
        together = case.engine.generate(case.prompt_ids, params, seeds=seeds)
        reordered = case.engine.generate(case.prompt_ids[::-1], params, seeds=seeds[::-1])
        for i, prompt in enumerate(case.prompt_ids):
            alone = case.engine.generate([prompt], params, seeds=[seeds[i]])
            j = len(case.prompt_ids) - 1 - i
            for k in range(params.n):
                assert response_of(alone, k) == response_of(together, i * params.n + k)
                assert response_of(alone, k) == response_of(reordered, j * params.n + k)
            length = int(alone.response_lengths[0])
            torch.testing.assert_close(alone.rollout_log_probs[0, :length],
                                       together.rollout_log_probs[i * params.n, :length], atol=1e-4, rtol=0)
        other = case.engine.generate(case.prompt_ids, params, seeds=[2001, 2002, 2003])
        assert not torch.equal(other.sequences, together.sequences)

    def test_seeds_must_match_the_prompts(self, case):
        with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
            case.engine.generate(case.prompt_ids, SamplingParams(max_new_tokens=2), seeds=[1, 2])

    def test_several_eos_ids_each_end_a_response(self, case):
        """With two EOS ids, whichever comes first ends the response (and is kept in it)."""
        greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
        base = case.engine.generate(case.prompt_ids, greedy)
        long_row = int(base.response_lengths.argmax())
        second_token = response_of(base, long_row)[1]
        assert second_token != case.eos_token_id
        engine = copy.copy(case.engine)  # shares the model; only the stop set differs
        engine.eos_token_ids = [case.eos_token_id, second_token]
        out = engine.generate(case.prompt_ids, greedy)
        assert response_of(out, long_row) == response_of(base, long_row)[:2]
        assert not out.truncated[long_row]
        for row in range(len(case.prompt_ids)):
            expected = response_of(base, row)
            cut = next((i + 1 for i, tok in enumerate(expected) if tok in engine.eos_token_ids), len(expected))
            assert response_of(out, row) == expected[:cut]
