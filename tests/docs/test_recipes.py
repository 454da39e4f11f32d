"""The shell recipes in scripts/ carry only flags their CLI accepts, in combinations it accepts, and
their header comments state the numbers the command really uses.

Each recipe's torchrun command is read with `shell_commands` (line continuations, `${VAR:-default}`),
parsed by the CLI's own `build_parser()` with exact flag names, and checked by its `parse_args`,
its world-size check and the gradient-accumulation arithmetic for the launcher's GPU count. The
reader itself is checked against bash: a recipe run by bash with a `torchrun` that only records its
arguments must yield the very words the reader extracted.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.docs.shell_commands import (CliCommand, ShellSyntaxError, check_cli_command, extract_cli_commands,
                                       parse_cli_command)

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO_ROOT / "scripts").glob("*.sh"))
SIZE_CLASSES = ("0.5b", "1.5b", ("7b", "8b"), "14b", "32b", ("70b", "72b"))
_ASSIGNED = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=", re.MULTILINE)


@pytest.fixture(scope="module")
def recipe_paths(tmp_path_factory):
    """Real stand-ins for the recipes' path variables: a tiny model folder and a prompt file."""
    from lightrft.utils.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("recipe_paths")
    model = save_tiny_model(root / "model")
    data = root / "prompts.jsonl"
    data.write_text('{"problem": "1+1=", "answer": "2", "prompt": "1+1=", "input": "1+1=", "output": "2"}\n')
    return {"model": str(model), "data": str(data), "dir": str(root / "out")}


def substituted_env(text: str, paths: dict) -> dict:
    """Values for the recipe's path variables (names ending in MODEL, _DATA, DATASET or _DIR)."""
    env = {}
    for name in _ASSIGNED.findall(text):
        if name.endswith("MODEL"):
            env[name] = paths["model"]
        elif name.endswith("_DATA") or name.endswith("DATASET"):
            env[name] = paths["data"]
        elif name.endswith("_DIR"):
            env[name] = paths["dir"]
    return env


def recipe_commands(path: Path, env: dict | None = None) -> list[CliCommand]:
    commands = extract_cli_commands(path.read_text(), env or {})
    assert commands, f"{path.name}: no `-m lightrft.cli.<name>` command found"
    return commands


def header_text(path: Path) -> str:
    """The leading comment block, one space-joined string (wrapped lines read as one)."""
    lines = []
    for line in path.read_text().splitlines()[1:]:
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(" ".join(lines).split())


# ----------------------------------------------------------------------------- the recipes
def test_every_size_class_has_a_grpo_and_a_ppo_recipe():
    names = [p.name for p in RECIPES]
    for size in SIZE_CLASSES:
        sizes = size if isinstance(size, tuple) else (size,)
        for algo in ("grpo", "ppo"):
            found = [n for n in names if n.startswith(algo + "_") and any(n.endswith(f"_{s}.sh") for s in sizes)]
            assert found, f"no {algo} recipe for the {'/'.join(sizes)} class in scripts/ (have {names})"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_is_an_executable_bash_script(path):
    assert path.read_text().startswith("#!/usr/bin/env bash\n"), f"{path.name}: first line must be the bash shebang"
    assert os.access(path, os.X_OK), f"{path.name} is not executable: chmod +x scripts/{path.name}"
    assert "set -euo pipefail" in path.read_text(), f"{path.name}: stop on the first error (set -euo pipefail)"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_flags_are_accepted_by_the_cli(path, recipe_paths):
    text = path.read_text()
    for command in recipe_commands(path, substituted_env(text, recipe_paths)):
        assert check_cli_command(command) == []


