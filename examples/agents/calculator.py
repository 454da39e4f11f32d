"""A calculator tool, learned by GRPO over multi-turn episodes (docs/agents.md).

Prompts are products of two 2-digit numbers ("37*48"), which a tiny model cannot work out. It can
call the `multiply` tool of examples/agents/calculator_workflow.py instead, read the result from a
tool message, and answer. On CPU, with nothing downloaded:

  1. makes the products of 10..99 x 10..99, 2000 for training and 64 held out;
  2. SFT-warms a tiny character-level model on transcripts in which the first factor decides the
     habit: below 50 it mostly calls the tool, from 50 it mostly answers from memory (wrongly,
     nearly always), so greedy play calls the tool on about half the questions; every question
     also gives a transcript that only teaches reading the tool's result (its call is context);
  3. runs GRPO with `train_ppo --workflow`, reward 1 for the right final answer: the policy
     learns to call the tool every time (rollout/tool_calls goes to ~1 per episode);
  4. prints the held-out success rate of greedy play before and after RL (eval/reward_greedy).

    python examples/agents/calculator.py [--output_dir calculator_output] [--nproc 2]
           [--rollout_engine vllm] [--explorer_ranks 1]
"""

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import greedy_success, torchrun, transcript, warm_start  # noqa: E402

WORKFLOW = HERE / "calculator_workflow.py"
TURNS = 3                 # --max_turns: a call and an answer, and one turn to spare
TURN_TOKENS = 80          # --generate_max_len: a tool call is ~62 characters
EPISODE_TOKENS = 128      # --max_episode_tokens


def product_splits(seed: int = 0, n_train: int = 2000, held_out: int = 64) -> tuple[list[dict], list[dict]]:
    """Rows {"input": "a*b", "label": "a times b"} of 10 <= a, b <= 99, shuffled: `n_train` for
    training, `held_out` others for evaluation."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    rows = [{"input": f"{a}*{b}", "label": str(a * b)} for a, b in pairs]
    return rows[held_out:held_out + n_train], rows[:held_out]


def conversation(row: dict, use_tool: bool) -> list[tuple[str, list[dict]]]:
    """One warm-start conversation, as `common.transcript` takes it: a tool call, the tool's
    result as a "tool" message, and the answer read from it; or the answer straight away."""
    a, b = (int(x) for x in row["input"].split("*"))
    if not use_tool:
        return [(row["label"], [])]
    call = json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}}, separators=(",", ":"))
    return [(f"<tool_call>{call}</tool_call>", [{"role": "tool", "name": "multiply", "content": str(a * b)}]),
            (row["label"], [])]


def sft_model(output_dir: Path, train_rows: list[dict], steps: int, seed: int = 0, habit: float = 0.8,
              stray: float = 0.1) -> Path:
    """The warm start: `steps` SFT steps (the rate decaying) on two conversations per training
    row. The first teaches the habit: the tool for a share `habit` of the rows whose first factor
    is below 50 and `stray` of the others. The second teaches reading the result: a tool call as
    context, the answer read from the tool's message trained.

    Both choices keep the start's greedy play the same kind on every CPU: reading the result is
    learnt within the steps (with the habit transcripts alone it appeared after 600 to over 1000
    steps as float rounding changed), and with `stray` well under the nine-way split of a first
    digit answered from memory, greedy play from 50 answers rather than calls."""
    from lightrft.utils.tiny import build_char_tokenizer

    tokenizer, rng = build_char_tokenizer(), random.Random(seed)
    transcripts = []
    for row in train_rows:
        share = habit if int(row["input"].split("*")[0]) < 50 else stray
        transcripts.append(transcript(tokenizer, row["input"], conversation(row, rng.random() < share)))
        transcripts.append(transcript(tokenizer, row["input"], conversation(row, True), context_turns=1))
    return warm_start(output_dir, transcripts, steps=steps, lr=5e-3, hidden_size=64, seed=seed, lr_decay=True)


def grpo_flags(model: Path, train_file: Path, eval_file: Path, out: Path, steps: int, seed: int = 0) -> list:
    """train_ppo flags for `steps` GRPO steps of 16 questions x 8 samples, evaluated at the end."""
    return ["--pretrain", model, "--prompt_data", train_file, "--input_key", "input", "--label_key", "label",
            "--apply_chat_template", "--workflow", WORKFLOW, "--max_turns", TURNS,
            "--max_episode_tokens", EPISODE_TOKENS, "--generate_max_len", TURN_TOKENS, "--prompt_max_len", 32,
            "--tool_timeout", 5, "--tool_workers", 2,
            "--advantage_estimator", "group_norm", "--n_samples_per_prompt", 8, "--rollout_batch_size", 16,
            "--micro_rollout_batch_size", 64, "--train_batch_size", 128, "--micro_train_batch_size", 64,
            "--actor_learning_rate", 5e-4, "--lr_scheduler", "constant", "--init_kl_coef", 0,
            "--num_episodes", 1000, "--max_steps", steps, "--zero_stage", 2, "--seed", seed,
            "--eval_data", eval_file, "--eval_steps", steps,
            "--save_path", out / "grpo", "--ckpt_path", out / "grpo_ckpt", "--use_tensorboard", out / "tb"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="calculator_output")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (processes) for torchrun")
    parser.add_argument("--sft_steps", type=int, default=900)
    parser.add_argument("--grpo_steps", type=int, default=30, help="GRPO steps of 16 questions x 8 samples")
    parser.add_argument("--rollout_engine", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--explorer_ranks", type=int, default=0, help="ranks that only generate (of --nproc)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from lightrft.datasets.toy import write_jsonl

    started = time.time()
    out = Path(args.output_dir).resolve()
    if out.exists():
        shutil.rmtree(out)
    train_rows, eval_rows = product_splits(args.seed)
    train_file, eval_file = write_jsonl(train_rows, out / "train.jsonl"), write_jsonl(eval_rows, out / "eval.jsonl")
    print(f"{len(train_rows)} training products, {len(eval_rows)} held out")

    sft = sft_model(out / "sft", train_rows, args.sft_steps, args.seed)
    before = greedy_success(sft, WORKFLOW, eval_rows, max_turns=TURNS, max_new_tokens=TURN_TOKENS,
                            max_episode_tokens=EPISODE_TOKENS)
    print(f"held-out success after SFT: {before:.1%}")

    flags = grpo_flags(sft, train_file, eval_file, out, args.grpo_steps, args.seed)
    if args.rollout_engine == "vllm":      # vLLM's CPU build: a small KV cache, float32 like the trainer
        flags += ["--rollout_engine", "vllm", "--vllm_kv_cache_gb", 0.25]
    if args.explorer_ranks:
        flags += ["--explorer_ranks", args.explorer_ranks]
    summary = torchrun("lightrft.cli.train_ppo", args.nproc, flags, out / "grpo.log")
    after = summary.get("eval/reward_greedy")
    print(f"held-out success (greedy)   before RL: {before:6.1%}   after RL: {after:6.1%}   "
          f"({(after - before) * 100:+.1f} points)")
    print(f"rollout/tool_calls {summary.get('rollout/tool_calls', float('nan')):.2f} per episode; model in "
          f"{out / 'grpo'}; log in {out / 'grpo.log'}; {(time.time() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
