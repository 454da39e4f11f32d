"""serve_rm: a real HTTP server on 127.0.0.1 scoring with a real (tiny) RewardModel."""

import base64
import http.client
import json
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
import torch
from transformers import AutoTokenizer

from lightrft.cli.serve_rm import RewardScorer, build_server, main
from lightrft.models import RewardModel
from lightrft.rewards.remote import RemoteRewardClient
from lightrft.serving.http import HTTPSettings
from lightrft.utils.tiny import save_tiny_model
from tests.conftest import REPO_ROOT, subprocess_env
from tests.serving.test_http import raw

TEXTS = ["user: 2+2?\nassistant: 4", "hi", "a much longer text that needs padding in its batch", "x y z", "Q: ok"]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A reward-model folder: a tiny Qwen2 backbone with a seeded head, saved with its tokenizer and
    normalisation statistics mean=0.25, std=2."""
    root = tmp_path_factory.mktemp("serve_rm")
    base = save_tiny_model(root / "base", seed=3)
    torch.manual_seed(0)
    model = RewardModel(base, init_value_head=True)
    with torch.no_grad():
        model.model.score.weight.normal_(0, 1.0)  # a large head so texts score far apart
    model.set_normalization(0.25, 2.0)
    model.save_pretrained(root / "rm", tokenizer=AutoTokenizer.from_pretrained(base))
    return root / "rm"


@pytest.fixture(scope="module")
def direct_scores(rm_dir):
    """Each text scored alone (no padding) straight through RewardModel, with EOS appended as in training."""
    model = RewardModel(rm_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(rm_dir)
    with torch.no_grad():
        return [model(torch.tensor([tokenizer(t)["input_ids"] + [tokenizer.eos_token_id]])).item() for t in TEXTS]


@pytest.fixture(scope="module")
def scorer(rm_dir):
    return RewardScorer(RewardModel(rm_dir), AutoTokenizer.from_pretrained(rm_dir), batch_size=2, max_len=64)


def start(scorer, settings=None):
    """`build_server` on a free port, serving in a thread: (url, server)."""
    srv = build_server(scorer, "127.0.0.1", 0, settings)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{srv.server_address[1]}", srv


@pytest.fixture(scope="module")
def server(scorer):
    url, srv = start(scorer)
    yield url
    srv.shutdown()
    srv.server_close()


def post(url, body: bytes, path="/get_reward", headers=None):
    request = urllib.request.Request(url + path, data=body, headers={"Content-Type": "application/json",
                                                                     **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post_json(url, payload, path="/get_reward", headers=None):
    return post(url, json.dumps(payload).encode(), path, headers)


def test_batch_scores_equal_direct_reward_model_scores(server, direct_scores):
    # Five texts in batches of two: padding and batching must not change any score or the order.
    assert min(abs(a - b) for i, a in enumerate(direct_scores) for b in direct_scores[i + 1:]) > 1e-3
    status, reply = post_json(server, {"query": TEXTS, "prompts": ["p"] * 5, "labels": [None] * 5})
    assert status == 200
    assert reply["rewards"] == pytest.approx(direct_scores, abs=1e-5)
    # Any POST path works, and "query" alone is enough.
    status, reply = post_json(server, {"query": TEXTS[:1]}, path="/")
    assert (status, reply["rewards"]) == (200, pytest.approx(direct_scores[:1], abs=1e-5))


def test_long_queries_keep_their_last_tokens(server, rm_dir):
    text = "y" * 100 + "tail"
    tokenizer = AutoTokenizer.from_pretrained(rm_dir)
    ids = (tokenizer(text)["input_ids"] + [tokenizer.eos_token_id])[-64:]  # --max_len 64
    with torch.no_grad():
        expected = RewardModel(rm_dir)(torch.tensor([ids])).item()
    assert post_json(server, {"query": [text]})[1]["rewards"] == pytest.approx([expected], abs=1e-5)


@pytest.mark.parametrize("body, status, message", [
    (b"{not json", 400, "the request body is not valid JSON"),
    (b"[1, 2]", 400, "the request body must be a JSON object of the reward endpoint's fields, got an array"),
    (b'{"prompts": ["a"]}', 400, "'query' is missing: it must be a list of full texts (prompt + response)"),
    (b'{"query": "just one string"}', 400, "'query': input should be a valid list, got 'just one string'"),
    (b'{"query": ["ok", 5]}', 400, "'query[1]': input should be a valid string, got 5"),
    (b"\xff\xfe", 400, "not valid JSON"),
    (b'{"query": ["a"], "quary": ["b"]}', 400, "unknown field 'quary' for the reward endpoint"),
])
def test_malformed_requests_get_4xx_and_the_server_keeps_serving(server, direct_scores, body, status, message):
    got_status, reply = post(server, body)
    assert got_status == status
    assert message in reply["error"]
    assert post_json(server, {"query": TEXTS[1:2]})[1]["rewards"] == pytest.approx(direct_scores[1:2], abs=1e-5)


@pytest.mark.parametrize("body, status, words", [
    (b'{"query": ["ok", "a\\ud800"]}', 400, "'query[1]' holds a lone UTF-16 surrogate"),
    (b'{"query": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "'query' nests JSON"),
    (json.dumps({"query": ["ok", "z" * 321]}).encode(), 413, "'query[1]' is 321 characters, over this server's limit "
     "of 320"),                                          # --max_len 64 x the longest token ("<pad>", 5 characters)
], ids=["surrogate", "deep-nesting", "over-character-cap"])
def test_hostile_queries_get_4xx_naming_the_field(server, direct_scores, body, status, words):
    got, reply = post(server, body)
    assert (got, words in reply["error"]) == (status, True), reply
    assert post_json(server, {"query": TEXTS[1:2]})[1]["rewards"] == pytest.approx(direct_scores[1:2], abs=1e-5)


def raw_reply(url: str, data: bytes) -> tuple[int, dict]:
    """Sends `data` as is; (status, JSON body) of the reply, read until the server closes."""
    host, port = url.removeprefix("http://").split(":")
    return raw(int(port), data, host=host)


def test_bad_content_length_and_type_are_refused_unread(server):
    start_line = b"POST /get_reward HTTP/1.1\r\nHost: t\r\n"
    status, reply = raw_reply(server, start_line + b"Content-Type: application/json\r\nContent-Length: -1\r\n\r\n{}")
    assert status == 400 and "bad Content-Length: send one Content-Length" in reply["error"]
    status, reply = raw_reply(server, start_line + b"Content-Type: text/plain\r\nContent-Length: 13\r\n\r\n"
                                                   b'{"query": []}')
    assert status == 415 and "application/json" in reply["error"]


def test_api_key_via_bearer_or_the_password_of_the_url(scorer, direct_scores):
    url, srv = start(scorer, HTTPSettings(api_key="rm-key"))
    try:
        status, reply = post_json(url, {"query": TEXTS[:1]})
        assert status == 401 and "no API key" in reply["error"]
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(url + "/health", timeout=30)
        assert info.value.code == 401
        status, reply = post_json(url, {"query": TEXTS[:1]}, headers={"Authorization": "Bearer rm-key"})
        assert (status, reply["rewards"]) == (200, pytest.approx(direct_scores[:1], abs=1e-5))
        # train_ppo --remote_rm_url http://user:<key>@host/... sends the key as the basic-auth password.
        keyed = RemoteRewardClient(url.replace("http://", "http://trainer:rm-key@") + "/get_reward", max_retries=0)
        assert keyed(TEXTS, ["p"] * 5, [None] * 5).tolist() == pytest.approx(direct_scores, abs=1e-5)
        wrong = RemoteRewardClient(url.replace("http://", "http://trainer:guess@") + "/get_reward", max_retries=0)
        with pytest.raises(Exception, match="HTTP 401"):
            wrong(TEXTS, ["p"] * 5, [None] * 5)
        basic = base64.b64encode(b"trainer:guess").decode()
        assert post_json(url, {"query": []}, headers={"Authorization": f"Basic {basic}"})[0] == 401
    finally:
        srv.shutdown()
        srv.server_close()


def test_missing_content_length_and_routes(server):
    host, port = server.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/get_reward")
    conn.putheader("Content-Type", "application/json")
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 411 and "Content-Length" in json.loads(response.read())["error"]
    conn.close()
    with urllib.request.urlopen(server + "/health", timeout=30) as response:
        assert (response.status, json.loads(response.read())) == (200, {"status": "ok"})
    with pytest.raises(urllib.error.HTTPError) as info:        # every path takes a POST, none a GET
        urllib.request.urlopen(server + "/nope", timeout=30)
    assert info.value.code == 405 and "no GET route '/nope'; POST texts to score" in json.loads(info.value.read())["error"]


def test_empty_query_list_and_concurrent_clients(server, direct_scores):
    assert post_json(server, {"query": []}) == (200, {"rewards": []})
    results = [None] * 6

    def client(i):
        order = TEXTS[i % 5:] + TEXTS[:i % 5]
        results[i] = (order, post_json(server, {"query": order})[1]["rewards"])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = dict(zip(TEXTS, direct_scores))
    for order, rewards in results:
        assert rewards == pytest.approx([expected[t] for t in order], abs=1e-5)


def test_command_line_server_with_normalisation(rm_dir, direct_scores):
    cmd = [sys.executable, "-m", "lightrft.cli.serve_rm", "--reward_pretrain", str(rm_dir), "--port", "0",
           "--batch_size", "3", "--normalize_reward", "--device", "cpu"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=subprocess_env(LIGHTRFT_API_KEY="cli-key"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "http://127.0.0.1:" in line, proc.stderr.read() if proc.poll() is not None else line
        assert "API key required" in line
        url = line.split("http://")[1].split()[0]
        assert post_json("http://" + url, {"query": TEXTS})[0] == 401      # the key from $LIGHTRFT_API_KEY
        status, reply = post_json("http://" + url, {"query": TEXTS}, headers={"Authorization": "Bearer cli-key"})
        # Saved statistics mean=0.25, std=2: served scores are (r - 0.25) / 2.
        assert status == 200
        assert reply["rewards"] == pytest.approx([(r - 0.25) / 2 for r in direct_scores], abs=1e-5)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0


def test_command_line_rejects_bad_flags(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--reward_pretrain", str(tmp_path), "--batch_size", "0"])
    assert info.value.code == 2 and "--batch_size must be positive, got 0" in capsys.readouterr().err


def test_remote_reward_client_of_train_ppo_reads_the_server(server, direct_scores):
    from lightrft.rewards.remote import RemoteRewardClient

    client = RemoteRewardClient(server + "/get_reward", timeout=30, max_retries=0)
    rewards = client(TEXTS, ["p"] * len(TEXTS), [None] * len(TEXTS))
    assert rewards.dtype == torch.float32
    assert rewards.tolist() == pytest.approx(direct_scores, abs=1e-5)
