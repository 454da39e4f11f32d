"""Tool calls for multi-turn agents: parse them from the policy's text, run the Python functions
they name in worker processes, and feed the results back as chat messages.

Formats `parse_tool_calls` reads, in the order they appear in the text:

- Hermes / Qwen: `<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>`, several
  per message. `arguments` may also be a JSON string holding the object (some models emit that)
  and may be called `parameters`. A final `<tool_call>` without its closing tag counts, so an
  engine that stops at "</tool_call>" and strips the stop string loses nothing.
- Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
- Llama 3.1 bare JSON (`{"name": ..., "parameters": {...}}` as the whole message, optionally
  after `<|python_tag|>`), only with `bare_json=True`: any JSON answer would otherwise look like it.

A malformed call (bad JSON, no name, arguments that are not an object) comes back as a `ToolCall`
with `error` set, so the episode can tell the policy what was wrong instead of failing.

Results go back as `{"role": "tool", "name": ..., "content": ...}` (`tool_message`). Qwen and
Hermes templates render role "tool" as `<tool_response>` inside a user turn; templates that print
any role verbatim (SmolLM2's ChatML, lightrft's tiny test tokenizer) render it as a "tool" turn.
A template that rejects unknown roles (Llama 2, older Mistral: "roles must alternate
user/assistant") needs `tool_message(call, result, role="user")`, which wraps the content in
`<tool_response>...</tool_response>` as Qwen does.

`ToolRunner` runs the functions. Each is identified by the file that defines it
(`fn.__code__.co_filename`) and its name there, because workflow files are imported under a
generated module name that no other process can import. Workers are persistent processes started
with `subprocess` (fork and exec: safe in a trainer holding torch and DeepSpeed threads) that import
only this file, the standard library and the tool files. multiprocessing's spawn and forkserver
start methods were measured and not used: both re-import the trainer's `__main__` module in every
worker (`lightrft.cli.train_ppo`: torch, DeepSpeed, transformers), which costs seconds and
hundreds of MB per worker and is paid again for every worker replaced after a timeout.

A call that passes `timeout` seconds has its worker's process group killed (subprocesses the tool
started die with it) and the worker replaced; a worker that dies (os._exit, a segfault) is
replaced the same way. Both come back as a `ToolResult` whose `error` ("timeout", "crashed") ends
the episode (`ToolResult.ends_episode`), never the run. Unknown tools and arguments that do not fit
the function's signature are answered without reaching a worker.
"""

import asyncio
import base64
import inspect
import io
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Optional, Union

from lightrft.utils.lifeline import exit_with_parent
from lightrft.utils.pyfile import PythonFileError, import_python_file

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
LLAMA_PYTHON_TAG = "<|python_tag|>"

# ToolResult.error values. The last two mean the worker hung or died: they end the episode.
TOOL_ERRORS = ("malformed_call", "unknown_tool", "bad_arguments", "exception", "timeout", "crashed")
EPISODE_ENDING_ERRORS = ("timeout", "crashed")


# ------------------------------------------------------------------------------------- parsing
@dataclass(frozen=True)
class ToolCall:
    """One tool call as the policy wrote it. `raw` is its text, tags included; `error` says what
    is wrong with a malformed call (then `arguments` is empty and `name` is "" when unknown)."""

    name: str
    arguments: dict
    raw: str
    error: Optional[str] = None


def parse_tool_calls(text: str, bare_json: bool = False) -> list[ToolCall]:
    """The tool calls in `text`, in order (formats in the module docstring); [] when there are
    none. Never raises on malformed calls: they carry `error`."""
    return [call for _, _, call in _find_calls(text, bare_json)]


def text_without_tool_calls(text: str, bare_json: bool = False) -> str:
    """`text` with every tool call `parse_tool_calls` finds removed, stripped."""
    pieces, pos = [], 0
    for start, end, _ in _find_calls(text, bare_json):
        pieces.append(text[pos:start])
        pos = max(pos, end)
    pieces.append(text[pos:])
    return "".join(pieces).strip()


