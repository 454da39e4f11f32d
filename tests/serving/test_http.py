"""The HTTP front of `serve` against hostile or careless clients, on a real server on 127.0.0.1
with a tiny policy: the API key, content types, body and prompt caps, strict JSON, framing that
the HTTP library handles, per-request deadlines, the connection bounds (per client and in all),
and 50 parallel clients beside slowloris connections. (serve_rm shares lightrft/serving/http.py
and server.py; tests/cli/test_serve_rm.py drives it.)"""

import base64
import http.client
import json
import logging
import shutil
import socket
import subprocess
import threading
import time
from contextlib import contextmanager

import pytest
from openai import AuthenticationError, OpenAI
from transformers import GPT2Config

from lightrft.models.hf_utils import context_length
from lightrft.models.tokenizer import build_tokenizer, stop_token_ids
from lightrft.serving.http import (HTTPSettings, RequestError, exposure_warning, longest_token_chars, parse_json,
                                   settings_from_flags)
from lightrft.serving.openai_api import OpenAIServer, ServeLimits, build_server
from lightrft.serving.policy import ServedPolicy
from lightrft.serving.records import ExperienceRecorder
from lightrft.utils.tiny import save_tiny_model

CONTEXT = 48          # the tiny model's max_position_embeddings
MAX_NEW = 8           # --generate_max_len
KEY = "s3cret-key"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """The OpenAI front of a tiny Qwen2 policy with a 48-token context, recording."""
    root = tmp_path_factory.mktemp("http")
    model = save_tiny_model(root / "model", max_position_embeddings=CONTEXT)
    tokenizer = build_tokenizer(str(model), False)
    policy = ServedPolicy(model, tokenizer, stop_token_ids(tokenizer, str(model)))
    limits = ServeLimits(MAX_NEW, 4096, context_len=policy.context_len, token_chars=longest_token_chars(tokenizer))
    recorder = ExperienceRecorder(root / "record")
    yield OpenAIServer(policy, limits, "tiny", seed=1, recorder=recorder)
    recorder.close()


@contextmanager
def serving(api, **settings):
    """`build_server` on a free port, serving in a thread; yields the server."""
    server = build_server(api, "127.0.0.1", 0, HTTPSettings(**settings))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def running(api, **settings):
    """`serving`, yielding the port."""
    with serving(api, **settings) as server:
        yield server.server_address[1]


@pytest.fixture(scope="module")
def port(api):
    with running(api) as p:
        yield p


def call(port, method, path, payload=None, headers=None, body=None, timeout=30):
    """(status, JSON reply, reply headers) of one request on a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        if body is None and payload is not None:
            body = json.dumps(payload).encode()
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, json.loads(response.read()), {k.lower(): v for k, v in response.getheaders()}
    finally:
        conn.close()


def raw(port, data: bytes, timeout=10, host="127.0.0.1") -> tuple[int, dict]:
    """Sends `data` as is and reads the reply until the server closes: (status, JSON body)."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(data)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def feedback_lines(api) -> int:
    path = api.recorder.folder / "feedback.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def completion(port, prompt="1+1=", **extra):
    return call(port, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 2, "seed": 3, **extra})


