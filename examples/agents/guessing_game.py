"""Higher or lower, learned by GRPO over multi-turn episodes (docs/agents.md).

A prompt names a range of digits ("3-8"); the policy guesses, the environment answers each wrong
guess "higher" or "lower" (examples/agents/guessing_game_workflow.py), and three guesses win or
lose the game. On CPU, with nothing downloaded:

  1. makes every game (range, hidden digit) of ranges of 3 to 10 digits and holds a quarter out;
  2. SFT-warms a tiny character-level model on transcripts of a player that mostly scans up
     from the low end (wins 56% of games) and otherwise bisects (wins 95%): greedy play scans;
  3. runs GRPO with `train_ppo --workflow`, one game per sample, reward 1 for a win (and a
     per-turn penalty for a guess the answers already ruled out);
  4. prints the held-out win rate of greedy play before and after RL (eval/reward_greedy).

    python examples/agents/guessing_game.py [--output_dir guessing_game_output] [--nproc 2]
"""

import argparse
import random
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import greedy_success, torchrun, transcript, warm_start  # noqa: E402
from guessing_game_workflow import feedback  # noqa: E402

WORKFLOW = HERE / "guessing_game_workflow.py"
GUESSES = 3              # --max_turns
EPISODE_TOKENS = 96      # --max_episode_tokens: three guesses and two answers fit


def game_splits(seed: int = 0, held_out: int = 64) -> tuple[list[dict], list[dict]]:
    """Every game {"input": "lo-hi", "label": "hidden digit"} of 0 <= lo, hi <= 9, hi - lo >= 2,
    shuffled; `held_out` of them for evaluation, the rest for training."""
    games = [{"input": f"{lo}-{hi}", "label": str(secret)}
             for lo in range(10) for hi in range(lo + 2, 10) for secret in range(lo, hi + 1)]
    random.Random(seed).shuffle(games)
    return games[held_out:], games[:held_out]


def player(game: dict, rng: random.Random, scan_share: float = 0.7) -> list[tuple[str, list[dict]]]:
    """A game as the warm-start data plays it: (guess, the environment's answer) per turn, as
    `common.transcript` takes them. Most games scan up from the low end (lo, lo+1, lo+2: wins
    only when the digit is among the first three); the others bisect the digits still possible."""
    lo, hi = (int(x) for x in game["input"].split("-"))
    secret, scan, turns = int(game["label"]), rng.random() < scan_share, []
    for guess_number in range(GUESSES):
        guess = lo if scan else (lo + hi) // 2
        if guess == secret:
            return turns + [(str(guess), [])]
        last = guess_number == GUESSES - 1
        turns.append((str(guess), [] if last else [{"role": "user", "content": feedback(str(guess), secret)}]))
        lo, hi = (guess + 1, hi) if secret > guess else (lo, guess - 1)
    return turns


def sft_model(output_dir: Path, train_rows: list[dict], steps: int, seed: int = 0, games_per_row: int = 4) -> Path:
    """The warm start: `steps` SFT steps on `games_per_row` games of each training row (`player`)."""
    from lightrft.utils.tiny import build_char_tokenizer

    tokenizer, rng = build_char_tokenizer(), random.Random(seed)
    transcripts = [transcript(tokenizer, row["input"], player(row, rng))
                   for row in train_rows for _ in range(games_per_row)]
    return warm_start(output_dir, transcripts, steps=steps, hidden_size=64, seed=seed)


def grpo_flags(model: Path, train_file: Path, eval_file: Path, out: Path, steps: int, seed: int = 0) -> list:
    """train_ppo flags for `steps` GRPO steps of 32 games x 8 samples, evaluated at the end."""
    return ["--pretrain", model, "--prompt_data", train_file, "--input_key", "input", "--label_key", "label",
            "--apply_chat_template", "--workflow", WORKFLOW, "--max_turns", GUESSES,
            "--max_episode_tokens", EPISODE_TOKENS, "--generate_max_len", 2, "--prompt_max_len", 32,
            "--advantage_estimator", "group_norm", "--n_samples_per_prompt", 8, "--rollout_batch_size", 32,
            "--micro_rollout_batch_size", 128, "--train_batch_size", 256, "--micro_train_batch_size", 64,
            "--actor_learning_rate", 2e-3, "--lr_scheduler", "constant", "--init_kl_coef", 0,
            "--num_episodes", 1000, "--max_steps", steps, "--zero_stage", 2, "--seed", seed,
            "--eval_data", eval_file, "--eval_steps", steps,
            "--save_path", out / "grpo", "--ckpt_path", out / "grpo_ckpt", "--use_tensorboard", out / "tb"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="guessing_game_output")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (processes) for torchrun")
    parser.add_argument("--sft_steps", type=int, default=300)
    parser.add_argument("--grpo_steps", type=int, default=50, help="GRPO steps of 32 games x 8 samples")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from lightrft.datasets.toy import write_jsonl

    started = time.time()
    out = Path(args.output_dir).resolve()
    if out.exists():
        shutil.rmtree(out)
    train_rows, eval_rows = game_splits(args.seed)
    train_file, eval_file = write_jsonl(train_rows, out / "train.jsonl"), write_jsonl(eval_rows, out / "eval.jsonl")
    print(f"{len(train_rows)} training games, {len(eval_rows)} held out; {GUESSES} guesses each")

    sft = sft_model(out / "sft", train_rows, args.sft_steps, args.seed)
    before = greedy_success(sft, WORKFLOW, eval_rows, max_turns=GUESSES, max_new_tokens=2,
                            max_episode_tokens=EPISODE_TOKENS)
    print(f"held-out win rate after SFT: {before:.1%}")

    summary = torchrun("lightrft.cli.train_ppo", args.nproc,
                       grpo_flags(sft, train_file, eval_file, out, args.grpo_steps, args.seed), out / "grpo.log")
    after = summary.get("eval/reward_greedy")
    print(f"held-out win rate (greedy)   before RL: {before:6.1%}   after RL: {after:6.1%}   "
          f"({(after - before) * 100:+.1f} points)")
    print(f"rollout/turns {summary.get('rollout/turns', float('nan')):.2f}; model in {out / 'grpo'}; "
          f"log in {out / 'grpo.log'}; {(time.time() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
