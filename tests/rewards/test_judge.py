"""LLM judges (`--remote_rm_url judge:...`): a tiny judge whose answers are known by construction
gives the expected scores from a model folder, through our own `serve`, from the CLI, a YAML file,
the typed config and the doctor; answers do not depend on the batch, the run or the rank; a
hanging judge URL is timed out and counted; repeated inputs are judged once."""

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from lightrft.builders.rewards import build_reward_sources
from lightrft.cli.doctor import run_doctor
from lightrft.cli.train_ppo import parse_args
from lightrft.config import RewardConfig
from lightrft.config.sections import ConfigError
from lightrft.rewards import RewardSourceError, make_reward_source
from lightrft.rewards.judge import (DEFAULT_TEMPLATE, JudgeSettings, JudgeSource, LocalJudge, OpenAIJudge,
                                    answer_parser, fill_template)
from lightrft.trainer.metrics import reward_source_counters
from lightrft.utils.tiny import build_char_tokenizer, build_tiny_causal_lm, save_tiny_model
from tests.conftest import REPO_ROOT, run_torchrun, subprocess_env
from tests.trainer.ppo_harness import LAUNCH_ENV, flags, make_task

# The known judge reads only the last character of its input (see save_known_judge).
LAST_CHAR_ANSWERS = {**{chr(ord("A") + d): str(d) for d in range(10)}, "+": "yes", "-": "no", "~": "?"}
OTHER_ANSWER = "5"
ANSWER_CHAIN = {**{chr(ord("A") + d): str(d) for d in range(10)}, "+": "y", "y": "e", "e": "s", "-": "n", "n": "o",
                "~": "?"}
