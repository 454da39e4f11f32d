"""Multi-turn episodes, token in, token out: what the runner samples is what trains, the
environment's tokens are out of the loss (hand-checked gradients, advantages and per-turn
rewards), budgets end episodes with a recorded reason, and a run draws the same episodes again."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightrft.agents import ChatRenderer, Workflow, WorkflowRunner, load_workflow
from lightrft.agents.runner import WorkflowFailed
from lightrft.algorithms.kl import FixedKLController
from lightrft.experience.maker import ExperienceBuilder, encode_rollout_prompts
from lightrft.experience.samples import collate_samples, split_experience
from lightrft.models import ActorLanguage
from lightrft.models.loss import PolicyLoss
from lightrft.rollout.base import SamplingParams
from lightrft.rollout.hf_engine import HFEngine
from lightrft.utils.tiny import build_char_tokenizer, build_tiny_causal_lm

PROMPTS = ["12+3=", "7*8=", "ab"]


class RecordingEngine:
    """A real HF engine that also keeps every response it returned, as the runner received it."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompt_ids, params, seeds=None):
        out = self.engine.generate(prompt_ids, params, seeds=seeds)
        lengths = out.action_mask.sum(dim=1).tolist()
        self.calls.append([row[:n] for row, n in zip(out.responses.tolist(), lengths)])
        return out


class TwoTurns(Workflow):
    """Turn, environment reply, turn; a per-turn reward on the first, 1.0 at the end."""

    async def run(self, episode):
        await episode.generate()
        episode.reward_turn(0.25)
        episode.add_messages({"role": "user", "content": "again"})
        await episode.generate()
        return 1.0


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, seed=3).eval()
    return SimpleNamespace(tokenizer=tokenizer, model=model,
                           engine=HFEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id),
                           prompt_ids=encode_rollout_prompts(tokenizer, PROMPTS, True, 64))


def run_episodes(tiny, workflow, n=2, max_turns=4, max_episode_tokens=80, max_new_tokens=6, seeds=(11, 12, 13),
                 engine=None):
    runner = WorkflowRunner(workflow, tiny.tokenizer, max_turns=max_turns, max_episode_tokens=max_episode_tokens,
                            eos_token_ids=[tiny.tokenizer.eos_token_id])
    params = SamplingParams(max_new_tokens=max_new_tokens, n=n, temperature=1.0)
    return runner.run(engine or tiny.engine, tiny.prompt_ids, PROMPTS, ["15", "56", "x"], params, list(seeds))


def test_the_trained_sequence_is_the_sampled_ids_with_the_rendered_environment_between(tiny):
    engine = RecordingEngine(tiny.engine)
    batch = run_episodes(tiny, TwoTurns(), engine=engine)
    assert len(engine.calls) == 2 and len(engine.calls[0]) == 6      # each turn batched over all 6 episodes
    environment = tiny.tokenizer.encode("\nuser: again\nassistant: ", add_special_tokens=False)
    round_trip_changed = 0
    for row, record in enumerate(batch.records):
        first, second = engine.calls[0][row], engine.calls[1][row]
        assert record.response_ids == first + environment + second
        assert record.loss_mask == [True] * len(first) + [False] * len(environment) + [True] * len(second)
        response = batch.rollout.responses[row, :len(record.response_ids)].tolist()
        assert response == record.response_ids                      # the rollout row holds exactly these ids
        assert batch.rollout.action_mask[row, :len(record.loss_mask)].tolist() == record.loss_mask
        text = tiny.tokenizer.decode(first, skip_special_tokens=True)
        round_trip_changed += tiny.tokenizer.encode(text, add_special_tokens=False) != first
    # The random tiny model samples special tokens: re-tokenising its text would change the ids
    # of some turns, yet the trained ids are the sampled ones.
    assert round_trip_changed > 0
    assert batch.rewards.scores.tolist() == [1.0] * 6 and batch.rewards.info["turns"].tolist() == [2.0] * 6


