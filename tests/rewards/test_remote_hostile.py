"""RemoteRewardClient against reward servers that misbehave on purpose, on 127.0.0.1.

Each case is a real HTTP server whose answer is written by the test: redirects to another origin,
answers trickled a few bytes at a time, bodies larger than the cap, JSON nested too deep to parse,
numbers too large for a float32 reward. Each must end as a counted failure under the failure
policy, within the timeout, with the credentials kept from every server but the one configured.
"""

import base64
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from lightrft.rewards import RemoteRewardClient, RewardSourceError

pytestmark = pytest.mark.timeout(60)

QUERIES = ["a", "bb", "ccc", "dddd", "eeeee"]
PROMPTS = ["p"] * 5
LABELS = [None] * 5
REWARDS = [0.1, 0.2, 0.3, 0.4, 0.5]
OK_BODY = json.dumps({"rewards": REWARDS}).encode()


class Server:
    """A ThreadingHTTPServer that records every request and answers with `self.answer(handler)`."""

    def __init__(self, answer):
        self.answer = answer
        self.requests: list[dict] = []  # {"method", "path", "headers"}
        self.done = threading.Event()  # set when an answer has been written to the end or broke off
        self.finished = False  # the whole answer was written
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def handle_one(self):
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                server.requests.append({"method": self.command, "path": self.path, "headers": dict(self.headers)})
                try:
                    server.answer(self)
                    server.finished = True
                except OSError:
                    pass  # the client hung up, as it should on a hostile answer
                finally:
                    server.done.set()

            do_POST = do_GET = handle_one

        class QuietServer(ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                pass

        self.httpd = QuietServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/get_reward"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve():
    servers = []

    def start(answer):
        servers.append(Server(answer))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def send(handler, status: int, body: bytes, headers: dict | None = None):
    handler.send_response(status)
    for name, value in {"Content-Type": "application/json", "Content-Length": str(len(body)),
                        **(headers or {})}.items():
        handler.send_header(name, value)
    handler.end_headers()
    handler.wfile.write(body)


def ok(handler):
    send(handler, 200, OK_BODY)


# --- redirects ---------------------------------------------------------------------------------

@pytest.mark.parametrize("status, location, shown", [
    # another origin (another port), with credentials of its own in the Location: shown redacted
    (302, "http://127.0.0.1:{other}/get_reward", "http://127.0.0.1:{other}/get_reward"),
    (307, "http://bob:pw@127.0.0.1:{other}/get_reward?token=zzz", "http://***@127.0.0.1:{other}/get_reward?token=***"),
    (308, "http://127.0.0.1:{other}/get_reward", "http://127.0.0.1:{other}/get_reward"),
])
def test_a_redirect_elsewhere_is_refused_and_never_sees_the_credentials(serve, status, location, shown):
    other = serve(ok)
    location, shown = location.format(other=other.port), shown.format(other=other.port)
    home = serve(lambda h: send(h, status, b"", {"Location": location}))
    rm = RemoteRewardClient(f"http://alice:s3cret@127.0.0.1:{home.port}/get_reward", timeout=2.0, max_retries=2,
                            backoff=0.01)
    with pytest.raises(RewardSourceError) as info:
        rm(QUERIES, PROMPTS, LABELS)
    message = str(info.value)
    assert f"HTTP {status} redirect to {shown}" in message and "redirects are not followed" in message
    assert "s3cret" not in message and "zzz" not in message
    assert other.requests == []  # the other origin got nothing: no Authorization, no body
    assert home.requests[0]["headers"]["Authorization"] == "Basic " + base64.b64encode(b"alice:s3cret").decode()
    assert len(home.requests) == 1  # a redirect is a permanent failure: not retried
    assert rm.stats.as_dict() == {"requests": 1, "retries": 0, "failures": 1, "dropped": 0}


def test_a_same_origin_redirect_is_refused_too_with_the_url_to_use(serve, caplog):
    home = serve(lambda h: send(h, 302, b"", {"Location": "/get_reward/"}) if h.path == "/get_reward" else ok(h))
    rm = RemoteRewardClient(home.url, timeout=2.0, max_retries=0, on_failure="drop")
    with caplog.at_level(logging.WARNING, logger="lightrft.rewards.remote"):
        result = rm.score(QUERIES, PROMPTS, LABELS)
    assert result.valid.tolist() == [False] * 5
    assert [r["path"] for r in home.requests] == ["/get_reward"]
    assert f"HTTP 302 redirect to {home.url}/: redirects are not followed" in caplog.text
    assert rm.stats.as_dict() == {"requests": 1, "retries": 0, "failures": 1, "dropped": 5}


# --- the whole request within the timeout ------------------------------------------------------

TRICKLE_INTERVAL = 0.05  # seconds between bytes: each read gets a byte well within the timeout
PADDING = 120  # bytes of padding trickled: about 6 s in all, far past the 0.5 s timeout


def trickle(handler, data: bytes):
    for i in range(len(data)):
        handler.wfile.write(data[i:i + 1])
        time.sleep(TRICKLE_INTERVAL)


def trickle_headers(handler):
    head = b"HTTP/1.0 200 OK\r\nX-Padding: " + b"x" * PADDING + b"\r\nContent-Length: %d\r\n\r\n" % len(OK_BODY)
    trickle(handler, head)
    handler.wfile.write(OK_BODY)


def trickle_body(handler):
    body = b" " * PADDING + OK_BODY  # valid JSON once it is all there
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    trickle(handler, body)


@pytest.mark.parametrize("answer", [trickle_headers, trickle_body])
def test_an_answer_trickled_byte_by_byte_ends_at_the_timeout(serve, caplog, answer):
    """Every read gets a byte within 0.05 s, so a per-read timeout never fires (the old client took
    the whole ~7 s and accepted the answer); the deadline ends the request at 0.5 s."""
    server = serve(answer)
    rm = RemoteRewardClient(server.url, timeout=0.5, max_retries=0, on_failure="drop")
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="lightrft.rewards.remote"):
        result = rm.score(QUERIES, PROMPTS, LABELS)
    elapsed = time.monotonic() - start
    assert elapsed < 3.0, f"took {elapsed:.1f}s with timeout=0.5s"
    assert result.valid.tolist() == [False] * 5
    assert rm.stats.as_dict() == {"requests": 1, "retries": 0, "failures": 1, "dropped": 5}
    assert f"reward server {server.url}: queries 0..4: no answer within timeout=0.5s" in caplog.text
    assert not server.finished


