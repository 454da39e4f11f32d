"""A client for HTTP reward servers, with bounded retries and an explicit failure policy.

Protocol (the one `lightrft.cli.serve_rm` and OpenRLHF's remote reward servers speak):

    POST <url>   {"query": [full texts], "prompts": [...], "labels": [...]}
    200          {"rewards": [float, ...]}     ({"scores": [...]} and a bare list are accepted too)

Failures are sorted into two kinds:

- transient (a timeout, a refused or reset connection, HTTP 5xx, HTTP 429 "too many requests"):
  retried up to `max_retries` times with exponential backoff and jitter;
- permanent (any other HTTP 4xx, a body that is not JSON, the wrong number of scores, an entry
  that is not a number): not retried, the same request would fail the same way.

A request that still fails then follows `on_failure`: "error" raises `RewardSourceError`, "drop"
marks its samples invalid in the returned `RewardResult`. Scores that are NaN, infinite or null
are invalid per sample: an error under "error", dropped samples under "drop".

URLs in messages and logs never show credentials: `http://user:secret@host/?token=abc` appears as
`http://***@host/?token=***`.
"""

import base64
import http.client
import json
import logging
import random
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lightrft.rewards.base import (FailurePolicySource, RewardResult, RewardSourceError, check_batch_lengths,
                                   is_finite_number)

logger = logging.getLogger(__name__)

ON_FAILURE_POLICIES = ("error", "drop")
RETRYABLE_STATUS = 429  # plus every 5xx


