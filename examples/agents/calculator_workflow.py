"""A calculator the policy calls to multiply: arithmetic a tiny model cannot do in its head.

A prompt is a product of two 2-digit numbers, "37*48"; the row's label is its value. The policy
may answer at once ("1776") or call the `multiply` tool first, Hermes / Qwen style:

    <tool_call>{"name": "multiply", "arguments": {"a": 37, "b": 48}}</tool_call>

The tool runs in a worker process (`--tool_workers`, `--tool_timeout`), its result comes back as
a "tool" message (out of the loss), and the policy answers from it. The reward is 1 for a final
answer equal to the label. Every turn with a tool call is followed by another turn; `--max_turns`
ends an episode that keeps calling tools (reward 0).

    torchrun ... -m lightrft.cli.train_ppo --workflow examples/agents/calculator_workflow.py \
        --apply_chat_template --max_turns 3 --max_episode_tokens 128 --generate_max_len 80 ...
"""

from lightrft.agents import Workflow
from lightrft.agents.tools import parse_tool_calls


def multiply(a: int, b: int) -> int:
    """The product of two integers."""
    return int(a) * int(b)


class Calculator(Workflow):
    tools = [multiply]

    async def run(self, episode) -> float:
        while True:                       # generate() ends the episode once --max_turns turns were taken
            turn = await episode.generate()
            calls = parse_tool_calls(turn.text)
            if not calls:
                return float(turn.text.strip() == str(episode.label))
            await episode.call_tools(calls)
