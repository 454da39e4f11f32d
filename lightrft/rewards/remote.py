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

URLs in messages and logs never show credentials: `http://user:secret@host/?token=abc` appears as
`http://***@host/?token=***`.
"""

import base64
import functools
import http.client
import io
import json
import logging
import random
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lightrft.utils.secrets import redact_url  # noqa: F401  (re-exported: lightrft.rewards.redact_url)
from lightrft.rewards.base import (FailurePolicySource, RewardResult, RewardSourceError, check_batch_lengths,
                                   is_finite_number)

logger = logging.getLogger(__name__)

ON_FAILURE_POLICIES = ("error", "drop")
RETRYABLE_STATUS = 429  # plus every 5xx
DEFAULT_MAX_RESPONSE_BYTES = 64 * 2 ** 20  # a reward answer needs ~20 bytes per query; this is ~3M queries
ERROR_BODY_BYTES = 1024  # read of an HTTP error's body, for the message only
READ_BLOCK_BYTES = 2 ** 16
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

    Redirects are refused, not followed: a reward server has no reason to redirect a POST, and
    following one would send the credentials and the queries wherever it points. The error names
    the target, so a moved server is fixed by changing the URL.
    """

    def __init__(self, url: str, timeout: float = 30.0, max_retries: int = 3, backoff: float = 0.5,
                 on_failure: str = "error", batch_size: int | None = 256, max_backoff: float = 10.0,
                 headers: dict[str, str] | None = None, max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES):
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
        self._opener = urllib.request.build_opener(_RefuseRedirects, _DeadlineHTTPHandler, _DeadlineHTTPSHandler)

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

    def _score_chunk(self, payload: dict) -> list:
        """Posts one chunk and returns its raw score entries (numbers, or None/NaN/inf)."""
        try:
            body = json.dumps(payload).encode()
        except (TypeError, ValueError) as err:
            raise RewardSourceError(f"reward server {self.url}: labels and prompts must be JSON-serialisable "
                                    f"({err})") from None
        answer = self.post_with_retries(body)
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
        expected = len(payload["query"])
        if len(data) != expected:
            raise RemoteRequestFailure(f"{len(data)} scores returned for {expected} queries")
        for i, score in enumerate(data):
            if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float))):
                raise RemoteRequestFailure(f"score {i} is not a number: {_describe(score)}")
        return data

    def post_with_retries(self, body: bytes) -> bytearray:
        """POSTs `body` with the client's retries, deadline, size cap and redirect refusal; the answer's
        bytes, or `RemoteRequestFailure` after the last attempt."""
        attempt = 0
        while True:
            self.stats.requests += 1
            timed_out = False
            try:
                return self._post(body)
            except urllib.error.HTTPError as err:
                cause = self._http_error(err)
            except TimeoutError:
                cause = f"no answer within timeout={self.timeout}s (the whole answer must arrive within it)"
                timed_out = True
            except urllib.error.URLError as err:
                timed_out = isinstance(err.reason, TimeoutError)
                cause = (f"no connection within timeout={self.timeout}s" if timed_out
                         else f"connection failed: {err.reason}")
            except (ConnectionError, http.client.HTTPException, OSError) as err:
                cause = f"connection error: {type(err).__name__}: {err}"
            if attempt == self.max_retries:
                raise RemoteRequestFailure(f"{cause} (gave up after {attempt + 1} attempts)", timed_out)
            self.stats.retries += 1
            wait = retry_wait(attempt, self.backoff, self.max_backoff, self._jitter)
            logger.warning("reward server %s: %s; retry %d/%d in %.2fs", self.url, cause, attempt + 1,
                           self.max_retries, wait)
            time.sleep(wait)
            attempt += 1

    def _post(self, body: bytes) -> bytearray:
        """One POST; its answer read whole, all of it within `timeout` and `max_response_bytes`."""
        request = _TimedRequest(self._request_url, data=body, headers=self._headers, method="POST",
                                deadline=time.monotonic() + self.timeout)
        with self._opener.open(request, timeout=self.timeout) as response:
            cap = self.max_response_bytes
            declared = response.headers.get("Content-Length", "")
            if declared.isascii() and declared.isdigit() and int(declared) > cap:
                raise RemoteRequestFailure(f"the answer is {int(declared)} bytes, over max_response_bytes={cap}; "
                                    "refused unread (is the URL a reward server?)")
            answer = bytearray()
            while block := response.read(READ_BLOCK_BYTES):
                answer += block
                if len(answer) > cap:
                    raise RemoteRequestFailure(f"the answer is over max_response_bytes={cap}; refused after reading "
                                        f"{len(answer)} bytes (is the URL a reward server?)")
            return answer

    def _http_error(self, err: urllib.error.HTTPError) -> str:
        """The retryable cause of a non-2xx answer; raises `RemoteRequestFailure` for a permanent one."""
        with err:
            if 300 <= err.code < 400:
                target = _redirect_target(self._request_url, err.headers.get("Location"))
                raise RemoteRequestFailure(f"HTTP {err.code} redirect to {target}: redirects are not followed (the "
                                    f"request and its credentials go to {self.url} only); if the server moved, "
                                    "give its new URL (--remote_rm_url)")
            detail = _snippet(_read_error_body(err))
            if err.code < 500 and err.code != RETRYABLE_STATUS:
                raise RemoteRequestFailure(f"HTTP {err.code} {err.reason}: {detail} (client errors are not retried)")
            return f"HTTP {err.code} {err.reason}: {detail}"


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """Hands every 3xx on as an `HTTPError` instead of following it (see `RemoteRewardClient`)."""

    def http_error_302(self, req, fp, code, msg, headers):
        return None

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