# ------------------------------------------------------------------------------- strict JSON
DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', "temperature", "NaN"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": NaN}', "top_p", "NaN"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": -Infinity}', "top_p", "-Infinity"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1e999}', "temperature", "finite"),
    ("/v1/completions", b'{"prompt": "hi", "seed": ' + b"7" * 5000 + b"}", "seed", "5000 digits"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ' + b"7" * 30 + b"}", "max_tokens", "30 digits"),
    ("/v1/completions", b'{"prompt": ' + DEEP + b', "max_tokens": 2}', "prompt", "too deeply"),
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt", "surrogate"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content",
     "surrogate"),
    ("/v1/feedback", b'{"id": "x", "reward": ' + b"9" * 401 + b"}", "reward", "401 digits"),
    ("/v1/feedback", b'{"id": "x", "reward": NaN}', "reward", "NaN"),
    # A prompt and answer longer than the model's 48 positions.
    ("/v1/completions", b'{"prompt": "' + b"x" * 45 + b'", "max_tokens": 8}', "max_tokens", "context of 48"),
    ("/v1/completions", b'{"prompt": "' + b"x" * 50 + b'"}', "prompt", "context of 48"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "' + b"x" * 50 + b'"}]}', "messages",
     "context of 48"),
    # Fields an endpoint does not take are named, not ignored.
    ("/v1/completions", b'{"prompt": "hi", "temprature": 0.5}', "temprature", "unknown field 'temprature' for "
     "/v1/completions; it takes"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "tools": []}', "tools",
     "unknown field 'tools'"),
    ("/v1/feedback", b'{"id": "x", "reward": 1, "comment": "nice"}', "comment", "unknown field 'comment'"),
    # Forty arrays deep is parseable, but no request needs more than a few levels.
    ("/v1/completions", b'{"prompt": ' + b"[" * 40 + b"]" * 40 + b"}", "prompt" + "[0]" * 31, "more than 32 deep"),
], ids=["nan-temperature", "nan-top_p", "infinity", "1e999", "5000-digit-int", "30-digit-int", "deep-nesting",
        "surrogate", "chat-surrogate", "401-digit-reward", "nan-reward", "prompt+answer-over-context",
        "prompt-over-context", "chat-over-context", "misspelt-field", "unsupported-field", "feedback-field",
        "40-deep"])
def test_hostile_values_get_a_400_naming_the_field(api, port, path, body, param, words):
    status, reply, _ = call(port, "POST", path, body=body)
    assert status == 400, reply
    assert reply["error"]["param"] == param and words in reply["error"]["message"], reply
    assert reply["error"]["type"] == "invalid_request_error"
    assert completion(port)[0] == 200                    # and the server keeps serving


def test_a_body_of_millions_of_tiny_values_is_refused_before_parsing(port):
    """63 MB of `[{},{},...]` (21 million objects) is under the 64 MB body cap; parsed, it took the
    server from 1.1 to 5.1 GB and 75 s of CPU. Counted first, it is a 413."""
    body = b'{"prompt": [' + b"{}," * 20_999_999 + b'{}]}'
    status, reply, _ = call(port, "POST", "/v1/completions", body=body, timeout=60)
    assert status == 413 and "has 42,000,001 JSON arrays, objects and commas, over this server's limit of " \
        "1,000,000" in reply["error"]["message"]
    assert completion(port)[0] == 200


def test_parse_json_counts_values_outside_strings():
    # 1.5 million commas inside one string are one value, not 1.5 million.
    assert parse_json(json.dumps({"prompt": "a,\\\",b" + "," * 1_500_000}).encode())["prompt"].count(",") == 1_500_002
    with pytest.raises(RequestError, match="has 1,000,002 JSON arrays, objects and commas"):
        parse_json(b"[" + b"0," * 1_000_001 + b"0]")


def test_a_prompt_within_the_context_gets_the_room_left_as_its_default_budget(port):
    # 44 prompt tokens in a 48-token context: max_tokens defaults to the 4 left, not --generate_max_len 8.
    status, reply, _ = call(port, "POST", "/v1/completions", {"prompt": "x" * 44, "temperature": 0})
    assert status == 200 and reply["usage"]["prompt_tokens"] == 44
    assert reply["usage"]["completion_tokens"] <= 4


def test_a_huge_prompt_is_refused_before_tokenising(api, port):
    # 2 MB of text: the character cap (context 48 tokens x the longest token, 5 characters) refuses it
    # by its length; tokenising it first took seconds and hundreds of MB.
    cap = api.limits.prompt_chars
    assert cap == CONTEXT * 5
    for path, payload, param, chars in [
            ("/v1/completions", {"prompt": "y" * 2_000_000}, "prompt", 2_000_000),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 2_000_000}]}, "messages",
             2_000_004)]:                              # the role's characters count too
        status, reply, _ = call(port, "POST", path, payload)
        assert status == 400 and reply["error"]["param"] == param
        assert f"is {chars} characters, more than {cap} characters" in reply["error"]["message"]
    status, reply, _ = call(port, "POST", "/v1/completions", {"prompt": list(range(5, 105))})
    assert status == 400 and "100 tokens" in reply["error"]["message"]


