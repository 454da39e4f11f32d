"""serve: the policy behind an OpenAI-compatible server, driven by the `openai` client as an agent
application would; recording, reward feedback, one train_ppo step on the recordings, and the
server answering with the new weights. Plus the request parsing, the record files and the
recorded-data checks on their own."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM

from lightrft.cli.train_ppo import parse_args, train
from lightrft.models.tokenizer import build_tokenizer
from lightrft.serving.openai_api import (RequestError, ServeLimits, finish_choice, parse_chat_request,
                                         parse_completion_request)
from lightrft.serving.policy import Sample
from lightrft.serving.records import ExperienceRecord, ExperienceRecorder, read_records, tokenizer_fingerprint
from lightrft.experience.recorded import RecordedExperienceDataset, check_recorded_algorithm
from lightrft.utils.tiny import build_char_tokenizer, build_char_tokenizer_with_bos, save_tiny_model
from tests.conftest import REPO_ROOT, subprocess_env, to_flags
from tests.trainer.ppo_harness import LAUNCH_ENV
from tests.trainer.test_preview import parse_markdown_table, tensorboard_texts

MAX_NEW = 8
API_KEY = "test-key"


def token_log_probs(model, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    """Teacher-forced log-probs of the response under `model` at temperature 1. Shape: (A,)"""
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float()            # (A, V)
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(response_ids)[:, None]).squeeze(1)


def records_by_id(folder: Path) -> dict[str, ExperienceRecord]:
    return {r.id: r for r, _ in read_records(folder)[0]}


@pytest.fixture
def server(tmp_path):
    """`python -m lightrft.cli.serve --port 0` on a tiny model, recording, watching a checkpoint folder,
    with an API key from $LIGHTRFT_API_KEY."""
    model = save_tiny_model(tmp_path / "model", seed=0)
    record, ckpt = tmp_path / "record", tmp_path / "ckpt"
    stderr = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "lightrft.cli.serve", "--pretrain", str(model), "--port", "0",
                             "--record", str(record), "--watch", str(ckpt), "--watch_interval", "0.2",
                             "--generate_max_len", str(MAX_NEW), "--seed", "5"],
                            cwd=REPO_ROOT, env=subprocess_env(LIGHTRFT_API_KEY=API_KEY), stdout=subprocess.PIPE,
                            stderr=stderr, text=True)
    try:
        line = proc.stdout.readline()
        if "http://" not in line:
            pytest.fail(f"serve did not start: {line!r}\n{(tmp_path / 'serve.log').read_text()[-3000:]}")
        url = line.split("http://")[1].split("/v1")[0]
        yield {"url": f"http://{url}", "model": model, "record": record, "ckpt": ckpt, "root": tmp_path}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        stderr.close()


def test_agent_session_record_feedback_train_and_reload(server):
    client = OpenAI(base_url=server["url"] + "/v1", api_key=API_KEY, max_retries=0)
    # The key from $LIGHTRFT_API_KEY guards every route; other HTTP clients send it as a bearer token.
    assert httpx.get(server["url"] + "/health").status_code == 401
    http = httpx.Client(headers={"Authorization": f"Bearer {API_KEY}"})
    old_model = AutoModelForCausalLM.from_pretrained(server["model"]).eval()
    tokenizer = build_tokenizer(str(server["model"]))

    # 1. A three-turn chat: each turn sends the whole conversation so far.
    messages, chat_ids = [], []
    for question in ["2+3=", "and 4+4=", "thanks"]:
        messages.append({"role": "user", "content": question})
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_NEW, logprobs=True)
        assert reply.system_fingerprint == "lightrft-policy-v0"
        choice = reply.choices[0]
        recorded = records_by_id(server["record"])[reply.id]
        # The record holds what the client got, for the conversation rendered by the chat template.
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert recorded.prompt_token_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert recorded.messages == messages and recorded.response == choice.message.content
        assert recorded.log_probs == [t.logprob for t in choice.logprobs.content]
        assert recorded.policy_version == 0
        assert reply.usage.completion_tokens == len(recorded.response_token_ids)
        # The served log-probs are the policy's (temperature 1, no filters: the model's own softmax).
        expected = token_log_probs(old_model, recorded.prompt_token_ids, recorded.response_token_ids)
        assert torch.tensor(recorded.log_probs) == pytest.approx(expected, abs=1e-4)
        chat_ids.append(reply.id)
        messages.append({"role": "assistant", "content": choice.message.content})

    # 2. Completions: one request = one generation with its own seed; streaming gives the same text.
    first = client.completions.create(model="policy", prompt="7+1=", max_tokens=MAX_NEW, seed=7, logprobs=1)
    again = client.completions.create(model="policy", prompt="7+1=", max_tokens=MAX_NEW, seed=7)
    other = client.completions.create(model="policy", prompt="7+1=", max_tokens=MAX_NEW, seed=8)
    assert first.choices[0].text == again.choices[0].text != other.choices[0].text
    streamed = client.completions.create(model="policy", prompt="7+1=", max_tokens=MAX_NEW, seed=7, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == first.choices[0].text
    assert first.choices[0].logprobs.token_logprobs == records_by_id(server["record"])[first.id].log_probs

    # 3. Rewards through the feedback endpoint; a second reward for the same response replaces the first.
    rewards = {chat_ids[0]: 1.0, chat_ids[1]: 0.0, chat_ids[2]: 1.0, first.id: 0.0}
    feedback = server["url"] + "/v1/feedback"
    assert http.post(feedback, json={"id": chat_ids[1], "reward": 5.0}).status_code == 200
    for response_id, reward in rewards.items():
        assert http.post(feedback, json={"id": response_id, "reward": reward}).json()["status"] == "recorded"
    missing = http.post(feedback, json={"id": "cmpl-nope", "reward": 1.0})
    assert missing.status_code == 404 and "cmpl-nope" in missing.json()["error"]["message"]
    assert http.post(feedback, json={"id": first.id, "reward": "good"}).json()["error"]["param"] == "reward"
    joined = {r.id: reward for r, reward in read_records(server["record"])[0]}
    assert {k: joined[k] for k in rewards} == rewards
    assert joined[again.id] is None                      # no feedback: not trained on

    # 4. One REINFORCE step on every rewarded sample, exporting global_step1_hf: the completion, and
    #    the chat, whose turns join into one episode where the text round trip kept their token ids
    #    (the tiny tokenizer drops spaces on encoding: a turn after an answer with one stays apart).
    dataset = RecordedExperienceDataset(server["record"], tokenizer)
    batch = len(dataset)
    assert 2 <= batch <= 4 and sum(s.turns for s in dataset.samples) == 4
    for key in LAUNCH_ENV:
        os.environ.pop(key, None)
    out = server["root"] / "train"
    logs = train(parse_args(to_flags({
        "pretrain": server["model"], "recorded_data": server["record"], "advantage_estimator": "reinforce",
        "rollout_batch_size": batch, "train_batch_size": batch, "micro_train_batch_size": 1,
        "micro_rollout_batch_size": batch,
        "init_kl_coef": 0, "actor_learning_rate": 1e-2, "lr_scheduler": "constant", "lr_warmup_ratio": 0,
        "max_steps": 1, "save_steps": 1, "save_hf_ckpt": True, "disable_ds_ckpt": True, "zero_stage": 2,
        "seed": 3, "ckpt_path": server["ckpt"], "save_path": out / "model", "preview_steps": 1,
        "use_tensorboard": out / "tb"})))
    for key in LAUNCH_ENV:
        os.environ.pop(key, None)
    assert logs["rollout/reward"] == pytest.approx(sum(s.reward for s in dataset.samples) / batch)
    assert logs["rollout/policy_version"] == 0.0
    # The preview shows the recorded responses (a joined chat's turns with the tokens between them
    # marked [env: ...]) with their rewards (a chat's last turn's), served by version 0 (staleness 0).
    [(step, table)] = tensorboard_texts(out / "tb", "rollout/preview")
    served = {r.id: r.response for r, _ in read_records(server["record"])[0]}
    rows = parse_markdown_table(table)[1]
    assert step == 1 and len(rows) == batch
    assert sorted((float(r[3]), int(r[4]), int(r[5])) for r in rows) == \
        sorted((rewards[s.id], 0, 0) for s in dataset.samples)
    for s in dataset.samples:
        assert sum(r[2].endswith(served[s.id]) and ("[env: " in r[2]) == (s.turns > 1) for r in rows) == 1

    # 5. The server picks the export up as policy version 1 and answers with its weights.
    deadline = time.time() + 60
    while http.get(server["url"] + "/health").json()["policy_version"] != 1:
        assert time.time() < deadline, "the server did not load global_step1_hf"
        time.sleep(0.2)
    new_model = AutoModelForCausalLM.from_pretrained(server["ckpt"] / "global_step1_hf").eval()
    messages = [{"role": "user", "content": "2+3="}]
    reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_NEW, temperature=0,
                                           logprobs=True)
    assert reply.system_fingerprint == "lightrft-policy-v1"
    recorded = records_by_id(server["record"])[reply.id]
    assert recorded.policy_version == 1
    new = token_log_probs(new_model, recorded.prompt_token_ids, recorded.response_token_ids)
    old = token_log_probs(old_model, recorded.prompt_token_ids, recorded.response_token_ids)
    assert torch.tensor(recorded.log_probs) == pytest.approx(new, abs=1e-4)
    assert (new - old).abs().max() > 1e-3                # the step moved the weights the server now uses
    # Greedy: every served token is the new model's most likely one.
    ids = torch.tensor([recorded.prompt_token_ids + recorded.response_token_ids])
    with torch.no_grad():
        logits = new_model(ids).logits[0, len(recorded.prompt_token_ids) - 1:-1]
    assert logits.argmax(dim=-1).tolist() == recorded.response_token_ids


# --------------------------------------------------------------------------- request parsing
LIMITS = ServeLimits(max_new_tokens=16, prompt_max_len=32)


@pytest.mark.parametrize("payload, param, words", [
    ({"prompt": "hi", "max_tokens": 17}, "max_tokens", "--generate_max_len"),
    ({"prompt": "hi", "temperature": -1}, "temperature", "'temperature': input should be greater than or equal to 0"),
    ({"prompt": "hi", "n": 17}, "n", "'n': input should be less than or equal to 16, got 17"),
    ({"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
    ({"prompt": "x" * 40}, "prompt", "--prompt_max_len"),
    ({"prompt": [5, 1000]}, "prompt", "outside the vocabulary"),
    ({"prompt": "hi", "stop": 3}, "stop", "stop"),
    ({"prompt": "hi", "temperature": float("nan")}, "temperature", "finite"),
    ({"prompt": "hi", "stream": "x" * 10_000}, "stream", "(10002 characters)"),
])
def test_bad_completion_requests_name_the_field(payload, param, words):
    with pytest.raises(RequestError) as info:
        parse_completion_request(payload, build_char_tokenizer(), LIMITS)
    assert info.value.param == param and words in str(info.value)


def test_prompt_and_answer_must_fit_the_model_context():
    limits = ServeLimits(max_new_tokens=16, prompt_max_len=32, context_len=20, token_chars=1)
    tokenizer = build_char_tokenizer()
    # No max_tokens: the room the context leaves (20 - 12 = 8), not --generate_max_len 16.
    assert parse_completion_request({"prompt": "x" * 12}, tokenizer, limits).params.max_new_tokens == 8
    assert parse_completion_request({"prompt": "x" * 12, "max_tokens": 8}, tokenizer, limits).params.max_new_tokens == 8
    for payload, param, words in [({"prompt": "x" * 12, "max_tokens": 9}, "max_tokens", "ask for at most 8"),
                                  ({"prompt": "x" * 20}, "prompt", "no room for an answer"),
                                  ({"prompt": "x" * 21}, "prompt", "21 characters, more than 20"),
                                  ({"prompt": list(range(5, 45))}, "prompt", "40 tokens")]:
        with pytest.raises(RequestError) as info:
            parse_completion_request(payload, tokenizer, limits)
        assert info.value.param == param and words in str(info.value), str(info.value)


def test_chat_request_uses_the_template_and_checks_messages():
    tokenizer = build_char_tokenizer_with_bos()
    request = parse_chat_request({"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 4},
                                 tokenizer, LIMITS)
    assert request.prompt == "user: 1+1=\nassistant: "
    # The template's text is encoded without adding a second BOS.
    assert request.prompt_token_ids == tokenizer(request.prompt, add_special_tokens=False)["input_ids"]
    assert request.params.max_new_tokens == 4 and request.params.temperature == 1.0
    with pytest.raises(RequestError) as info:
        parse_chat_request({"messages": [{"role": "user"}]}, tokenizer, LIMITS)
    assert info.value.param == "messages[0].content" and "'messages[0].content' is missing" in str(info.value)
    # A conversation of more messages than prompt tokens is refused before it is rendered (300,000
    # empty messages took a gigabyte to validate and render).
    with pytest.raises(RequestError, match="'messages' holds 33 messages, more than the 32 prompt tokens"):
        parse_chat_request({"messages": [{"role": "user", "content": ""}] * 33}, tokenizer, LIMITS)


def test_stop_string_cuts_text_and_keeps_the_tokens_that_made_it():
    tokenizer = build_char_tokenizer()
    ids = tokenizer("ab|cd", add_special_tokens=False)["input_ids"]
    sample = Sample(token_ids=ids, log_probs=[-1.0, -2.0, -3.0, -4.0, -5.0], truncated=True, policy_version=0)
    choice = finish_choice(tokenizer, sample, ["|c", "d"])
    assert (choice.text, choice.token_ids, choice.log_probs, choice.finish_reason) == \
        ("ab", ids[:4], [-1.0, -2.0, -3.0, -4.0], "stop")
    assert finish_choice(tokenizer, sample, []).finish_reason == "length"


# ------------------------------------------------------------------------- records on disk
def make_record(tokenizer, rid: str, version: int = 0, **changes) -> ExperienceRecord:
    """A record as the server writes it (answer "c" + EOS to "ab"), with `changes` applied."""
    values = dict(id=rid, index=0, prompt_token_ids=[10, 11], response_token_ids=[12, 2], log_probs=[-0.5, -0.25],
                  policy_version=version, tokenizer=tokenizer_fingerprint(tokenizer), prompt="ab", response="c",
                  messages=None, sampling={"seed": 1}, finish_reason="stop", time=0.0)
    values.update(changes)
    return ExperienceRecord(**values)


def test_recorder_survives_a_torn_line_and_the_last_feedback_counts(tmp_path):
    tokenizer = build_char_tokenizer()
    recorder = ExperienceRecorder(tmp_path)
    recorder.record(make_record(tokenizer, "a"))
    recorder.add_feedback("a", 1.0)
    recorder.add_feedback("a", -2.0)
    with pytest.raises(KeyError, match="'b'"):
        recorder.add_feedback("b", 1.0)
    with pytest.raises(ValueError, match="finite"):
        recorder.add_feedback("a", float("nan"))
    with open(tmp_path / "experiences.jsonl", "a") as f:      # a crash in the middle of a write
        f.write('{"id": "torn", "ind')
    assert [(r.id, reward) for r, reward in read_records(tmp_path)[0]] == [("a", -2.0)]
    recorder.close()                                          # the server stops; it held the folder
    reopened = ExperienceRecorder(tmp_path)                   # cuts the torn tail, appends after it
    reopened.record(make_record(tokenizer, "c", version=3))
    assert [(r.id, r.policy_version, reward) for r, reward in read_records(tmp_path)[0]] == \
        [("a", 0, -2.0), ("c", 3, None)]


def test_recorded_dataset_keeps_rewarded_records_and_refuses_another_tokenizer(tmp_path):
    tokenizer = build_char_tokenizer()
    recorder = ExperienceRecorder(tmp_path / "ok")
    for i in range(4):
        recorder.record(make_record(tokenizer, f"r{i}", version=i))
    for i in (0, 2, 3):
        recorder.add_feedback(f"r{i}", float(i))
    dataset = RecordedExperienceDataset(tmp_path / "ok", tokenizer)
    assert [s.id for s in dataset.samples] == ["r0", "r2", "r3"] and dataset.unrewarded == 1
    samples, rewards = dataset.collate_fn([dataset[0], dataset[1]])
    assert rewards == [0.0, 2.0] and [s.policy_version for s in samples] == [0, 2]
    assert len(RecordedExperienceDataset(tmp_path / "ok", tokenizer, max_samples=2)) == 2

    other = ExperienceRecorder(tmp_path / "other")
    # The fingerprint follows the vocabulary (what a token id means), not how prompts get a BOS.
    bigger = build_char_tokenizer()
    bigger.add_tokens(["<extra>"])
    assert tokenizer_fingerprint(bigger) != tokenizer_fingerprint(tokenizer)
    assert tokenizer_fingerprint(build_char_tokenizer_with_bos()) == tokenizer_fingerprint(tokenizer)
    other.record(make_record(bigger, "x"))
    with pytest.raises(ValueError, match=r"record 1 \(id 'x'.*different tokenizer"):
        RecordedExperienceDataset(tmp_path / "other", tokenizer)
    with pytest.raises(FileNotFoundError, match="--recorded_data"):
        RecordedExperienceDataset(tmp_path / "nothing", tokenizer)


def test_recorded_training_refuses_group_estimators():
    with pytest.raises(ValueError, match="one response per prompt"):
        check_recorded_algorithm("group_norm", 4)
    with pytest.raises(ValueError, match="--n_samples_per_prompt"):
        check_recorded_algorithm("reinforce", 2)
    check_recorded_algorithm("reinforce", 1)


def test_a_second_server_on_a_record_folder_is_refused_before_loading_the_model(tmp_path):
    model = save_tiny_model(tmp_path / "model", seed=0)
    holder = ExperienceRecorder(tmp_path / "record")      # another server, recording into the folder
    try:
        done = subprocess.run([sys.executable, "-m", "lightrft.cli.serve", "--pretrain", str(model), "--port", "0",
                               "--record", str(tmp_path / "record")], cwd=REPO_ROOT, env=subprocess_env(),
                              capture_output=True, text=True, timeout=120)
    finally:
        holder.close()
    assert done.returncode == 2, done.stderr
    assert "serve: error:" in done.stderr and str(tmp_path / "record") in done.stderr
    assert f"pid {os.getpid()}" in done.stderr and "Traceback" not in done.stderr
