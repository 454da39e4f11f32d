"""RemoteRewardClient against a real HTTP server on 127.0.0.1 that misbehaves on cue.

The server answers each request with the next behaviour of a script (the last one repeats):
"ok" scores every query as len(query) / 10, and the others inject one failure each. Timeouts and
backoffs are tiny, so a failing case takes well under a second.
"""

import base64
import json
import logging
import math
import random
import re
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from lightrft.rewards import RemoteRewardClient, RewardResult, RewardSourceError, make_reward_source, redact_url
from lightrft.rewards.remote import retry_wait

pytestmark = pytest.mark.timeout(60)

QUERIES = ["a", "bb", "ccc", "dddd", "eeeee"]
PROMPTS = ["p"] * 5
LABELS = [None, "x", 3, {"k": 1}, [1, 2]]
EXPECTED = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])  # len(query) / 10
CLIENT_TIMEOUT = 0.3


class ScriptedServer:
    """A ThreadingHTTPServer whose handler follows `self.script` and records every request."""

    def __init__(self):
        self.script: list[str] = ["ok"]
        self.requests: list[dict] = []  # {"body": parsed JSON, "headers": dict, "path": request path and query}
        self.in_flight = self.most_in_flight = 0     # requests being answered now, and the most at once
        self._lock = threading.Condition()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server._lock:
                    server.requests.append({"body": body, "headers": dict(self.headers), "path": self.path})
                    behaviour = server.script.pop(0) if len(server.script) > 1 else server.script[0]
                    server.in_flight += 1
                    server.most_in_flight = max(server.most_in_flight, server.in_flight)
                    server._lock.notify_all()
                    if behaviour == "pair":      # wait (up to 1 s) for a second request to be in flight
                        server._lock.wait_for(lambda: server.in_flight >= 2, timeout=1.0)
                        behaviour = "ok"
                try:
                    server.respond(self, behaviour, body["query"])
                finally:
                    with server._lock:
                        server.in_flight -= 1

            def finish(self):
                try:
                    super().finish()
                except OSError:
                    pass  # the "reset" behaviour already closed the socket

        class QuietServer(ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                pass  # a "slow" answer finds the client gone: expected, not worth a traceback

        self.httpd = QuietServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/get_reward"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    @staticmethod
    def respond(handler, behaviour: str, queries: list):
        scores = [len(q) / 10 for q in queries]
        if behaviour == "slow":
            time.sleep(CLIENT_TIMEOUT * 3)
            behaviour = "ok"
        if behaviour == "reset":
            # SO_LINGER 0 makes close() send a TCP reset instead of a clean shutdown.
            handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            handler.connection.close()
            return
        status, payload = {
            "ok": (200, json.dumps({"rewards": scores})),
            "scores_key": (200, json.dumps({"scores": scores})),
            "bare_list": (200, json.dumps(scores)),
            "bad_json": (200, "<html>proxy error</html>"),
            "wrong_count": (200, json.dumps({"rewards": scores[:-1]})),
            "nan": (200, json.dumps({"rewards": [float("nan")] + scores[1:-1] + [None]})),
            "inf": (200, json.dumps({"rewards": scores[:-1] + [float("inf")]})),
            "string_score": (200, json.dumps({"rewards": ["high"] * len(scores)})),
            "500": (500, json.dumps({"error": "model crashed"})),
            "503": (503, json.dumps({"error": "overloaded"})),
            "429": (429, json.dumps({"error": "slow down"})),
            "400": (400, json.dumps({"error": "field 'query' missing"})),
        }[behaviour]
        data = payload.encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    srv = ScriptedServer()
    yield srv
    srv.close()


def client(url, **kwargs) -> RemoteRewardClient:
    options = dict(timeout=CLIENT_TIMEOUT, max_retries=3, backoff=0.01)
    options.update(kwargs)
    return RemoteRewardClient(url, **options)


def test_scores_come_back_in_order_with_the_documented_payload(server):
    rm = client(server.url)
    rewards = rm(QUERIES, PROMPTS, LABELS)
    torch.testing.assert_close(rewards, EXPECTED)
    assert rewards.dtype == torch.float32
    assert [r["body"] for r in server.requests] == [{"query": QUERIES, "prompts": PROMPTS, "labels": LABELS}]
    assert rm.stats.as_dict() == {"requests": 1, "retries": 0, "failures": 0, "dropped": 0}


@pytest.mark.parametrize("behaviour", ["scores_key", "bare_list"])
def test_scores_key_and_bare_list_answers_are_accepted(server, behaviour):
    server.script = [behaviour]
    torch.testing.assert_close(client(server.url)(QUERIES, PROMPTS, LABELS), EXPECTED)


def test_large_batches_go_in_chunks(server):
    rm = client(server.url, batch_size=2)
    torch.testing.assert_close(rm(QUERIES, PROMPTS, LABELS), EXPECTED)
    # The chunks go out together, so they may arrive in any order; the scores come back in order.
    chunks = sorted((r["body"]["query"], r["body"]["labels"]) for r in server.requests)
    assert chunks == [(["a", "bb"], [None, "x"]), (["ccc", "dddd"], [3, {"k": 1}]), (["eeeee"], [[1, 2]])]
    assert rm.stats.requests == 3


@pytest.mark.parametrize("concurrency", [1, 2])
def test_a_batchs_requests_are_in_flight_together_up_to_the_bound(server, concurrency):
    """Five one-query chunks; the server holds each request until a second one is in flight (or
    1 s passes): a client sending them one by one never has two in flight, a bound of two always."""
    server.script = ["pair"]
    rm = client(server.url, batch_size=1, max_concurrency=concurrency, timeout=5.0)
    torch.testing.assert_close(rm(QUERIES, PROMPTS, LABELS), EXPECTED)
    assert len(server.requests) == 5 and server.most_in_flight == concurrency


@pytest.mark.parametrize("script", [["500", "503", "ok"], ["429", "ok"], ["slow", "ok"], ["reset", "reset", "ok"]])
def test_transient_failures_are_retried_until_success(server, script):
    server.script = list(script)
    rm = client(server.url)
    torch.testing.assert_close(rm(QUERIES, PROMPTS, LABELS), EXPECTED)
    failures = len(script) - 1
    assert rm.stats.as_dict() == {"requests": failures + 1, "retries": failures, "failures": 0, "dropped": 0}


@pytest.mark.parametrize("behaviour, cause", [
    ("500", "HTTP 500"),
    ("slow", "no answer within timeout=0.3s"),
    ("reset", "connection"),
])
def test_persistent_failures_raise_after_the_retries(server, behaviour, cause):
    server.script = [behaviour]
    rm = client(server.url, max_retries=2)
    with pytest.raises(RewardSourceError) as info:
        rm(QUERIES, PROMPTS, LABELS)
    message = str(info.value)
    assert server.url in message and cause in message and "gave up after 3 attempts" in message
    # "slow" requests may still be on the server when the client gives up; the client's count is exact.
    assert rm.stats.as_dict() == {"requests": 3, "retries": 2, "failures": 1, "dropped": 0}
    if behaviour != "slow":
        assert len(server.requests) == 3


def test_connection_refused_raises_after_the_retries():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    rm = client(f"http://127.0.0.1:{port}/get_reward", max_retries=1)
    with pytest.raises(RewardSourceError, match="connection failed"):
        rm(QUERIES, PROMPTS, LABELS)
    assert rm.stats.requests == 2 and rm.stats.retries == 1


@pytest.mark.parametrize("behaviour, words", [
    ("400", r"HTTP 400 Bad Request: .*field .*query.* missing.*not retried"),
    ("bad_json", "the answer is not JSON: '<html>proxy error</html>'"),
    ("wrong_count", "4 scores returned for 5 queries"),
    ("string_score", "score 0 is not a number"),
])
def test_permanent_failures_are_not_retried(server, behaviour, words):
    server.script = [behaviour]
    rm = client(server.url)
    with pytest.raises(RewardSourceError, match=words):
        rm(QUERIES, PROMPTS, LABELS)
    assert len(server.requests) == 1
    assert rm.stats.as_dict() == {"requests": 1, "retries": 0, "failures": 1, "dropped": 0}


@pytest.mark.parametrize("behaviour, bad", [("nan", [0, 4]), ("inf", [4])])
def test_non_finite_scores_are_errors(server, behaviour, bad):
    server.script = [behaviour]
    words = f"scores for queries {bad} are NaN, infinite, null or beyond the float32 range"
    with pytest.raises(RewardSourceError, match=re.escape(words)):
        client(server.url)(QUERIES, PROMPTS, LABELS)


def test_drop_policy_marks_only_the_failed_samples_invalid(server):
    # Chunks of 2, sent one at a time (the script follows the order of arrival): the first chunk
    # succeeds, the second fails for good, the third has a null score.
    server.script = ["ok", "500", "500", "nan"]
    rm = client(server.url, batch_size=2, max_retries=1, on_failure="drop", max_concurrency=1)
    result = rm(QUERIES, PROMPTS, LABELS)
    assert isinstance(result, RewardResult)
    assert result.valid.tolist() == [True, True, False, False, False]
    torch.testing.assert_close(result.rewards, torch.tensor([0.1, 0.2, 0.0, 0.0, 0.0]))
    assert result.num_dropped == 3
    assert not torch.isnan(result.rewards).any()
    assert rm.stats.as_dict() == {"requests": 4, "retries": 1, "failures": 2, "dropped": 3}


def test_drop_policy_keeps_the_good_scores_of_a_partly_nan_answer(server):
    server.script = ["nan"]
    result = client(server.url, on_failure="drop").score(QUERIES, PROMPTS, LABELS)
    assert result.valid.tolist() == [False, True, True, True, False]
    torch.testing.assert_close(result.rewards, torch.tensor([0.0, 0.2, 0.3, 0.4, 0.0]))


def test_credentials_never_appear_in_errors_or_logs(server, caplog):
    server.script = ["503"]
    url = f"http://alice:s3cret@127.0.0.1:{server.port}/get_reward?token=abc123&model=rm"
    rm = client(url, max_retries=1)
    with caplog.at_level(logging.WARNING, logger="lightrft.rewards.remote"):
        with pytest.raises(RewardSourceError) as info:
            rm(QUERIES, PROMPTS, LABELS)
    shown = str(info.value) + repr(rm) + caplog.text
    assert "retry 1/1" in caplog.text
    assert f"http://***@127.0.0.1:{server.port}/get_reward?token=***&model=***" in str(info.value)
    assert "s3cret" not in shown and "abc123" not in shown and "alice" not in shown
    # The credentials still reach the server: as basic auth, with the query string intact.
    assert server.requests[0]["headers"]["Authorization"] == "Basic " + base64.b64encode(b"alice:s3cret").decode()


def test_redact_url():
    assert redact_url("https://u:p@host:8443/a/b?key=1&x=#frag") == "https://***@host:8443/a/b?key=***&x=***"
    assert redact_url("http://127.0.0.1:5000/get_reward") == "http://127.0.0.1:5000/get_reward"


def test_backoff_waits_grow_and_stay_bounded():
    """d = min(max_backoff, backoff * 2^attempt) = 1, 2, 3, 3 for backoff 1 and cap 3; the wait
    is drawn from [d/2, d] and differs between draws (jitter)."""
    rng = random.Random(0)
    for attempt, cap in enumerate([1.0, 2.0, 3.0, 3.0]):
        waits = [retry_wait(attempt, 1.0, 3.0, rng) for _ in range(200)]
        assert all(cap / 2 <= w <= cap for w in waits)
        assert max(waits) - min(waits) > cap / 4
    assert retry_wait(5, 0.0, 3.0, rng) == 0.0


@pytest.mark.parametrize("kwargs, words", [
    ({"on_failure": "ignore"}, r"--reward_on_failure"),
    ({"timeout": 0}, r"--reward_timeout"),
    ({"max_retries": -1}, r"--reward_retries"),
    ({"batch_size": 0}, r"batch_size must be >= 1"),
])
def test_bad_options_raise_clear_errors(kwargs, words):
    with pytest.raises(ValueError, match=words):
        RemoteRewardClient("http://127.0.0.1:1/x", **kwargs)


def test_a_url_without_host_is_rejected():
    with pytest.raises(ValueError, match="http\\(s\\)://host"):
        RemoteRewardClient("http:///nohost")


def test_make_reward_source_builds_the_client_for_urls(server):
    rm = make_reward_source(server.url, timeout=CLIENT_TIMEOUT, max_retries=0, on_failure="drop", batch_size=3)
    assert isinstance(rm, RemoteRewardClient)
    result = rm(QUERIES, PROMPTS, LABELS)
    assert result.valid.all() and len(server.requests) == 2
    assert math.isclose(result.rewards.sum().item(), 1.5, rel_tol=1e-6)