def _find_calls(text: str, bare_json: bool) -> list[tuple[int, int, ToolCall]]:
    """(start, end, call) of every call, by position in `text`."""
    found = []
    pos = 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) != -1:
        body_start = start + len(TOOL_CALL_OPEN)
        close = text.find(TOOL_CALL_CLOSE, body_start)
        next_open = text.find(TOOL_CALL_OPEN, body_start)
        unclosed = close == -1 or -1 < next_open < close  # runs to the next call or the end of the text
        body_end = (len(text) if next_open == -1 else next_open) if unclosed else close
        end = body_end if unclosed else close + len(TOOL_CALL_CLOSE)
        raw = text[start:end].rstrip() if unclosed else text[start:end]
        found.append((start, end, _call_from_json(text[body_start:body_end], raw, unclosed)))
        pos = end
    pos = 0
    while (start := text.find(MISTRAL_TOOL_CALLS, pos)) != -1:
        if any(s <= start < e for s, e, _ in found):  # the marker quoted inside a Hermes call
            pos = start + len(MISTRAL_TOOL_CALLS)
            continue
        end, calls = _mistral_calls(text, start + len(MISTRAL_TOOL_CALLS))
        found.extend((start, end, call) for call in calls)
        pos = end
    if not found and bare_json:
        found = [(0, len(text), call) for call in _bare_json_calls(text)]
    return sorted(found, key=lambda item: item[0])


def _call_from_json(body: str, raw: str, unclosed: bool = False) -> ToolCall:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as err:
        hint = " and has no closing </tool_call>" if unclosed else ""
        return ToolCall("", {}, raw, f"the tool call is not valid JSON{hint} ({_json_problem(err)}); write "
                                     '{"name": ..., "arguments": {...}}')
    return _call_from_value(value, raw)


def _json_problem(err: Exception) -> str:
    """What stopped a JSON decode, for a call's `error`: the decoder's message and position, or the
    limits Python sets (nesting deeper than its recursion limit, integers past 4,300 digits)."""
    if isinstance(err, json.JSONDecodeError):
        return f"{err.msg} at line {err.lineno} column {err.colno}"
    if isinstance(err, RecursionError):
        return "its values are nested too deep to read"
    return f"it holds a number too long to read: {str(err)[:120]}"


def _call_from_value(value: Any, raw: str) -> ToolCall:
    """The call a decoded JSON value describes, or a ToolCall with `error` saying what is wrong."""
    if not isinstance(value, dict):
        return ToolCall("", {}, raw, f'a tool call must be a JSON object with "name" and "arguments", '
                                     f"got {_json_type(value)}")
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCall("", {}, raw, f'the tool call has no "name" (a non-empty string), got {_json_type(name)}')
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as err:
            problem = (f"{err.msg} at column {err.colno}" if isinstance(err, json.JSONDecodeError)
                       else _json_problem(err))
            return ToolCall(name, {}, raw, f'"arguments" of the call to {name!r} is a string that is not JSON '
                                           f"({problem}); give a JSON object")
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, raw, f'"arguments" of the call to {name!r} must be a JSON object, '
                                       f"got {_json_type(arguments)}")
    return ToolCall(name, arguments, raw)


def _mistral_calls(text: str, pos: int) -> tuple[int, list[ToolCall]]:
    """The calls of the JSON list starting at `pos` (after [TOOL_CALLS]) and where the list ends.
    The list is read element by element so each call's `raw` is its own text; a list cut off by
    the end of the text keeps the elements that are complete."""
    decoder = json.JSONDecoder()
    pos = _skip_space(text, pos)
    if not text.startswith("[", pos):
        return len(text), [ToolCall("", {}, text[pos:], f"expected a JSON list of calls after {MISTRAL_TOOL_CALLS}")]
    calls, pos = [], pos + 1
    while True:
        pos = _skip_space(text, pos)
        if pos == len(text):
            return pos, calls
        if text.startswith("]", pos):
            return pos + 1, calls
        try:
            value, end = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError) as err:
            problem = err.msg if isinstance(err, json.JSONDecodeError) else _json_problem(err)
            return len(text), calls + [ToolCall("", {}, text[pos:], f"the tool call is not valid JSON ({problem}); "
                                                                    'write {"name": ..., "arguments": {...}}')]
        calls.append(_call_from_value(value, text[pos:end]))
        pos = _skip_space(text, end)
        if text.startswith(",", pos):
            pos += 1


