"""lightrft quickstart: SFT, then GRPO, on a tiny model that learns to add small numbers.

Runs on a CPU-only laptop in a few minutes, with nothing downloaded:
  1. builds a character-level tokenizer and a tiny Qwen2-shaped model in code;
  2. writes a toy addition task ("23+5=" -> "28") with train and held-out splits;
  3. SFT-warms the model briefly with `lightrft.cli.train_sft` (two ranks, torchrun);
  4. runs GRPO with `lightrft.cli.train_ppo` (two ranks, torchrun, the builtin `math` reward);
  5. prints held-out greedy accuracy before and after RL, and where checkpoints and logs went.

    python examples/quickstart.py [--output_dir quickstart_output] [--nproc 2]
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from lightrft.datasets.toy import arithmetic_splits, greedy_accuracy, write_jsonl  # noqa: E402
from lightrft.utils.tiny import save_tiny_model  # noqa: E402


PROGRESS = re.compile(r"^(SFT steps|PPO steps):\s+(\d+)%")


def torchrun(module: str, nproc: int, flags: list[str], log_path: Path) -> None:
    """Runs `torchrun -m module flags` on 127.0.0.1, streaming its progress to the terminal and
    keeping the full output in `log_path`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(29500 + os.getpid() % 1000), "-m", module, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "WANDB_MODE": "offline", "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    print(f"\n$ torchrun --nproc_per_node {nproc} -m {module} {' '.join(flags)}\n", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=REPO_ROOT)
        shown = {}
        for line in proc.stdout:
            log.write(line)
            bar = PROGRESS.search(line)
            if bar:
                # Progress bars: one line per 10% of each bar, not every refresh.
                name, percent = bar.group(1), int(bar.group(2)) // 10
                if shown.get(name) == percent:
                    continue
                shown[name] = percent
            elif not (line.startswith("{") or "Error" in line or "resumed" in line):
                continue
            sys.stdout.write(line)
            sys.stdout.flush()
        if proc.wait() != 0:
            raise SystemExit(f"{module} failed with exit code {proc.returncode}; full output in {log_path}")


def fresh_output_dir(path: str) -> Path:
    """`path` resolved, emptied of an earlier run's files, with its logs/ folder made."""
    out = Path(path).resolve()
    if out.exists():
        shutil.rmtree(out)
    (out / "logs").mkdir(parents=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="quickstart_output", help="where models, checkpoints and logs go")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (processes) for torchrun")
    parser.add_argument("--sft_epochs", type=int, default=20, help="SFT passes: enough for a modest start")
    parser.add_argument("--grpo_episodes", type=int, default=30, help="GRPO passes over the prompts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    started = time.time()
    out = fresh_output_dir(args.output_dir)

    # 1-2. Tiny model and toy task, all made here.
    base = save_tiny_model(out / "base", arch="qwen2", seed=args.seed, hidden_size=64, num_layers=2)
    train_rows, eval_rows = arithmetic_splits(n_train=320, n_eval=80, seed=args.seed, max_operand=20)
    train_file = write_jsonl(train_rows, out / "data" / "train.jsonl")
    eval_file = write_jsonl(eval_rows, out / "data" / "eval.jsonl")
    print(f"task: a+b with a, b < 20; {len(train_rows)} training prompts, {len(eval_rows)} held out")

    common = ["--zero_stage", "2", "--seed", str(args.seed), "--input_key", "input"]
    # 3. SFT warm-up: a short run, so RL has room to improve.
    torchrun("lightrft.cli.train_sft", args.nproc, [
        "--pretrain", str(base), "--dataset", str(train_file), "--output_key", "output",
        "--max_len", "16", "--max_epochs", str(args.sft_epochs), "--train_batch_size", "32",
        "--micro_train_batch_size", "16", "--learning_rate", "3e-3", "--lr_scheduler", "constant",
        "--save_path", str(out / "sft"), "--ckpt_path", str(out / "sft_ckpt"), *common,
    ], out / "logs" / "sft.log")
    before = greedy_accuracy(out / "sft", eval_rows)
    print(f"\nheld-out greedy accuracy after SFT: {before:.1%}")

    # 4. GRPO: 8 samples per prompt, exact-answer reward, group-normalised advantages.
    torchrun("lightrft.cli.train_ppo", args.nproc, [
        "--pretrain", str(out / "sft"), "--prompt_data", str(train_file), "--label_key", "label",
        "--remote_rm_url", "math", "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "8",
        "--rollout_batch_size", "32", "--micro_rollout_batch_size", "64", "--train_batch_size", "128",
        "--micro_train_batch_size", "32", "--generate_max_len", "4", "--prompt_max_len", "16",
        "--temperature", "1.0", "--actor_learning_rate", "1e-3", "--lr_scheduler", "cosine_with_min_lr",
        "--lr_warmup_ratio", "0.0",
        "--init_kl_coef", "0", "--num_episodes", str(args.grpo_episodes), "--max_epochs", "1",
        "--eval_data", str(eval_file), "--save_path", str(out / "grpo"), "--ckpt_path", str(out / "grpo_ckpt"),
        "--eval_steps", "20", "--save_steps", "20", "--use_tensorboard", str(out / "logs" / "tensorboard"), *common,
    ], out / "logs" / "grpo.log")
    after = greedy_accuracy(out / "grpo", eval_rows)

    # 5. Summary.
    summary = {"accuracy_before_rl": before, "accuracy_after_rl": after, "minutes": (time.time() - started) / 60,
               "sft_model": str(out / "sft"), "rl_model": str(out / "grpo"), "checkpoints": str(out / "grpo_ckpt"),
               "logs": str(out / "logs")}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\n================ quickstart summary ================")
    print(f"held-out greedy accuracy   before RL: {before:6.1%}   after RL: {after:6.1%}   "
          f"({(after - before) * 100:+.1f} points)")
    print(f"final model (Hugging Face folder): {out / 'grpo'}")
    print(f"resumable checkpoints:             {out / 'grpo_ckpt'}")
    print(f"logs (text and TensorBoard):       {out / 'logs'}")
    print(f"wall time: {summary['minutes']:.1f} min")


if __name__ == "__main__":
    main()