def test_parse_json_refuses_what_python_would_crash_on_or_pass_through():
    assert parse_json(b'{"a": [1, 2.5, "\\u00e9"], "b": -9223372036854775808}') == \
        {"a": [1, 2.5, "\u00e9"], "b": -2**63}
    for body, param, words in [(b'{"a": {"b": [0, NaN]}}', "a.b[1]", "NaN"),
                               (b'{"a": 9223372036854775808}', "a", "19 digits"),
                               (b'{"k\\ud801": 1}', None, "surrogate"),
                               (b'{"a": 1, "b": ' + b"[" * 50_000, "b", "too deeply"),
                               (b"\xff", None, "not UTF-8"),
                               (b'{"a": }', None, "not valid JSON")]:
        with pytest.raises(RequestError) as info:
            parse_json(body)
        assert info.value.param == param and words in str(info.value), (body[:40], str(info.value))


# ---------------------------------------------------------------------------- headers and body
@pytest.mark.parametrize("headers, status, words", [
    (b"Content-Type: application/json\r\nContent-Length: -1\r\n", 400, "bad Content-Length: send one"),
    (b"Content-Type: application/json\r\nContent-Length: +2\r\n", 400, "bad Content-Length"),
    (b"Content-Type: application/json\r\nContent-Length: 2\r\nContent-Length: 3\r\n", 400,
     "conflicting Content-Length headers"),
    (b"Content-Type: application/json\r\n", 411, "needs a Content-Length"),
    (b"Content-Type: application/json\r\nTransfer-Encoding: gzip\r\n", 501,
     "Only Transfer-Encoding: chunked is supported"),
    (b"Content-Type: application/json\r\nContent-Length: 99999999999\r\n", 413, "over this server's limit"),
    (b"Content-Type: text/plain\r\nContent-Length: 2\r\n", 415, "got 'text/plain'"),
    (b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 2\r\n", 415, "application/json"),
    (b"Content-Length: 2\r\n", 415, "no Content-Type"),
    (b"Content-Type: application/json; charset=latin-1\r\nContent-Length: 2\r\n", 415, "UTF-8"),
], ids=["negative-length", "signed-length", "two-lengths", "no-length", "gzip", "over-cap", "text/plain", "form",
        "no-content-type", "latin-1"])
def test_bad_headers_are_refused_before_the_body_is_read(api, port, headers, status, words):
    before = feedback_lines(api)
    got, reply = raw(port, b"POST /v1/feedback HTTP/1.1\r\nHost: t\r\n" + headers + b"\r\n{}")
    assert got == status and words in reply["error"]["message"], reply
    assert reply["error"]["param"] in ("Content-Length", "Content-Type", "Transfer-Encoding")
    assert feedback_lines(api) == before


def replies(port, data: bytes, timeout=10) -> list[tuple[int, bytes]]:
    """Sends `data` as is; every (status, body) the server answers until it closes, in order."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        stream = b""
        while chunk := sock.recv(65536):
            stream += chunk
    out = []
    while stream:
        head, _, rest = stream.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        out.append((int(head.split()[1]), rest[:length]))
        stream = rest[length:]
    return out


def test_framing_tricks_are_answered_by_the_http_library(api, port):
    """What h11 does for the server, checked on the wire: pipelined requests answered in order,
    a request smuggled behind Content-Length and chunked framing at once not run, oversized
    headers refused with 431 as JSON."""
    body = json.dumps({"prompt": "1+1=", "max_tokens": 2, "seed": 3}).encode()
    post = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    got = replies(port, post % len(body) + body + b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n"
                  + b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    assert [status for status, _ in got] == [200, 200, 200]
    assert [json.loads(got[0][1])["object"], json.loads(got[1][1])["object"]] == ["text_completion", "list"]
    assert json.loads(got[0][1])["choices"][0]["text"] == completion(port)[1]["choices"][0]["text"]
    # Both framings: chunked wins (an empty body, refused), and the GET hidden in it never runs.
    got = replies(port, b"POST /v1/feedback HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
                        b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
    assert len(got) == 1 and got[0][0] == 400 and "not valid JSON" in json.loads(got[0][1])["error"]["message"]
    # A header block that grows past 64 KiB without ending.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n" + b"X-Filler: a\r\n" * 6000)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.split()[1] == b"431", reply[:200]
    assert "the request is not valid HTTP/1.1" in json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["message"]


def test_a_refusal_sent_before_a_large_body_is_read_reaches_the_client(api):
    """A request refused on its headers (no key, a text/plain body) while its 800 kB body is still
    coming: the server drains what follows, so the client reads the 4xx instead of a reset."""
    with running(api, api_key=KEY) as p:
        for headers, status in [({"Content-Type": "text/plain", "Authorization": f"Bearer {KEY}"}, 415),
                                ({"Content-Type": "application/json"}, 401)]:
            for _ in range(3):
                conn = http.client.HTTPConnection("127.0.0.1", p, timeout=10)
                try:
                    conn.request("POST", "/v1/completions", body=b"x" * 800_000, headers=headers)
                    response = conn.getresponse()
                    assert response.status == status and json.loads(response.read())["error"]["param"] in \
                        ("Content-Type", "Authorization")
                finally:
                    conn.close()
        assert call(p, "GET", "/health", headers={"Authorization": f"Bearer {KEY}"})[0] == 200


def test_a_chunked_body_is_read_and_capped(api):
    """A body sent in chunks (what a client streaming its upload sends) is framed by the HTTP
    library and read against the same byte cap."""
    def chunked(port, body: bytes, size=7) -> tuple[int, dict]:
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size])
                          for i in range(0, len(body), size))
        return raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + chunks + b"0\r\n\r\n")

    body = json.dumps({"prompt": "1+1=", "max_tokens": 2, "seed": 3}).encode()
    with running(api, max_body_bytes=len(body)) as p:
        status, reply = chunked(p, body)
        assert status == 200 and reply["choices"][0]["text"] == completion(p)[1]["choices"][0]["text"]
        status, reply = chunked(p, body + b" ")
        assert status == 413 and f"over this server's limit of {len(body)} bytes" in reply["error"]["message"]
    # A body trickled in 1-byte chunks costs the event loop a parse per byte: a short one is read,
    # a long one is refused once its first 1,024 pieces average under 64 bytes, and the server
    # goes on serving.
    padded = json.dumps({"prompt": "1+1=", "max_tokens": 2, "seed": 3, "user": "u" * 3000}).encode()
    with running(api) as p:
        assert chunked(p, body, size=1)[0] == 200
        status, reply = chunked(p, padded, size=1)
        assert status == 400 and reply["error"]["param"] == "Transfer-Encoding", reply
        assert reply["error"]["message"] == ("the body arrived in 1025 pieces of 1.0 bytes on average; send it with a "
                                             "Content-Length, or in chunks of at least 64 bytes")
        assert chunked(p, padded, size=64)[0] == 200 and completion(p)[0] == 200


def test_api_key_guards_every_route_and_a_web_page_cannot_post_rewards(api):
    with running(api, api_key=KEY) as p:
        url = f"http://127.0.0.1:{p}"
        for method, path in [("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/completions"),
                             ("POST", "/v1/feedback")]:
            status, reply, headers = call(p, method, path, {"prompt": "hi"} if method == "POST" else None)
            assert (status, reply["error"]["code"]) == (401, "invalid_api_key"), (path, reply)
            assert headers["www-authenticate"].startswith("Bearer") and "no API key" in reply["error"]["message"]
        status, reply, _ = call(p, "GET", "/health", headers={"Authorization": "Bearer wrong"})
        assert status == 401 and "wrong" in reply["error"]["message"]
        assert call(p, "GET", "/health", headers={"Authorization": f"Bearer {KEY}"})[0] == 200
        basic = base64.b64encode(f"anyone:{KEY}".encode()).decode()
        assert call(p, "GET", "/health", headers={"Authorization": f"Basic {basic}"})[0] == 200

        # The OpenAI client sends the key as a bearer token.
        reply = OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0).completions.create(
            model="tiny", prompt="1+1=", max_tokens=2)
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=url + "/v1", api_key="guess", max_retries=0).completions.create(
                model="tiny", prompt="1+1=", max_tokens=2)
        # What a cross-site form or fetch can send: the right body, but as text/plain (or no key).
        before = feedback_lines(api)
        body = json.dumps({"id": reply.id, "reward": 1.0}).encode()
        for headers in [{"Authorization": f"Bearer {KEY}", "Content-Type": "text/plain"}, {}]:
            status, _, _ = call(p, "POST", "/v1/feedback", body=body, headers=headers)
            assert status in (401, 415)
        assert feedback_lines(api) == before
        assert call(p, "POST", "/v1/feedback", body=body, headers={"Authorization": f"Bearer {KEY}"})[0] == 200
        assert feedback_lines(api) == before + 1


def test_settings_key_from_env_and_the_exposure_warning(monkeypatch):
    class Flags:
        api_key, request_timeout, max_connections, max_connections_per_client = None, 5.0, 8, 4

    monkeypatch.setenv("LIGHTRFT_API_KEY", "from-env")
    assert settings_from_flags(Flags).api_key == "from-env"
    for empty in ("", "  "):           # a secret that did not fill in: refused, never an open server
        monkeypatch.setenv("LIGHTRFT_API_KEY", empty)
        with pytest.raises(ValueError, match=r"\$LIGHTRFT_API_KEY is set but empty"):
            settings_from_flags(Flags)
    monkeypatch.delenv("LIGHTRFT_API_KEY")
    assert settings_from_flags(Flags).api_key is None
    for unsendable in (" spaced ", "tab\tkey", "clé"):       # header values lose them: it could never match
        with pytest.raises(ValueError, match="white space or characters outside printable ASCII"):
            HTTPSettings(api_key=unsendable)
    with pytest.raises(ValueError, match="--request_timeout must be a positive number of seconds"):
        HTTPSettings(request_timeout=0)
    open_settings = HTTPSettings()
    for host in ("127.0.0.1", "localhost", "::1"):
        assert exposure_warning(host, open_settings, "x") is None
    for host in ("0.0.0.0", "", "10.1.2.3", "myhost"):
        assert "no API key" in exposure_warning(host, open_settings, "send rewards")
    assert exposure_warning("0.0.0.0", HTTPSettings(api_key=KEY), "x") is None


def test_context_length_reads_each_config_family():
    assert context_length(GPT2Config(n_positions=40)) == 40
    assert context_length(object()) is None


# ---------------------------------------------------------------------- slow clients, thread bound
def slowloris(port) -> socket.socket:
    """A connection that sends the start of a request and then nothing more."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=15)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nX-Slow: ")
    return sock


