"""Tool calls (lightrft.agents.tools): calls parsed from Hermes/Qwen and Mistral text with exact
names and arguments, malformed ones reported rather than raised; real tool files run in worker
processes with exact outputs; a hanging tool is stopped at the timeout and a crashing one is
contained, and either way the next call gets a fresh worker; output is capped with a marker;
workers share the calls; no worker (or its children) outlives close() or the trainer."""

import asyncio
import importlib.util
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lightrft.agents.tools import (ToolCall, ToolResult, ToolRunner, ToolRunnerError, cap_output, parse_tool_calls,
                                   text_without_tool_calls, tool_message)
from lightrft.utils.pretrained import PretrainedUnavailable, smollm2_folder
from lightrft.utils.tiny import build_char_tokenizer
from tests.conftest import REPO_ROOT, subprocess_env

TOOL_FILE = '''
import os, subprocess, time

def add(a, b):
    return a + b

def describe(title, tags=()):
    return {"title": title, "tags": list(tags), "note": "naïve"}

def slow():
    time.sleep(30)

def crash():
    os._exit(3)

def raises():
    raise ValueError("bad")

def big():
    return "x" * 100_000

def nap(seconds, tag):
    time.sleep(seconds)
    return f"{tag} from {os.getpid()}"

def pid():
    return os.getpid()

def hang_with_child(pid_file):
    child = subprocess.Popen(["sleep", "60"])
    with open(pid_file, "w") as f:
        f.write(str(child.pid))
    time.sleep(60)
'''
CAP = 1000


def write(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return path


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def worker_pids(runner: ToolRunner) -> list[int]:
    return [slot.worker.process.pid for slot in runner._slots if slot.worker is not None]


@pytest.fixture(scope="module")
def tool_file(tmp_path_factory) -> Path:
    return write(tmp_path_factory.mktemp("tools"), "my_tools.py", TOOL_FILE)


@pytest.fixture(scope="module")
def runner(tool_file):
    """One runner for most tests (worker start-up is the slow part): 2 workers, a timeout well
    above what the tools that finish take on a loaded machine."""
    with ToolRunner.from_file(tool_file, timeout=5.0, max_output_chars=CAP, workers=2) as made:
        yield made


@pytest.fixture(scope="module")
def quick(tool_file):
    """A runner with a short timeout, for the tools that hang."""
    with ToolRunner.from_file(tool_file, names=["add", "slow", "hang_with_child"], timeout=0.5, workers=1) as made:
        yield made


# ------------------------------------------------------------------------------------- parsing
def test_parses_two_qwen_calls_in_one_message():
    text = ('Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
            '<tool_call>\n{"name": "describe", "arguments": {"title": "x", "tags": ["p", "q"]}}\n</tool_call>')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("add", {"a": 2, "b": 3}, None), ("describe", {"title": "x", "tags": ["p", "q"]}, None)]
    assert calls[0].raw == '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    assert text_without_tool_calls(text) == "Let me compute."


def test_arguments_given_as_a_json_string_and_parameters_key():
    calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 4}"}</tool_call>'
                             '<tool_call>{"name": "pid", "parameters": {}}</tool_call>'
                             '<tool_call>{"name": "pid"}</tool_call>')
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 1, "b": 4}, None),
                                                               ("pid", {}, None), ("pid", {}, None)]


@pytest.mark.parametrize("body, name, error", [
    ('{"name": "add", "arguments": {"a": 1,, "b": 2}}', "",
     'the tool call is not valid JSON (Expecting property name enclosed in double quotes at line 1 column 38); '
     'write {"name": ..., "arguments": {...}}'),
    ('{"arguments": {"a": 1}}', "", 'the tool call has no "name" (a non-empty string), got null'),
    ('{"name": "add", "arguments": [1, 2]}', "add",
     '"arguments" of the call to \'add\' must be a JSON object, got a list'),
    ('{"name": "add", "arguments": "a=1"}', "add",
     '"arguments" of the call to \'add\' is a string that is not JSON (Expecting value at column 1); give a JSON '
     'object'),
    ('["add", 1, 2]', "", 'a tool call must be a JSON object with "name" and "arguments", got a list'),
], ids=["bad_json", "no_name", "list_arguments", "string_arguments_not_json", "not_an_object"])
def test_malformed_call_is_returned_with_the_problem_named(body, name, error):
    raw = f"<tool_call>{body}</tool_call>"
    calls = parse_tool_calls(f"before {raw} after")
    assert calls == [ToolCall(name, {}, raw, error)]


