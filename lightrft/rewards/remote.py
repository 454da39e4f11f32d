"""A client for HTTP reward servers, with bounded retries and an explicit failure policy.

Protocol (the one `lightrft.cli.serve_rm` and OpenRLHF's remote reward servers speak):

    POST <url>   {"query": [full texts], "prompts": [...], "labels": [...]}
    200          {"rewards": [float, ...]}     ({"scores": [...]} and a bare list are accepted too)

Failures are sorted into two kinds:

- transient (a timeout, a refused or reset connection, HTTP 5xx, HTTP 429 "too many requests"):
  retried up to `max_retries` times with exponential backoff and jitter;
- permanent (any other HTTP 4xx, a redirect, an answer over `max_response_bytes`, a body that is
  not JSON or nests too deeply to parse, the wrong number of scores, an entry that is not a
  number): not retried, the same request would fail the same way.

A request that still fails then follows `on_failure`: "error" raises `RewardSourceError`, "drop"
marks its samples invalid in the returned `RewardResult`. Scores that are NaN, infinite, null or
beyond the float32 range are invalid per sample: an error under "error", dropped samples under
"drop".

The server is not trusted: redirects are never followed (so credentials go to the configured
origin only), an answer is read only up to `max_response_bytes`, and `timeout` bounds the whole
request (connecting, sending and every byte of the answer), not each socket read.

Transport: one `httpx.AsyncClient` per client (pooled keep-alive connections), run on the
process's background event loop (`lightrft.utils.event_loop`): the requests of one batch go out
together, at most `max_concurrency` at a time, and a request past its deadline is cancelled
(`asyncio.wait_for`), which a per-read socket timeout cannot do against a server trickling bytes.

URLs in messages and logs never show credentials: `http://user:secret@host/?token=abc` appears as
`http://***@host/?token=***`.
"""

import asyncio
import base64
import json
import logging
import random
import urllib.parse
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lightrft.utils.secrets import redact_url  # noqa: F401  (re-exported: lightrft.rewards.redact_url)
from lightrft.rewards.base import (FailurePolicySource, RewardResult, RewardSourceError, check_batch_lengths,
                                   is_finite_number)
from lightrft.utils.event_loop import run_blocking

logger = logging.getLogger(__name__)

ON_FAILURE_POLICIES = ("error", "drop")
RETRYABLE_STATUS = 429  # plus every 5xx
DEFAULT_MAX_RESPONSE_BYTES = 64 * 2 ** 20  # a reward answer needs ~20 bytes per query; this is ~3M queries
ERROR_BODY_BYTES = 1024  # read of an HTTP error's body, for the message only
DEFAULT_MAX_CONCURRENCY = 4  # requests of one batch in flight at once
FLOAT32_MAX = torch.finfo(torch.float32).max


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


class _RetryableStatus(Exception):
    """A 5xx or 429 answer: the server may answer the same request later."""


