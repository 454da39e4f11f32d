"""HFEngine: the shared rollout contract plus what is particular to decoding with the live model."""

import copy
import warnings
from types import SimpleNamespace

import pytest
import torch
from transformers.utils.deprecation import deprecate_kwarg

from lightrft.models import ActorLanguage
from lightrft.rollout import HFEngine, RolloutEngine, RolloutOutput, SamplingParams
from lightrft.rollout.base import request_seeds_for
from lightrft.rollout.hf_engine import distinct_rows, left_pad
from lightrft.rollout.sampling import sample_next_tokens
from lightrft.rollout.seeds import sample_seed
from lightrft.utils.hf_api import cache_argument, forward_parameters
from lightrft.utils.tiny import build_tiny_arch, tiny_tokenizer
from tests.conftest import read_json_lines, run_torchrun
from tests.rollout.contract import (
    PROMPTS,
    EngineCase,
    RolloutEngineContract,
    build_contract_model,
    greedy_chain,
    response_of,
)


def make_case(arch: str = "qwen2") -> EngineCase:
    tokenizer, model = build_contract_model(arch=arch)
    engine = HFEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    return EngineCase(engine, model, prompt_ids, tokenizer.pad_token_id, tokenizer.eos_token_id)


class TestHFEngineContract(RolloutEngineContract):
    logprob_atol = 1e-5

    @pytest.fixture(scope="class")
    def case(self):
        return make_case()


@pytest.fixture(scope="module")
def case():
    return make_case()


def test_is_a_rollout_engine(case):
    assert isinstance(case.engine, RolloutEngine)


def test_llama_greedy_equals_argmax_chain():
    case = make_case("llama")
    out = case.engine.generate(case.prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=8))
    for row, prompt in enumerate(case.prompt_ids):
        tokens, _ = greedy_chain(case.reference, prompt, 8, case.eos_token_id)
        assert response_of(out, row) == tokens


@pytest.mark.parametrize("training", [True, False])
def test_generation_runs_in_eval_mode_and_restores_the_mode(case, training):
    model = case.engine.model
    seen_modes = []
    handle = model.model.register_forward_pre_hook(lambda module, args: seen_modes.append(module.training))
    model.train(training)
    try:
        case.engine.generate(case.prompt_ids, SamplingParams(max_new_tokens=3, seed=0))
        mode_after = model.training
    finally:
        handle.remove()
        model.eval()
    assert seen_modes and not any(seen_modes)
    assert mode_after is training


def test_decoding_uses_the_kv_cache(case):
    """After the prefill every forward gets one new token per row."""
    widths = []
    handle = case.engine.model.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        out = case.engine.generate(case.prompt_ids, SamplingParams(min_new_tokens=5, max_new_tokens=5, seed=0))
    finally:
        handle.remove()
    assert widths == [out.prompt_len, 1, 1, 1, 1]


def test_padding_does_not_change_a_prompt_samples(case):
    """A prompt decoded alone, or left-padded in a batch with longer prompts, gets the same greedy
    tokens and log-probs."""
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    batched = case.engine.generate(case.prompt_ids, params)
    for row, prompt in enumerate(case.prompt_ids):
        alone = case.engine.generate([prompt], params)
        assert response_of(alone, 0) == response_of(batched, row)
        length = int(alone.response_lengths[0])
        torch.testing.assert_close(alone.rollout_log_probs[0, :length], batched.rollout_log_probs[row, :length],
                                   atol=1e-5, rtol=0)