def header_finder(path: Path):
    header = header_text(path)

    def find(pattern: str) -> tuple:
        match = re.search(pattern, header)
        assert match, f"{path.name}: header has no line matching {pattern!r}"
        return tuple(int(g) if g.isdigit() else g for g in match.groups())

    return header, find


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_header_states_hardware_memory_settings_and_accumulation(path):
    (command,) = recipe_commands(path)
    args = parse_cli_command(command)
    header, find = header_finder(path)

    # Hardware: GPUs per node x nodes = world size, as launched.
    gpn, nodes, gpus = find(r"Hardware (\d+) GPUs per node x (\d+) nodes? = (\d+) GPUs")
    assert gpn == int(command.launcher_option("--nproc_per_node")), "GPUs per node != --nproc_per_node"
    assert nodes == int(command.launcher_option("--nnodes", "1")), "nodes != NNODES default (--nnodes)"
    assert gpus == gpn * nodes == command.world_size
    if nodes > 1:
        for flag in ("--nnodes", "--node_rank", "--master_addr"):
            assert command.launcher_option(flag) is not None, f"multi-node recipe without torchrun {flag}"

    # ZeRO stage, offload, precision, packing.
    assert find(r"ZeRO stage (\d)") == (args.zero_stage,)
    offload = re.search(r"offload: (.*?) Precision", header).group(1)
    assert ("--adam_offload" in offload) == args.adam_offload, f"offload line {offload!r} vs --adam_offload"
    assert ("--zero3_param_offload" in offload) == args.zero3_param_offload, offload
    frozen_offload = getattr(args, "ref_reward_offload", False)
    assert ("--ref_reward_offload" in offload) == frozen_offload, offload
    assert offload.startswith("none") == (not args.adam_offload and not args.zero3_param_offload
                                          and not frozen_offload), offload
    assert find(r"Precision (bf16|fp32)") == ("bf16" if args.bf16 else "fp32",)
    assert ("gradient checkpointing" in header) == args.gradient_checkpointing
    assert find(r"Packing (on|off)") == ("on" if args.packing_samples else "off",)
    if hasattr(args, "max_len"):
        assert find(r"\bmax_len (\d+)") == (args.max_len,)

    # Gradient accumulation, recomputed here.
    micro, world, per_forward, tbs, per_forward2, accumulation = find(
        r"micro_train_batch_size (\d+) x (\d+) GPUs = (\d+) (?:samples|pairs) per forward: (\d+) / (\d+) = (\d+) "
        r"gradient-accumulation steps")
    assert micro == args.micro_train_batch_size and world == gpus and tbs == args.train_batch_size
    assert per_forward == per_forward2 == micro * gpus
    assert accumulation * per_forward == tbs


@pytest.mark.parametrize("path", [p for p in RECIPES if p.name.startswith(("grpo_", "ppo_"))], ids=lambda p: p.name)
def test_rl_recipe_header_states_its_rollout_and_batches(path):
    (command,) = recipe_commands(path)
    args = parse_cli_command(command)
    _, find = header_finder(path)

    (engine,) = find(r"Rollout (hf|vllm)\b")
    assert engine == args.rollout_engine
    if engine == "vllm":
        (util,) = find(r"--vllm_gpu_memory_utilization ([0-9.]+)")
        assert float(util) == args.vllm_gpu_memory_utilization

    rbs, n, samples = find(r"rollout_batch_size (\d+) prompts x n_samples_per_prompt (\d+) = (\d+) samples per rollout")
    assert (rbs, n) == (args.rollout_batch_size, args.n_samples_per_prompt)
    assert samples == rbs * n
    rbs2, world, prompts_per_gpu, samples_per_gpu = find(r"\((\d+) / (\d+) GPUs = (\d+) prompts, (\d+) samples per GPU\)")
    assert (rbs2, world) == (rbs, command.world_size)
    assert prompts_per_gpu * world == rbs and samples_per_gpu == prompts_per_gpu * n
    tbs, samples2, tbs2, steps, epochs = find(
        r"train_batch_size (\d+): (\d+) / (\d+) = (\d+) optimizer steps per rollout \(max_epochs (\d+)\)")
    assert tbs == tbs2 == args.train_batch_size and samples2 == samples and epochs == args.max_epochs
    assert steps * tbs == samples
    assert find(r"micro_rollout_batch_size (\d+) samples?") == (args.micro_rollout_batch_size,)
    assert find(r"prompt_max_len (\d+), generate_max_len (\d+)") == (args.prompt_max_len, args.generate_max_len)

    # What each kind of recipe is for.
    if path.name.startswith("grpo_"):
        assert args.advantage_estimator == "group_norm" and args.remote_rm_url == "math"
        assert args.critic_pretrain is None and args.n_samples_per_prompt >= 2
    else:
        assert args.advantage_estimator == "gae"
        assert args.critic_pretrain and args.reward_pretrain


