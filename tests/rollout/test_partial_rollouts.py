"""Partial rollouts in the Hugging Face engine: new weights taken while a batch decodes.

A response that spans a weight switch carries, token by token, the version that sampled it, and
each token's log-prob is that version's own teacher-forced log-prob of it (the engine rebuilds
its KV cache under the new weights); without a switch nothing changes.
"""

import copy
from dataclasses import replace

import pytest
import torch

from lightrft.models import ActorLanguage
from lightrft.rollout import HFEngine, RolloutOutput, SamplingParams
from tests.rollout.contract import PROMPTS, build_contract_model

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=12, n=3, seed=5)


@pytest.fixture(scope="module")
def policies():
    """A tokenizer, the policy (version 0) and a perturbed copy of it (version 1)."""
    tokenizer, model = build_contract_model()
    newer = copy.deepcopy(model)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for param in newer.parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=generator) * param.abs().mean())
    return tokenizer, model, newer


def switch_at(engine: HFEngine, module: torch.nn.Module, newer: torch.nn.Module, at_step: int):
    """A weight switch that loads `newer` into `module` when asked for the `at_step`-th time."""
    calls = {"n": 0}

    def switch():
        calls["n"] += 1
        if calls["n"] != at_step + 1:        # the first call comes before the prefill
            return None
        module.load_state_dict(newer.state_dict())
        return engine.version + 1
    return switch


def teacher_forced(model, out: RolloutOutput) -> torch.Tensor:
    actor = ActorLanguage(model, temperature=PARAMS.temperature)
    with torch.no_grad():
        return actor(out.sequences, out.num_actions, attention_mask=out.attention_mask)


@pytest.mark.parametrize("at_step", [1, 4])
def test_tokens_carry_the_version_that_sampled_them_and_its_log_probs(policies, at_step):
    tokenizer, model, newer = policies
    module = copy.deepcopy(model)
    engine = HFEngine(module, tokenizer.pad_token_id, tokenizer.eos_token_id)
    engine.weight_switch = switch_at(engine, module, newer, at_step)
    out = engine.generate([tokenizer.encode(p) for p in PROMPTS], PARAMS)

    mask = out.action_mask
    assert out.versions.shape == mask.shape and out.versions.dtype == torch.int32
    assert torch.all(out.versions[~mask] == -1)
    # Tokens before the switch are version 0, from it on version 1: a long response has both.
    columns = torch.arange(out.num_actions).expand_as(mask)
    assert torch.equal(out.versions[mask], (columns[mask] >= at_step).int())
    spans = [set(row[m].tolist()) for row, m in zip(out.versions, mask)]
    assert any(s == {0, 1} for s in spans)
    # Each token's log-prob is its own version's, to float32 rounding.
    old, new = teacher_forced(model, out), teacher_forced(newer, out)
    expected = torch.where(out.versions == 0, old, new)
    torch.testing.assert_close(out.rollout_log_probs[mask], expected[mask], atol=1e-5, rtol=0)
    # The versions differ enough that using one for both would fail (the check can fail).
    later = mask & (out.versions == 1)
    assert (out.rollout_log_probs[later] - old[later]).abs().max() > 1e-2


def test_no_switch_samples_as_without_partial_rollouts(policies):
    tokenizer, model, _ = policies
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    plain = HFEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id).generate(prompts, PARAMS)
    engine = HFEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    engine.version = 7
    engine.weight_switch = lambda: None
    out = engine.generate(prompts, PARAMS)
    assert plain.versions is None
    assert torch.equal(out.sequences, plain.sequences)
    assert torch.equal(out.rollout_log_probs, plain.rollout_log_probs)
    assert torch.equal(out.versions[out.action_mask], torch.full((int(out.action_mask.sum()),), 7, dtype=torch.int32))