def test_the_chat_renderer_appends_what_the_template_writes_after_the_turn():
    from transformers import AutoTokenizer

    from lightrft.utils.pretrained import smollm2_folder

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    renderer = ChatRenderer(tokenizer, [im_end])
    text = renderer.environment_text([{"role": "tool", "content": "42"}])
    # ChatML: the newline after the assistant's <|im_end|> (which the policy samples), the tool
    # message, then the next assistant header.
    full = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                          {"role": "tool", "content": "42"}], tokenize=False,
                                         add_generation_prompt=True)
    assert full.endswith("a<|im_end|>" + text) and text.startswith("\n<|im_start|>")
    assert text.endswith("<|im_start|>assistant\n")


def test_environment_tokens_get_no_gradient_and_per_turn_rewards_land_on_the_turns_last_token(tiny, tmp_path):
    tiny.model.save_pretrained(tmp_path / "m")
    tiny.tokenizer.save_pretrained(tmp_path / "m")
    actor = ActorLanguage(str(tmp_path / "m"))
    batch = run_episodes(tiny, TwoTurns())
    builder = ExperienceBuilder(actor, None, None, FixedKLController(0.0), SimpleNamespace(device="cpu"),
                                advantage_estimator="reinforce", gamma=1.0)
    exp = builder.experience_from_rollout(batch.rollout, batch.rewards, n=2)[0]
    mask = exp.action_mask
    # reinforce, gamma 1: A_t = sum of rewards from t on over trained tokens; the first turn's
    # tokens also see its per-turn reward 0.25; environment tokens get 0.
    for row, record in enumerate(batch.records):
        first_end = record.loss_mask.index(False)
        expected = torch.zeros(mask.size(1))
        expected[:len(record.loss_mask)] = torch.tensor([(1.25 if t < first_end else 1.0) if trains else 0.0
                                                          for t, trains in enumerate(record.loss_mask)])
        torch.testing.assert_close(exp.advantages[row], expected)
    # The policy loss's gradient with respect to each token's log-prob: -A_t / N on the N trained
    # tokens (token-mean, ratio 1), exactly 0 on the environment's tokens.
    log_probs = actor(exp.sequences, exp.num_actions, attention_mask=exp.attention_mask)
    log_probs.retain_grad()
    loss = PolicyLoss()(log_probs, log_probs.detach(), exp.advantages, action_mask=mask)
    loss.backward()
    n_trained = mask.sum()
    torch.testing.assert_close(log_probs.grad, torch.where(mask, -exp.advantages / n_trained, 0.0))
    assert (log_probs.grad[~mask] == 0).all() and int((~mask & (exp.attention_mask[:, -mask.size(1):] == 1)).sum()) > 0
    # Packed, the same samples give the same loss (holes kept in place).
    packed = collate_samples(split_experience(exp), tiny.tokenizer.pad_token_id, packing=True)
    packed_log_probs = actor(packed.sequences, packed.num_actions, packed_seq_lens=packed.packed_seq_lens)
    packed_loss = PolicyLoss()(packed_log_probs, packed_log_probs.detach(), packed.advantages,
                               action_mask=packed.action_mask)
    torch.testing.assert_close(packed_loss, loss)


def test_group_estimators_add_per_turn_rewards_to_the_episode_reward(tiny, tmp_path):
    tiny.model.save_pretrained(tmp_path / "m")
    tiny.tokenizer.save_pretrained(tmp_path / "m")
    batch = run_episodes(tiny, TwoTurns())
    builder = ExperienceBuilder(ActorLanguage(str(tmp_path / "m")), None, None, FixedKLController(0.0),
                                SimpleNamespace(device="cpu"), advantage_estimator="group_norm")
    exp = builder.experience_from_rollout(batch.rollout, batch.rewards, n=2)[0]
    assert exp.info["reward"].tolist() == [1.25] * 6        # 1.0 + the first turn's 0.25
    assert (exp.advantages == 0).all()                      # equal rewards in every group


