"""The commands in docs/*.md work.

- Every fenced shell block whose first line is `# cpu-test` is run with bash, in order, in one empty
  folder per page (after the page's `# doc-test: NAME.py` blocks are saved there), with the
  repository on PYTHONPATH; each must exit 0.
- Every other `-m lightrft.cli.NAME ...` command in a shell block is parsed by that CLI's parser
  and start-up checks, like the recipes (tests/docs/test_recipes.py).
"""

import json
import math
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import free_port, subprocess_env
from tests.docs.markdown_blocks import FencedBlock, fenced_blocks
from tests.docs.shell_commands import (CliCommand, ShellSyntaxError, check_cli_command, extract_cli_commands,
                                       extract_recipe_runs)

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO_ROOT / "docs").glob("*.md"))
# Variables a doc uses without setting them stand for user-chosen values.
UNSET = "{name}"
BLOCK_TIMEOUT_S = 300


def shell_blocks(path: Path) -> list[FencedBlock]:
    return [b for b in fenced_blocks(path) if b.is_shell]


def cpu_test_blocks(path: Path) -> list[FencedBlock]:
    return [b for b in shell_blocks(path) if b.marker("cpu-test") is not None]


def doc_test_files(path: Path) -> dict[str, str]:
    """NAME -> source of the page's `# doc-test: NAME` blocks."""
    files = {}
    for block in fenced_blocks(path):
        name = block.marker("doc-test")
        if name:
            if name in files:
                raise ValueError(f"{block.where}: a second `# doc-test: {name}` block")
            files[name] = block.body
    return files


def doc_commands():
    for path in DOCS:
        for block in shell_blocks(path):
            try:
                commands = extract_cli_commands(block.body, unset=UNSET)
            except ShellSyntaxError as err:  # reported by the test, not at collection
                yield pytest.param(block, err, id=f"{block.where}:unreadable")
                continue
            for command in commands:
                yield pytest.param(block, command, id=f"{path.name}:{block.line + command.line}")


def doc_recipe_runs():
    for path in DOCS:
        for block in shell_blocks(path):
            try:
                runs = extract_recipe_runs(block.body, unset=UNSET)
            except ShellSyntaxError:  # test_doc_command_is_accepted_by_its_cli reports the block
                continue
            for run in runs:
                yield pytest.param(block, run, id=f"{path.name}:{block.line + run.line}:{Path(run.script).name}")


DOC_COMMANDS = list(doc_commands())
DOC_RECIPE_RUNS = list(doc_recipe_runs())
PAGES_WITH_CPU_TESTS = [p for p in DOCS if cpu_test_blocks(p)]


def run_blocks(path: Path, workdir: Path, env: dict | None = None) -> list[str]:
    """Saves the page's doc-test files in `workdir` and runs its cpu-test blocks there in order;
    returns their outputs, or fails with the block and its output when one exits non-zero.
    Processes a block leaves behind (a server started with `&`) are stopped with it: each block
    runs in its own session."""
    outputs = []
    for name, source in doc_test_files(path).items():
        (workdir / name).write_text(source)
    for block in cpu_test_blocks(path):
        script = workdir / f"block_{block.line}.sh"
        script.write_text(block.body)
        proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", str(script)], cwd=workdir,
                                env=subprocess_env(**(env or {})), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            pytest.fail(f"{block.where}: the cpu-test block ran past {BLOCK_TIMEOUT_S} s\n{block.body}\n"
                        f"--- output (tail) ---\n{output[-6000:]}")
        finally:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        if proc.returncode != 0:
            pytest.fail(f"{block.where}: the cpu-test block exited with {proc.returncode}\n{block.body}\n"
                        f"--- output (tail) ---\n{output[-6000:]}")
        outputs.append(output)
    return outputs


@pytest.mark.parametrize("block, command", DOC_COMMANDS)
def test_doc_command_is_accepted_by_its_cli(block, command):
    if isinstance(command, ShellSyntaxError):
        pytest.fail(f"{block.where}: this shell block cannot be read to check its lightrft commands: {command}")
    problems = check_cli_command(command)
    assert problems == [], f"{block.where}: {problems}"


@pytest.mark.parametrize("block, run", DOC_RECIPE_RUNS)
def test_doc_recipe_run_is_accepted_by_its_cli(block, run):
    """`[VAR=value] bash scripts/X.sh --extra flags`: the recipe's command with those variables and
    the extra flags appended (where its `"$@"` puts them) passes its CLI's checks."""
    script = REPO_ROOT / run.script
    assert script.is_file(), f"{block.where}: {run.script} does not exist"
    (command,) = extract_cli_commands(script.read_text(), run.env)
    command.argv += run.args
    assert check_cli_command(command) == [], block.where


