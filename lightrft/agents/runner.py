"""Runs a workflow's episodes for a rollout batch, their turns batched across episodes.

Every episode of the batch (prompts x G) runs as a coroutine. When every unfinished episode is
waiting for the policy, their requests go to the engine as one `generate` call (one per distinct
token limit), each request with its own seed: the seed of sample j of prompt i
(`lightrft.rollout.seeds`) mixed with the turn's number. Batches therefore form the same way
whatever the tools' timing, and each turn's samples do not depend on the batch, so a run (and a
resumed run) draws the same episodes. Tools run in worker processes meanwhile (`ToolRunner`).

The result is one `RolloutOutput` row per episode (`RolloutOutput.from_episodes`: the environment's
tokens are holes of the loss mask) and a `RewardBatch` with the workflow's rewards, per-turn
rewards as token rewards, and per-episode numbers (turns, tool calls, ...) for the logs.
"""

import asyncio
import contextlib
import dataclasses
import logging
import math
import sys
import threading
import time
import traceback
from collections import Counter
from typing import Optional, Sequence

import torch

from lightrft.agents.episode import ChatRenderer, Episode, EpisodeEnd, EpisodeRecord
from lightrft.rewards.batch import RewardBatch
from lightrft.rollout.base import RolloutOutput, SamplingParams
from lightrft.rollout.seeds import mix_seed, sample_seed

logger = logging.getLogger(__name__)


class WorkflowFailed(RuntimeError):
    """Every episode of a rollout failed in the user's workflow: the run stops with one line naming
    the workflow and the first failure (the command line prints it without lightrft's traceback)."""


def failure_line(error: str) -> str:
    """One line for an episode's error text: a traceback's exception line and the place it was
    raised ("ValueError: broken (my_workflow.py, line 12, in run)"); other text as it is."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    if not lines or not lines[0].startswith("Traceback"):
        return " ".join(lines)
    frames = [line for line in lines if line.startswith('File "')]
    where = ""
    if frames:
        path, _, rest = frames[-1][len('File "'):].partition('"')
        where = f" ({path.rsplit('/', 1)[-1]}{rest})"
    return lines[-1] + where


def finite_float(value: int | float) -> bool:
    """Whether a number is finite as a float: NaN, infinity and integers too large for a float
    (10**400, on which `math.isfinite` raises OverflowError) are not."""
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _number(value) -> float:
    """A workflow's logged value as a float (a one-element tensor too); non-numbers count as NaN."""
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError):
        return math.nan


@dataclasses.dataclass
class AgentBatch:
    rollout: RolloutOutput
    rewards: RewardBatch
    records: list[EpisodeRecord]
    unscored: torch.Tensor          # (B,) bool: the workflow returned None, the run's reward sources score these


class EpisodeDeadline:
    """An episode's --episode_timeout: seconds it may spend outside generation (its workflow code,
    tools and environment), paused while it waits for the policy, whose time is bounded by the
    token limits and shared by the whole batch. Expiry cancels the episode's task (`hit` says why);
    None: no deadline."""

    def __init__(self, seconds: Optional[float]):
        self.left, self.hit = seconds, False
        self._handle = self._started = None

    def resume(self) -> None:
        if self.left is None or self._handle is not None:
            return
        loop = asyncio.get_running_loop()
        self._started = loop.time()
        self._handle = loop.call_later(max(self.left, 0.0), self._expire, asyncio.current_task())

    def pause(self) -> None:
        if self._handle is None:
            return
        self._handle.cancel()
        self._handle = None
        self.left -= asyncio.get_running_loop().time() - self._started

    def _expire(self, task) -> None:
        self._handle = None
        self.hit = True
        task.cancel()


