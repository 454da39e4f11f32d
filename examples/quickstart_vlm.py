"""lightrft vision-language quickstart: GRPO on a tiny Idefics3 (the SmolVLM architecture) that
learns to name the colour of a disc in a picture.

Runs on a CPU-only laptop in about a minute, with nothing downloaded:
  1. builds a tiny Idefics3 and its processor in code (a SigLIP-style vision tower, a Llama decoder);
  2. draws the task with PIL: one disc of colour r, g, b or y per 56 x 56 image, train and held-out
     splits written as JSONL rows naming PNG files (`{"input": "<image>Colour?", "images": [...],
     "label": "r"}`);
  3. a 30-step format warm-up on *random* answers (plain PyTorch): the model learns to answer with
     one letter, not which one, so it starts at chance (25%);
  4. runs GRPO with `lightrft.cli.train_ppo --image_key images` (two ranks, torchrun, the builtin
     `exact` rule reward; rollouts with the images by Hugging Face decoding, or by vLLM with
     `--rollout_engine vllm` where it is installed);
  5. prints held-out greedy accuracy before and after RL.

    python examples/quickstart_vlm.py [--output_dir quickstart_vlm_output] [--nproc 2] [--rollout_engine vllm]
"""

import argparse
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quickstart import fresh_output_dir, torchrun  # noqa: E402

from lightrft.datasets.toy_images import colour_splits, format_warm_start, greedy_accuracy, read_rows  # noqa: E402
from lightrft.utils.tiny import save_tiny_idefics3  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="quickstart_vlm_output", help="where models, checkpoints and logs go")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (processes) for torchrun")
    parser.add_argument("--warmup_steps", type=int, default=30, help="format warm-up steps on random answers")
    parser.add_argument("--grpo_episodes", type=int, default=10, help="GRPO passes over the prompts")
    parser.add_argument("--rollout_engine", choices=("hf", "vllm"), default="hf", help="who samples the rollouts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    started = time.time()
    out = fresh_output_dir(args.output_dir)

    # 1-2. Tiny vision-language model and the colour task, all made here.
    base = save_tiny_idefics3(out / "base", seed=args.seed)
    data = out / "data"
    train_file, eval_file = colour_splits(data, n_train=256, n_eval=64, seed=args.seed)
    train_rows, eval_rows = read_rows(train_file), read_rows(eval_file)
    print(f"task: the colour of a disc (r, g, b, y); {len(train_rows)} training images, {len(eval_rows)} held out")

    # 3. Format warm-up on random answers: it answers with a letter, at chance.
    warm = format_warm_start(base, out / "warm", train_rows, data, steps=args.warmup_steps, seed=args.seed)
    before = greedy_accuracy(warm, eval_rows, data)
    print(f"held-out greedy accuracy after the format warm-up: {before:.1%} (chance: 25%)")

    # 4. GRPO: 8 samples per prompt, exact-letter reward, group-normalised advantages.
    torchrun("lightrft.cli.train_ppo", args.nproc, [
        "--pretrain", str(warm), "--prompt_data", str(train_file), "--image_key", "images", "--label_key", "label",
        "--remote_rm_url", "exact", "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "8",
        "--rollout_batch_size", "32", "--micro_rollout_batch_size", "64", "--train_batch_size", "128",
        "--micro_train_batch_size", "32", "--generate_max_len", "2", "--prompt_max_len", "64",
        "--temperature", "1.0", "--actor_learning_rate", "1e-3", "--lr_scheduler", "constant", "--init_kl_coef", "0",
        "--num_episodes", str(args.grpo_episodes), "--max_epochs", "1", "--packing_samples",
        "--eval_data", str(eval_file), "--eval_steps", "20", "--save_path", str(out / "grpo"),
        "--ckpt_path", str(out / "grpo_ckpt"), "--save_steps", "40", "--zero_stage", "2", "--seed", str(args.seed),
        "--use_tensorboard", str(out / "logs" / "tensorboard"), "--rollout_engine", args.rollout_engine,
        *(["--vllm_kv_cache_gb", "0.25", "--vllm_enforce_eager"] if args.rollout_engine == "vllm" else []),
    ], out / "logs" / "grpo.log")
    after = greedy_accuracy(out / "grpo", eval_rows, data)

    # 5. Summary.
    summary = {"accuracy_before_rl": before, "accuracy_after_rl": after, "minutes": (time.time() - started) / 60,
               "rl_model": str(out / "grpo"), "checkpoints": str(out / "grpo_ckpt"), "logs": str(out / "logs")}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\n============ vision-language quickstart summary ============")
    print(f"held-out greedy accuracy   before RL: {before:6.1%}   after RL: {after:6.1%}   "
          f"({(after - before) * 100:+.1f} points)")
    print(f"final model (loads with AutoModelForImageTextToText and AutoProcessor): {out / 'grpo'}")
    print(f"wall time: {summary['minutes']:.1f} min")


if __name__ == "__main__":
    main()
