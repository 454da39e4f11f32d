"""docs/configuration.md is exactly what tools/gen_config_docs.py makes of the CLI parsers today."""

import argparse
import difflib
import importlib
from pathlib import Path

import pytest

from tests.conftest import load_file_module

REPO_ROOT = Path(__file__).resolve().parents[2]
DOC = REPO_ROOT / "docs" / "configuration.md"


def load_generator():
    return load_file_module(REPO_ROOT / "tools" / "gen_config_docs.py")


@pytest.fixture(scope="module")
def generator():
    return load_generator()


def test_configuration_reference_is_up_to_date(generator):
    expected = generator.render()
    current = DOC.read_text() if DOC.exists() else ""
    if current != expected:
        diff = "".join(difflib.unified_diff(current.splitlines(True), expected.splitlines(True),
                                            "docs/configuration.md (committed)", "generated from the parsers", n=1))
        pytest.fail("docs/configuration.md is out of date with the CLI parsers; regenerate it with "
                    f"`python tools/gen_config_docs.py` and commit it.\n{diff[:4000]}")


def test_every_cli_flag_appears_in_the_reference(generator):
    """Independent of the renderer's layout: each option string of each parser is on the page."""
    text = DOC.read_text()
    for name in generator.CLI_MODULES:
        module = importlib.import_module(f"lightrft.cli.{name}")
        section = text.split(f"\n## {name}\n", 1)
        assert len(section) == 2, f"docs/configuration.md has no '## {name}' section"
        body = section[1].split("\n## ", 1)[0]
        inherited = set()
        if name in generator.EXTENDS_TRAIN_PPO:      # listed once, under train_ppo
            inherited = {a.dest for a in importlib.import_module("lightrft.cli.train_ppo").build_parser()._actions}
            assert "every [train_ppo](#train_ppo) flag" in body
        for action in module.build_parser()._actions:
            if isinstance(action, argparse._HelpAction) or action.dest in inherited:
                continue
            for flag in action.option_strings:
                assert f"`{flag}`" in body, f"{name} flag {flag} missing from docs/configuration.md"


def test_renderer_tells_a_default_a_switch_a_choice_and_a_required_flag_apart(generator):
    parser = argparse.ArgumentParser(prog="demo")
    group = parser.add_argument_group("things", "a group | with a pipe")
    group.add_argument("--rate", type=float, default=0.5, help="step size, %(default)s by default (100%%)")
    group.add_argument("--fast", action="store_true", help="go fast")
    group.add_argument("--mode", choices=["a", "b"], default="a", help="a or b")
    group.add_argument("--path", required=True, help="where")
    group.add_argument("--pair", type=int, nargs=2, default=(1, 2), metavar=("LOW", "HIGH"), help="two ints")
    text = generator.render_cli("demo", parser)
    assert "### demo: things" in text and "a group \\| with a pipe" in text
    assert "| `--rate` | float | `0.5` | step size, 0.5 by default (100%) |" in text
    assert "| `--fast` | switch | off | go fast |" in text
    assert "| `--mode` | `a` \\| `b` | `a` | a or b |" in text
    assert "| `--path` | str | **required** | where |" in text
    assert "| `--pair` | LOW HIGH | `1 2` | two ints |" in text


def test_check_mode_fails_on_a_stale_page(generator, tmp_path, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text(generator.render().replace("`--seed`", "`--old_seed`", 1))
    assert generator.main(["--check", "--output", str(stale)]) == 1
    assert "python tools/gen_config_docs.py" in capsys.readouterr().err
    fresh = tmp_path / "fresh.md"
    assert generator.main(["--output", str(fresh)]) == 0
    assert generator.main(["--check", "--output", str(fresh)]) == 0