# ----------------------------------------------------------------- the reader against bash
FAKE_TORCHRUN = """#!/usr/bin/env bash
printf '%s\\0' "$@" >> "$ARGV_LOG"
printf '\\n\\0' >> "$ARGV_LOG"
"""


def bash_argv(path: Path, tmp_path: Path, env: dict) -> list[list[str]]:
    """The argument lists bash passes to `torchrun` when it runs the recipe."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "torchrun"
    fake.write_text(FAKE_TORCHRUN)
    fake.chmod(0o755)
    log = tmp_path / "argv.log"
    log.write_text("")
    full_env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "ARGV_LOG": str(log), "HOME": str(tmp_path),
                **env}
    subprocess.run(["bash", str(path)], env=full_env, cwd=tmp_path, check=True, timeout=60)
    calls, current = [], []
    for word in log.read_text().split("\0")[:-1]:
        if word == "\n":
            calls.append(current)
            current = []
        else:
            current.append(word)
    return calls


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_reader_extracts_what_bash_passes(path, tmp_path):
    env = {"NNODES": "3", "NODE_RANK": "2", "MASTER_ADDR": "10.1.2.3", "MODEL": "/models/with space/m"}
    commands = recipe_commands(path, env)
    expected = [c.launcher[1:] + ["-m", c.module] + c.argv for c in commands if c.launcher[:1] == ["torchrun"]]
    assert expected, f"{path.name}: no torchrun launch"
    assert bash_argv(path, tmp_path, env) == expected
    launcher = commands[0]
    assert launcher.launcher_option("--nnodes") == "3" and launcher.launcher_option("--node_rank") == "2"
    assert launcher.launcher_option("--master_addr") == "10.1.2.3"
    assert launcher.argv[launcher.argv.index("--pretrain") + 1] == "/models/with space/m"


# ---------------------------------------------------------------------- the checker can fail
GOOD = """#!/usr/bin/env bash
MODEL=${MODEL:-tiny/model}
DATA=${DATA:-data.jsonl}   # a trailing comment
torchrun --nproc_per_node 2 -m lightrft.cli.train_ppo \\
    --pretrain "$MODEL" --prompt_data ${DATA} \\
    --remote_rm_url math --advantage_estimator group_norm --n_samples_per_prompt 4 \\
    --rollout_batch_size 8 --train_batch_size 16 --micro_train_batch_size 2 2>&1 | tee log.txt