class LoopWatchdog:
    """While its block runs, a daemon thread checks that the event loop turns (a callback it
    schedules every second runs); when it has not for `blocked_seconds`, it logs a warning once per
    stall naming the workflow, its file and the main thread's innermost frames: a workflow that
    calls blocking code (time.sleep, a synchronous request) in `run` stalls every episode, and no
    deadline can end it until the call returns."""

    def __init__(self, workflow, blocked_seconds: float):
        self.workflow, self.blocked_seconds = workflow, blocked_seconds
        self.stalls = 0
        self._generating = False
        self._beat = time.monotonic()
        self._stop = threading.Event()

    def _tick(self) -> None:
        self._beat = time.monotonic()
        if not self._stop.is_set():
            self._handle = self._loop.call_later(1.0, self._tick)

    @contextlib.contextmanager
    def generating(self):
        """The policy's generation runs in the loop's thread on purpose: not a stall."""
        self._generating = True
        try:
            yield
        finally:
            self._beat = time.monotonic()
            self._generating = False

    def _watch(self, main_id: int) -> None:
        reported = False
        while not self._stop.wait(1.0):
            stalled = 0.0 if self._generating else time.monotonic() - self._beat
            if stalled < self.blocked_seconds:
                reported = False
            elif not reported:
                reported = True
                self.stalls += 1
                frame = sys._current_frames().get(main_id)
                where = "".join(traceback.format_stack(frame, limit=4)) if frame is not None else "(unknown)\n"
                source = getattr(self.workflow, "source_file", None) or type(self.workflow).__module__
                logger.warning(f"--workflow {type(self.workflow).__name__} ({source}) has blocked the event loop for "
                               f"{stalled:.0f} s: every episode waits, and no deadline can end them. A workflow's "
                               "run() must await (asyncio.sleep, an async client, episode.call_tool), not block. "
                               f"The main thread is at:\n{where}")

    def __enter__(self) -> "LoopWatchdog":
        self._loop = asyncio.get_running_loop()
        self._beat = time.monotonic()
        self._handle = self._loop.call_later(1.0, self._tick)
        self._thread = threading.Thread(target=self._watch, args=(threading.get_ident(),), daemon=True,
                                        name="lightrft-loop-watchdog")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._handle.cancel()
        self._thread.join(timeout=5)


