"""OpenRLHF agent files, run as lightrft workflows.

An OpenRLHF agent file (`--agent_func_path` there) defines `AgentInstance(AgentInstanceBase)` with
async `reset(states)` and `step(states)`, and usually `AgentExecutor(MultiTurnAgentExecutor)`.
Change its import line from `openrlhf.utils.agent` to `lightrft.agents.openrlhf` and pass it as
`--workflow FILE.py`; `OpenRLHFWorkflow` runs its `AgentInstance` as OpenRLHF's multi-turn
executor does, token in, token out:

- `reset({"observation": prompt, "label": label})` once, with the prompt's text as the engine sees
  it (after the chat template when `--apply_chat_template`); its `observation` is the text the
  first turn is sampled from.
- Each turn, `step({"observation_text", "action_text", "label", "sampling_params"})` gets the
  turn's text; its `rewards` (a number or a one-element tensor) are summed into the episode's
  reward, `environment_feedback` is encoded as is and appended (out of the loss), `done` ends the
  episode, `scores` are logged (rollout/agent_scores, the last step's) and numeric `extra_logs`
  kept in the episode's record (`episode.extra["agent_<key>"]`; their keys vary, so they are not
  logged).
- The budgets are lightrft's: `--max_turns` and `--max_episode_tokens` (OpenRLHF's max_length);
  a `sampling_params` returned by `step` is ignored (the run's sampling parameters hold).
"""

import inspect
from abc import ABC, abstractmethod

from lightrft.agents.episode import EpisodeEnd
from lightrft.agents.workflow import Workflow


class AgentInstanceBase(ABC):
    """OpenRLHF's base of an agent instance (one per episode)."""

    @abstractmethod
    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states: dict, **kwargs):
        return states

    @abstractmethod
    async def step(self, states: dict, **kwargs):
        raise NotImplementedError("AgentInstance.step is not implemented")


class AgentExecutorBase(ABC):
    """OpenRLHF's executor base: kept so agent files import; lightrft runs `AgentInstance` itself."""

    async def execute(self, *args, **kwargs):
        raise NotImplementedError("lightrft runs the file's AgentInstance through OpenRLHFWorkflow")


class MultiTurnAgentExecutor(AgentExecutorBase):
    def __init__(self, agent_instance_cls=None, *args, **kwargs):
        self.agent_instance_cls = agent_instance_cls


class SingleTurnAgentExecutor(AgentExecutorBase):
    def __init__(self, *args, **kwargs):
        pass


def _number(value) -> float:
    return float(value.item() if hasattr(value, "item") else value)


class OpenRLHFWorkflow(Workflow):
    """Runs an OpenRLHF `AgentInstance` class as a workflow (see the module docstring)."""

    metrics = ("agent_scores",)

    def __init__(self, instance_cls):
        self.instance_cls = instance_cls

    def setup(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    async def run(self, episode) -> float:
        agent = self.instance_cls()
        if inspect.isawaitable(agent):
            agent = await agent
        observation = self.tokenizer.decode(episode.prompt_ids)
        reset = await agent.reset({"observation": observation, "label": episode.label})
        if isinstance(reset, dict) and reset.get("observation", observation) != observation:
            observation = reset["observation"]
            episode.prompt_ids = self.tokenizer.encode(observation, add_special_tokens=False)
        total = 0.0
        while True:
            try:
                turn = await episode.generate()
            except EpisodeEnd:
                break              # a budget ran out: the rewards so far stand, the episode is flagged truncated
            result = await agent.step({"observation_text": observation, "action_text": turn.text,
                                       "label": episode.label, "sampling_params": None})
            total += _number(result.get("rewards", 0.0))
            episode.extra["agent_scores"] = _number(result.get("scores", total))
            for key, value in (result.get("extra_logs") or {}).items():
                try:
                    episode.extra[f"agent_{key}"] = _number(value)
                except (TypeError, ValueError):
                    pass
            feedback = result.get("environment_feedback") or ""
            observation = observation + turn.text + feedback
            if result.get("done", True):
                break
            if feedback:
                try:
                    episode.add_text(feedback)
                except EpisodeEnd:
                    break
        return total
