"""serve and serve_rm refuse what they cannot serve with one line naming the flag and the fix, not
a traceback: a port another process listens on (checked before the model loads), a missing model
folder, and a causal LM folder given as a reward model (no value head)."""

import socket

import pytest

from lightrft.cli import serve, serve_rm
from lightrft.utils.tiny import save_tiny_model


@pytest.fixture(scope="module")
def lm_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("lm") / "lm", seed=0)


@pytest.fixture
def busy_port():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def error_of(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("main, flag", [(serve.main, "--pretrain"), (serve_rm.main, "--reward_pretrain")])
def test_a_port_in_use_is_refused_before_the_model_loads(main, flag, busy_port, lm_folder, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr("lightrft.models.tokenizer.build_tokenizer", no_loading)
    line = error_of(main, [flag, str(lm_folder), "--port", str(busy_port)], capsys)
    assert f"cannot listen on --host 127.0.0.1 --port {busy_port}: Address already in use" in line
    assert "pick another --port (0 takes any free port" in line


def test_serve_rm_names_a_missing_folder_and_a_folder_without_a_value_head(lm_folder, tmp_path, capsys):
    line = error_of(serve_rm.main, ["--reward_pretrain", str(tmp_path / "nope"), "--port", "0"], capsys)
    assert "--reward_pretrain" in line and "no such model folder" in line
    line = error_of(serve_rm.main, ["--reward_pretrain", str(lm_folder), "--port", "0"], capsys)
    assert "has no value-head weights 'score.weight': it is not a trained reward model" in line