def test_a_call_cut_at_the_stop_string_still_counts():
    # An engine stopping at "</tool_call>" strips it from the text.
    assert parse_tool_calls('ok <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}\n') == [
        ToolCall("add", {"a": 1, "b": 2}, '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}')]
    (cut,) = parse_tool_calls('<tool_call>{"name": "add", "argu')
    assert cut.error.startswith("the tool call is not valid JSON and has no closing </tool_call> (")
    # An unclosed call does not swallow the next one.
    first, second = parse_tool_calls('<tool_call>{"name": "pid"}\n<tool_call>{"name": "add"}</tool_call>')
    assert (first.name, first.raw, first.error) == ("pid", '<tool_call>{"name": "pid"}', None)
    assert (second.name, second.error) == ("add", None)


def test_mistral_tool_calls():
    text = 'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 5, "b": 6}}, {"name": "pid", "arguments": {}}] done'
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.raw) for c in calls] == [
        ("add", {"a": 5, "b": 6}, '{"name": "add", "arguments": {"a": 5, "b": 6}}'),
        ("pid", {}, '{"name": "pid", "arguments": {}}')]
    assert text_without_tool_calls(text) == "Sure.  done"


def test_bare_json_is_a_call_only_when_asked():
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 1}}'
    assert parse_tool_calls(text) == []
    assert parse_tool_calls(text, bare_json=True) == [ToolCall("add", {"a": 1, "b": 1}, text)]
    assert parse_tool_calls('{"answer": 4}', bare_json=True) == []
    assert parse_tool_calls("no calls here <tool_call") == []


def test_tool_message_roles():
    call, result = ToolCall("add", {"a": 2, "b": 3}, ""), ToolResult("5")
    assert tool_message(call, result) == {"role": "tool", "name": "add", "content": "5"}
    assert tool_message(call, result, role="user") == {"role": "user",
                                                       "content": "<tool_response>\n5\n</tool_response>"}


def smollm2_tokenizer():
    try:
        return AutoTokenizer.from_pretrained(smollm2_folder())
    except PretrainedUnavailable as err:
        pytest.skip(str(err))


@pytest.mark.parametrize("make, expected", [
    (build_char_tokenizer, "user: 2+3?\nassistant: <tool_call>{}</tool_call>\ntool: 5\nassistant: "),
    (smollm2_tokenizer, "<|im_start|>assistant\n<tool_call>{}</tool_call><|im_end|>\n<|im_start|>tool\n5<|im_end|>\n"
                        "<|im_start|>assistant\n"),
], ids=["tiny", "smollm2"])
def test_the_chat_templates_render_role_tool(make, expected):
    """Both templates print the role verbatim, so role "tool" needs no wrapper for them."""
    messages = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "<tool_call>{}</tool_call>"},
                tool_message(ToolCall("add", {}, ""), ToolResult("5"))]
    assert make().apply_chat_template(messages, tokenize=False, add_generation_prompt=True).endswith(expected)


def test_cap_output_keeps_the_head_and_counts_the_cut():
    assert cap_output("abcdef", 4) == "abcd\n[... 2 chars cut]"
    assert cap_output("abcd", 4) == "abcd"


# -------------------------------------------------------------------------------------- running
def run(runner, name, **arguments) -> ToolResult:
    return runner.call_sync(ToolCall(name, arguments, ""))


