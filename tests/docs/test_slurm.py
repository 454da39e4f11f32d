"""scripts/slurm.sbatch starts a recipe once per node with the right NNODES, NODE_RANK and
MASTER_ADDR. SLURM itself does not run here: `srun` and `scontrol` are stand-ins on PATH that do
what SLURM documents (srun starts the command once per node with SLURM_NODEID set; `scontrol show
hostnames` expands the node list), and `torchrun` is a stand-in that writes the command line it
was given, so the real recipe's launch line is what is checked."""

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

SBATCH = REPO_ROOT / "scripts" / "slurm.sbatch"
INHERITED = {"MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "RANK", "WORLD_SIZE", "LOCAL_RANK", "RECIPE",
             "MODEL", "PROMPT_DATA", "EVAL_DATA", "SAVE_DIR"}

SRUN = r"""#!/usr/bin/env bash
# srun --nodes N --ntasks-per-node 1 --kill-on-bad-exit=1 CMD...: CMD once per node, SLURM_NODEID set.
nodes=1
while [[ "$1" == --* ]]; do
    case "$1" in
        --nodes) nodes=$2; shift 2 ;;
        --ntasks-per-node) [[ "$2" == 1 ]] || exit 9; shift 2 ;;
        *) shift ;;
    esac
done
pids=()
for ((i = 0; i < nodes; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i "$@" & pids+=($!); done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""

SCONTROL = r"""#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" ]] || { echo "unexpected: $*" >&2; exit 9; }
case "$3" in
    "gpu-[07-08]") printf 'gpu-07\ngpu-08\n' ;;
    "big-[0000-4999]") for ((i = 0; i < 5000; i++)); do printf 'big-%04d\n' "$i"; done ;;
    *) echo "unexpected list $3" >&2; exit 9 ;;
esac
"""

TORCHRUN = r"""#!/usr/bin/env bash
printf '%q ' "$@" > "$OUT/torchrun.$NODE_RANK"
"""


@pytest.fixture
def slurm_env(tmp_path):
    shims = tmp_path / "bin"
    shims.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("torchrun", TORCHRUN)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    # Neither SLURM's variables nor a process group's (tests in this process may have set MASTER_PORT)
    # nor the recipe's own reach the script from the test run.
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("SLURM_") and key not in INHERITED}
    env.update(PATH=f"{shims}:{os.environ['PATH']}", OUT=str(tmp_path), SLURM_JOB_NODELIST="gpu-[07-08]",
               SLURM_NNODES="2")
    return env


def run(env, *args, **extra) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SBATCH), *args], cwd=REPO_ROOT, env={**env, **extra}, capture_output=True,
                          text=True, timeout=120)


def test_each_node_starts_the_recipe_with_its_rank_and_the_first_node_as_master(slurm_env, tmp_path):
    done = run(slurm_env, "--generate_max_len", "4096", "--use_wandb", "a b", RECIPE="scripts/grpo_qwen2.5_14b.sh",
               MODEL="/models/qwen14b")
    assert done.returncode == 0, done.stderr
    assert "scripts/grpo_qwen2.5_14b.sh on 2 nodes, master gpu-07:29500" in done.stderr
    for rank in (0, 1):
        argv = shlex.split((tmp_path / f"torchrun.{rank}").read_text())
        assert argv[:8] == ["--nnodes", "2", "--node_rank", str(rank), "--master_addr", "gpu-07", "--master_port",
                            "29500"]
        assert argv[argv.index("--pretrain") + 1] == "/models/qwen14b"      # the recipe's variables pass through
        assert argv[-4:] == ["--generate_max_len", "4096", "--use_wandb", "a b"]   # extra flags, quoting kept
    assert not (tmp_path / "torchrun.2").exists()


def test_a_long_node_list_gives_its_first_host(slurm_env, tmp_path):
    # Reading only the first line of 5000 (`| head -n 1`) killed scontrol with SIGPIPE, fatal under pipefail.
    done = run(slurm_env, RECIPE="scripts/grpo_qwen2.5_14b.sh", SLURM_JOB_NODELIST="big-[0000-4999]", SLURM_NNODES="1")
    assert done.returncode == 0, done.stderr
    assert shlex.split((tmp_path / "torchrun.0").read_text())[:6] == ["--nnodes", "1", "--node_rank", "0",
                                                                      "--master_addr", "big-0000"]


def test_a_failing_node_fails_the_job(slurm_env, tmp_path):
    recipe = tmp_path / "fails_on_node_1.sh"
    recipe.write_text('[[ "$NODE_RANK" == 1 ]] && exit 3\nexit 0\n')
    done = run(slurm_env, RECIPE=str(recipe))
    assert done.returncode == 3


@pytest.mark.parametrize("extra, words", [
    ({"RECIPE": "scripts/nope.sh"}, "RECIPE=scripts/nope.sh is not a file"),
    ({}, "set RECIPE to one of the scripts in scripts/"),
    ({"RECIPE": "scripts/grpo_qwen2.5_7b.sh", "SLURM_JOB_NODELIST": ""}, "not inside a SLURM job"),
])
def test_a_bad_submission_is_named(slurm_env, extra, words):
    env = dict(slurm_env)
    if extra.get("SLURM_JOB_NODELIST") == "":
        del env["SLURM_JOB_NODELIST"]
        extra = {k: v for k, v in extra.items() if k != "SLURM_JOB_NODELIST"}
    done = run(env, **extra)
    assert done.returncode != 0 and words in done.stderr, done.stderr


def test_the_script_is_executable_and_names_its_sbatch_defaults():
    assert os.access(SBATCH, os.X_OK)
    directives = [line for line in Path(SBATCH).read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --ntasks-per-node=1" in directives and "#SBATCH --requeue" in directives