class Limited(Workflow):
    reward_on_end = -1.0

    async def run(self, episode):
        while True:
            await episode.generate()
            episode.add_messages({"role": "user", "content": "more"})


def test_budgets_end_episodes_flagged_with_the_workflows_end_reward(tiny):
    by_turns = run_episodes(tiny, Limited(), max_turns=2, max_episode_tokens=500)
    assert [r.stop_reason for r in by_turns.records] == ["max_turns"] * 6
    assert by_turns.rewards.info["turns"].tolist() == [2.0] * 6 and by_turns.rollout.truncated.all()
    assert by_turns.rewards.scores.tolist() == [-1.0] * 6 and by_turns.rewards.info["ended_early"].all()
    # The environment's reply after the last turn is dropped: the row ends with the last sampled token.
    assert all(r.loss_mask[-1] for r in by_turns.records)
    by_tokens = run_episodes(tiny, Limited(), max_turns=50, max_episode_tokens=30)
    assert {r.stop_reason for r in by_tokens.records} == {"token_budget"}
    assert all(len(r.response_ids) <= 30 for r in by_tokens.records)


class Crashes(Workflow):
    async def run(self, episode):
        turn = await episode.generate()
        if episode.index == 1:
            raise KeyError("bug in the workflow")
        return float(len(turn.token_ids))


def test_a_workflow_bug_drops_that_episode_only_and_a_bug_everywhere_is_an_error(tiny):
    batch = run_episodes(tiny, Crashes())
    assert batch.rewards.valid.tolist() == [True, True, False, False, True, True]
    assert batch.rewards.info["workflow_error"].tolist() == [0, 0, 1, 1, 0, 0]
    assert "KeyError: 'bug in the workflow'" in batch.records[2].extra["error"]

    class Always(Workflow):
        async def run(self, episode):
            raise ValueError("broken")

    with pytest.raises(WorkflowFailed) as failed:
        run_episodes(tiny, Always())
    # One line: the workflow, the count and the first failure with where it was raised.
    message = str(failed.value)
    assert "\n" not in message and message.startswith("--workflow Always: every episode of this rollout failed "
                                                       "(6 of 6), so nothing can train; the first: ValueError: broken (")
    assert "test_episodes.py, line" in message and "in run)" in message


def test_episodes_are_reproducible_and_independent_across_prompts(tiny):
    first, again = run_episodes(tiny, TwoTurns()), run_episodes(tiny, TwoTurns())
    assert torch.equal(first.rollout.sequences, again.rollout.sequences)
    assert torch.equal(first.rollout.rollout_log_probs, again.rollout.rollout_log_probs)
    # Prompt 0 alone with its own seed draws what it drew in the batch of three.
    alone = WorkflowRunner(TwoTurns(), tiny.tokenizer, max_turns=4, max_episode_tokens=80,
                           eos_token_ids=[tiny.tokenizer.eos_token_id]).run(
        tiny.engine, tiny.prompt_ids[:1], PROMPTS[:1], ["15"], SamplingParams(max_new_tokens=6, n=2), [11])
    assert [r.response_ids for r in alone.records] == [r.response_ids for r in first.records[:2]]
    # The two samples of a prompt differ (independent streams).
    assert first.records[0].response_ids != first.records[1].response_ids