def test_outputs_are_exact(runner):
    added = run(runner, "add", a=2, b=3)
    assert (added.output, added.error) == ("5", None) and 0 < added.seconds < 5.0
    assert run(runner, "add", a="ab", b="c").output == "abc"
    assert run(runner, "describe", title="n", tags=["t"]).output == '{"title": "n", "tags": ["t"], "note": "naïve"}'
    raised = run(runner, "raises")
    assert (raised.output, raised.error) == ("Error: the tool 'raises' raised ValueError: bad", "exception")
    assert not raised.ends_episode


def test_unknown_tools_and_bad_arguments_never_reach_a_worker(runner):
    async def main():
        naps = [asyncio.create_task(runner.call(ToolCall("nap", {"seconds": 1.5, "tag": str(i)}, ""))) for i in (1, 2)]
        await asyncio.sleep(0.2)  # both workers are busy now
        unknown = await runner.call(ToolCall("sub", {"a": 1}, ""))
        bad = await runner.call(ToolCall("add", {"a": 1}, ""))
        malformed = await runner.call(parse_tool_calls("<tool_call>{oops}</tool_call>")[0])
        answered_while_busy = not any(task.done() for task in naps)
        await asyncio.gather(*naps)
        return unknown, bad, malformed, answered_while_busy

    unknown, bad, malformed, answered_while_busy = asyncio.run(main())
    assert answered_while_busy
    assert unknown == ToolResult("Error: there is no tool named 'sub'; the tools are: add, big, crash, describe, "
                                 "hang_with_child, nap, pid, raises, slow", "unknown_tool", 0.0)
    assert bad == ToolResult("Error: wrong arguments for the tool 'add': missing a required argument: 'b'; its "
                             "parameters are (a, b)", "bad_arguments", 0.0)
    assert malformed.error == "malformed_call"
    assert malformed.output.startswith("Error: the tool call is not valid JSON (Expecting property name")


def test_timeout_stops_and_replaces_the_worker(quick):
    (before,) = worker_pids(quick)
    quick.reset_stats()
    started = time.monotonic()
    result = run(quick, "slow")
    assert time.monotonic() - started < 10.0  # slow() sleeps 30 s
    assert result.error == "timeout" and result.ends_episode
    assert result.output == "Error: the tool 'slow' did not finish within 0.5 s (--tool_timeout) and was stopped"
    assert result.seconds >= 0.5
    assert worker_pids(quick) == [] and not alive(before)
    assert [run(quick, "add", a=1, b=1).output for _ in range(3)] == ["2"] * 3
    (after,) = worker_pids(quick)
    assert after != before
    stats = quick.stats
    assert (stats["calls"], stats["timeout"], stats["restarts"], stats["crashed"]) == (4, 1, 1, 0)
    assert stats["seconds"] >= 0.5


def test_crash_is_contained_and_the_next_call_works(runner):
    runner.reset_stats()
    result = run(runner, "crash")
    assert (result.output, result.error) == ("Error: the tool 'crash' crashed its worker process (exit code 3)",
                                             "crashed")
    assert result.ends_episode
    assert [run(runner, "add", a=2, b=2).output for _ in range(3)] == ["4"] * 3
    assert (runner.stats["crashed"], runner.stats["restarts"], runner.stats["calls"]) == (1, 1, 4)


def test_output_is_capped_with_a_marker(runner):
    output = run(runner, "big").output
    assert output == "x" * CAP + f"\n[... {100_000 - CAP} chars cut]"
    assert len(output) == CAP + len("\n[... 99000 chars cut]")


def test_calls_share_the_workers(runner):
    async def main():
        return await asyncio.gather(*(runner.call(ToolCall("nap", {"seconds": 0.5, "tag": str(i)}, ""))
                                      for i in range(4)))

    started = time.monotonic()
    results = asyncio.run(main())
    assert time.monotonic() - started < 10.0
    assert [r.error for r in results] == [None] * 4
    assert [r.output.split(" from ")[0] for r in results] == ["0", "1", "2", "3"]
    assert {int(r.output.split(" from ")[1]) for r in results} == set(worker_pids(runner))  # both, and only them


