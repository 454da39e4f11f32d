"""Multi-turn agents: workflows that run an episode of several policy turns with tools or an
environment in between, trained token in, token out with the environment's tokens out of the
loss (docs/agents.md).

A workflow file imports `Workflow` from here; tool workers import that file too, so this package
loads torch only when the runner is asked for (`WorkflowRunner`, `AgentBatch`)."""

from lightrft.agents.episode import ChatRenderer, Episode, EpisodeEnd, Turn
from lightrft.agents.loading import load_workflow
from lightrft.agents.tools import ToolCall, ToolResult, ToolRunner, parse_tool_calls, tool_message
from lightrft.agents.workflow import SingleTurn, Workflow

__all__ = ["AgentBatch", "ChatRenderer", "Episode", "EpisodeEnd", "SingleTurn", "ToolCall", "ToolResult", "ToolRunner",
           "Turn", "Workflow", "WorkflowRunner", "load_workflow", "parse_tool_calls", "tool_message"]


def __getattr__(name: str):
    if name in ("AgentBatch", "WorkflowRunner"):
        from lightrft.agents import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'lightrft.agents' has no attribute {name!r}")