def _bare_json_calls(text: str) -> list[ToolCall]:
    """Llama 3.1 style: the whole message is one call object (or a list of them); else none."""
    body = text.strip()
    body = body[len(LLAMA_PYTHON_TAG):].strip() if body.startswith(LLAMA_PYTHON_TAG) else body
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return []
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, dict) and "name" in v and ("parameters" in v or "arguments" in v)
                             for v in values):
        return []
    return [_call_from_value(v, text.strip() if len(values) == 1 else json.dumps(v)) for v in values]


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)


# ------------------------------------------------------------------------------------ results
@dataclass(frozen=True)
class ToolResult:
    """What a tool call gave. `output` is the text the policy sees: the function's return value as
    text (a str as is, a dict or list as JSON, anything else through str()), cut to
    `max_output_chars` with a "[... N chars cut]" line, or, when `error` is set, a message saying
    what went wrong. `error` is None or one of TOOL_ERRORS. `seconds` is the time in the worker
    (0 for calls answered without one)."""

    output: str
    error: Optional[str] = None
    seconds: float = 0.0
    images: tuple[bytes, ...] = ()      # pictures the tool returned (PNG bytes), shown to the policy before the text

    @property
    def ends_episode(self) -> bool:
        """True when the tool hung or crashed its worker: the episode ends with `error` as reason."""
        return self.error in EPISODE_ENDING_ERRORS


def tool_message(call: ToolCall, result: ToolResult, role: str = "tool") -> dict:
    """The chat message carrying `result` back to the policy. Role "tool" (Qwen, Hermes, ChatML
    templates) gives `{"role": "tool", "name": ..., "content": ...}`; any other role (use "user"
    for templates that reject "tool") wraps the content in <tool_response> tags as Qwen renders it."""
    text = result.output if role == "tool" else f"<tool_response>\n{result.output}\n</tool_response>"
    if result.images:       # a vision-language run: the pictures as image parts, then the text
        content = [*({"type": "image", "image": image} for image in result.images), {"type": "text", "text": text}]
    else:
        content = text
    return {"role": "tool", "name": call.name, "content": content} if role == "tool" else {"role": role, "content": content}


def cap_output(text: str, max_chars: int) -> str:
    """The first `max_chars` characters of `text`, then a line saying how many were cut."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}\n[... {len(text) - max_chars} chars cut]"


def is_picture(value: Any) -> bool:
    """Whether `value` is a PIL image (checked without importing PIL)."""
    return type(value).__module__.startswith("PIL.") and hasattr(value, "save") and hasattr(value, "size")


def split_pictures(value: Any) -> tuple[Any, list[bytes]]:
    """A tool's return value without its pictures, and the pictures as PNG bytes: a PIL image
    alone, or the PIL images in a list or tuple (the rest stays the value; one item left is the
    value itself, none leaves "")."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    pictures = [item for item in items if is_picture(item)]
    if not pictures:
        return value, []
    encoded = []
    for picture in pictures:
        buffer = io.BytesIO()
        picture.save(buffer, format="PNG")
        encoded.append(buffer.getvalue())
    rest = [item for item in items if not is_picture(item)]
    return (rest[0] if len(rest) == 1 else rest or ""), encoded


def output_text(value: Any) -> str:
    """A tool's return value as the text the policy reads."""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


# ------------------------------------------------------------------------------------- runner
class ToolRunnerError(RuntimeError):
    """A tool worker could not start (a tool file that fails to import, a function not found)."""


@dataclass(frozen=True)
class _Tool:
    path: str                       # the .py file defining the function
    function: str                   # its name at the top level of that file
    signature: inspect.Signature    # checked here, so bad arguments never reach a worker


WORKER_OUTPUT_BYTES = 64 * 1024      # of what a worker's tools print, shown on the trainer's stderr