class RenamedCacheLM(torch.nn.Module):
    """A causal LM with the forward of newer transformers releases: the KV cache is `cache` in and
    out, and `past_key_values` is a deprecated alias (transformers' own `deprecate_kwarg`, which
    warns with a FutureWarning)."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm
        self.inner_name = cache_argument(forward_parameters(lm))

    @deprecate_kwarg("past_key_values", "99.0.0", new_name="cache")
    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None,
                logits_to_keep=0):
        out = self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=use_cache, logits_to_keep=logits_to_keep, **{self.inner_name: cache})
        cache = getattr(out, self.inner_name)
        return SimpleNamespace(logits=out.logits, cache=cache, past_key_values=cache)  # the old name still reads


def test_the_kv_cache_goes_by_the_name_the_forward_takes(case):
    renamed = HFEngine(RenamedCacheLM(case.engine.model), case.pad_token_id, case.eos_token_id)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)     # the deprecated name is never passed
        got = renamed.generate(case.prompt_ids, params, seeds=[3, 4, 5])
    want = case.engine.generate(case.prompt_ids, params, seeds=[3, 4, 5])
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(got.rollout_log_probs, want.rollout_log_probs, atol=1e-6, rtol=0)


def test_rollout_log_probs_equal_the_actor_log_probs():
    """The trainer's ActorLanguage, at the sampling temperature, computes the same log-probs for
    the sampled tokens as the engine reported: rollout and old log-probs agree before training."""
    tokenizer, model = build_contract_model()
    actor = ActorLanguage(model, temperature=0.7)
    engine = HFEngine(actor.model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    out = engine.generate(prompt_ids, SamplingParams(temperature=0.7, max_new_tokens=10, n=2, seed=3))
    with torch.no_grad():
        actor_log_probs = actor(out.sequences, out.num_actions, attention_mask=out.attention_mask)
    assert actor_log_probs.shape == out.rollout_log_probs.shape
    torch.testing.assert_close(out.rollout_log_probs[out.action_mask], actor_log_probs[out.action_mask],
                               atol=1e-5, rtol=0)


def test_from_token_lists_rebuilds_the_engine_output(case):
    """The padding helper the vLLM engine uses gives exactly what HFEngine builds with tensors."""
    out = case.engine.generate(case.prompt_ids, SamplingParams(max_new_tokens=12, n=2, seed=4))
    prompts = [p for p in case.prompt_ids for _ in range(2)]
    responses = [response_of(out, row) for row in range(out.sequences.shape[0])]
    log_probs = [out.rollout_log_probs[row, :len(r)].tolist() for row, r in enumerate(responses)]
    rebuilt = RolloutOutput.from_token_lists(prompts, responses, log_probs, case.pad_token_id, [case.eos_token_id])
    assert rebuilt.prompt_len == out.prompt_len
    for name in ("sequences", "attention_mask", "action_mask", "rollout_log_probs", "truncated"):
        assert torch.equal(getattr(rebuilt, name), getattr(out, name)), name


@pytest.mark.parametrize("seeds", [None, [31, 32, 33]])
def test_micro_batch_size_does_not_change_the_samples(case, seeds):
    """One generate call decodes in chunks of micro_batch_size samples; every sample draws from
    its own stream, so any chunking gives the same tokens, log-probs and flags."""
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=10, n=3, seed=5)
    whole = case.engine.generate(case.prompt_ids, params, seeds=seeds)
    assert whole.sequences.shape[0] == 9
    for micro_batch_size in (1, 2, 4):
        engine = HFEngine(case.engine.model, case.pad_token_id, case.eos_token_id, micro_batch_size=micro_batch_size)
        chunked = engine.generate(case.prompt_ids, params, seeds=seeds)
        assert torch.equal(chunked.sequences, whole.sequences), micro_batch_size
        assert torch.equal(chunked.action_mask, whole.action_mask)
        assert torch.equal(chunked.truncated, whole.truncated)
        torch.testing.assert_close(chunked.rollout_log_probs, whole.rollout_log_probs, atol=1e-5, rtol=0)


def test_bad_micro_batch_size_is_refused(case):
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1"):
        HFEngine(case.engine.model, case.pad_token_id, case.eos_token_id, micro_batch_size=0)


def test_seed_none_follows_torch_global_seed(case):
    params = SamplingParams(max_new_tokens=8, n=2)
    torch.manual_seed(11)
    first = case.engine.generate(case.prompt_ids, params)
    torch.manual_seed(11)
    second = case.engine.generate(case.prompt_ids, params)
    assert torch.equal(first.sequences, second.sequences)


def test_update_weights_sleep_and_wake_up_leave_the_live_model_alone(case):
    before = {k: v.clone() for k, v in case.engine.model.state_dict().items()}
    zeros = [(name, torch.zeros_like(p)) for name, p in case.engine.model.named_parameters()]
    case.engine.update_weights(zeros)
    case.engine.sleep()
    case.engine.wake_up()
    after = case.engine.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_bad_prompts_raise_clear_errors(case):
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match="no prompts"):
        case.engine.generate([], params)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        case.engine.generate([[5, 6], []], params)
    with pytest.raises(ValueError, match="prompt 0 must be a list of token ids"):
        case.engine.generate(["1+1="], params)


def test_missing_special_tokens_raise(case):
    with pytest.raises(ValueError, match="eos_token_id"):
        HFEngine(case.engine.model, pad_token_id=0, eos_token_id=None)
    with pytest.raises(ValueError, match="pad_token_id"):
        HFEngine(case.engine.model, pad_token_id=None, eos_token_id=2)


@pytest.fixture(scope="module")
def two_rank_rows(tmp_path_factory):
    """One torchrun launch (2 ranks, gloo) for every multi-rank check; see dist_synced_decode.py."""
    result = tmp_path_factory.mktemp("synced") / "rows.jsonl"
    run_torchrun(["tests/rollout/dist_synced_decode.py", result], nproc=2)
    return read_json_lines(result)


@pytest.mark.dist
def test_synced_gpus_keeps_ranks_in_lockstep(two_rank_rows):
    """Two ranks whose greedy responses end at different steps: with synced_gpus both run the
    same number of forwards (what ZeRO-3 needs), without it the early rank stops; the tokens are
    the same either way."""
    rows = {(r["rank"], r["synced"]): r for r in two_rank_rows if r["check"] == "lockstep"}
    for rank in (0, 1):
        assert rows[(rank, True)]["responses"] == rows[(rank, False)]["responses"]
    unsynced = [rows[(rank, False)]["forwards"] for rank in (0, 1)]
    assert unsynced[0] != unsynced[1]
    assert rows[(0, True)]["forwards"] == rows[(1, True)]["forwards"] == max(unsynced)


@pytest.mark.dist
def test_zero3_partitioned_model_samples_like_the_whole_model(two_rank_rows):
    """Under ZeRO-3 each rank holds a shard of every parameter; HFEngine(synced_gpus=True) still
    draws the same tokens with the same log-probs as the unsharded model, and after an optimizer
    step it decodes with the new weights (no update_weights needed)."""
    rows = [r for r in two_rank_rows if r["check"] == "zero3"]
    assert len(rows) == 2
    for row in rows:
        assert row["partitioned"]
        assert row["same_samples"] and row["log_prob_max_diff"] <= 1e-5
        assert row["greedy_after"] == row["expected_after"]
        assert row["chunked"] == row["expected_chunked"]  # uneven chunk counts did not hang or differ
    # The step changed what greedy decoding produces, so the check above compares new weights.
    assert any(row["greedy_after"] != row["greedy_before"] for row in rows)


# ------------------------------------------------------------------ the fast decode == the plain loop
def reference_generate(model, prompts: list, sample_seeds: list, params: SamplingParams, pad_token_id: int,
                       eos_token_ids: list) -> tuple:
    """HFEngine's decoding loop as it was before it was made faster, written plainly: one fresh
    generator per sample, a prompt forward for every sample (no sharing within a group), the
    attention mask grown by concatenation and per-step lists stacked at the end.
    Returns (sequences, action_mask, log_probs, truncated)."""
    batch, steps = len(prompts), params.max_new_tokens
    uniforms = None
    if not params.greedy:
        uniforms = torch.stack([torch.rand(steps, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
                                for s in sample_seeds])
    prompt_len = max(len(p) for p in prompts)
    input_ids = torch.full((batch, prompt_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, prompt_len), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, prompt_len - len(prompt):] = torch.tensor(prompt)
        attention_mask[i, prompt_len - len(prompt):] = 1
    prompt_mask = attention_mask
    eos = torch.tensor(eos_token_ids)
    positions = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    step_ids, cache = input_ids, None
    cache_name = cache_argument(forward_parameters(model))
    unfinished = torch.ones(batch, dtype=torch.bool)
    tokens, log_probs, is_action = [], [], []
    with torch.no_grad():
        for step in range(steps):
            out = model(input_ids=step_ids, attention_mask=attention_mask, position_ids=positions,
                        use_cache=True, **{cache_name: cache})
            cache = getattr(out, cache_name)
            next_tokens, next_log_probs = sample_next_tokens(
                out.logits[:, -1, :], params.temperature, params.top_k, params.top_p,
                None if uniforms is None else uniforms[:, step], eos if step < params.min_new_tokens else None)
            next_tokens = torch.where(unfinished, next_tokens, pad_token_id)
            tokens.append(next_tokens)
            log_probs.append(torch.where(unfinished, next_log_probs, 0.0))
            is_action.append(unfinished.clone())
            attention_mask = torch.cat([attention_mask, unfinished.long().unsqueeze(1)], dim=1)
            unfinished = unfinished & ~torch.isin(next_tokens, eos)
            step_ids, positions = next_tokens.unsqueeze(1), positions[:, -1:] + 1
            if not unfinished.any():
                break
    action_mask = torch.stack(is_action, dim=1)
    width = int(action_mask.sum(dim=-1).max())
    sequences = torch.cat([input_ids, torch.stack(tokens, dim=1)[:, :width]], dim=1)
    assert prompt_mask.shape[1] == prompt_len
    return sequences, action_mask[:, :width], torch.stack(log_probs, dim=1)[:, :width], unfinished


def assert_same_as_reference(engine, prompt_ids, params, seeds):
    out = engine.generate(prompt_ids, params, seeds=seeds)
    request_seeds = request_seeds_for(prompt_ids, params, seeds)
    prompts = [p for p in prompt_ids for _ in range(params.n)]
    sample_seeds = [sample_seed(s, j) for s in request_seeds for j in range(params.n)]
    sequences, action_mask, log_probs, truncated = reference_generate(
        engine.model, prompts, sample_seeds, params, engine.pad_token_id, engine.eos_token_ids)
    assert torch.equal(out.sequences, sequences)
    assert torch.equal(out.action_mask, action_mask)
    assert torch.equal(out.truncated, truncated)
    # Float32 rounding only: a prompt forward over fewer rows can take another GEMM kernel (seen:
    # 1.4e-6 with one distinct row, 0 with several); the same bound the contract puts on chunking.
    torch.testing.assert_close(out.rollout_log_probs, log_probs, atol=1e-5, rtol=0)
    return out


FAST_PATH_PARAMS = [
    SamplingParams(temperature=0.0, max_new_tokens=12, n=1),
    SamplingParams(temperature=0.0, max_new_tokens=12, n=3),
    SamplingParams(temperature=1.0, max_new_tokens=12, n=4, seed=21),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=10, n=3, seed=22),
    SamplingParams(temperature=1.2, max_new_tokens=10, min_new_tokens=4, n=2, seed=23),
]


@pytest.mark.parametrize("params", FAST_PATH_PARAMS, ids=lambda p: f"T{p.temperature}-n{p.n}-min{p.min_new_tokens}")
@pytest.mark.parametrize("micro_batch_size", [None, 3])
def test_decode_equals_the_plain_loop(case, params, micro_batch_size):
    """Greedy and sampled, with padded prompts of three lengths, groups of n sharing one prompt
    forward, and chunks of 3 that split groups: the same tokens, masks, flags and log-probs as the
    plain loop that runs a prompt forward per sample."""
    engine = HFEngine(case.engine.model, case.pad_token_id, case.eos_token_id, micro_batch_size=micro_batch_size)
    out = assert_same_as_reference(engine, case.prompt_ids, params, seeds=[41, 42, 43])
    assert len({len(p) for p in case.prompt_ids}) == 3 and out.sequences.shape[0] == 3 * params.n


def test_decode_equals_the_plain_loop_with_two_eos_ids_and_repeated_prompts(case):
    """Two stop ids; the same prompt in two requests next to each other (one shared prompt
    forward for both) and apart, each with its own seeds."""
    engine = copy.copy(case.engine)
    base = engine.generate(case.prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=12))
    engine.eos_token_ids = [case.eos_token_id, response_of(base, int(base.response_lengths.argmax()))[1]]
    prompts = [case.prompt_ids[0], case.prompt_ids[0], case.prompt_ids[1], case.prompt_ids[0]]
    for params in (SamplingParams(temperature=0.0, max_new_tokens=12, n=2),
                   SamplingParams(temperature=1.0, max_new_tokens=12, n=3, seed=5)):
        out = assert_same_as_reference(engine, prompts, params, seeds=[7, 8, 9, 10])
        last = [response_of(out, row)[-1] for row in range(out.sequences.shape[0])]
        assert engine.eos_token_ids[1] in last  # the second stop id ended some response


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2", "qwen3_moe"])
def test_decode_equals_the_plain_loop_on_other_architectures(arch):
    """Sliding-window layers (Gemma 2), learned positions (GPT-2) and MoE (Qwen3-MoE): the shared
    prompt cache is copied correctly into every layer's cache type."""
    tokenizer = tiny_tokenizer(arch)
    model = build_tiny_arch(arch, tokenizer).eval()
    engine = HFEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    assert_same_as_reference(engine, prompt_ids, SamplingParams(temperature=1.0, max_new_tokens=8, n=3, seed=3),
                             seeds=None)


def test_prompt_forward_runs_once_per_distinct_prompt(case):
    """With n samples per prompt the prompt forward sees each prompt once (3 rows, not 3 x 4);
    every later forward sees all 12 rows, one token each."""
    shapes = []
    handle = case.engine.model.model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        out = case.engine.generate(case.prompt_ids, SamplingParams(min_new_tokens=4, max_new_tokens=4, n=4, seed=0))
    finally:
        handle.remove()
    assert shapes == [(3, out.prompt_len), (12, 1), (12, 1), (12, 1)]


def test_left_pad_and_distinct_rows_by_hand():
    ids, mask = left_pad([[5, 6], [7], [8, 9, 10]], pad_token_id=0)
    assert ids.tolist() == [[0, 5, 6], [0, 0, 7], [8, 9, 10]]
    assert mask.tolist() == [[0, 1, 1], [0, 0, 1], [1, 1, 1]]
    first, expand = distinct_rows([[1], [1], [2], [2], [2], [1], [3]])
    assert first.tolist() == [0, 2, 5, 6]
    assert expand.tolist() == [0, 0, 1, 1, 1, 2, 3]
    first, expand = distinct_rows([[4, 5]])
    assert first.tolist() == [0] and expand.tolist() == [0]