def test_timeout_kills_what_the_tool_started(quick, tmp_path):
    pid_file = tmp_path / "child.pid"
    assert run(quick, "hang_with_child", pid_file=str(pid_file)).error == "timeout"
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5.0
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild)


# ------------------------------------------------------------------------------------ lifecycle
def test_close_leaves_no_worker_alive(tool_file):
    runner = ToolRunner.from_file(tool_file, names=["add"], workers=2)
    pids = worker_pids(runner)
    assert len(pids) == 2 and all(alive(pid) for pid in pids)
    assert run(runner, "add", a=1, b=2).output == "3"
    runner.close()
    assert not any(alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="this ToolRunner was closed"):
        run(runner, "add", a=1, b=2)


def test_workers_die_with_the_trainer(tool_file, tmp_path):
    """A trainer killed with SIGKILL runs no cleanup: the workers notice and exit by themselves."""
    script = write(tmp_path, "trainer.py", f"""
        import os, time
        from lightrft.agents.tools import ToolRunner
        runner = ToolRunner.from_file({str(tool_file)!r}, names=["add"], workers=2)
        print(" ".join(str(slot.worker.process.pid) for slot in runner._slots), flush=True)
        time.sleep(60)
    """)
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                               env=subprocess_env())
    try:
        pids = [int(pid) for pid in trainer.stdout.readline().split()]
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    assert len(pids) == 2
    deadline = time.monotonic() + 10.0
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in pids)


def test_functions_given_directly_with_their_own_names(tool_file):
    spec = importlib.util.spec_from_file_location("workflow_file_under_a_generated_name", tool_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not in sys.modules: no other process could import it by name
    with ToolRunner({"plus": module.add}, workers=1) as runner:
        assert run(runner, "plus", a=40, b=2).output == "42"
    with ToolRunner([module.add, module.pid], workers=1) as runner:
        assert runner.names == ["add", "pid"]
        assert run(runner, "pid").output == str(worker_pids(runner)[0])


def test_tools_a_worker_could_not_find_are_refused(tool_file, tmp_path):
    def nested(a):
        return a

    with pytest.raises(ValueError, match=r"tool 'nested' \(.*<locals>.nested\) must be defined with def at the top "
                                         r"level of its file"):
        ToolRunner({"nested": nested})
    with pytest.raises(ValueError, match="tool 'f' must be a function defined with def in a .py file, got <built-in"):
        ToolRunner({"f": len})
    with pytest.raises(ValueError, match=r"tool file .*my_tools\.py defines no function sub; it defines: add, "):
        ToolRunner.from_file(tool_file, names=["sub"])
    with pytest.raises(ValueError, match=r"positive seconds \(--tool_timeout\), got 0"):
        ToolRunner.from_file(tool_file, timeout=0)
    with pytest.raises(ValueError, match=r"--tool_workers\), got 0"):
        ToolRunner.from_file(tool_file, workers=0)
    broken = write(tmp_path, "broken.py", "def f():\n    return 1\nraise ImportError('no such dependency')\n")
    with pytest.raises(ToolRunnerError, match=r"importing tool file .*broken\.py failed: ImportError: no such dep"):
        ToolRunner.from_file(broken)
    # Imports here but not in the worker (say, a dependency missing where the worker runs).
    worker_only = write(tmp_path, "worker_only.py", """
        def f():
            return 1
        if __name__.startswith("lightrft_tool_file"):
            raise ImportError("not in the worker")
    """)
    with pytest.raises(ToolRunnerError, match=r"importing tool file .*worker_only\.py failed: ImportError: not in"):
        ToolRunner.from_file(worker_only)


# ------------------------------------------------------------------------ hostile calls and tools
@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "add", "arguments": {"a": ' + "9" * 5000 + '}}</tool_call>',
    '<tool_call>{"name": "add", "arguments": ' + "[" * 100_000 + "]" * 100_000 + '}</tool_call>',
    '<tool_call>{"name": "add", "arguments": "{\\"a\\": ' + "9" * 5000 + '}"}</tool_call>',
    '[TOOL_CALLS] [{"name": "add", "arguments": {"a": ' + "9" * 5000 + '}}]',
])
def test_parsing_never_raises_on_huge_numbers_or_deep_nesting(text):
    (call,) = parse_tool_calls(text)
    assert call.error is not None and ("too long to read" in call.error or "nested too deep" in call.error)
    assert text_without_tool_calls(text) == ""
    assert parse_tool_calls("[" * 100_000 + "]" * 100_000, bare_json=True) == []