class _OutputForwarder:
    """Copies a worker's stdout and stderr (one pipe) to the trainer's stderr, at most
    WORKER_OUTPUT_BYTES of it, then says how much it left out when the pipe ends: a tool that
    prints in a loop cannot flood the run's log. A daemon thread reads the pipe to its end, so the
    worker never blocks on a full pipe."""

    def __init__(self, pipe, limit: int = WORKER_OUTPUT_BYTES):
        self.pipe, self.limit, self.shown, self.dropped = pipe, limit, 0, 0
        self.thread = threading.Thread(target=self._run, name="lightrft-tool-output", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while chunk := self.pipe.read1(65536):
                room = max(0, self.limit - self.shown)
                if room:
                    _write_stderr(chunk[:room])
                    self.shown += min(room, len(chunk))
                self.dropped += max(0, len(chunk) - room)
        except (OSError, ValueError):
            pass
        finally:
            if self.dropped:
                _write_stderr(f"\n[lightrft: a tool worker printed {self.dropped} more bytes, not shown (the first "
                              f"{self.limit} are)]\n".encode())


def _write_stderr(data: bytes) -> None:
    try:
        if hasattr(sys.stderr, "buffer"):
            sys.stderr.buffer.write(data)
        else:                       # a text stream put in its place (a test's capture)
            sys.stderr.write(data.decode(errors="replace"))
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


class _Worker:
    """One worker process and the connection to it."""

    def __init__(self, process: subprocess.Popen, conn: Connection):
        self.process, self.conn = process, conn
        self.output = _OutputForwarder(process.stdout) if process.stdout is not None else None
        self._lock = threading.Lock()
        self._ended: Optional[str] = None

    def stop(self, exiting: bool = False) -> str:
        """Kills the worker's process group (a hung tool may ignore anything gentler; tools'
        subprocesses go too), reaps it, and returns how it ended ("exit code 3", ...). `exiting`:
        the worker closed its end, so it is dying by itself; its own exit code is worth a short
        wait. Safe to call again and from several threads: the first call does the work."""
        with self._lock:
            if self._ended is None:
                self._ended = self._kill(exiting)
            return self._ended

    def _kill(self, exiting: bool) -> str:
        if exiting:
            try:
                self.process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        for pid in _descendants(self.process.pid):      # those that left the session too (setsid)
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # the session the worker leads: it and its children
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()
        self.conn.close()
        if self.output is not None:       # the pipe ends with the process group: its last words shown
            self.output.thread.join(timeout=5.0)
            self.process.stdout.close()
        code = self.process.returncode
        return f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class _Slot:
    """A place for one worker; `worker` is None after its worker was stopped, until a call
    starts a fresh one."""

    def __init__(self):
        self.worker: Optional[_Worker] = None


ToolsArg = Union[Mapping[str, Callable], Sequence[Callable]]


class ToolRunner:
    """Runs tool functions in `workers` persistent worker processes (module docstring).

    Args:
        tools: {name the policy calls: function}, or a list of functions named by `__name__`.
            Each must be a function defined with `def` at the top level of a .py file.
        timeout: seconds one call may run (`--tool_timeout`); then its worker is killed and replaced.
        max_output_chars: characters of a tool's output the policy sees (`--tool_max_output_chars`);
            more are cut and the cut is marked.
        workers: worker processes (`--tool_workers`): calls beyond that many wait in turn.
        start_timeout: seconds a worker may take to import the tool files.

    Workers start (and the tool files are imported in them) at construction, so a broken file stops
    the run at start-up. `close()` (or leaving a `with` block) kills every worker; so does garbage
    collection, interpreter exit, and, within about a second, the death of this process.
    `stats` counts calls, seconds in workers, worker restarts and each kind of error.
    """

    def __init__(self, tools: ToolsArg, *, timeout: float = 10.0, max_output_chars: int = 4096, workers: int = 2,
                 start_timeout: float = 60.0):
        if not timeout > 0:
            raise ValueError(f"tool timeout must be positive seconds (--tool_timeout), got {timeout}")
        if not (isinstance(max_output_chars, int) and max_output_chars >= 1):
            raise ValueError(f"max_output_chars must be a positive integer (--tool_max_output_chars), "
                             f"got {max_output_chars!r}")
        if not (isinstance(workers, int) and workers >= 1):
            raise ValueError(f"tool workers must be a positive integer (--tool_workers), got {workers!r}")
        named = tools.items() if isinstance(tools, Mapping) else [(getattr(fn, "__name__", fn), fn) for fn in tools]
        self._tools = {name: _locate_tool(name, fn) for name, fn in named}
        self.timeout, self.max_output_chars, self.start_timeout = float(timeout), max_output_chars, start_timeout
        self.names = sorted(self._tools)  # the tools the policy may call
        self._index = {name: i for i, name in enumerate(self.names)}
        self._lock = threading.Lock()
        self._closed = False
        self.stats: dict[str, float] = {}
        self.reset_stats()
        self._slots = [_Slot() for _ in range(workers)]
        self._finalizer = weakref.finalize(self, _stop_slots, self._slots)
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lightrft-tool")
        try:
            for slot in self._slots:  # all start at once; then each is waited for
                slot.worker = self._launch()
            for slot in self._slots:
                self._await_ready(slot.worker)
        except BaseException:
            _stop_slots(self._slots)
            raise
        self._free: queue.Queue = queue.Queue()
        for slot in self._slots:
            self._free.put(slot)

    @classmethod
    def from_file(cls, path: Union[str, Path], names: Optional[Sequence[str]] = None, **kwargs) -> "ToolRunner":
        """A runner for functions of the .py file at `path` (imported here too, for their
        signatures): those in `names`, or every public function the file defines."""
        path = Path(path).expanduser()
        module = _import_file(path, "lightrft_tools")
        if names is None:
            names = [name for name, fn in vars(module).items() if inspect.isfunction(fn)
                     and fn.__module__ == module.__name__ and not name.startswith("_")]
        missing = [name for name in names if not callable(getattr(module, name, None))]
        if missing:
            defined = [name for name, value in vars(module).items() if inspect.isfunction(value)]
            raise ValueError(f"tool file {path} defines no function {', '.join(missing)}; "
                             f"it defines: {', '.join(defined)}")
        return cls({name: getattr(module, name) for name in names}, **kwargs)

    def __enter__(self) -> "ToolRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ToolRunner({self.names}, timeout={self.timeout:g}, max_output_chars={self.max_output_chars}, "
                f"workers={len(self._slots)})")

    def reset_stats(self) -> None:
        with self._lock:
            self.stats = {"calls": 0, "seconds": 0.0, "restarts": 0, **{kind: 0 for kind in TOOL_ERRORS}}

    async def call(self, call: ToolCall) -> ToolResult:
        """`call_sync` for asyncio code: the call waits for a free worker in a thread, not the loop."""
        request = self._check(call)
        if isinstance(request, ToolResult):
            return self._record(request)
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._dispatch, call, request)

    def call_sync(self, call: ToolCall) -> ToolResult:
        """Runs `call` in a worker (waiting for a free one) and returns its result; errors are
        results, not exceptions. Raises RuntimeError only after `close()`."""
        request = self._check(call)
        if isinstance(request, ToolResult):
            return self._record(request)
        return self._dispatch(call, request)

    def close(self) -> None:
        """Kills every worker; calls in flight come back "crashed", later calls raise."""
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._finalizer()

    # ----------------------------------------------------------------------------- internals
    def _check(self, call: ToolCall) -> Union[bytes, ToolResult]:
        """The request for a worker, or the result of a call that cannot run (malformed, unknown
        tool, arguments that do not fit the signature or are not JSON)."""
        if self._closed:
            raise RuntimeError("this ToolRunner was closed; make a new one to run tools")
        if call.error:
            return ToolResult(f"Error: {call.error}", "malformed_call")
        tool = self._tools.get(call.name)
        if tool is None:
            return ToolResult(f"Error: there is no tool named {call.name!r}; the tools are: {', '.join(self.names)}",
                              "unknown_tool")
        try:
            tool.signature.bind(**call.arguments)
            return json.dumps([self._index[call.name], call.arguments, self.max_output_chars]).encode()
        except TypeError as err:
            parameters = tool.signature.replace(return_annotation=inspect.Signature.empty)
            return ToolResult(f"Error: wrong arguments for the tool {call.name!r}: {err}; its parameters are "
                              f"{parameters}", "bad_arguments")

    def _dispatch(self, call: ToolCall, request: bytes) -> ToolResult:
        slot = self._free.get()
        try:
            if self._closed:
                raise RuntimeError("this ToolRunner was closed; make a new one to run tools")
            return self._record(self._run(slot, call.name, request))
        finally:
            self._free.put(slot)

    def _run(self, slot: _Slot, name: str, request: bytes) -> ToolResult:
        """Sends one request to the slot's worker (starting one first if the last was stopped)."""
        if slot.worker is None:
            try:
                worker = self._launch()
                self._await_ready(worker)
            except ToolRunnerError as err:
                return ToolResult(f"Error: the tool {name!r} could not run: {err}", "crashed")
            with self._lock:
                self.stats["restarts"] += 1
                if self._closed:
                    worker.stop()
                    raise RuntimeError("this ToolRunner was closed; make a new one to run tools")
                slot.worker = worker
        worker = slot.worker
        started = time.monotonic()
        try:
            worker.conn.send_bytes(request)
            answered = worker.conn.poll(self.timeout)
            answer = json.loads(worker.conn.recv_bytes()) if answered else None
        except (EOFError, OSError):
            slot.worker = None
            cause = "the tool runner was closed" if self._closed else worker.stop(exiting=True)
            return ToolResult(f"Error: the tool {name!r} crashed its worker process ({cause})", "crashed",
                              time.monotonic() - started)
        seconds = time.monotonic() - started
        if answer is None:
            slot.worker = None
            worker.stop()
            return ToolResult(f"Error: the tool {name!r} did not finish within {self.timeout:g} s (--tool_timeout) "
                              "and was stopped", "timeout", seconds)
        status, text, *pictures = answer
        if status == "exception":
            return ToolResult(f"Error: the tool {name!r} raised {text}", "exception", seconds)
        return ToolResult(text, None, seconds, tuple(base64.b64decode(p) for p in (pictures[0] if pictures else ())))

    def _record(self, result: ToolResult) -> ToolResult:
        with self._lock:
            self.stats["calls"] += 1
            self.stats["seconds"] += result.seconds
            if result.error:
                self.stats[result.error] += 1
        return result

    def _launch(self) -> _Worker:
        """Starts a worker process (this file run by path, not imported as lightrft.agents.tools,
        so the worker imports neither torch nor the rest of lightrft) and sends it the tools."""
        ours, theirs = socket.socketpair()
        arm_death_signal = threading.current_thread() is threading.main_thread()
        with theirs:
            process = subprocess.Popen(
                [sys.executable, "-c", _WORKER_BOOT, __file__, json.dumps(sys.path), str(theirs.fileno()),
                 str(os.getpid()), "1" if arm_death_signal else "0"],
                # A tool's print() goes to the trainer's stderr, not into its stdout (which ends with
                # the run's JSON summary line), capped (`_OutputForwarder`).
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True)
        conn = Connection(ours.detach())
        tools = [[self._tools[name].path, self._tools[name].function] for name in self.names]
        conn.send_bytes(json.dumps(tools).encode())
        return _Worker(process, conn)

    def _await_ready(self, worker: _Worker) -> None:
        try:
            ready = worker.conn.poll(self.start_timeout)
            answer = json.loads(worker.conn.recv_bytes()) if ready else None
        except (EOFError, OSError):
            answer = ["load_error", f"the tool worker died while starting ({worker.stop(exiting=True)})"]
        if answer is None:
            answer = ["load_error", f"the tool worker did not start within {self.start_timeout:g} s"]
        if answer[0] != "ready":
            worker.stop()
            raise ToolRunnerError(answer[1])