# --- response size cap -------------------------------------------------------------------------

BIG = 32 * 2 ** 20  # bytes the server offers: more than the socket buffers hold


def write_big(handler, status: int, declare_length: bool):
    handler.send_response(status)
    if declare_length:
        handler.send_header("Content-Length", str(BIG))
    handler.end_headers()
    block = b" " * 2 ** 16
    for _ in range(BIG // len(block) - 1):
        handler.wfile.write(block)
    handler.wfile.write(OK_BODY.ljust(len(block)))  # valid JSON once it is all there


@pytest.mark.parametrize("status, declare_length, words", [
    (200, True, f"the answer is {BIG} bytes, over max_response_bytes=4096"),
    (200, False, "the answer is over max_response_bytes=4096"),
    (500, True, "HTTP 500"),  # an error's body is read only for its first bytes, for the message
])
def test_an_oversized_answer_is_refused_without_reading_it_all(serve, status, declare_length, words):
    server = serve(lambda h: write_big(h, status, declare_length))
    rm = RemoteRewardClient(server.url, timeout=5.0, max_retries=0, max_response_bytes=4096)
    with pytest.raises(RewardSourceError, match=words):
        rm(QUERIES, PROMPTS, LABELS)
    assert server.done.wait(10)
    assert not server.finished  # the client hung up long before the 32 MiB were sent
    assert rm.stats.failures == 1


def test_max_response_bytes_must_be_positive():
    with pytest.raises(ValueError, match="max_response_bytes"):
        RemoteRewardClient("http://127.0.0.1:1/x", max_response_bytes=0)


# --- answers that do not parse into usable rewards ---------------------------------------------

def test_deeply_nested_json_is_a_counted_failure_and_the_run_goes_on(serve, caplog):
    """100k nested lists overflow Python's JSON parser (RecursionError); under "drop" that chunk
    is dropped and the next chunks are scored."""
    answers = iter([b"[" * 100_000 + b"]" * 100_000, b'{"rewards": [0.3, 0.4]}'])
    server = serve(lambda h: send(h, 200, next(answers)))
    rm = RemoteRewardClient(server.url, timeout=5.0, max_retries=0, batch_size=2, on_failure="drop",
                            max_concurrency=1)      # the answers follow the order of arrival
    with caplog.at_level(logging.WARNING, logger="lightrft.rewards.remote"):
        result = rm.score(QUERIES[:4], PROMPTS[:4], LABELS[:4])
    assert result.valid.tolist() == [False, False, True, True]
    torch.testing.assert_close(result.rewards, torch.tensor([0.0, 0.0, 0.3, 0.4]))
    assert rm.stats.as_dict() == {"requests": 2, "retries": 0, "failures": 1, "dropped": 2}
    assert f"reward server {server.url}: queries 0..1: the answer nests" in caplog.text


@pytest.mark.parametrize("first", [
    b"1e300",  # finite in float64, inf in the float32 reward tensor
    b"1" + b"0" * 400,  # an int too large for a float
    b"9" * 5000,  # an int longer than Python's int-parsing limit (4300 digits)
])
def test_a_score_beyond_float32_is_one_invalid_sample(serve, caplog, first):
    body = b'{"rewards": [' + first + b", 0.2, 0.3, 0.4, 0.5]}"
    server = serve(lambda h: send(h, 200, body))
    rm = RemoteRewardClient(server.url, timeout=5.0, max_retries=0, on_failure="drop")
    with caplog.at_level(logging.WARNING, logger="lightrft.rewards.remote"):
        result = rm.score(QUERIES, PROMPTS, LABELS)
    assert result.valid.tolist() == [False, True, True, True, True]
    torch.testing.assert_close(result.rewards, torch.tensor([0.0, 0.2, 0.3, 0.4, 0.5]))
    assert torch.isfinite(result.rewards).all()
    assert rm.stats.as_dict() == {"requests": 1, "retries": 0, "failures": 1, "dropped": 1}
    assert f"reward server {server.url}: scores for queries [0] are NaN, infinite, null or beyond" in caplog.text
