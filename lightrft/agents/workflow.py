"""Workflows: what one rollout episode does.

A workflow is a Python class in a file passed by `--workflow FILE.py[:Class]`. Its `run` is
given an `Episode` (the prompt row and the policy), asks the policy for turns as often as it
likes, calls tools or an environment in between, and returns the episode's reward:

    class Guess(Workflow):
        async def run(self, episode):
            for _ in range(episode.max_turns):
                turn = await episode.generate()
                if turn.text.strip() == episode.label:
                    return 1.0
                episode.add_messages({"role": "user", "content": "wrong, again"})
            return 0.0

`SingleTurn`, one response scored by the run's reward sources, is what runs without
`--workflow` (the plain rollout path, unchanged). `lightrft.agents.loading.load_workflow` reads the
file; OpenRLHF agent files (`AgentInstance` with async `reset` and `step`) load too
(`lightrft.agents.openrlhf`).
"""

from typing import Optional


class Workflow:
    """Base of a user's workflow. One instance serves a whole run; `run` is called once per
    episode (G per prompt) and may keep no state between episodes other than read-only setup.

    Attributes a subclass may set:
    - `tools`: tool functions the policy may call (`episode.call_tools`), as a list of functions
      defined in the workflow's file; they run in worker processes (`--tool_workers`).
    - `reward_on_end`: the reward of an episode ended early (a limit reached, a tool that hung
      or crashed) rather than by `run` returning. Default 0.
    - `metrics`: keys of `episode.extra` (numbers the workflow sets per episode) logged every step
      as rollout/<key>, the mean over episodes (0 for an episode that did not set it). Fixed per
      workflow, so every rank logs the same keys.
    """

    tools: list = []
    reward_on_end: float = 0.0
    metrics: tuple = ()

    def setup(self, tokenizer) -> None:
        """Called once before the first episode with the run's tokenizer."""

    async def run(self, episode) -> float:
        """Runs one episode and returns its final reward."""
        raise NotImplementedError(f"{type(self).__name__}.run(episode) is not implemented")


class SingleTurn(Workflow):
    """One response per prompt, scored by the run's reward sources: the plain rollout as a
    workflow (the trainer runs it without the episode machinery; this class documents it and
    lets tests compare the two paths)."""

    async def run(self, episode) -> Optional[float]:
        await episode.generate()
        return None     # None: the run's reward sources score the response