def _stop_slots(slots: list[_Slot]) -> None:
    for slot in slots:
        worker, slot.worker = slot.worker, None
        if worker is not None:
            worker.stop()


def _locate_tool(name: str, fn: Callable) -> _Tool:
    """Where a worker finds `fn`: its file and top-level name. ValueError naming the tool when a
    worker could not (a lambda, a nested function, a method, a function typed into a REPL)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool names must be non-empty strings, got {name!r}")
    if not inspect.isfunction(fn):
        raise ValueError(f"tool {name!r} must be a function defined with def in a .py file, got {fn!r}")
    path = inspect.unwrap(fn).__code__.co_filename
    if fn.__qualname__ != fn.__name__ or fn.__name__ == "<lambda>":
        raise ValueError(f"tool {name!r} ({fn.__qualname__}) must be defined with def at the top level of its file: "
                         "tool workers import the file and look the function up by name")
    if not Path(path).is_file():
        raise ValueError(f"tool {name!r} was not defined in a file ({path}); define it in a .py file")
    module = sys.modules.get(fn.__module__)
    if module is not None and getattr(module, fn.__name__, None) is not fn:
        raise ValueError(f"tool {name!r}: {path} has no top-level function {fn.__name__!r} that is this function; "
                         "tool workers import the file and look the function up by name")
    return _Tool(str(Path(path).resolve()), fn.__name__, inspect.signature(fn))


def _import_file(path: Path, prefix: str):
    """Imports the .py file at `path` (`lightrft.utils.pyfile`); ToolRunnerError naming the file
    when it cannot be read or raises."""
    try:
        return import_python_file(path, prefix, "tool file")
    except PythonFileError as err:
        raise ToolRunnerError(str(err)) from err.__cause__


def _descendants(pid: int) -> list[int]:
    """Every living descendant of `pid`, read from /proc (children lists); [] where /proc has none."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(child) for child in f.read().split()]
            except (OSError, ValueError):
                continue
            found += children
            frontier += children
    return found


