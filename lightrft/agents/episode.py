"""One multi-turn episode, token in, token out.

An `Episode` holds the sequence the policy is trained on: the prompt's token ids, then each turn's
ids exactly as the engine sampled them (they train), with the environment's ids (tool results,
user replies, game feedback) between turns as the chat template renders them (they are attended
to but do not train). Nothing is decoded and encoded again: a turn's text is decoded only for the
workflow to read.

Environment messages are rendered by `ChatRenderer`: the template's text for the new messages,
preceded by what the template writes after an assistant message's end-of-turn token (ChatML's
newline after `<|im_end|>`), so the sequence reads as the template would have written the whole
conversation, but with the sampled ids of every assistant turn kept as they were.
"""

import asyncio
import contextvars
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Sequence

from lightrft.datasets.prompt_record import PromptRecord

# The request a turn makes: (token ids so far, most new tokens, turn index) -> (ids, log-probs, cut).
TurnRequest = Callable[[list[int], int, int], Awaitable[tuple[list[int], list[float], bool]]]


class EpisodeEnd(Exception):
    """Ends an episode before its workflow returns: a limit was reached (`max_turns`, the token
    budget) or the environment failed (a tool that hung or crashed). The runner records `reason`
    and scores the episode with the workflow's `reward_on_end` (default 0)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


_TOKEN_CHARS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _longest_token_chars(tokenizer) -> int:
    """`lightrft.serving.http.longest_token_chars` of `tokenizer`, computed once per tokenizer."""
    if tokenizer not in _TOKEN_CHARS:
        from lightrft.serving.http import longest_token_chars

        _TOKEN_CHARS[tokenizer] = longest_token_chars(tokenizer)
    return _TOKEN_CHARS[tokenizer]


@dataclass
class Turn:
    """One policy turn: what the engine sampled and its text."""

    text: str                  # decoded without special tokens, for the workflow to read
    token_ids: list[int]       # exactly what the engine sampled: these ids train
    log_probs: list[float]     # the engine's log-probs of those ids
    truncated: bool            # stopped by a length limit rather than an end-of-sequence token
    reward: Optional[float] = None   # per-turn reward (`Episode.reward_turn`), on the turn's last token


class ChatRenderer:
    """Renders environment messages appended to a conversation as token ids, with the tokenizer's
    chat template, without re-rendering the conversation before them."""

    _BASE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]

    def __init__(self, tokenizer, eos_token_ids: Sequence[int]):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this workflow adds chat messages, but the tokenizer has no chat template: use a model "
                             "whose tokenizer has one, or add raw text with Episode.add_text")
        self.tokenizer = tokenizer
        self.base = self._render(self._BASE, generation_prompt=False)
        # What the template writes after the assistant's content, less the end-of-turn token the
        # policy itself samples (it is already in the sequence).
        after = self.base[self.base.rindex("a") + 1:]
        for eos in eos_token_ids:
            eos_text = tokenizer.decode([eos])
            if eos_text and after.startswith(eos_text):
                after = after[len(eos_text):]
                break
        self.turn_tail = after

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def environment_text(self, messages: Sequence[dict], generation_prompt: bool = True) -> str:
        """The text that follows an assistant turn's end-of-turn token when `messages` come next
        (and, with `generation_prompt`, the next assistant turn's header)."""
        full = self._render(self._BASE + list(messages), generation_prompt)
        if not full.startswith(self.base):
            raise ValueError("the tokenizer's chat template renders a conversation differently once messages are "
                             "appended (the earlier turns changed), so environment messages cannot be appended as "
                             "tokens: add them with Episode.add_text instead")
        return self.turn_tail + full[len(self.base):]

    def environment_ids(self, messages: Sequence[dict], generation_prompt: bool = True) -> list[int]:
        return self.tokenizer.encode(self.environment_text(messages, generation_prompt), add_special_tokens=False)


@dataclass
class EpisodeStats:
    tool_calls: int = 0
    tool_errors: int = 0
    env_seconds: float = 0.0       # seconds spent in tools and environment calls


class Episode:
    """One episode of one sample: the workflow's handle on the policy and the environment.

    - `prompt`, `label`: the dataset row; `messages`: the conversation so far as chat messages
      (the prompt as a user message, then each turn and each environment message).
    - `await generate()`: the policy's next turn from everything so far.
    - `add_messages(...)` / `add_text(...)`: environment output, in the sequence but not trained.
    - `await call_tools(calls)`: runs parsed tool calls and adds their results as tool messages.
    - `reward_turn(r)`: a per-turn reward on the last turn.
    - `end(reason)`: stops the episode here (the workflow's `reward_on_end` scores it).
    """

    def __init__(self, *, prompt: Any, label: Any, prompt_ids: list[int], tokenizer, request: TurnRequest,
                 max_turns: int, max_tokens: int, max_new_tokens: int, renderer: Optional[ChatRenderer] = None,
                 tools=None, index: int = 0, sample: int = 0, images=None, max_images: Optional[int] = None):
        # A dataset's prompt is a `PromptRecord`: the workflow reads its text; its images stay here.
        record = prompt if isinstance(prompt, PromptRecord) else None
        self.prompt, self.label = (record.text if record is not None else prompt), label
        self.messages: list[dict] = (list(prompt) if isinstance(prompt, list)
                                     else [{"role": "user", "content": str(self.prompt)}])
        self.prompt_ids = list(prompt_ids)
        # A vision-language run (`images`: its `ImagePrompts`): the pictures of the prompt and of
        # environment messages, their model inputs in placeholder order, and the sequence with one
        # marker per picture (what an engine that expands placeholders itself takes).
        self._images, self.max_images = images, max_images
        self.pictures: list = list(record.images) if record is not None else []
        self._media: list = [(-1, record.media)] if record is not None and record.media else []   # (offset, media)
        self._marker_ids: list[int] = list(record.marker_ids if record is not None and record.marker_ids
                                           else prompt_ids)
        self.tokenizer, self._request, self._renderer, self.tools = tokenizer, request, renderer, tools
        self.max_turns, self.max_tokens, self.max_new_tokens = max_turns, max_tokens, max_new_tokens
        self.index, self.sample = index, sample
        self.response_ids: list[int] = []
        self.loss_mask: list[bool] = []
        self.log_probs: list[float] = []
        self.versions: list[int] = []       # the policy version of each response token, -1 for the environment's
        self.turns: list[Turn] = []
        self.turn_ends: list[int] = []      # response position of each turn's last token
        self.truncated = False
        self.stats = EpisodeStats()
        # The workflow's own per-episode numbers; those named in `Workflow.metrics` are logged
        # as rollout/<key> (means over episodes), the rest stay in the episode's record.
        self.extra: dict = {}

    # ------------------------------------------------------------------------------------- budget
    @property
    def tokens_left(self) -> int:
        return self.max_tokens - len(self.response_ids)

    @property
    def turns_left(self) -> int:
        return self.max_turns - len(self.turns)

    def end(self, reason: str) -> None:
        """Stops the episode here: raises `EpisodeEnd(reason)`."""
        raise EpisodeEnd(reason)

    # ------------------------------------------------------------------------------------- policy
    async def generate(self, max_new_tokens: Optional[int] = None) -> Turn:
        """The policy's next turn, sampled from every token so far (batched with the other
        episodes' turns). Ends the episode (`EpisodeEnd`) when no turn or token is left."""
        if self.turns_left <= 0:
            self.truncated = True
            raise EpisodeEnd("max_turns")
        if self.tokens_left <= 0:
            self.truncated = True
            raise EpisodeEnd("token_budget")
        limit = min(self.max_new_tokens if max_new_tokens is None else max_new_tokens, self.tokens_left)
        ids, log_probs, cut, *tagged = await self._request(self.prompt_ids + self.response_ids, limit,
                                                             len(self.turns))
        self.response_ids += ids
        self._marker_ids += ids
        self.loss_mask += [True] * len(ids)
        self.log_probs += log_probs
        # the version of the weights that sampled each token, where the engine tags them (partial rollouts)
        self.versions += tagged[0] if tagged and tagged[0] is not None else [-1] * len(ids)
        self.turn_ends.append(len(self.response_ids) - 1)
        turn = Turn(self.tokenizer.decode(ids, skip_special_tokens=True), list(ids), list(log_probs), cut)
        self.truncated |= cut
        self.turns.append(turn)
        self.messages.append({"role": "assistant", "content": turn.text})
        return turn

    def reward_turn(self, reward: float) -> None:
        """A reward for the last turn, on its last token (token-level estimators credit it there;
        the others add it to the episode's reward)."""
        if not self.turns:
            raise ValueError("reward_turn() needs a turn first: call generate()")
        self.turns[-1].reward = float(reward)

    # -------------------------------------------------------------------------------- environment
    def add_messages(self, *messages: dict) -> None:
        """Environment messages (role "tool" or "user"), rendered by the chat template and
        appended with the next assistant header; they are attended to, never trained. In a
        vision-language run a message's content may be a list of parts, `{"type": "text", "text":
        ...}` and `{"type": "image", "image": picture}` (a PIL image, PNG/JPEG bytes, base64 or a
        file path): the picture is shown to the policy where the part stands."""
        if self._renderer is None:
            raise ValueError("add_messages() needs the tokenizer's chat template; add raw text with add_text()")
        flat, pictures = self._take_pictures(messages)
        if pictures and self.max_images is not None and len(self.pictures) + len(pictures) > self.max_images:
            raise ValueError(f"add_messages: the episode would show {len(self.pictures) + len(pictures)} pictures, "
                             f"over --max_images_per_prompt {self.max_images} (the prompt's and the environment's "
                             "together); raise it")
        self._check_length(sum(len(str(m.get("content") or "")) for m in flat if isinstance(m, dict)))
        if not pictures:
            ids = self._renderer.environment_ids(flat)
            self._append_environment(ids, ids)
        else:
            text = self._renderer.environment_text(flat)
            self._append_environment(self._images.expand(text, pictures, add_special_tokens=False),
                                     self._images.marker_ids(text, add_special_tokens=False),
                                     pictures, self._images.media(pictures))
        self.messages.extend(messages)

    def add_text(self, text: str) -> None:
        """Raw environment text, encoded as is and appended; attended to, never trained."""
        self._check_length(len(text))
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self._append_environment(ids, ids)
        self.messages.append({"role": "user", "content": text})

    def _take_pictures(self, messages: Sequence[dict]) -> tuple[list, list]:
        """`messages` with image parts replaced by the model's image marker (contents joined into
        text), and the pictures (PIL) in order."""
        if not any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages):
            return list(messages), []
        from lightrft.datasets.images import open_image
        from lightrft.datasets.validation import DatasetRowError

        flat, pictures = [], []
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list):
                flat.append(message)
                continue
            pieces = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    pieces.append(part["text"])
                elif kind == "image" and "image" in part:
                    if self._images is None:
                        raise ValueError("an environment message holds an image, but this run takes none: train a "
                                         "vision-language model with --image_key (docs/vlm.md)")
                    try:
                        pictures.append(open_image(part["image"], None, "environment message", i,
                                                   f"content[{j}].image"))
                    except DatasetRowError as err:
                        raise ValueError(f"add_messages: message {i}, content[{j}]: {err.reason}") from None
                    pieces.append(self._images.marker)
                else:
                    raise ValueError(f"add_messages: message {i}, content[{j}] must be {{'type': 'text', 'text': ...}} "
                                     f"or {{'type': 'image', 'image': ...}}, got {part!r:.80}")
            flat.append({**message, "content": "".join(pieces)})
        return flat, pictures

    # ------------------------------------------------------------------------------------ images
    def media(self, before: Optional[int] = None) -> Optional[dict]:
        """The model inputs of every picture in the sequence so far (or in the prompt and the
        first `before` response tokens), in placeholder order, or None."""
        from lightrft.models.media import merge_media

        return merge_media([media for at, media in self._media if before is None or at < before])

    def engine_images(self):
        """The sequence's pictures as an engine that expands placeholders itself takes them
        (`PromptImages`: pictures, ids with one marker each, the expanded ids), or None."""
        if not self.pictures:
            return None
        from lightrft.rollout.base import PromptImages

        return PromptImages(tuple(self.pictures), tuple(self._marker_ids), tuple(self.prompt_ids + self.response_ids))

    def _check_length(self, chars: int) -> None:
        """Ends the episode (token budget) before tokenising a text that cannot fit: one token
        stands for at most `longest_token_chars` characters, so more characters than that times
        the tokens left is over budget whatever the tokenizer makes of it (a tool that returns
        10 MB is not tokenised into gigabytes first)."""
        if chars > self.tokens_left * _longest_token_chars(self.tokenizer):
            self.truncated = True
            raise EpisodeEnd("token_budget")

    def _append_environment(self, ids: list[int], marker_ids: list[int], pictures: Sequence = (),
                            media: Optional[dict] = None) -> None:
        if len(ids) > self.tokens_left:
            self.truncated = True
            raise EpisodeEnd("token_budget")
        self.pictures += list(pictures)
        if media:
            self._media.append((len(self.response_ids), media))
        self._marker_ids += marker_ids
        self.response_ids += ids
        self.loss_mask += [False] * len(ids)
        self.log_probs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    async def call_tools(self, calls: Sequence, tool_role: str = "tool") -> list:
        """Runs tool calls (`lightrft.agents.tools.parse_tool_calls`) in the tool workers, adds
        each result as a tool message (`tool_role`) and returns the results. A call that hung or
        crashed its worker ends the episode (`EpisodeEnd("tool_timeout")` / `"tool_crash"`); a
        malformed call, an unknown tool, bad arguments or an exception inside the tool are
        reported to the policy in the tool message."""
        from lightrft.agents.tools import tool_message

        if self.tools is None:
            raise ValueError("call_tools() needs tools: declare them in the workflow's `tools` attribute")
        started = time.perf_counter()
        results = await asyncio.gather(*(self.tools.call(call) for call in calls))
        self.stats.env_seconds += time.perf_counter() - started
        self.stats.tool_calls += len(calls)
        self.stats.tool_errors += sum(1 for r in results if r.error)
        for result in results:
            if result.ends_episode:
                raise EpisodeEnd("tool_timeout" if result.error == "timeout" else "tool_crash")
        self.add_messages(*(tool_message(call, result, tool_role) for call, result in zip(calls, results)))
        return list(results)

    async def environment(self, fn: Callable, *args, **kwargs):
        """Runs a blocking environment call in a thread, timed under rollout/env_seconds. The
        thread is a daemon of its own, not the loop's executor: a call that never returns ends
        with its episode's --episode_timeout (its result, when it comes, is dropped) and holds up
        neither the rollout's end nor the process's exit."""
        started = time.perf_counter()
        try:
            return await _in_daemon_thread(fn, *args, **kwargs)
        finally:
            self.stats.env_seconds += time.perf_counter() - started