OPENRLHF_AGENT = '''
import torch
from lightrft.agents.openrlhf import AgentExecutorBase, AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.step_idx = 0

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        self.step_idx += 1
        done = self.step_idx >= 3
        return {"rewards": torch.tensor(0.5 if done else 0.1), "scores": torch.tensor(1.0),
                "environment_feedback": "" if done else "\\nHuman: try again\\nAssistant: ", "done": done,
                "sampling_params": states.get("sampling_params"), "extra_logs": {"steps": self.step_idx}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


def test_an_openrlhf_agent_file_runs_with_its_import_line_changed(tiny, tmp_path):
    path = Path(tmp_path / "agent_func.py")
    path.write_text(OPENRLHF_AGENT)
    workflow = load_workflow(str(path))
    engine = RecordingEngine(tiny.engine)
    batch = run_episodes(tiny, workflow, engine=engine, max_new_tokens=4, max_episode_tokens=200)
    feedback = tiny.tokenizer.encode("\nHuman: try again\nAssistant: ", add_special_tokens=False)
    assert len(engine.calls) == 3
    for row, record in enumerate(batch.records):
        turns = [engine.calls[k][row] for k in range(3)]
        assert record.response_ids == turns[0] + feedback + turns[1] + feedback + turns[2]
        assert record.turns == 3 and record.extra["agent_scores"] == 1.0
    assert batch.rewards.scores.tolist() == pytest.approx([0.7] * 6)       # 0.1 + 0.1 + 0.5, summed as OpenRLHF does
    assert batch.rewards.info["agent_scores"].tolist() == [1.0] * 6         # logged as rollout/agent_scores


def test_a_bad_workflow_flag_names_the_file_and_what_it_lacks(tmp_path):
    empty = tmp_path / "nothing.py"
    empty.write_text("x = 1\n")
    with pytest.raises(ValueError, match="--workflow .*nothing.py defines no Workflow subclass"):
        load_workflow(str(empty))
    with pytest.raises(ValueError, match="--workflow .*no such file"):
        load_workflow(str(tmp_path / "missing.py"))
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ValueError, match="importing --workflow file .*broken.py failed: ModuleNotFoundError"):
        load_workflow(str(broken))


def test_the_rollout_preview_shows_the_whole_episode_with_the_environment_marked(tiny):
    from lightrft.trainer.preview import response_text

    engine = RecordingEngine(tiny.engine)
    batch = run_episodes(tiny, TwoTurns(), engine=engine)
    decode = lambda ids: tiny.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    for row in range(6):
        expected = decode(engine.calls[0][row]) + "[env: \nuser: again\nassistant: ]" + decode(engine.calls[1][row])
        assert response_text(tiny.tokenizer, batch.rollout, row) == expected


TOOL_WORKFLOW = '''
import os
import time

from lightrft.agents import Workflow, parse_tool_calls


def add(a, b):
    return a + b


def hang():
    time.sleep(60)


def die():
    os._exit(3)


CALLS = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>',
         '<tool_call>{"name": "hang", "arguments": {}}</tool_call>',
         '<tool_call>{"name": "die", "arguments": {}}</tool_call>']


class Tools(Workflow):
    tools = [add, hang, die]

    async def run(self, episode):
        await episode.generate()
        [result] = await episode.call_tools(parse_tool_calls(CALLS[episode.index]))
        await episode.generate()
        return float(result.output == "42")