def test_versions_follow_select_rows_and_concat():
    versions = torch.tensor([[3, 3, 4], [3, 4, -1]], dtype=torch.int32)
    out = RolloutOutput(sequences=torch.tensor([[5, 1, 2, 3], [5, 1, 2, 0]]),
                        attention_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]),
                        action_mask=torch.tensor([[True, True, True], [True, True, False]]),
                        rollout_log_probs=torch.zeros(2, 3), prompt_len=1, versions=versions)
    assert torch.equal(out.select([1]).versions, versions[1:])
    assert torch.equal(out.rows(1, 2).versions, torch.tensor([[3, 4]], dtype=torch.int32))
    untagged = RolloutOutput(torch.tensor([[5, 1]]), torch.tensor([[1, 1]]), torch.tensor([[True]]),
                             torch.zeros(1, 1), 1)
    both = RolloutOutput.concat([out, untagged], pad_token_id=0)
    assert torch.equal(both.versions, torch.tensor([[3, 3, 4], [3, 4, -1], [-1, -1, -1]], dtype=torch.int32))


def test_an_explorer_takes_weights_published_while_it_decodes(policies):
    """The explorer's weight switch over the real control channel: weights published (as the
    trainers publish them) while a batch decodes are loaded at the next step, and tagged."""
    from types import SimpleNamespace

    from lightrft.explorers.explorer import Explorer
    from lightrft.explorers.roles import LocalChannel
    from lightrft.explorers.weights import WeightPublisher, WeightSubscriber

    tokenizer, model, newer = policies
    module = copy.deepcopy(model)
    channel = LocalChannel()
    publisher, subscriber = WeightPublisher(channel), WeightSubscriber(channel, 0)
    publisher.publish(0, list(model.named_parameters()), start_batch=0)
    subscriber.wait(lambda: subscriber.newest() == 0)
    explorer = Explorer.__new__(Explorer)        # the loop's weight handling alone, without prompts or scoring
    explorer.engine = HFEngine(module, tokenizer.pad_token_id, tokenizer.eos_token_id)
    explorer.module, explorer.loaded_version, explorer._blocked = module, -1, 0.0
    explorer.roles = SimpleNamespace(partial_rollouts=True, staleness_policy="wait")
    explorer._refresh(0, subscriber, needed=0)
    steps = {"n": 0}

    def switch():      # the trainers publish version 1 once three tokens are out
        steps["n"] += 1
        if steps["n"] == 4:
            publisher.publish(1, [(k, v.detach().clone()) for k, v in newer.named_parameters()], start_batch=0)
            subscriber.wait(lambda: subscriber.newest() == 1)
        return explorer._take_newer(subscriber)
    explorer.engine.weight_switch = switch
    out = explorer.engine.generate([tokenizer.encode(p) for p in PROMPTS], PARAMS)
    publisher.close(5.0)

    mask = out.action_mask
    columns = torch.arange(out.num_actions).expand_as(mask)
    assert explorer.loaded_version == 1 and subscriber.newest() == 1
    assert torch.equal(out.versions[mask], (columns[mask] >= 3).int())
    expected = torch.where(out.versions == 0, teacher_forced(model, out), teacher_forced(newer, out))
    torch.testing.assert_close(out.rollout_log_probs[mask], expected[mask], atol=1e-5, rtol=0)


def overlapped(engine, **params):
    from lightrft.explorers.overlap import OverlappedBatches

    return OverlappedBatches(engine, replace(PARAMS, **params), engine.pad_token_id, engine.eos_token_ids, segment=4)


def test_overlapped_batches_tag_each_token_with_the_version_that_sampled_it(policies):
    """Two batches in flight (--overlap_batches), the second admitted after the first's first
    segment, new weights loaded after the second segment: every token carries the version that
    sampled it and that version's log-prob; the batches come out whole, in order."""
    tokenizer, model, newer = policies
    module = copy.deepcopy(model)
    engine = HFEngine(module, tokenizer.pad_token_id, tokenizer.eos_token_id)
    batches = overlapped(engine)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    batches.admit(0, prompts, seeds=[11, 12, 13], version=0, payload="first")
    batches.decode_segment(version=0)
    assert batches.finished() == []
    batches.admit(1, prompts[:2], seeds=[21, 22], version=0, payload="second")
    batches.decode_segment(version=0)
    module.load_state_dict(newer.state_dict())
    done = []
    while batches.in_flight:
        batches.decode_segment(version=1)
        done += batches.finished()
    assert [(d.batch, d.version, d.payload) for d in done] == [(0, 0, "first"), (1, 0, "second")]
    spans = []
    for d, switch_at in zip(done, (8, 4)):       # tokens decoded before the switch: two segments, then one
        out, mask = d.rollout, d.rollout.action_mask
        columns = torch.arange(out.num_actions).expand_as(mask)
        assert torch.equal(out.versions[mask], (columns[mask] >= switch_at).int())
        assert torch.all(out.versions[~mask] == -1)
        expected = torch.where(out.versions == 0, teacher_forced(model, out), teacher_forced(newer, out))
        torch.testing.assert_close(out.rollout_log_probs[mask], expected[mask], atol=1e-5, rtol=0)
        spans += [set(row[m].tolist()) for row, m in zip(out.versions, mask)]
    assert {0, 1} in spans and out.sequences.shape[0] == 2 * PARAMS.n