def closed_within(sock: socket.socket, seconds: float, trickle: float = 0.2) -> float:
    """Sends a byte every `trickle` seconds until the server closes the connection; the seconds it
    took (fails past `seconds`)."""
    start = time.monotonic()
    sock.settimeout(trickle)
    try:
        while time.monotonic() - start < seconds:
            try:
                if sock.recv(65536) == b"":
                    return time.monotonic() - start
            except TimeoutError:
                sock.sendall(b"a")
    except (ConnectionResetError, BrokenPipeError):
        return time.monotonic() - start
    finally:
        sock.close()
    pytest.fail(f"the server kept a slow connection open for {seconds} s")


def test_slow_clients_are_cut_off_at_the_request_timeout(api):
    with running(api, request_timeout=1.0) as p:
        # Headers trickled a byte at a time: cut at the deadline although bytes keep coming.
        assert closed_within(slowloris(p), 8) < 4
        # A body that stops halfway: 408 naming the timeout.
        status, reply = raw(p, b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                               b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        assert status == 408 and "--request_timeout 1 s" in reply["error"]["message"]
        # An idle keep-alive connection is closed too.
        conn = http.client.HTTPConnection("127.0.0.1", p, timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().read()
        assert closed_within(conn.sock, 8, trickle=5) < 4


def wait_for(condition, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.05)
    return condition()


def test_the_connection_bound_answers_503_and_frees_slots_as_slow_clients_are_cut(api):
    with serving(api, request_timeout=1.0, max_connections=2) as server:
        p = server.server_address[1]
        slow = [slowloris(p) for _ in range(2)]
        assert wait_for(lambda: server.connections.total == 2)
        # A third connection is over the bound: its request is answered 503 naming the flag, not queued.
        status, reply, _ = completion(p)
        assert status == 503 and "--max_connections 2" in reply["error"]["message"], reply
        assert reply["error"]["type"] == "server_error"
        for sock in slow:
            closed_within(sock, 10)
        assert wait_for(lambda: server.connections.total == 0)
        assert completion(p)[0] == 200


def test_one_client_holding_many_slow_connections_does_not_lock_out_others(api):
    """The probe's finding on the threaded server: one client holding 180-192 slow connections
    made another client's /health wait 58-88 s, and past about 192 no one could connect. Now a
    client's connections beyond --max_connections_per_client are refused, other addresses are
    served at once, and no connection costs a thread."""
    threads_before = threading.active_count()
    with serving(api, request_timeout=30.0, max_connections=64, max_connections_per_client=8) as server:
        p = server.server_address[1]

        def from_greedy(data: bytes | None = None) -> socket.socket:     # the greedy client: 127.0.0.2
            sock = socket.create_connection(("127.0.0.1", p), timeout=15, source_address=("127.0.0.2", 0))
            if data:
                sock.sendall(data)
            return sock

        greedy = [from_greedy(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nX-Slow: ") for _ in range(200)]
        assert wait_for(lambda: server.connections.per_client.get("127.0.0.2") == 8)
        assert server.connections.total == 8 and threading.active_count() < threads_before + 20
        # Another address is served, well within the greedy client's 30 s deadline.
        status, reply, _ = call(p, "GET", "/health", timeout=5)
        assert (status, reply["status"]) == (200, "ok")
        assert completion(p)[0] == 200
        # The greedy client's next request is refused by name.
        with from_greedy(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n") as sock:
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.split()[1] == b"503"
        assert "this client (127.0.0.2) already has 8 connections open" in json.loads(body)["error"]["message"]
        for sock in greedy:
            sock.close()
        assert wait_for(lambda: server.connections.total == 0)
        with from_greedy(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n") as sock:
            assert sock.recv(65536).split()[1] == b"200"


def test_refused_connections_are_answered_at_once_closed_and_logged_once(api, caplog):
    """The probe's finding: connections over the per-client bound stayed open for the request
    deadline uncounted (1,100 idle ones from one address ran the server out of descriptors) and
    each was logged. Now each gets its 503 unprompted and is closed by the server, without a
    request from the client; the refusals are logged once; an IPv6 host's connections are counted
    under its /64 network."""
    from lightrft.serving.server import client_key

    assert client_key("2001:db8:1:2::5") == client_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert client_key("2001:db8:1:3::5") != client_key("2001:db8:1:2::5")
    assert client_key("::ffff:10.0.0.7") == "10.0.0.7" and client_key("127.0.0.2") == "127.0.0.2"
    with serving(api, request_timeout=30.0, max_connections=64, max_connections_per_client=2) as server:
        p = server.server_address[1]
        held = [socket.create_connection(("127.0.0.1", p), timeout=15, source_address=("127.0.0.2", 0))
                for _ in range(2)]
        assert wait_for(lambda: server.connections.per_client.get("127.0.0.2") == 2)
        with caplog.at_level(logging.WARNING, logger="lightrft.serving.server"):
            refused = [socket.create_connection(("127.0.0.1", p), timeout=15, source_address=("127.0.0.2", 0))
                       for _ in range(40)]
            for sock in refused:          # nothing sent: the reply comes, then the server's close
                reply = b""
                while chunk := sock.recv(65536):
                    reply += chunk
                assert reply.split()[1] == b"503" and b"already has 2 connections open" in reply
                sock.close()
        assert server.connections.refused == 40
        assert wait_for(lambda: server.connections.refused_open == 0)
        messages = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
        assert len(messages) == 1, messages
        assert server.connections.total == 2         # the held ones, still served
        for sock in held:
            sock.close()
        assert wait_for(lambda: server.connections.total == 0)


def test_fifty_parallel_clients_lose_nothing_beside_slowloris_connections(api):
    results, errors = [], []

    def client(i):
        conn = http.client.HTTPConnection("127.0.0.1", p, timeout=60)
        try:
            for j, (path, payload) in enumerate([
                    ("/v1/completions", {"prompt": f"{i}+{i}=", "max_tokens": 2}),
                    ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"{i}?"}], "max_tokens": 2}),
                    ("/health", None)]):
                if payload is None:
                    conn.request("GET", path)
                else:
                    conn.request("POST", path, body=json.dumps(payload), headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                results.append((i, j, response.status, json.loads(response.read())))
        except Exception as e:  # noqa: BLE001 - every lost request is reported below
            errors.append(f"client {i}: {type(e).__name__}: {e}")
        finally:
            conn.close()

    with running(api, request_timeout=2.0) as p:
        slow = [slowloris(p) for _ in range(10)]
        threads = [threading.Thread(target=client, args=(i,)) for i in range(50)]
        for t in threads:
            t.start()
        cut = [closed_within(sock, 20) for sock in slow]
        for t in threads:
            t.join(60)
    assert errors == [] and len(results) == 150
    assert all(status == 200 for _, _, status, _ in results), [r for r in results if r[2] != 200][:3]
    answers = [body for _, j, _, body in results if j < 2]
    assert len({a["id"] for a in answers}) == 100 and all(a["usage"]["completion_tokens"] <= 2 for a in answers)
    assert max(cut) < 10                            # every slowloris connection was cut near the 2 s deadline


# ------------------------------------------------------------------------- standard clients
def test_the_openai_client_gets_n_choices_stops_seeds_and_streams(api, port):
    """The official client, as an agent framework calls it: n > 1, stop strings, seeds, log-probs,
    and streaming that gives the same choices as the plain answer."""
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    full = client.completions.create(model="tiny", prompt="1+2=", max_tokens=MAX_NEW, n=3, seed=11, logprobs=1)
    assert [c.index for c in full.choices] == [0, 1, 2]
    texts = [c.text for c in full.choices]
    assert len(set(texts)) > 1                            # n samples of one seed are not copies
    stop = next(t[1:3] for t in texts if len(t) >= 3)     # a string the seeded answer is known to contain
    cut = client.completions.create(model="tiny", prompt="1+2=", max_tokens=MAX_NEW, n=3, seed=11, stop=[stop])
    for plain, stopped in zip(full.choices, cut.choices):
        if stop in plain.text:
            assert stopped.text == plain.text[:plain.text.index(stop)] and stopped.finish_reason == "stop"
        else:
            assert stopped.text == plain.text
    assert all(len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) > 0 for c in full.choices)

    messages = [{"role": "user", "content": "2+2="}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_NEW, n=2, seed=4)
    streamed = {0: "", 1: ""}
    for chunk in client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_NEW, n=2, seed=4,
                                                stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == {c.index: c.message.content for c in chat.choices}


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed on this machine")
def test_curl_posts_a_completion(port):
    """A plain `curl`, as a shell script would call the server."""
    reply = subprocess.run(["curl", "-sS", "--max-time", "30", "-H", "Content-Type: application/json",
                            "-d", json.dumps({"prompt": "1+1=", "max_tokens": 2, "seed": 3}),
                            f"http://127.0.0.1:{port}/v1/completions"], capture_output=True, text=True, timeout=60)
    assert reply.returncode == 0, reply.stderr
    body = json.loads(reply.stdout)
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == completion(port)[1]["choices"][0]["text"]