class _TimedRequest(urllib.request.Request):
    """A request that must be done by `deadline` (a `time.monotonic()` value)."""

    def __init__(self, *args, deadline: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.deadline = deadline


def _time_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the request deadline has passed")
    return left


class _DeadlineConnection:
    """Mixin for `http.client` connections: connecting, sending and every read of the answer end by
    the request's deadline. A socket timeout alone restarts at each read, so a server sending one
    byte a second could hold a request for minutes."""

    def __init__(self, *args, deadline: float, **kwargs):
        super().__init__(*args, **kwargs)
        self._deadline = deadline
        # http.client opens its socket through this attribute; setting the time left on the new
        # socket bounds the TLS handshake that follows (https) by the same deadline.
        self._create_connection = self._open_socket

    def _open_socket(self, address, timeout, source_address=None):
        sock = socket.create_connection(address, _time_left(self._deadline), source_address)
        try:
            sock.settimeout(_time_left(self._deadline))
        except TimeoutError:
            sock.close()
            raise
        return sock

    def connect(self):
        super().connect()
        self.sock = _DeadlineSocket(self.sock, self._deadline)


class _DeadlineHTTPConnection(_DeadlineConnection, http.client.HTTPConnection):
    pass


class _DeadlineHTTPSConnection(_DeadlineConnection, http.client.HTTPSConnection):
    pass


class _DeadlineHTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req):
        return self.do_open(functools.partial(_DeadlineHTTPConnection, deadline=req.deadline), req)


class _DeadlineHTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req):
        return self.do_open(functools.partial(_DeadlineHTTPSConnection, deadline=req.deadline), req,
                            context=self._context)


class _DeadlineSocket:
    """A connected socket whose `sendall` and reads (through `makefile`, as http.client reads)
    stop at `deadline`; everything else is the socket's own."""

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock = sock
        self._deadline = deadline

    def sendall(self, data) -> None:
        self._sock.settimeout(_time_left(self._deadline))  # a total for the whole sendall (Python >= 3.5)
        self._sock.sendall(data)

    def makefile(self, mode: str = "rb", *args, **kwargs) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


class _DeadlineReader(io.RawIOBase):
    """The socket's own reader (which keeps the socket open while in use), each read given only
    the time left."""

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock = sock
        self._raw = sock.makefile("rb", buffering=0)
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        self._sock.settimeout(_time_left(self._deadline))
        return self._raw.readinto(buffer)

    def close(self) -> None:
        self._raw.close()
        super().close()


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


def _read_error_body(err: urllib.error.HTTPError) -> bytes:
    try:
        return err.read(ERROR_BODY_BYTES)
    except (OSError, http.client.HTTPException):
        return b""


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