"""


def one_command(text: str, **env) -> CliCommand:
    (command,) = extract_cli_commands(text, env)
    return command


def test_reader_joins_continuations_and_expands_defaults():
    command = one_command(GOOD)
    assert command.module == "lightrft.cli.train_ppo" and command.line == 4
    assert command.launcher == ["torchrun", "--nproc_per_node", "2"]
    assert command.world_size == 2
    assert command.argv == ["--pretrain", "tiny/model", "--prompt_data", "data.jsonl", "--remote_rm_url", "math",
                            "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4",
                            "--rollout_batch_size", "8", "--train_batch_size", "16", "--micro_train_batch_size", "2"]
    assert check_cli_command(command) == []
    # A value from the caller's environment wins over the recipe's default, as in bash.
    assert one_command(GOOD, MODEL="/elsewhere").argv[1] == "/elsewhere"


def test_checker_rejects_a_bogus_flag():
    problems = check_cli_command(one_command(GOOD.replace("--remote_rm_url math", "--remote_rm_url math --bogus_flag 3")))
    assert len(problems) == 1 and "--bogus_flag" in problems[0] and "unknown flag" in problems[0]


def test_checker_rejects_an_abbreviated_flag():
    """argparse would accept `--n_samples` for `--n_samples_per_prompt`; a recipe must spell flags out."""
    problems = check_cli_command(one_command(GOOD.replace("--n_samples_per_prompt", "--n_samples")))
    assert problems and "--n_samples" in problems[0]


def test_checker_rejects_a_bad_choice_and_a_bad_combination():
    (problem,) = check_cli_command(one_command(GOOD.replace("group_norm", "grpo")))
    assert "--advantage_estimator" in problem and "grpo" in problem
    # gae needs a critic: the parser accepts the flags, parse_args refuses the combination.
    (problem,) = check_cli_command(one_command(GOOD.replace("group_norm", "gae")))
    assert "--critic_pretrain" in problem


def test_checker_rejects_batch_sizes_that_do_not_fit_the_gpu_count():
    # 8 prompts over 3 ranks do not divide evenly.
    (problem,) = check_cli_command(one_command(GOOD.replace("--nproc_per_node 2", "--nproc_per_node 3")))
    assert "3 ranks" in problem and "--rollout_batch_size" in problem
    # 16 samples per step over 4 ranks x 8 per forward = 32: no whole number of accumulation steps.
    (problem,) = check_cli_command(one_command(GOOD.replace("--nproc_per_node 2", "--nproc_per_node 4")
                                               .replace("--micro_train_batch_size 2", "--micro_train_batch_size 8")))
    assert "--train_batch_size" in problem and "--micro_train_batch_size" in problem


def test_reader_refuses_shell_it_cannot_expand():
    with pytest.raises(ShellSyntaxError, match=r"arithmetic expansion"):
        extract_cli_commands("torchrun -m lightrft.cli.train_ppo --rollout_batch_size $((8 * 16))")
    with pytest.raises(ShellSyntaxError, match=r"\$UNSET_NAME is not set"):
        extract_cli_commands("torchrun -m lightrft.cli.train_ppo --pretrain $UNSET_NAME")


def test_checker_reads_elided_examples_flag_by_flag():
    """`train_ppo ... --flag value` in prose: the flags shown must exist, the rest cannot be judged."""
    elided = "torchrun ... -m lightrft.cli.train_ppo ... --remote_rm_url http://127.0.0.1:5000/get_reward"
    assert check_cli_command(one_command(elided)) == []
    (problem,) = check_cli_command(one_command(elided + " --remote_rm_uri x"))
    assert "--remote_rm_uri" in problem
    (problem,) = check_cli_command(one_command(elided + " --rollout_engine sglang"))
    assert "--rollout_engine" in problem and "sglang" in problem


# ---------------------------------------------------------------- the table in docs/recipes.md
def recipes_table() -> dict[str, list[str]]:
    """Script name -> the cells of its row in docs/recipes.md's table."""
    rows = {}
    for line in (REPO_ROOT / "docs" / "recipes.md").read_text().splitlines():
        match = re.match(r"\| \[`([\w.+-]+\.sh)`\]\(\.\./scripts/\1\) \|(.*)\|$", line)
        if match:
            assert match.group(1) not in rows, f"docs/recipes.md lists {match.group(1)} twice"
            rows[match.group(1)] = [cell.strip() for cell in match.group(2).split("|")]
    return rows


def test_recipes_table_lists_every_script_once():
    assert sorted(recipes_table()) == [p.name for p in RECIPES]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipes_table_row_matches_the_script(path):
    method, model, hardware, zero, offload, rollout, batches = recipes_table()[path.name]
    (command,) = recipe_commands(path)
    args = parse_cli_command(command)
    _, find = header_finder(path)
    assert method.lower() == path.name.split("_")[0]
    assert model == f"`{command.argv[command.argv.index('--pretrain') + 1]}`"
    (gigabytes,) = find(r"GPUs, (\d+) GB each")
    assert hardware == (f"{command.launcher_option('--nnodes', '1')} x {command.launcher_option('--nproc_per_node')}, "
                        f"{gigabytes} GB")
    assert zero == str(args.zero_stage)
    offloaded = [name for name, on in (("Adam", args.adam_offload), ("params", args.zero3_param_offload),
                                       ("ref/RM", getattr(args, "ref_reward_offload", False))) if on]
    assert offload == (" + ".join(offloaded) or "none")
    assert rollout == getattr(args, "rollout_engine", "-")
    if hasattr(args, "rollout_batch_size"):
        samples = args.rollout_batch_size * args.n_samples_per_prompt
        assert batches == (f"{args.rollout_batch_size} x {args.n_samples_per_prompt} = {samples} / "
                           f"{args.train_batch_size}")
    else:
        assert batches == str(args.train_batch_size)
