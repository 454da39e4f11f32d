"""Workflows cannot hang or end a run silently: an episode past --episode_timeout ends with the
workflow's reward_on_end (counted), the others still train; a blocked event loop is reported,
naming the workflow; sys.exit() in run() or at import, and a NaN or infinite reward, are workflow
errors of that episode (or a clear error at load), never the end of training with exit code 0."""

import asyncio
import logging
import math
import time

import pytest

from lightrft.agents import Workflow, WorkflowRunner, load_workflow
from lightrft.rollout.base import SamplingParams
from tests.agents.test_episodes import PROMPTS, tiny  # noqa: F401  (the module's fixture)


def runner_for(tiny, workflow, **kwargs):  # noqa: F811
    return WorkflowRunner(workflow, tiny.tokenizer, max_turns=4, max_episode_tokens=80,
                          eos_token_ids=[tiny.tokenizer.eos_token_id], **kwargs)


def run(tiny, runner):  # noqa: F811
    params = SamplingParams(max_new_tokens=6, n=2, temperature=1.0)
    return runner.run(tiny.engine, tiny.prompt_ids, PROMPTS, ["15", "56", "x"], params, [11, 12, 13])


class SlowOnOne(Workflow):
    """Prompt 1's episodes wait in their environment far past the deadline; the others answer."""
    reward_on_end = -0.5

    async def run(self, episode):
        await episode.generate()
        if episode.index == 1:
            await asyncio.sleep(3600)
        episode.add_messages({"role": "user", "content": "again"})
        await episode.generate()
        return 1.0


def test_an_episode_past_its_deadline_ends_with_the_end_reward_and_the_rest_train(tiny):  # noqa: F811
    batch = run(tiny, runner_for(tiny, SlowOnOne(), episode_timeout=2.0))
    assert [r.stop_reason for r in batch.records] == ["done", "done", "episode_timeout", "episode_timeout",
                                                      "done", "done"]
    assert batch.rewards.scores.tolist() == [1.0, 1.0, -0.5, -0.5, 1.0, 1.0]
    assert batch.rewards.info["episode_timeout"].tolist() == [0, 0, 1, 1, 0, 0]
    assert [r.turns for r in batch.records] == [2, 2, 1, 1, 2, 2]         # the others went on to turn 2
    assert batch.rewards.valid.all()


class BlockingEnvironment(Workflow):
    """Prompt 1's episodes make an environment call that never returns (a blocking library call)."""
    reward_on_end = -0.5

    async def run(self, episode):
        await episode.generate()
        if episode.index == 1:
            await episode.environment(time.sleep, 1e6)
        return 1.0


def test_an_environment_call_that_never_returns_ends_with_the_episode_deadline(tiny):  # noqa: F811
    """The probe's finding: `await episode.environment(time.sleep, 1e6)` outlived --episode_timeout
    (the loop's executor waited for its thread at the rollout's end). Now the episode ends at its
    deadline, the rollout returns, and the thread is left to itself (a daemon)."""
    batch = run(tiny, runner_for(tiny, BlockingEnvironment(), episode_timeout=1.0))
    assert [r.stop_reason for r in batch.records] == ["done", "done", "episode_timeout", "episode_timeout",
                                                      "done", "done"]
    assert batch.rewards.scores.tolist() == [1.0, 1.0, -0.5, -0.5, 1.0, 1.0]


class Blocks(Workflow):
    async def run(self, episode):
        await episode.generate()
        time.sleep(2.5)                 # blocking call: the loop cannot turn
        return 1.0


def test_a_blocked_event_loop_is_reported_naming_the_workflow(tiny, caplog):  # noqa: F811
    with caplog.at_level(logging.WARNING, logger="lightrft.agents.runner"):
        batch = run(tiny, runner_for(tiny, Blocks(), blocked_seconds=1.5))
    assert batch.rewards.scores.tolist() == [1.0] * 6
    assert "--workflow Blocks" in caplog.text and "has blocked the event loop for" in caplog.text
    assert "time.sleep(2.5)" in caplog.text            # where: the workflow's own line


class Exits(Workflow):
    async def run(self, episode):
        await episode.generate()
        if episode.index == 0:
            raise SystemExit(0)
        return 2.0


class NonFinite(Workflow):
    async def run(self, episode):
        await episode.generate()
        return [math.nan, math.inf, 1.0][episode.index]


def test_sys_exit_and_non_finite_rewards_are_errors_of_that_episode(tiny):  # noqa: F811
    batch = run(tiny, runner_for(tiny, Exits()))
    assert batch.rewards.valid.tolist() == [False, False, True, True, True, True]
    assert "Exits.run called sys.exit(0)" in batch.records[0].extra["error"]
    batch = run(tiny, runner_for(tiny, NonFinite()))
    assert batch.rewards.valid.tolist() == [False, False, False, False, True, True]
    assert batch.rewards.info["workflow_error"].tolist() == [1, 1, 1, 1, 0, 0]
    assert "returned the reward nan" in batch.records[0].extra["error"]
    assert "returned the reward inf" in batch.records[2].extra["error"]
    assert not batch.unscored.any()          # NaN is not "no reward": the reward sources do not score it
    # An integer too large for a float: an error of that episode, not an OverflowError of the run.
    batch = run(tiny, runner_for(tiny, Huge()))
    assert batch.rewards.valid.tolist() == [False, False, True, True, True, True]
    assert "Huge.run returned the reward an integer of 401 digits" in batch.records[0].extra["error"]


class Huge(Workflow):
    async def run(self, episode):
        await episode.generate()
        return 10**400 if episode.index == 0 else 1


def test_sys_exit_at_import_is_a_clear_error(tmp_path):
    path = tmp_path / "exits.py"
    path.write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(ValueError, match=f"importing --workflow file {path} called sys.exit\\(0\\)"):
        load_workflow(str(path))