async def _in_daemon_thread(fn: Callable, *args, **kwargs):
    """`fn(*args, **kwargs)` on a daemon thread, awaited; cancelling the await leaves the thread to
    finish alone (`asyncio.to_thread` uses the loop's executor, whose threads the loop's shutdown
    and the interpreter's exit wait for)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    context = contextvars.copy_context()

    def settle(outcome: tuple[bool, Any]) -> None:
        if not future.done():
            (future.set_result if outcome[0] else future.set_exception)(outcome[1])

    def work() -> None:
        try:
            outcome = (True, context.run(fn, *args, **kwargs))
        except BaseException as err:       # handed to the awaiting episode
            outcome = (False, err)
        try:
            loop.call_soon_threadsafe(settle, outcome)
        except RuntimeError:               # the loop is closed: nobody waits for it any more
            pass

    threading.Thread(target=work, name="lightrft-environment", daemon=True).start()
    return await future


@dataclass
class EpisodeRecord:
    """A finished episode as the runner hands it on."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[bool]
    log_probs: list[float]
    reward: float
    turn_rewards: list[tuple[int, float]]      # (response position, reward)
    truncated: bool
    valid: bool
    stop_reason: str                           # "done", "max_turns", "token_budget", "tool_timeout", ...
    turns: int
    stats: EpisodeStats = field(default_factory=EpisodeStats)
    extra: dict = field(default_factory=dict)
    media: Optional[dict] = None               # the pictures' model inputs (prompt's and environment's), or None
    versions: Optional[list[int]] = None       # per response token, the policy version that sampled it (-1: the
    #                                            environment's); None unless the engine tags them (partial rollouts)