def redact_url(url: str) -> str:
    """The URL with user info and every query value replaced by `***`, and no fragment."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = "&".join(f"{key}=***" for key, _ in urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def retry_wait(attempt: int, backoff: float, max_backoff: float, rng: random.Random) -> float:
    """Seconds to wait before retry `attempt + 1`: exponential backoff with jitter, drawn
    uniformly from [d/2, d] with d = min(max_backoff, backoff * 2^attempt)."""
    delay = min(max_backoff, backoff * 2 ** attempt)
    return delay / 2 + rng.uniform(0, delay / 2)


@dataclass
class RemoteRewardStats:
    """Counters since the client was built, for logging."""

    requests: int = 0  # HTTP requests sent, retries included
    retries: int = 0  # requests sent again after a transient failure
    failures: int = 0  # chunks that came back without a usable score for some sample
    dropped: int = 0  # samples returned invalid under on_failure="drop"

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class _ChunkFailure(Exception):
    """One chunk got no scores; the message is safe to show (no credentials)."""


class RemoteRewardClient(FailurePolicySource):
    """Scores samples with an HTTP reward server.

    Args:
        url: the server endpoint, e.g. `http://127.0.0.1:5000/get_reward`. User info in the URL
            (`http://user:pass@host/...`) is sent as HTTP basic authentication.
        timeout: seconds to wait for the connection and for each read of the answer.
        max_retries: how many times a transiently failed request is sent again.
        backoff: the first retry waits about `backoff` seconds, each next one twice as long (at
            most `max_backoff`), the wait drawn uniformly from [d/2, d] so ranks do not retry in
            step.
        on_failure: "error" raises `RewardSourceError`; "drop" returns a `RewardResult` whose
            `valid` mask is False for the samples that got no score.
        batch_size: queries per request; larger batches are sent in several requests.
        headers: extra HTTP headers (e.g. an API key); their values never appear in messages.
    """

    def __init__(self, url: str, timeout: float = 30.0, max_retries: int = 3, backoff: float = 0.5,
                 on_failure: str = "error", batch_size: int | None = 256, max_backoff: float = 10.0,
                 headers: dict[str, str] | None = None):
        if on_failure not in ON_FAILURE_POLICIES:
            raise ValueError(f"on_failure must be one of {ON_FAILURE_POLICIES} (--reward_on_failure), "
                             f"got {on_failure!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive (--reward_timeout), got {timeout}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0 (--reward_retries), got {max_retries}")
        if backoff < 0 or max_backoff < 0:
            raise ValueError(f"backoff and max_backoff must be >= 0, got {backoff} and {max_backoff}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"reward server URL must look like http(s)://host[:port]/path, got {redact_url(url)}")
        self.url = redact_url(url)  # safe to show
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.on_failure = on_failure
        self.batch_size = batch_size
        self.stats = RemoteRewardStats()
        self._headers = {"Content-Type": "application/json", **(headers or {})}
        if parts.username is not None:
            user = urllib.parse.unquote(parts.username)
            password = urllib.parse.unquote(parts.password or "")
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            self._headers["Authorization"] = f"Basic {token}"
            parts = parts._replace(netloc=parts.netloc.rsplit("@", 1)[1])
        self._request_url = urllib.parse.urlunsplit(parts)
        self._jitter = random.Random()  # retry spacing only, never training randomness

    def __repr__(self) -> str:
        return f"RemoteRewardClient({self.url!r}, on_failure={self.on_failure!r})"

    def score(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any],
              truncated: Sequence[bool] | None = None) -> RewardResult:
        """Rewards and validity of every sample; raises `RewardSourceError` under "error". The
        request carries "truncated" (per query: cut at the length limit) when it is known."""
        check_batch_lengths(queries, prompts, labels)
        total = len(queries)
        rewards = torch.zeros(total, dtype=torch.float32)
        valid = torch.zeros(total, dtype=torch.bool)
        step = self.batch_size or max(total, 1)
        for start in range(0, total, step):
            end = min(start + step, total)
            payload = {"query": list(queries[start:end]), "prompts": list(prompts[start:end]),
                       "labels": list(labels[start:end])}
            if truncated is not None:
                payload["truncated"] = [bool(t) for t in truncated[start:end]]
            try:
                scores = self._score_chunk(payload)
            except _ChunkFailure as failure:
                self._fail(f"queries {start}..{end - 1}: {failure}", end - start)
                continue
            finite = [is_finite_number(s) for s in scores]
            for i, (score, ok) in enumerate(zip(scores, finite)):
                if ok:
                    rewards[start + i] = float(score)
                    valid[start + i] = True
            if not all(finite):
                bad = [start + i for i, ok in enumerate(finite) if not ok]
                self._fail(f"scores for queries {bad[:10]} are NaN, infinite or null "
                           f"({[scores[i - start] for i in bad[:10]]})", len(bad))
        return RewardResult(rewards, valid)

    def _fail(self, reason: str, num_samples: int) -> None:
        """Applies the failure policy to `num_samples` samples that got no score."""
        self.stats.failures += 1
        message = f"reward server {self.url}: {reason}"
        if self.on_failure == "error":
            raise RewardSourceError(message + " (on_failure='error'; use 'drop' to train on without these samples)")
        self.stats.dropped += num_samples
        logger.warning("%s; dropping %d samples (on_failure='drop')", message, num_samples)

    def _score_chunk(self, payload: dict) -> list:
        """Posts one chunk and returns its raw score entries (numbers, or None/NaN/inf)."""
        try:
            body = json.dumps(payload).encode()
        except (TypeError, ValueError) as err:
            raise RewardSourceError(f"reward server {self.url}: labels and prompts must be JSON-serialisable "
                                    f"({err})") from None
        answer = self._post_with_retries(body)
        try:
            data = json.loads(answer)
        except ValueError:
            raise _ChunkFailure(f"the answer is not JSON: {_snippet(answer)}") from None
        if isinstance(data, dict):
            key = next((k for k in ("rewards", "scores") if k in data), None)
            if key is None:
                raise _ChunkFailure(f"the answer has no 'rewards' (or 'scores') entry; keys: {sorted(data)}")
            data = data[key]
        if not isinstance(data, list):
            raise _ChunkFailure(f"the rewards must be a JSON list, got {type(data).__name__}")
        expected = len(payload["query"])
        if len(data) != expected:
            raise _ChunkFailure(f"{len(data)} scores returned for {expected} queries")
        for i, score in enumerate(data):
            if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float))):
                raise _ChunkFailure(f"score {i} is not a number: {_snippet(json.dumps(score).encode())}")
        return data

    def _post_with_retries(self, body: bytes) -> bytes:
        attempt = 0
        while True:
            self.stats.requests += 1
            request = urllib.request.Request(self._request_url, data=body, headers=self._headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return response.read()
            except urllib.error.HTTPError as err:
                detail = _snippet(_read_error_body(err))
                if err.code < 500 and err.code != RETRYABLE_STATUS:
                    raise _ChunkFailure(f"HTTP {err.code} {err.reason}: {detail} "
                                        "(client errors are not retried)") from None
                cause = f"HTTP {err.code} {err.reason}: {detail}"
            except TimeoutError:
                cause = f"no answer within timeout={self.timeout}s"
            except urllib.error.URLError as err:
                if isinstance(err.reason, TimeoutError):
                    cause = f"no connection within timeout={self.timeout}s"
                else:
                    cause = f"connection failed: {err.reason}"
            except (ConnectionError, http.client.HTTPException, OSError) as err:
                cause = f"connection error: {type(err).__name__}: {err}"
            if attempt == self.max_retries:
                raise _ChunkFailure(f"{cause} (gave up after {attempt + 1} attempts)")
            self.stats.retries += 1
            wait = retry_wait(attempt, self.backoff, self.max_backoff, self._jitter)
            logger.warning("reward server %s: %s; retry %d/%d in %.2fs", self.url, cause, attempt + 1,
                           self.max_retries, wait)
            time.sleep(wait)
            attempt += 1


def _read_error_body(err: urllib.error.HTTPError) -> bytes:
    try:
        return err.read()
    except (OSError, http.client.HTTPException):
        return b""


def _snippet(body: bytes, limit: int = 200) -> str:
    text = body.decode("utf-8", errors="replace").strip()
    return repr(text if len(text) <= limit else text[:limit] + "...")