'''


def test_a_hanging_or_crashing_tool_ends_only_its_episode_with_the_reason_recorded(tiny, tmp_path):
    from lightrft.builders.agents import build_workflow_runner
    from lightrft.config import AgentConfig

    path = tmp_path / "tools_workflow.py"
    path.write_text(TOOL_WORKFLOW)
    runner = build_workflow_runner(AgentConfig(workflow=str(path), max_turns=4, max_episode_tokens=200,
                                               tool_timeout=1.0, tool_workers=2),
                                   tiny.tokenizer, [tiny.tokenizer.eos_token_id])
    try:
        batch = runner.run(tiny.engine, tiny.prompt_ids, PROMPTS, [None] * 3, SamplingParams(max_new_tokens=4, n=2),
                           [1, 2, 3])
        again = runner.run(tiny.engine, tiny.prompt_ids, PROMPTS, [None] * 3,
                           SamplingParams(max_new_tokens=4, n=2), [1, 2, 3])    # the replaced workers serve
    finally:
        runner.close()
    assert [r.stop_reason for r in batch.records] == ["done", "done", "tool_timeout", "tool_timeout", "tool_crash",
                                                      "tool_crash"]
    assert batch.rewards.scores.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert batch.rewards.info["tool_failure"].tolist() == [0, 0, 1, 1, 1, 1]
    assert batch.rewards.info["tool_calls"].tolist() == [1.0] * 6
    assert batch.rewards.info["turns"].tolist() == [2, 2, 1, 1, 1, 1]
    assert batch.rewards.valid.all()         # ended episodes still train, with the workflow's end reward
    # The tool's answer is in the first two episodes as the template's tool message, out of the loss.
    tool_ids = tiny.tokenizer.encode("\ntool: 42\nassistant: ", add_special_tokens=False)
    first = batch.records[0]
    start = first.loss_mask.index(False)
    assert first.response_ids[start:start + len(tool_ids)] == tool_ids
    assert first.loss_mask[start:start + len(tool_ids)] == [False] * len(tool_ids)
    assert [r.stop_reason for r in again.records] == [r.stop_reason for r in batch.records]


def test_a_rollout_whose_every_episode_failed_stops_the_command_with_one_line(capsys, monkeypatch):
    # The command line prints the workflow's failure as an error line, exit 1, no traceback of lightrft's.
    from types import SimpleNamespace

    from lightrft.cli.common import run_command

    def train(args):
        raise WorkflowFailed("--workflow Always: every episode of this rollout failed (6 of 6), so nothing can "
                             "train; the first: ValueError: broken (always.py, line 3, in run)")
    monkeypatch.delenv("LIGHTRFT_TRACEBACK", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as done:
        run_command("train_ppo", train, SimpleNamespace(ckpt_path=None, preemption_grace=1.0))
    err = capsys.readouterr().err
    assert done.value.code == 1 and "Traceback" not in err
    assert err.startswith("train_ppo: error: --workflow Always: every episode of this rollout failed (6 of 6)")


def test_partial_rollouts_tag_each_turns_tokens_with_the_version_that_sampled_them(tiny):
    """New weights taken between the turns (and inside the second): the policy's tokens carry the
    version that sampled them, the environment's -1; the log-probs are each version's own."""
    import copy

    module, newer = copy.deepcopy(tiny.model), copy.deepcopy(tiny.model)
    with torch.no_grad():
        for param in newer.parameters():
            param.mul_(1.5)
    engine = HFEngine(module, tiny.tokenizer.pad_token_id, tiny.tokenizer.eos_token_id)
    calls = {"n": 0}

    def switch():      # asked before each prefill and decoding step: the second turn's third step loads v1
        calls["n"] += 1
        if calls["n"] == 6 + 3:       # the first turn asks 6 times (a prefill and 5 steps of 6 tokens at most)
            module.load_state_dict(newer.state_dict())
            return 1
        return None
    engine.weight_switch = switch
    batch = run_episodes(tiny, TwoTurns(), engine=engine, max_new_tokens=6)
    environment = len(tiny.tokenizer.encode("\nuser: again\nassistant: ", add_special_tokens=False))
    rollout = batch.rollout
    spanning = 0
    for row, record in enumerate(batch.records):
        first = record.loss_mask.index(False)
        assert record.versions[first:first + environment] == [-1] * environment
        policy = [v for v, trains in zip(record.versions, record.loss_mask) if trains]
        assert set(policy) <= {0, 1} and policy == sorted(policy)       # never back to the older weights
        spanning += set(policy) == {0, 1}
        assert rollout.versions[row, :len(record.versions)].tolist() == record.versions
    assert spanning > 0
    # Each policy token's log-prob is its version's own, teacher-forced over the whole episode.
    old, new = ActorLanguage(tiny.model), ActorLanguage(newer)
    with torch.no_grad():
        lp_old = old(rollout.sequences, rollout.num_actions, attention_mask=rollout.attention_mask)
        lp_new = new(rollout.sequences, rollout.num_actions, attention_mask=rollout.attention_mask)
    mask = rollout.action_mask
    expected = torch.where(rollout.versions == 1, lp_new, lp_old)
    torch.testing.assert_close(rollout.rollout_log_probs[mask], expected[mask], atol=1e-5, rtol=0)