def test_overlapped_segments_continue_each_response_where_it_stopped(policies):
    """Greedy, one version: decoding in segments of 4 (each continued from the response so far)
    gives the tokens and log-probs of one uninterrupted call, and stops at the length limit."""
    tokenizer, model, _ = policies
    engine = HFEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    greedy = dict(temperature=0.0, n=1, max_new_tokens=10)
    whole = engine.generate(prompts, replace(PARAMS, **greedy))
    batches = overlapped(engine, **greedy)
    batches.admit(0, prompts, seeds=[1, 2, 3], version=0)
    segments = 0
    while batches.in_flight:
        segments += 1
        batches.decode_segment(version=0)
        done = batches.finished()
    out = done[0].rollout
    assert segments >= 3                       # 10 tokens in segments of 4: 4, 4, 2
    assert torch.equal(out.sequences, whole.sequences) and torch.equal(out.action_mask, whole.action_mask)
    assert torch.equal(out.truncated, whole.truncated) and bool(whole.truncated.any())
    torch.testing.assert_close(out.rollout_log_probs, whole.rollout_log_probs, atol=1e-5, rtol=0)
    assert int(out.action_mask.sum(dim=-1).max()) == 10


@pytest.mark.parametrize("newest, going, in_flight, admitted", [
    (4, 1.0, 1, True),      # the weights batch 5 calls for (offset 1: version 4) are in
    (3, 0.5, 1, True),      # one sync older, half of the batch in flight still going: early
    (3, 0.75, 1, False),    # ... but most of it still going: the batch in flight first
    (2, 0.25, 1, False),    # two syncs older: never
    (3, 0.5, 0, False),     # nothing in flight to overlap: wait for the weights it calls for
    (4, 0.0, 2, False),     # two batches in flight already
])
def test_an_overlapping_explorer_admits_the_next_batch_early_by_one_sync_at_most(newest, going, in_flight,
                                                                              admitted):
    from types import SimpleNamespace

    from lightrft.config.sections import RolesConfig
    from lightrft.explorers.explorer import Explorer

    explorer = Explorer.__new__(Explorer)
    explorer.roles = RolesConfig(explorer_ranks=1, sync_offset=1, partial_rollouts=True, overlap_batches=True)
    explorer.overlap = SimpleNamespace(in_flight=[SimpleNamespace(going_share=going)] * in_flight)
    subscriber = SimpleNamespace(newest=lambda: newest, offset=None)
    assert explorer._may_admit(5, subscriber) is admitted
    assert explorer.roles.max_staleness == 2       # the offset's 1, and one sync for an early start


def test_token_lists_with_versions_tag_the_kept_tokens_and_leave_the_rest_untagged():
    """What the segment loops (vLLM's and the overlapped batches') assemble their output with: each
    kept response token keeps its version, tokens past EOS and padding are -1."""
    out = RolloutOutput.from_token_lists([[7, 8], [9]], [[5, 2, 6], [4, 4, 4]], [[-0.1, -0.2, -0.3]] * 2,
                                         pad_token_id=0, eos_token_ids=[2], versions=[[3, 4, 4], [1, 1, 2]])
    assert out.versions.tolist() == [[3, 4, -1], [1, 1, 2]]
    assert out.action_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert RolloutOutput.from_token_lists([[7]], [[5]], [[-0.1]], 0, [2]).versions is None