class RemoteRequestFailure(Exception):
    """A request to a reward or judge server got no usable answer; the message is safe to show (no
    credentials). `timed_out` tells a deadline from other failures."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


class RemoteRewardClient(FailurePolicySource):
    """Scores samples with an HTTP reward server.

    Args:
        url: the server endpoint, e.g. `http://127.0.0.1:5000/get_reward`. User info in the URL
            (`http://user:pass@host/...`) is sent as HTTP basic authentication.
        timeout: seconds one request may take in all: connecting, sending and reading the whole
            answer (a deadline, so a server trickling bytes cannot stretch it).
        max_retries: how many times a transiently failed request is sent again.
        backoff: the first retry waits about `backoff` seconds, each next one twice as long (at
            most `max_backoff`), the wait drawn uniformly from [d/2, d] so ranks do not retry in
            step.
        on_failure: "error" raises `RewardSourceError`; "drop" returns a `RewardResult` whose
            `valid` mask is False for the samples that got no score.
        batch_size: queries per request; larger batches are sent in several requests.
        headers: extra HTTP headers (e.g. an API key); their values never appear in messages.
        max_response_bytes: the largest answer read; a longer one is refused (a failed request)
            as soon as its declared length, or the bytes read, pass the cap.
        max_concurrency: requests in flight at once (the chunks of one batch, or `post_many`'s
            bodies), and the connections kept open to the server.

    Redirects are refused, not followed: a reward server has no reason to redirect a POST, and
    following one would send the credentials and the queries wherever it points. The error names
    the target, so a moved server is fixed by changing the URL.
    """

    def __init__(self, url: str, timeout: float = 30.0, max_retries: int = 3, backoff: float = 0.5,
                 on_failure: str = "error", batch_size: int | None = 256, max_backoff: float = 10.0,
                 headers: dict[str, str] | None = None, max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
                 max_concurrency: int = DEFAULT_MAX_CONCURRENCY):
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
        if isinstance(max_response_bytes, bool) or not isinstance(max_response_bytes, int) or max_response_bytes < 1:
            raise ValueError(f"max_response_bytes must be a positive number of bytes, got {max_response_bytes!r}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
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
        self.max_response_bytes = max_response_bytes
        self.max_concurrency = max_concurrency
        self.stats = RemoteRewardStats()
        # identity: the byte cap counts what the server sends, and no decompression bomb is opened.
        self._headers = {"Content-Type": "application/json", "Accept-Encoding": "identity", **(headers or {})}
        if parts.username is not None:
            user = urllib.parse.unquote(parts.username)
            password = urllib.parse.unquote(parts.password or "")
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            self._headers["Authorization"] = f"Basic {token}"
            parts = parts._replace(netloc=parts.netloc.rsplit("@", 1)[1])
        self._request_url = urllib.parse.urlunsplit(parts)
        self._jitter = random.Random()  # retry spacing only, never training randomness
        self._http = None       # an httpx.AsyncClient, made on the background loop at first use
        self._http_loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"RemoteRewardClient({self.url!r}, on_failure={self.on_failure!r})"

    def score(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any],
              truncated: Sequence[bool] | None = None) -> RewardResult:
        """Rewards and validity of every sample; raises `RewardSourceError` under "error". The
        request carries "truncated" (per query: cut at the length limit) when it is known. The
        chunks of `batch_size` queries are sent together (`max_concurrency` at a time)."""
        check_batch_lengths(queries, prompts, labels)
        total = len(queries)
        rewards = torch.zeros(total, dtype=torch.float32)
        valid = torch.zeros(total, dtype=torch.bool)
        step = self.batch_size or max(total, 1)
        spans = [(start, min(start + step, total)) for start in range(0, total, step)]
        bodies = []
        for start, end in spans:
            payload = {"query": list(queries[start:end]), "prompts": list(prompts[start:end]),
                       "labels": list(labels[start:end])}
            if truncated is not None:
                payload["truncated"] = [bool(t) for t in truncated[start:end]]
            bodies.append(self._encode(payload))
        for (start, end), answer in zip(spans, self.post_many(bodies)):
            try:
                if isinstance(answer, RemoteRequestFailure):
                    raise answer
                scores = self._parse(answer, end - start)
            except RemoteRequestFailure as failure:
                self._fail(f"queries {start}..{end - 1}: {failure}", end - start)
                continue
            usable = [is_finite_number(s) and abs(s) <= FLOAT32_MAX for s in scores]
            for i, (score, ok) in enumerate(zip(scores, usable)):
                if ok:
                    rewards[start + i] = float(score)
                    valid[start + i] = True
            if not all(usable):
                bad = [start + i for i, ok in enumerate(usable) if not ok]
                self._fail(f"scores for queries {bad[:10]} are NaN, infinite, null or beyond the float32 range "
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

    def _encode(self, payload: dict) -> bytes:
        try:
            return json.dumps(payload).encode()
        except (TypeError, ValueError) as err:
            raise RewardSourceError(f"reward server {self.url}: labels and prompts must be JSON-serialisable "
                                    f"({err})") from None

    @staticmethod
    def _parse(answer: bytes, expected: int) -> list:
        """The raw score entries (numbers, or None/NaN/inf) of one answer to `expected` queries."""
        try:
            data = json.loads(answer, parse_int=_json_int)
        except RecursionError:
            raise RemoteRequestFailure("the answer nests lists or objects too deeply to parse (a reward answer is "
                                       "a flat list of numbers)") from None
        except ValueError as err:
            raise RemoteRequestFailure(f"the answer is not JSON: {_snippet(answer)} ({err})") from None
        if isinstance(data, dict):
            key = next((k for k in ("rewards", "scores") if k in data), None)
            if key is None:
                raise RemoteRequestFailure(f"the answer has no 'rewards' (or 'scores') entry; "
                                           f"keys: {sorted(data)[:10]}")
            data = data[key]
        if not isinstance(data, list):
            raise RemoteRequestFailure(f"the rewards must be a JSON list, got {type(data).__name__}")
        if len(data) != expected:
            raise RemoteRequestFailure(f"{len(data)} scores returned for {expected} queries")
        for i, score in enumerate(data):
            if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float))):
                raise RemoteRequestFailure(f"score {i} is not a number: {_describe(score)}")
        return data

    # ------------------------------------------------------------------ requests
    def post_with_retries(self, body: bytes) -> bytes:
        """POSTs `body` with the client's retries, deadline, size cap and redirect refusal; the answer's
        bytes, or `RemoteRequestFailure` after the last attempt."""
        answer = self.post_many([body])[0]
        if isinstance(answer, RemoteRequestFailure):
            raise answer
        return answer

    def post_many(self, bodies: Sequence[bytes]) -> list[bytes | RemoteRequestFailure]:
        """POSTs every body as `post_with_retries` does, `max_concurrency` at a time; each one's
        answer or failure, in order."""
        if not bodies:
            return []
        return run_blocking(self._post_all(list(bodies)))

    def close(self) -> None:
        """Closes the pooled connections (a later request opens new ones)."""
        if self._http is not None:
            http, self._http = self._http, None
            run_blocking(http.aclose())

    def _client(self):
        """The pooled `httpx.AsyncClient` of the running (background) loop."""
        import httpx    # here, not at the top: it takes ~0.15 s, and lightrft.config imports this module

        loop = asyncio.get_running_loop()
        if self._http is None or self._http_loop is not loop:
            limits = httpx.Limits(max_connections=self.max_concurrency,
                                  max_keepalive_connections=self.max_concurrency)
            self._http = httpx.AsyncClient(follow_redirects=False, timeout=httpx.Timeout(self.timeout),
                                           limits=limits)
            self._http_loop = loop
        return self._http

    async def _post_all(self, bodies: list[bytes]) -> list[bytes | RemoteRequestFailure]:
        gate = asyncio.Semaphore(self.max_concurrency)

        async def post(body: bytes) -> bytes | RemoteRequestFailure:
            async with gate:
                try:
                    return await self._post_with_retries(body)
                except RemoteRequestFailure as failure:
                    return failure

        return list(await asyncio.gather(*(post(body) for body in bodies)))

    async def _post_with_retries(self, body: bytes) -> bytes:
        import httpx

        attempt = 0
        while True:
            self.stats.requests += 1
            timed_out = False
            try:
                return await asyncio.wait_for(self._post(body), self.timeout)
            except _RetryableStatus as err:
                cause = str(err)
            except httpx.ConnectTimeout:
                cause, timed_out = f"no connection within timeout={self.timeout}s", True
            except (TimeoutError, httpx.TimeoutException):
                cause = f"no answer within timeout={self.timeout}s (the whole answer must arrive within it)"
                timed_out = True
            except httpx.ConnectError as err:
                cause = f"connection failed: {err}"
            except (httpx.TransportError, OSError) as err:       # a reset or a broken answer
                cause = f"connection error: {type(err).__name__}: {err}"
            if attempt == self.max_retries:
                raise RemoteRequestFailure(f"{cause} (gave up after {attempt + 1} attempts)", timed_out)
            self.stats.retries += 1
            wait = retry_wait(attempt, self.backoff, self.max_backoff, self._jitter)
            logger.warning("reward server %s: %s; retry %d/%d in %.2fs", self.url, cause, attempt + 1,
                           self.max_retries, wait)
            await asyncio.sleep(wait)
            attempt += 1

    async def _post(self, body: bytes) -> bytes:
        """One POST; its answer read whole within `max_response_bytes` (the caller bounds the time)."""
        async with self._client().stream("POST", self._request_url, content=body, headers=self._headers) as response:
            if not 200 <= response.status_code < 300:
                await self._refuse_status(response)
            cap = self.max_response_bytes
            declared = response.headers.get("Content-Length", "")
            if declared.isascii() and declared.isdigit() and int(declared) > cap:
                raise RemoteRequestFailure(f"the answer is {int(declared)} bytes, over max_response_bytes={cap}; "
                                           "refused unread (is the URL a reward server?)")
            answer = bytearray()
            async for block in response.aiter_raw():
                answer += block
                if len(answer) > cap:
                    raise RemoteRequestFailure(f"the answer is over max_response_bytes={cap}; refused after reading "
                                               f"{len(answer)} bytes (is the URL a reward server?)")
            return bytes(answer)

    async def _refuse_status(self, response) -> None:
        """Raises `_RetryableStatus` for a 5xx or 429 answer (an `httpx.Response`), `RemoteRequestFailure`
        for any other."""
        import httpx

        code, reason = response.status_code, response.reason_phrase
        if 300 <= code < 400:
            target = _redirect_target(self._request_url, response.headers.get("Location"))
            raise RemoteRequestFailure(f"HTTP {code} redirect to {target}: redirects are not followed (the "
                                       f"request and its credentials go to {self.url} only); if the server moved, "
                                       "give its new URL (--remote_rm_url)")
        head = bytearray()
        try:
            async for block in response.aiter_raw():
                head += block
                if len(head) >= ERROR_BODY_BYTES:
                    break
        except httpx.TransportError:
            pass                        # the message goes without the body
        detail = _snippet(bytes(head[:ERROR_BODY_BYTES]))
        if code < 500 and code != RETRYABLE_STATUS:
            raise RemoteRequestFailure(f"HTTP {code} {reason}: {detail} (client errors are not retried)")
        raise _RetryableStatus(f"HTTP {code} {reason}: {detail}")


def _json_int(text: str) -> int | float:
    """A JSON integer; one too long for any float32 reward is read as a float (large or inf), which
    the range check makes one invalid sample, instead of an int that overflows on conversion or
    passes Python's 4300-digit parsing limit (which would fail the whole answer)."""
    return int(text) if len(text) <= 40 else float(text)


def _redirect_target(base: str, location: str | None) -> str:
    """The redirect's target as it may be shown (credentials and query values redacted)."""
    if not location:
        return "(no Location header)"
    try:
        return redact_url(urllib.parse.urljoin(base, location.strip()))[:300]
    except ValueError:
        return "(an unreadable Location header)"


def _describe(value: Any) -> str:
    """A short description of a JSON value, safe for any size or depth."""
    if isinstance(value, list):
        return f"a list of {len(value)} entries"
    if isinstance(value, dict):
        return f"an object with {len(value)} keys"
    if isinstance(value, str):
        return _snippet(value[:100].encode(), limit=50)
    return json.dumps(value)


def _snippet(body: bytes, limit: int = 200) -> str:
    text = bytes(body[:4 * limit]).decode("utf-8", errors="replace").strip()
    return repr(text if len(text) <= limit else text[:limit] + "...")