def test_docs_hold_cli_commands_and_cpu_tests():
    """The checks above have something to check: the pages that document commands carry them."""
    pages = {p.name for p in PAGES_WITH_CPU_TESTS}
    assert {"pipeline.md", "extending.md"} <= pages, pages
    modules = {command.module for _, command in (p.values for p in DOC_COMMANDS) if isinstance(command, CliCommand)}
    assert {"lightrft.cli.train_sft", "lightrft.cli.train_rm", "lightrft.cli.train_ppo",
            "lightrft.cli.serve_rm"} <= modules, modules


def summaries(output: str) -> list[dict]:
    """The JSON summary lines the training CLIs print last."""
    return [json.loads(line) for line in output.splitlines() if line.startswith('{"stop_reason"')]


def check_pipeline(workdir: Path, outputs: list[str]) -> None:
    setup, sft, rm, ppo, grpo = outputs
    for name, output in (("sft", sft), ("rm", rm), ("ppo", ppo), ("grpo", grpo)):
        (summary,) = summaries(output)
        assert summary["stop_reason"] == "finished", (name, summary)
        assert Path(summary["save_path"]) == workdir / name
        assert (workdir / name / "config.json").is_file() and (workdir / name / "model.safetensors").is_file()
    # 64 rows / 16 per step = 4 SFT and 4 RM steps; 16 prompts / 8 = 2 PPO steps; 8 / 4 = 2 GRPO steps.
    assert [summaries(o)[0]["step"] for o in (sft, rm, ppo, grpo)] == [4, 4, 2, 2]
    assert 0.0 <= summaries(rm)[0]["train/acc"] <= 1.0
    # The server's answer to the two-query request: one finite score per query.
    (answer,) = [json.JSONDecoder().raw_decode(line[line.index('{"rewards"'):])[0] for line in grpo.splitlines()
                 if '{"rewards"' in line]
    assert len(answer["rewards"]) == 2 and all(math.isfinite(r) for r in answer["rewards"])


def check_extending(workdir: Path, outputs: list[str]) -> None:
    log = [json.loads(line) for line in (workdir / "reward_log.jsonl").read_text().splitlines()]
    # 16 prompts / 4 per step = 4 steps, logged by RewardLog before each step's update.
    assert [row["step"] for row in log] == [0, 1, 2, 3]
    for row in log:
        # LengthCurriculumTrainer: at most min(4, 1 + step) new tokens; a lone first token is exact.
        assert 1.0 <= row["response_length"] <= min(4, 1 + row["step"]), row
        # my_reward.py gives 0, 0.5 or 1 per sample: a mean over 4 x 4 = 16 samples is a multiple of 1/32.
        assert 0.0 <= row["reward"] <= 1.0 and abs(row["reward"] * 32 - round(row["reward"] * 32)) < 1e-4, row
    assert log[0]["response_length"] == 1.0
    assert (workdir / "extended" / "model.safetensors").is_file()


PAGE_CHECKS = {"pipeline.md": check_pipeline, "extending.md": check_extending}


@pytest.mark.dist
@pytest.mark.parametrize("path", PAGES_WITH_CPU_TESTS, ids=lambda p: p.name)
def test_cpu_test_blocks_run(path, tmp_path):
    outputs = run_blocks(path, tmp_path, env={"PORT": str(free_port())})
    if path.name in PAGE_CHECKS:
        PAGE_CHECKS[path.name](tmp_path, outputs)



def test_block_reader_finds_markers_and_refuses_an_unclosed_fence(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n```bash\n# cpu-test\necho hi\n```\n\n  ~~~python\n  # doc-test: a.py\n  x = 1\n  ~~~\n"
                    "```\nplain\n```\n")
    shell, python, plain = fenced_blocks(page)
    assert (shell.line, shell.language, shell.is_shell, shell.marker("cpu-test")) == (2, "bash", True, "")
    assert shell.body == "# cpu-test\necho hi\n"
    assert (python.language, python.marker("doc-test"), python.marker("cpu-test")) == ("python", "a.py", None)
    assert python.body == "# doc-test: a.py\nx = 1\n"
    assert plain.language == "" and not plain.is_shell
    assert doc_test_files(page) == {"a.py": "# doc-test: a.py\nx = 1\n"}
    page.write_text("```bash\necho never closed\n")
    with pytest.raises(ValueError, match="never closed"):
        fenced_blocks(page)
