"""No secret is written anywhere: a key planted in a reward server's URL (as user info and as a
query value) reaches the server, and appears in no file a training run writes (checkpoints,
run_config.yaml, TensorBoard events, the exported model) and nowhere in its output; the lock
file's command line and the options of every writer are redacted by the option's secret kind."""

import base64
import json
import subprocess
import sys

import pytest

from lightrft.config.options import option
from lightrft.utils import run_lock
from lightrft.utils.secrets import (REDACTED, holds_redacted, redact_argv, redact_options, redact_value,
                                    secret_flags)
from lightrft.utils.trackers import redacted_config
from tests.conftest import REPO_ROOT, subprocess_env
from tests.rewards.test_remote import ScriptedServer
from tests.trainer.ppo_harness import flags, make_task

KEY = "PLANTEDsecret7f3a9"
QUERY_KEY = "PLANTEDquery55c1"


def test_secret_flags_come_from_the_config_fields_marker():
    assert secret_flags() == {"api_key": "key", "use_wandb": "key", "remote_rm_url": "urls", "eval_remote_rm_url": "urls"}
    with pytest.raises(ValueError, match="secret kind must be 'key' or 'urls'"):
        option(None, "x", secret="password")


def test_values_are_redacted_by_their_kind():
    assert redact_value("use_wandb", KEY) == REDACTED
    assert redact_value("use_wandb", "offline") == "offline" and redact_value("use_wandb", None) is None
    assert redact_value("api_key", KEY) == REDACTED
    urls = f"http://user:{KEY}@rm:5000/score?token={QUERY_KEY},math,judge:https://{KEY}@judge/v1"
    assert redact_value("remote_rm_url", urls) == "http://***@rm:5000/score?token=***,math,judge:https://***@judge/v1"
    # a URL's credentials are caught in an option that is not marked too
    assert redact_value("pretrain", f"https://u:{KEY}@hub/model") == "https://***@hub/model"
    nested = redact_options({"logging": {"use_wandb": KEY, "logging_steps": 1}, "reward": {"remote_rm_url": urls}})
    assert KEY not in json.dumps(nested) and nested["logging"]["logging_steps"] == 1
    assert redacted_config({"use_wandb": KEY}) == {"use_wandb": REDACTED}      # the tracker's config


def test_a_command_line_is_recorded_without_its_secrets(monkeypatch):
    argv = ["train_ppo", "--use_wandb", KEY, f"--api_key={KEY}", "--remote_rm_url", f"http://a:{KEY}@h/p",
            "--use_wandb", "offline", "--pretrain", "model"]
    assert redact_argv(argv) == ["train_ppo", "--use_wandb", REDACTED, f"--api_key={REDACTED}", "--remote_rm_url",
                                 "http://***@h/p", "--use_wandb", "offline", "--pretrain", "model"]
    monkeypatch.setattr(sys, "argv", argv)
    record = run_lock.holder_record()
    assert KEY not in json.dumps(record) and "--pretrain model" in record["command"]
    assert KEY not in run_lock.describe(record)                      # the "in use" error shows this


def test_abbreviated_secret_flags_and_quotes_in_passwords_are_redacted(monkeypatch):
    # argparse takes `--use_wan KEY` for --use_wandb and `--api_ke KEY` for --api_key: the record
    # keys on the flag they stand for, not on the spelling.
    argv = ["train_ppo", "--use_wan", KEY, f"--api_ke={KEY}", "--remote_rm", f"http://rm:s3'{KEY}@host/p",
            "--pretrain", "model"]
    assert redact_argv(argv) == ["train_ppo", "--use_wan", REDACTED, f"--api_ke={REDACTED}", "--remote_rm",
                                 "http://***@host/p", "--pretrain", "model"]
    monkeypatch.setattr(sys, "argv", argv)
    assert KEY not in run_lock.describe(run_lock.holder_record())
    # A quote, a slash or a '#' in a password: the whole user info goes, in any text.
    for password in (f"s3'{KEY}", f"a/{KEY}", f"{KEY}#x", f'"{KEY}'):
        url = f"http://rm:{password}@127.0.0.1:5000/score"
        assert redact_value("remote_rm_url", url) == "http://***@127.0.0.1:5000/score", password
        assert KEY not in redact_value("pretrain", f"see {url}, or ['{url}']")
    assert redact_value("remote_rm_url", "http://127.0.0.1:5000/score,math") == "http://127.0.0.1:5000/score,math"


def test_no_file_a_run_writes_holds_a_planted_key(tmp_path):
    (tmp_path / "task").mkdir()
    task = make_task(tmp_path / "task")
    server = ScriptedServer()          # answers every request with scores (tests/rewards/test_remote.py)
    out = tmp_path / "run"
    url = f"http://lightrft:{KEY}@127.0.0.1:{server.port}/score?token={QUERY_KEY}"
    try:
        args = flags(task, out, remote_rm_url=url, use_tensorboard=out / "tb", save_steps=1, max_steps=1)
        proc = subprocess.run([sys.executable, "-m", "lightrft.cli.train_ppo", *args], cwd=REPO_ROOT,
                              env=subprocess_env(), capture_output=True, text=True, timeout=600)
    finally:
        server.close()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the credentials did reach the server
    first = server.requests[0]
    assert first["headers"]["Authorization"] == "Basic " + base64.b64encode(f"lightrft:{KEY}".encode()).decode()
    assert f"token={QUERY_KEY}" in first["path"]
    written = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "run_config.yaml" for p in written) and any("events.out.tfevents" in p.name for p in written)
    assert any(p.match("*/client_state/rank_0.pt") for p in written)
    for path in written:
        data = path.read_bytes()
        assert KEY.encode() not in data and QUERY_KEY.encode() not in data, path
    output = proc.stdout + proc.stderr
    assert KEY not in output and QUERY_KEY not in output
    assert '"remote_rm_url": "http://***@127.0.0.1' in output          # the options line, redacted

    # Repeating the run from its run_config.yaml asks for the secret again, naming the flag.
    config = out / "ckpt" / "run_config.yaml"
    assert holds_redacted(config.read_text())
    again = subprocess.run([sys.executable, "-m", "lightrft.cli.train_ppo", "--config", str(config)], cwd=REPO_ROOT,
                           env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode != 0
    assert "holds a value lightrft redacted when it saved the run" in again.stderr
    assert "pass --remote_rm_url on the command line" in again.stderr and "Traceback" not in again.stderr