ESCAPING_TOOLS = '''
import subprocess

def escape(pid_file):
    # The tool's shell leaves the worker's session (setsid), starts a sleeper and exits at once:
    # the sleeper is orphaned, outside the process group the worker leads.
    subprocess.run(["setsid", "sh", "-c", f"sleep 120 & echo $! > {pid_file}"], check=True)
    return "started"

def chatty():
    print("TOOL-PRINTED-THIS", flush=True)
    return "ok"
'''


def test_a_process_a_tool_detaches_with_setsid_ends_with_the_worker(tmp_path):
    tools = write(tmp_path, "escaping.py", ESCAPING_TOOLS)
    pid_file = tmp_path / "sleeper.pid"
    with ToolRunner.from_file(tools, names=["escape"], timeout=10.0, workers=1) as runner:
        assert run(runner, "escape", pid_file=str(pid_file)).output == "started"
        deadline = time.monotonic() + 10
        while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        sleeper = int(pid_file.read_text())
        assert alive(sleeper)
    deadline = time.monotonic() + 10
    while alive(sleeper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(sleeper), "the detached sleeper outlived close()"


def test_a_tools_print_goes_to_stderr_not_the_trainers_stdout(tmp_path, capfd):
    tools = write(tmp_path, "chatty.py", ESCAPING_TOOLS)
    with ToolRunner.from_file(tools, names=["chatty"], timeout=10.0, workers=1) as runner:
        assert run(runner, "chatty").output == "ok"
    captured = capfd.readouterr()
    assert "TOOL-PRINTED-THIS" not in captured.out and "TOOL-PRINTED-THIS" in captured.err


def test_a_tool_that_floods_its_output_shows_a_bounded_head_and_the_count(tmp_path, capfd):
    from lightrft.agents.tools import WORKER_OUTPUT_BYTES

    tools = write(tmp_path, "loud.py", "def loud():\n    print('x' * 999, flush=True) or None\n"
                                       "    for _ in range(3000):\n        print('y' * 999)\n    return 'done'\n")
    with ToolRunner.from_file(tools, names=["loud"], timeout=30.0, workers=1) as runner:
        assert run(runner, "loud").output == "done"
    captured = capfd.readouterr()
    assert "y" * 999 not in captured.out and "x" * 999 in captured.err
    assert WORKER_OUTPUT_BYTES <= len(captured.err) < WORKER_OUTPUT_BYTES + 4096
    # 3,001 lines of 1,000 bytes: the first WORKER_OUTPUT_BYTES shown, the rest counted.
    assert f"a tool worker printed {3001 * 1000 - WORKER_OUTPUT_BYTES} more bytes, not shown" in captured.err


def test_a_huge_environment_text_ends_the_episode_before_it_is_tokenised():
    from lightrft.agents.episode import Episode, EpisodeEnd

    tokenizer = build_char_tokenizer()
    calls = []
    encode = tokenizer.encode
    tokenizer.encode = lambda text, **kw: calls.append(len(text)) or encode(text, **kw)
    episode = Episode(prompt="p", label=None, prompt_ids=[5, 6], tokenizer=tokenizer, request=None, max_turns=4,
                      max_tokens=64, max_new_tokens=8, renderer=None, tools=None, index=0, sample=0)
    episode.add_text("fits")
    with pytest.raises(EpisodeEnd) as end:
        episode.add_text("x" * 10_000_000)
    assert end.value.reason == "token_budget" and episode.truncated
    assert calls == [4]                      # the 10 MB text was never tokenised