def _become_subreaper() -> None:
    """prctl(PR_SET_CHILD_SUBREAPER): orphaned descendants are reparented to this process rather
    than to init. Linux only; elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)       # PR_SET_CHILD_SUBREAPER = 36
    except (OSError, AttributeError):
        pass


# ------------------------------------------------------------------------------------- worker
# The worker's whole program: sets sys.path to the trainer's, imports this file by path under its
# own name (not as lightrft.agents.tools, whose package imports torch) and serves.
_WORKER_BOOT = """
import importlib.util, json, sys
sys.path[:] = json.loads(sys.argv[2])
spec = importlib.util.spec_from_file_location("lightrft_tool_worker", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
module.serve_tools(*sys.argv[3:])
"""


def serve_tools(fd: str, parent_pid: str, arm_death_signal: str) -> None:
    """The worker loop: imports the tool files, answers "ready" (or why not), then runs one call
    at a time until the connection closes. Requests and answers are JSON. The worker is a child
    subreaper (Linux): a process a tool starts, even one that leaves the worker's session with
    setsid and whose parent exits, stays its descendant, so stopping the worker ends it too."""
    exit_with_parent(int(parent_pid), arm_death_signal == "1", "lightrft-tool-parent-watch")
    _become_subreaper()
    conn = Connection(int(fd))
    functions = []
    try:
        modules = {}
        for path, function in json.loads(conn.recv_bytes()):
            if path not in modules:
                modules[path] = _import_file(Path(path), "lightrft_tool_file")
            if not callable(getattr(modules[path], function, None)):
                raise ToolRunnerError(f"tool file {path} has no top-level function {function!r}")
            functions.append(getattr(modules[path], function))
    except (ToolRunnerError, EOFError, OSError) as err:
        conn.send_bytes(json.dumps(["load_error", str(err)]).encode())
        return
    conn.send_bytes(json.dumps(["ready", ""]).encode())
    while True:
        try:
            index, arguments, max_chars = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            value = functions[index](**arguments)
            if inspect.iscoroutine(value):  # an async def tool
                value = asyncio.run(value)
            value, pictures = split_pictures(value)
            answer = ["ok", cap_output(output_text(value), max_chars),
                      [base64.b64encode(picture).decode() for picture in pictures]]
        except BaseException as err:  # SystemExit and KeyboardInterrupt from the tool too: the worker lives on
            answer = ["exception", f"{type(err).__name__}: {err}"]
        conn.send_bytes(json.dumps(answer).encode())
