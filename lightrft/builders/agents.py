"""The builder of a run's multi-turn workflow (--workflow; lightrft.agents)."""

from typing import Optional, Sequence


def build_workflow_runner(agent, tokenizer, eos_token_ids: Sequence[int], images=None,
                          max_images: Optional[int] = None) -> Optional["WorkflowRunner"]:
    """The `WorkflowRunner` of `agent` (an `AgentConfig`): the workflow file loaded, its tools'
    worker processes started; None without --workflow (one response per prompt). `images`: a
    vision-language run's `ImagePrompts` (`run_images`), so environment messages may show pictures,
    `max_images` in one episode (--max_images_per_prompt)."""
    if not agent.workflow:
        return None
    from lightrft.agents import WorkflowRunner, load_workflow

    workflow = load_workflow(agent.workflow)
    tools = None
    if getattr(workflow, "tools", None):
        from lightrft.agents.tools import ToolRunner

        tools = ToolRunner({fn.__name__: fn for fn in workflow.tools}, timeout=agent.tool_timeout,
                           max_output_chars=agent.tool_max_output_chars, workers=agent.tool_workers)
    return WorkflowRunner(workflow, tokenizer, max_turns=agent.max_turns, max_episode_tokens=agent.max_episode_tokens,
                          episode_timeout=agent.episode_timeout,
                          eos_token_ids=eos_token_ids, tools=tools, images=images,
                          max_images=max_images)