class WorkflowRunner:
    """Runs `workflow` over rollout batches with a rollout engine (see the module docstring).

    `max_episode_tokens` bounds an episode's response tokens (turns and environment together);
    `episode_timeout` its wall-clock seconds (None: no deadline); `tools` is the `ToolRunner` of the
    workflow's tools, or None. While episodes run, a watchdog thread reports an event loop that has
    not turned for `blocked_seconds` (a workflow calling blocking code in `run`), naming the
    workflow and where it is stuck: no deadline can end an episode while the loop is blocked."""

    def __init__(self, workflow, tokenizer, *, max_turns: int, max_episode_tokens: Optional[int],
                 eos_token_ids: Sequence[int], tools=None, episode_timeout: Optional[float] = None,
                 blocked_seconds: float = 60.0, images=None, max_images: Optional[int] = None):
        self.workflow, self.tokenizer, self.tools = workflow, tokenizer, tools
        # A vision-language run's `ImagePrompts`: environment messages may then show pictures, at
        # most `max_images` in one episode with the prompt's (--max_images_per_prompt).
        self.images, self.max_images = images, max_images
        self.max_turns, self.max_episode_tokens = max_turns, max_episode_tokens
        self.episode_timeout, self.blocked_seconds = episode_timeout, blocked_seconds
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        self.renderer = ChatRenderer(tokenizer, self.eos_token_ids) if getattr(tokenizer, "chat_template", None) \
            else None
        workflow.setup(tokenizer)
        self.errors_logged = 0

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()

    # ------------------------------------------------------------------------------------- engine
    def _generate(self, engine, requests: list, params: SamplingParams) -> None:
        """Answers `requests` ((ids, limit, seed, future, episode) each) with one engine call per
        limit; the episodes' pictures go with their sequences."""
        by_limit: dict[int, list] = {}
        for request in requests:
            by_limit.setdefault(request[1], []).append(request)
        for limit, group in sorted(by_limit.items()):
            turn_params = dataclasses.replace(params, n=1, max_new_tokens=limit,
                                              min_new_tokens=min(params.min_new_tokens, limit))
            episodes = [request[4] for request in group]
            inputs = {}
            if any(episode.pictures for episode in episodes):
                inputs = {"media": [episode.media() for episode in episodes],
                          "images": [episode.engine_images() for episode in episodes]}
            out = engine.generate([ids for ids, *_ in group], turn_params, seeds=[request[2] for request in group],
                                  **inputs)
            lengths = out.action_mask.sum(dim=1).tolist()
            responses, log_probs = out.responses.tolist(), out.rollout_log_probs.tolist()
            truncated = out.truncated.tolist() if out.truncated is not None else [False] * len(group)
            versions = out.versions.tolist() if out.versions is not None else None     # partial rollouts
            for row, (_, _, _, future, _) in enumerate(group):
                n = lengths[row]
                future.set_result((responses[row][:n], log_probs[row][:n], bool(truncated[row]),
                                   None if versions is None else versions[row][:n]))

    async def _drive(self, engine, episodes: list[Episode], seeds: list[int], params: SamplingParams) -> list:
        loop = asyncio.get_running_loop()
        pending: list = []
        wake = asyncio.Event()
        unfinished = len(episodes)

        def make_request(episode: Episode, episode_seed: int):
            async def request(ids: list[int], limit: int, turn: int):
                future = loop.create_future()
                pending.append((ids, limit, mix_seed(episode_seed, turn), future, episode))
                wake.set()
                episode._deadline.pause()          # waiting for the policy does not count
                try:
                    return await future
                finally:
                    episode._deadline.resume()
            return request

        async def run(episode: Episode):
            nonlocal unfinished
            try:
                return await self._run_episode(episode)
            finally:
                unfinished -= 1
                wake.set()

        for episode, seed in zip(episodes, seeds):
            episode._request = make_request(episode, seed)
            episode._deadline = EpisodeDeadline(self.episode_timeout)
        tasks = [asyncio.ensure_future(run(episode)) for episode in episodes]
        with LoopWatchdog(self.workflow, self.blocked_seconds) as watchdog:
            while unfinished:
                await wake.wait()
                wake.clear()
                # A request whose episode hit its deadline while waiting was cancelled: not generated.
                pending[:] = [request for request in pending if not request[3].done()]
                if pending and len(pending) == unfinished:
                    batch = list(pending)
                    pending.clear()
                    try:
                        with watchdog.generating():
                            self._generate(engine, batch, params)
                    except BaseException as err:
                        for _, _, _, future, _ in batch:
                            future.set_exception(err)
                        await asyncio.gather(*tasks, return_exceptions=True)
                        raise
            return await asyncio.gather(*tasks)

    # ------------------------------------------------------------------------------------ episode
    async def _run_episode(self, episode: Episode) -> EpisodeRecord:
        stop, valid, reward = "done", True, None
        name = type(self.workflow).__name__
        deadline = episode._deadline
        deadline.resume()
        try:
            reward = await self.workflow.run(episode)
        except EpisodeEnd as end:
            stop, reward = end.reason, self.workflow.reward_on_end
        except asyncio.CancelledError:
            if not deadline.hit:
                raise
            stop, reward = "episode_timeout", self.workflow.reward_on_end
        except SystemExit as exit_:       # would end the whole run with its code, nothing saved
            stop, valid, reward = "workflow_error", False, 0.0
            episode.extra["error"] = (f"{name}.run called sys.exit({exit_.code!r}); end an episode by returning its "
                                      "reward or raising lightrft.agents.EpisodeEnd, never by exiting the process")
        except Exception:                                       # a bug in the workflow: this episode only
            stop, valid, reward = "workflow_error", False, 0.0
            episode.extra["error"] = traceback.format_exc()
        finally:
            deadline.pause()
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
            stop, valid = "workflow_error", False
            episode.extra["error"] = (f"{name}.run returned {type(reward).__name__}; it must return a number (the "
                                      "episode's reward) or None (scored by --remote_rm_url)")
            reward = 0.0
        elif reward is not None and not finite_float(reward):
            stop, valid = "workflow_error", False
            shown = reward if isinstance(reward, float) else f"an integer of {len(str(abs(reward)))} digits"
            episode.extra["error"] = (f"{name}.run returned the reward {shown}; return a finite number, or None to "
                                      "have --remote_rm_url score the episode")
            reward = 0.0
        # The environment's tokens after the last turn neither train nor condition anything: drop them.
        kept = max((i + 1 for i, trains in enumerate(episode.loss_mask) if trains), default=0)
        turn_rewards = [(end, turn.reward) for end, turn in zip(episode.turn_ends, episode.turns)
                        if turn.reward is not None and end < kept]
        if kept == 0:
            valid = False       # no turn: nothing to train
        return EpisodeRecord(prompt_ids=episode.prompt_ids, response_ids=episode.response_ids[:kept],
                             media=episode.media(before=kept),
                             loss_mask=episode.loss_mask[:kept], log_probs=episode.log_probs[:kept],
                             versions=episode.versions[:kept] if any(v >= 0 for v in episode.versions) else None,
                             reward=math.nan if reward is None else float(reward), turn_rewards=turn_rewards,
                             truncated=episode.truncated or stop in ("max_turns", "token_budget"), valid=valid,
                             stop_reason=stop, turns=len(episode.turns), stats=episode.stats, extra=episode.extra)

    def episodes(self, prompt_ids: list[list[int]], prompts: list, labels: Optional[list],
                 params: SamplingParams) -> list[Episode]:
        labels = labels if labels is not None else [None] * len(prompts)
        max_tokens = self.max_episode_tokens or self.max_turns * params.max_new_tokens
        return [Episode(prompt=prompt, label=label, prompt_ids=ids, tokenizer=self.tokenizer, request=None,
                        max_turns=self.max_turns, max_tokens=max_tokens, max_new_tokens=params.max_new_tokens,
                        renderer=self.renderer, tools=self.tools, index=i, sample=j, images=self.images,
                        max_images=self.max_images)
                for i, (prompt, label, ids) in enumerate(zip(prompts, labels, prompt_ids)) for j in range(params.n)]

    def run(self, engine, prompt_ids: list[list[int]], prompts: list, labels: Optional[list],
            params: SamplingParams, seeds: list[int]) -> AgentBatch:
        """G = `params.n` episodes per prompt (rows i*G ... i*G + G - 1), prompt i's episode j
        seeded by `sample_seed(seeds[i], j)`."""
        episodes = self.episodes(prompt_ids, prompts, labels, params)
        episode_seeds = [sample_seed(seeds[e.index], e.sample) for e in episodes]
        records = asyncio.run(self._drive(engine, episodes, episode_seeds, params))
        self._report_errors(records)
        return self.batch(records)

    def _report_errors(self, records: list[EpisodeRecord]) -> None:
        failed = [r for r in records if r.stop_reason == "workflow_error"]
        if failed and len(failed) == len(records):
            first = failed[0].extra.get("error", "")
            logger.error("the first failed episode of --workflow %s:\n%s", type(self.workflow).__name__, first)
            raise WorkflowFailed(f"--workflow {type(self.workflow).__name__}: every episode of this rollout failed "
                                 f"({len(failed)} of {len(records)}), so nothing can train; the first: "
                                 f"{failure_line(first)}")
        if failed and self.errors_logged < 3:
            self.errors_logged += 1
            logger.warning("%d of %d episodes failed in the workflow (they do not train); the first one:\n%s",
                           len(failed), len(records), failed[0].extra.get("error", ""))

    def batch(self, records: list[EpisodeRecord]) -> AgentBatch:
        """The episodes as one rollout (rows in order) with their rewards and logged numbers."""
        rollout = RolloutOutput.from_episodes([r.prompt_ids for r in records], [r.response_ids for r in records],
                                              [r.loss_mask for r in records], [r.log_probs for r in records],
                                              [r.truncated for r in records], self.pad_token_id)
        if any(r.media for r in records):
            rollout = dataclasses.replace(rollout, media=[r.media for r in records])
        if any(r.versions is not None for r in records):      # partial rollouts: each token's version
            versions = torch.full(rollout.action_mask.shape, -1, dtype=torch.int32)
            for row, record in enumerate(records):
                if record.versions is not None:
                    versions[row, :len(record.versions)] = torch.tensor(record.versions, dtype=torch.int32)
            rollout = dataclasses.replace(rollout, versions=versions)
        token_rewards = None
        if any(r.turn_rewards for r in records):
            token_rewards = torch.zeros(rollout.action_mask.shape, dtype=torch.float32)
            for row, record in enumerate(records):
                for position, value in record.turn_rewards:
                    token_rewards[row, position] += value
        unscored = torch.tensor([math.isnan(r.reward) and r.stop_reason == "done" for r in records])
        scores = torch.tensor([0.0 if u else r.reward for r, u in zip(records, unscored.tolist())])
        info = {
            "turns": [r.turns for r in records],
            "tool_calls": [r.stats.tool_calls for r in records],
            "tool_errors": [r.stats.tool_errors for r in records],
            "env_seconds": [r.stats.env_seconds for r in records],
            "ended_early": [r.stop_reason not in ("done", "workflow_error") for r in records],
            "episode_timeout": [r.stop_reason == "episode_timeout" for r in records],
            "tool_failure": [r.stop_reason in ("tool_timeout", "tool_crash") for r in records],
            "workflow_error": [r.stop_reason == "workflow_error" for r in records],
            **{key: [_number(r.extra.get(key, 0.0)) for r in records] for key in self.workflow.metrics},
        }
        rewards = RewardBatch(scores=scores.float(), valid=torch.tensor([r.valid for r in records]),
                              token_rewards=token_rewards,
                              info={k: torch.tensor(v, dtype=torch.float32) for k, v in info.items()})
        return AgentBatch(rollout, rewards, records, unscored)

    @staticmethod
    def stop_reasons(records: list[EpisodeRecord]) -> dict[str, int]:
        return dict(Counter(r.stop_reason for r in records))