ENDERS = ("0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "s", "o", "?", "</s>", "<pad>")
IDENTITY_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
RESPONSE_ONLY = "{response}"
API_KEY = "judge-key"


def save_known_judge(path: Path) -> Path:
    """A tiny Qwen2-shaped judge whose greedy answer is fixed by the last character of its input:
    A..J give the digit 0..9, "+" gives "yes", "-" gives "no", "~" gives "?", anything else "5".

    Its blocks add nothing to the residual stream (output projections zeroed), so the logits at a
    position depend on that position's token alone; the embeddings put each token class on its
    own axis and the LM head maps each axis to the next character of the answer (ANSWER_CHAIN),
    after a digit, "s", "o" or "?" to EOS. Its chat template is the message text itself, so chat
    and plain requests read the same ids."""
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = IDENTITY_CHAT_TEMPLATE
    model = build_tiny_causal_lm(tokenizer, seed=0)
    vocab = tokenizer.get_vocab()
    classes = sorted(ANSWER_CHAIN) + ["end", "other"]           # 19 classes <= 64 hidden axes
    axis = {name: k for k, name in enumerate(classes)}
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.zero_()
        head.zero_()
        for token, token_id in vocab.items():
            name = token if token in ANSWER_CHAIN else "end" if token in ENDERS else "other"
            embed[token_id, axis[name]] = 1.0
        for name, nxt in {**ANSWER_CHAIN, "end": "</s>", "other": OTHER_ANSWER}.items():
            head[vocab[nxt], axis[name]] = 10.0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def known_judge(tmp_path_factory) -> Path:
    return save_known_judge(tmp_path_factory.mktemp("known_judge") / "judge")


@pytest.fixture(scope="module")
def local_known(known_judge) -> LocalJudge:
    return LocalJudge.from_pretrained(known_judge, max_new_tokens=4, batch_size=4)


def samples(last_chars: str, prompt: str = "Grade this: ") -> tuple[list[str], list[str], list]:
    """Queries (prompt + response) whose responses end in the given characters, their prompts and labels."""
    queries = [f"{prompt}answer {i} {c}" for i, c in enumerate(last_chars)]
    return queries, [prompt] * len(queries), [None] * len(queries)


# ---------------------------------------------------------------------------------- pure parts
def test_parsers_turn_answers_into_scores():
    number, scaled = answer_parser("number"), answer_parser("number:10")
    answers = ["Score: 8/10", "-2.5 points", "1e3", "none", "1e999"]
    assert [number(a) for a in answers] == [8.0, -2.5, 1000.0, None, None]
    assert [scaled(a) for a in ["7", "Score: 8/10", "12", "-3", "n/a"]] == [0.7, 0.8, 1.0, 0.0, None]
    verdict = answer_parser("verdict")
    assert [verdict(a) for a in ["Yes.", "INCORRECT", "it is correct", "The answer: no", "pass", "maybe"]] == \
        [1.0, 0.0, 1.0, 0.0, 1.0, None]
    regex = answer_parser("regex:(?i)score:\\s*(\\d+(?:\\.\\d+)?)")
    assert [regex(a) for a in ["SCORE: 4.5 of 5", "score: x", "7"]] == [4.5, None, None]


def test_a_backtracking_pattern_is_stopped_and_the_answer_scores_none(caplog, monkeypatch):
    """`^(?:1|11)+x(\\d+)$` on forty 1s backtracks through every way to split them (Fibonacci(40),
    about 10^8): minutes, with the interpreter lock held. The search is bounded (REGEX_SECONDS, set small here): that
    answer scores None with one warning naming the pattern, and answers it matches still score."""
    from lightrft.rewards import judge

    monkeypatch.setattr(judge, "REGEX_SECONDS", 0.2)
    parse = answer_parser("regex:^(?:1|11)+x(\\d+)$")
    assert parse("11x12") == 12.0
    with caplog.at_level(logging.WARNING, logger="lightrft.rewards.judge"):
        started = time.monotonic()
        assert parse("1" * 40 + "y") is None
        assert parse("1" * 41 + "z") is None
        elapsed = time.monotonic() - started
    assert caplog.text.count("regex:^(?:1|11)+x(\\d+)$: the search took over 0.2 s on an answer of 41 "
                             "characters") == 1
    assert elapsed < 60          # not a speed check: without the bound this takes many minutes
    assert parse("1x7") == 7.0


def test_template_is_filled_in_one_pass():
    template = "P={prompt} R={response} L={label} {\"json\": 1}"
    assert fill_template(template, "2+2", "{label}", None) == 'P=2+2 R={label} L=(none) {"json": 1}'
    assert fill_template(template, "q", "r", {"b": 2, "a": [1]}) == 'P=q R=r L={"a": [1], "b": 2} {"json": 1}'
    assert fill_template(template, "q", "r", 72) == 'P=q R=r L=72 {"json": 1}'
    # docs/rewards.md shows the built-in rubric as it is.
    assert DEFAULT_TEMPLATE in (REPO_ROOT / "docs" / "rewards.md").read_text()


def test_bad_judge_options_are_config_errors_naming_the_flag(tmp_path):
    cases = {"regex:(a)(b)": "2 groups", "regex:(": "does not compile", "regex:": "needs a pattern",
             "number:0": "positive number", "number:ten": "positive number", "verdict:x": "no argument",
             "score": "choose number, number:MAX, verdict or regex:PATTERN"}
    for parser, words in cases.items():
        with pytest.raises(ConfigError) as err:
            RewardConfig(remote_rm_url="judge:x", judge_parser=parser)
        assert str(err.value).startswith(f"--judge_parser '{parser}': ") and words in str(err.value)
    no_response, unknown = tmp_path / "no_response.txt", tmp_path / "unknown.txt"
    no_response.write_text("Grade {prompt}")
    unknown.write_text("Grade {response} against {answer}")
    for path, words in [(no_response, "no {response} placeholder"), (unknown, "{answer} that nothing fills"),
                        (tmp_path / "missing.txt", "cannot be read")]:
        with pytest.raises(ConfigError, match="--judge_template") as err:
            RewardConfig(remote_rm_url="judge:x", judge_template=str(path))
        assert str(path) in str(err.value) and words in str(err.value)
    template = tmp_path / "ok.txt"
    template.write_text(RESPONSE_ONLY)
    with pytest.raises(ConfigError, match="names no judge"):
        RewardConfig(remote_rm_url="math", judge_template=str(template))
    for flag in ("judge_max_new_tokens", "judge_batch_size"):
        with pytest.raises(ConfigError, match=f"--{flag} must be positive"):
            RewardConfig(**{flag: 0})
    with pytest.raises(ValueError, match="judge: needs a model folder or an http"):
        make_reward_source("judge:")
    with pytest.raises(FileNotFoundError, match="judge model folder .*nowhere not found"):
        make_reward_source(f"judge:{tmp_path / 'nowhere'}")


# ------------------------------------------------------------------------------ a local judge
def test_known_judge_gives_the_expected_scores_and_judges_repeats_once(local_known):
    queries, prompts, labels = samples("AJC+-xCC")
    numbers = JudgeSource(local_known, RESPONSE_ONLY, "number:10", on_failure="drop")
    result = numbers.score(queries, prompts, labels)
    # A..J -> digits 0..9 -> /10; "+" and "-" answer "yes" / "no" (no number: dropped); "x" -> "5".
    assert result.rewards.tolist() == pytest.approx([0.0, 0.9, 0.2, 0.0, 0.0, 0.5, 0.2, 0.2])
    assert result.valid.tolist() == [True, True, True, False, False, True, True, True]
    # Responses differ ("answer 6 C" vs "answer 7 C"), so each is judged: no cache hit yet.
    stats = numbers.stats
    assert (stats.judged, stats.cache_hits, stats.unparsed, stats.dropped) == (8, 0, 2, 2)

    verdicts = JudgeSource(local_known, "Grade: {response}", "verdict", on_failure="error")
    queries = ["Q: a +", "Q: a +", "Q: b -", "R: a +"]         # the same (prompt, response) twice
    prompts = ["Q: ", "Q: ", "Q: ", "R: "]
    assert verdicts(queries, prompts, [None] * 4).tolist() == [1.0, 1.0, 0.0, 1.0]
    # "a +" under two prompts is one judge input: the template does not show the prompt.
    assert (verdicts.stats.samples, verdicts.stats.judged, verdicts.stats.cache_hits) == (4, 2, 2)
    assert reward_source_counters([verdicts])["rollout/reward_source0_cache_hits"] == 2.0


def test_unparseable_answers_are_dropped_or_raise_with_the_answer(local_known):
    queries, prompts, labels = samples("A~B")
    drop = JudgeSource(local_known, RESPONSE_ONLY, "number:10", on_failure="drop")
    result = drop.score(queries, prompts, labels)
    assert result.rewards.tolist() == [0.0, 0.0, pytest.approx(0.1)] and result.valid.tolist() == [True, False, True]
    assert (drop.stats.unparsed, drop.stats.dropped, drop.stats.errors, drop.stats.timeouts) == (1, 1, 0, 0)
    strict = JudgeSource(local_known, RESPONSE_ONLY, "number:10", on_failure="error")
    with pytest.raises(RewardSourceError) as err:
        strict(queries, prompts, labels)
    message = str(err.value)
    assert message.startswith(f"{local_known.name}: sample 1: the answer '?' holds no score")
    assert "--judge_parser number:10" in message and "--reward_on_failure" in message
    assert strict.stats.unparsed == 1


def test_an_input_longer_than_the_judge_context_fails_alone(local_known):
    judge = LocalJudge(local_known.model, local_known.tokenizer, "judge:known", max_new_tokens=4)
    judge.context_len = 24                                      # room for 20 input tokens
    source = JudgeSource(judge, RESPONSE_ONLY, "number:10", on_failure="drop")
    result = source.score(["B", "x" * 30 + "B"], ["", ""], [None, None])
    assert result.valid.tolist() == [True, False] and result.rewards[0].item() == pytest.approx(0.1)
    assert (source.stats.errors, source.stats.dropped) == (1, 1)


INPUTS = ["Q: 2+2=?\nA: 4\nScore:", "Q: What is 3+5?\nA: It is nine, I think.\nScore:", "x" * 45, "hello world"]


@pytest.fixture(scope="module")
def random_judge(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("random_judge") / "tiny", seed=0)


@pytest.fixture(scope="module")
def random_local(random_judge) -> LocalJudge:
    return LocalJudge.from_pretrained(random_judge, max_new_tokens=8, batch_size=4)


def test_answers_do_not_depend_on_the_batch(random_local):
    """A random tiny judge (real attention, real padding): each input alone and batched with inputs
    of other lengths gets the same greedy answer (other runs and ranks: test_two_ranks_judge_alike)."""
    batched = [a.text for a in random_local.answer(INPUTS)]
    assert all(isinstance(t, str) and t for t in batched)
    assert [random_local.answer([t])[0].text for t in INPUTS] == batched
    assert [a.text for a in random_local.answer(INPUTS[::-1])][::-1] == batched


@pytest.mark.dist
def test_two_ranks_judge_alike(tmp_path, random_judge, random_local, known_judge, local_known):
    """Each of two ranks (two other runs) loads both judges and judges the same inputs, rank 1 in
    reverse order and another batch size; every rank gets this process's answers and scores."""
    inputs, out = tmp_path / "inputs.json", tmp_path / "ranks.json"
    queries, prompts, _ = samples("AJC+x")
    inputs.write_text(json.dumps({"texts": INPUTS, "queries": queries, "prompts": prompts}))
    run_torchrun(["tests/rewards/dist_judge.py", random_judge, known_judge, inputs, out], nproc=2)
    ranks = json.loads(out.read_text())
    answers = [a.text for a in random_local.answer(INPUTS)]
    scores = JudgeSource(local_known, RESPONSE_ONLY, "number:10", on_failure="drop").score(queries, prompts,
                                                                                       [None] * len(queries))
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["answers"] == answers
        assert r["scores"] == scores.rewards.tolist() and r["valid"] == scores.valid.tolist()


# ------------------------------------------------------------------------------- a judge URL
@pytest.fixture(scope="module")
def served_judge(known_judge, tmp_path_factory):
    """`python -m lightrft.cli.serve` of the known judge, with an API key."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "lightrft.cli.serve", "--pretrain", str(known_judge),
                                 "--port", "0", "--generate_max_len", "4"], cwd=REPO_ROOT,
                                env=subprocess_env(LIGHTRFT_API_KEY=API_KEY), stdout=subprocess.PIPE, stderr=stderr,
                                text=True)
        try:
            line = proc.stdout.readline()
            if "http://" not in line:
                pytest.fail(f"serve did not start: {line!r}\n{log.read_text()[-3000:]}")
            yield "http://" + line.split("http://")[1].split("/v1")[0]
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def test_url_judge_on_our_serve_scores_as_the_local_judge(served_judge, local_known, monkeypatch):
    queries, prompts, labels = samples("AJC+-x")
    local = JudgeSource(local_known, RESPONSE_ONLY, "number:10", on_failure="drop").score(queries, prompts, labels)
    monkeypatch.setenv("LIGHTRFT_JUDGE_API_KEY", API_KEY)       # sent as Authorization: Bearer
    settings = JudgeSettings(template=RESPONSE_ONLY, parser="number:10", max_new_tokens=4, batch_size=3)
    remote = make_reward_source(f"judge:{served_judge}", judge=settings, on_failure="drop", max_retries=0)
    result = remote(queries, prompts, labels)                   # /v1/chat/completions
    assert result.rewards.tolist() == local.rewards.tolist() and result.valid.tolist() == local.valid.tolist()
    assert (remote.stats.requests, remote.stats.unparsed, remote.stats.errors) == (6, 2, 0)
    monkeypatch.delenv("LIGHTRFT_JUDGE_API_KEY")
    keyless = make_reward_source(f"judge:{served_judge}/v1/completions", judge=settings, on_failure="drop",
                                 max_retries=0)
    refused = keyless(queries[:2], prompts[:2], labels[:2])
    assert refused.valid.tolist() == [False, False] and (keyless.stats.errors, keyless.stats.dropped) == (2, 2)
    # The key as the URL's password is a bearer token too.
    completions = make_reward_source(f"judge:http://:{API_KEY}@{served_judge[len('http://'):]}/v1/completions",
                                     judge=settings, on_failure="error", max_retries=0)
    assert completions.name == f"judge:http://***@{served_judge[len('http://'):]}/v1/completions"
    assert completions(queries[:3], prompts[:3], labels[:3]).tolist() == local.rewards[:3].tolist()


class RecordingOpenAI(BaseHTTPRequestHandler):
    """Answers every completion "Score: 7/10", except a prompt holding "garbage" (not JSON)."""

    requests: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, self.headers.get("Authorization"), body))
        text = b"<html>" if "garbage" in body.get("prompt", "") else json.dumps(
            {"choices": [{"index": 0, "text": "Score: 7/10", "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text)

    def log_message(self, *args):
        pass


def test_url_judge_requests_are_greedy_seeded_and_carry_the_filled_template():
    RecordingOpenAI.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), RecordingOpenAI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        judge = OpenAIJudge(f"http://user:s3cret@127.0.0.1:{server.server_port}/v1/completions/", max_new_tokens=5,
                            model="judge-7b", max_retries=0)
        source = JudgeSource(judge, "Label {label}. Grade: {response}", "regex:Score: (\\d+)", on_failure="drop")
        result = source.score(["Q1 good", "Q2 garbage"], ["Q1", "Q2"], ["4", None])
    finally:
        server.shutdown()
        server.server_close()
    assert result.rewards.tolist() == [7.0, 0.0] and result.valid.tolist() == [True, False]
    assert (source.stats.requests, source.stats.errors, source.stats.dropped) == (2, 1, 1)
    (path, auth, body), = [r for r in RecordingOpenAI.requests if "good" in r[2]["prompt"]]
    assert path == "/v1/completions" and auth == "Bearer s3cret"
    assert body == {"prompt": "Label 4. Grade:  good", "temperature": 0.0, "seed": 0, "max_tokens": 5, "n": 1,
                    "stream": False, "model": "judge-7b"}


def test_hanging_judge_url_is_timed_out_and_counted():
    """A real server that accepts connections and never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    held = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        judge = OpenAIJudge(url, timeout=0.5, max_retries=1, backoff=0.01, batch_size=2)
        source = JudgeSource(judge, RESPONSE_ONLY, "number", on_failure="drop")
        started = time.monotonic()
        result = source.score(["a", "b", "a"], ["", "", ""], [None] * 3)
        elapsed = time.monotonic() - started
        strict = JudgeSource(OpenAIJudge(url, timeout=0.5, max_retries=0), RESPONSE_ONLY, "number")
        with pytest.raises(RewardSourceError, match=f"judge:{url}: sample 0: no answer within timeout=0.5s"):
            strict(["a"], [""], [None])
    finally:
        stop.set()
        listener.close()
        for conn in held:
            conn.close()
    # Two distinct inputs, each sent twice (one retry) in parallel: about 1 s, never a hang.
    assert elapsed < 10
    assert result.valid.tolist() == [False, False, False] and result.rewards.tolist() == [0.0, 0.0, 0.0]
    assert source.stats.as_dict() == {"batches": 1, "samples": 3, "judged": 2, "cache_hits": 1, "requests": 4,
                                      "retries": 2, "timeouts": 2, "errors": 0, "unparsed": 0, "dropped": 3}
    assert strict.stats.timeouts == 1


# ---------------------------------------------------------- CLI, YAML, typed config, doctor
@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return make_task(tmp_path_factory.mktemp("judge_task"))


def test_cli_yaml_and_typed_config_build_the_same_judge(task, known_judge, tmp_path):
    template = tmp_path / "rubric.txt"
    template.write_text("Grade: {response}")
    judge_flags = ["--remote_rm_url", f"judge:{known_judge}", "--judge_template", str(template),
                   "--judge_parser", "verdict", "--judge_max_new_tokens", "4", "--judge_batch_size", "2",
                   "--reward_on_failure", "drop"]
    base = flags(task, tmp_path / "run", remote_rm_url=None)
    from_cli = parse_args(base + judge_flags)
    config_file = tmp_path / "run.yaml"
    config_file.write_text(f"rewards:\n  remote_rm_url: judge:{known_judge}\n  judge_template: {template}\n"
                           "  judge_parser: verdict\n  judge_max_new_tokens: 4\n  judge_batch_size: 2\n"
                           "  reward_on_failure: drop\n")
    from_yaml = parse_args(base + ["--config", str(config_file)])
    typed = RewardConfig(remote_rm_url=f"judge:{known_judge}", judge_template=str(template), judge_parser="verdict",
                         judge_max_new_tokens=4, judge_batch_size=2, reward_on_failure="drop")
    assert from_cli.rewards == from_yaml.rewards == typed
    (source,) = build_reward_sources(typed)
    assert isinstance(source, JudgeSource) and source.template == "Grade: {response}" and source.on_failure == "drop"
    assert (source.judge.max_new_tokens, source.judge.engine.micro_batch_size) == (4, 2)
    queries, prompts, labels = samples("+-A")
    result = source(queries, prompts, labels)
    assert result.rewards.tolist() == [1.0, 0.0, 0.0] and result.valid.tolist() == [True, True, False]
    with pytest.raises(SystemExit):
        parse_args(base + judge_flags[:2] + ["--judge_parser", "regex:(\\d)(\\d)"])
    assert RewardConfig(remote_rm_url=f"judge:{known_judge}").judge_parser == "number:10"
    (default,) = build_reward_sources(RewardConfig(remote_rm_url=f"judge:{known_judge}"))
    assert default.template == DEFAULT_TEMPLATE and default.parser == "number:10"


def test_doctor_rewards_check_runs_the_judge(task, known_judge, tmp_path):
    template = tmp_path / "rubric.txt"
    template.write_text("{response} |")              # ends in "|": the known judge answers "5" to everything
    for key in LAUNCH_ENV:
        os.environ.pop(key, None)
    argv = flags(task, tmp_path / "run", generate_max_len=8, remote_rm_url=f"judge:{known_judge}",
                 judge_template=template, judge_max_new_tokens=4, reward_on_failure="drop")
    try:
        report = run_doctor(argv + ["--doctor_checks", "rewards", "--doctor_reward_calls", "2"])
    finally:
        for key in LAUNCH_ENV:
            os.environ.pop(key, None)
    rewards = report.check("rewards")
    figures = rewards.figures[f"judge:{known_judge}"]
    assert (figures["count"], figures["finite"], figures["error"], figures["dropped"]) == (16, True, None, 0)
    assert figures["min"] == figures["max"] == 0.5
    stats = figures["stats"]
    assert (stats["batches"], stats["samples"], stats["unparsed"]) == (2, 32, 0)
    assert stats["judged"] + stats["cache_hits"] == 32 and stats["judged"] >= 2
    # Identical scores are worth a warning (no advantage); a judge model has no timeout to warn about.
    assert [f.level for f in rewards.findings] == ["WARN"]
    assert "every sample got the same score 0.5" in rewards.findings[0].text
