"""One vocabulary rule for every entry point (lightrft/models/vocabulary.py): a tokenizer with a
special token past the model's embedding rows is accepted with one warning when no id the run
feeds the model is out of range, and refused with the fix where one is. `serve` runs for real on
such a model: it starts, answers, and refuses a request that holds the extra token."""

import json
import logging
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightrft.models.vocabulary import check_vocabulary, ids_in_data
from lightrft.utils.tiny import save_tiny_model
from tests.conftest import REPO_ROOT, subprocess_env

EXTRA = "<|extra|>"


@pytest.fixture(scope="module")
def extra_token_model(tmp_path_factory):
    """A tiny model folder whose tokenizer has one added special token past the embedding rows."""
    path = save_tiny_model(tmp_path_factory.mktemp("vocab") / "model")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": [EXTRA]})
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def loaded(extra_token_model):
    return AutoModelForCausalLM.from_pretrained(extra_token_model), AutoTokenizer.from_pretrained(extra_token_model)


def test_an_unused_extra_token_is_accepted_with_one_warning(loaded, caplog):
    model, tokenizer = loaded
    rows = model.get_input_embeddings().num_embeddings
    assert len(tokenizer) == rows + 1
    with caplog.at_level(logging.WARNING, logger="lightrft"):
        assert check_vocabulary(model, tokenizer, "--pretrain unused") == rows
        assert check_vocabulary(model, tokenizer, "--pretrain unused", fed=ids_in_data([[5, 6]], "data")) == rows
    warnings = [r.getMessage() for r in caplog.records if "--pretrain unused" in r.getMessage()]
    assert len(warnings) == 1 and repr(EXTRA) in warnings[0] and "resize_token_embeddings" in warnings[0]


def test_an_extra_token_the_run_feeds_is_refused_with_the_fix(loaded):
    model, tokenizer = loaded
    extra = tokenizer.convert_tokens_to_ids(EXTRA)
    tokenizer.pad_token = EXTRA
    with pytest.raises(ValueError, match=rf"the pad token '{EXTRA}' \(id {extra}\).*resize_token_embeddings"):
        check_vocabulary(model, tokenizer, "--pretrain m")


def test_data_holding_the_extra_token_is_refused_naming_the_row(loaded):
    model, tokenizer = loaded
    ids = tokenizer(["12+3=", f"4+{EXTRA}"], add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match=r"--pretrain m: .*a token of row 1 of --dataset d.jsonl"):
        check_vocabulary(model, tokenizer, "--pretrain m", fed=ids_in_data(ids, "--dataset d.jsonl"))


def test_a_chat_template_writing_the_extra_token_is_refused_only_when_applied(loaded):
    model, tokenizer = loaded
    tokenizer.chat_template = ("{% for m in messages %}" + EXTRA + "{{ m['content'] }}{% endfor %}")
    check_vocabulary(model, tokenizer, "--pretrain m", chat_template=False)
    with pytest.raises(ValueError, match=rf"the chat template's token '{EXTRA}'"):
        check_vocabulary(model, tokenizer, "--pretrain m", chat_template=True)


def test_a_scorer_smaller_than_what_the_policy_samples_is_refused(loaded):
    model, tokenizer = loaded
    rows = model.get_input_embeddings().num_embeddings
    check_vocabulary(model, tokenizer, "--reward_pretrain rm", produced_by=rows)
    with pytest.raises(ValueError, match=rf"--reward_pretrain rm: .*sample token ids up to {rows}"):
        check_vocabulary(model, tokenizer, "--reward_pretrain rm", produced_by=rows + 1)


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def test_serve_runs_a_model_with_an_unused_extra_token(extra_token_model, tmp_path):
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "lightrft.cli.serve", "--pretrain", str(extra_token_model),
                             "--port", "0", "--generate_max_len", "4"],
                            cwd=REPO_ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = proc.stdout.readline()
        assert "http://" in line, (tmp_path / "serve.log").read_text()[-3000:]
        url = "http://" + line.split("http://")[1].split("/v1")[0] + "/v1/completions"
        status, body = post(url, {"prompt": "1+1=", "max_tokens": 4})
        assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")
        status, body = post(url, {"prompt": f"1+{EXTRA}", "max_tokens": 4})
        assert status == 400 and repr(EXTRA) in body["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    assert (tmp_path / "serve.log").read_text().count("are not fed by this run") == 1
