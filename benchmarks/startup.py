"""Where a short run's seconds go outside its steps: `train_ppo` on the real SmolLM2-135M-Instruct.

Each run is a fresh `python` process (as a user's first command is) running `lightrft.cli.train_ppo`'s
own `train` on one rank, ZeRO-2, the HF engine and `--max_steps` GRPO steps of 2 prompts x 4
samples of 8 tokens, with the functions below wrapped by timers (no profiler overhead):

    interpreter + imports   from spawning the process to the first timed call
    process group           `DeepspeedStrategy.setup_distributed` (DeepSpeed's backend included)
    models                  building actor (and reference) from the checkpoint
    tokenizer + data        the tokenizer, the prompt set and the rest of `build_run`
    DeepSpeed engines       `DeepspeedStrategy.prepare` and `create_optimizer`
    steps                   the GRPO steps (`PPOTrainer.fit` without its final checkpoint)
    final checkpoint        weights, Adam state and counters, resumable
    export                  the Hugging Face folder of the actor
    exit                    from `train` returning to the process ending

`--fresh_extensions` gives each run an empty torch extension cache, as on a machine's first run,
so that whatever DeepSpeed builds at start-up is counted. `--lightrft_root DIR` times another
checkout (e.g. `git archive <commit> | tar -x -C DIR`) to compare before and after a change;
runs alternate between the checkouts so both meet the same machine load.

    python benchmarks/startup.py [--steps 1] [--repeats 2] [--fresh_extensions] [--lightrft_root DIR]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = ["interpreter + imports", "process group", "models", "tokenizer + data", "DeepSpeed engines", "steps",
        "final checkpoint", "export", "exit", "total"]
# (module, class, method, phase)
TIMED = [
    ("lightrft.cli.train_ppo", None, "build_run", "build"),
    ("lightrft.strategy.deepspeed_strategy", "DeepspeedStrategy", "setup_distributed", "process group"),
    ("lightrft.models.actor", "ActorLanguage", "__init__", "models"),
    ("lightrft.strategy.deepspeed_strategy", "DeepspeedStrategy", "prepare", "DeepSpeed engines"),
    ("lightrft.strategy.deepspeed_strategy", "DeepspeedStrategy", "create_optimizer", "DeepSpeed engines"),
    ("lightrft.trainer.ppo_trainer", "PPOTrainer", "fit", "fit"),
    ("lightrft.trainer.ppo_trainer", "PPOTrainer", "save_checkpoint", "final checkpoint"),
    ("lightrft.strategy.deepspeed_strategy", "DeepspeedStrategy", "save_model", "export"),
]


def worker(args) -> None:
    """One run in this process; writes its phase seconds (and absolute stamps) to args.out."""
    sys.path.insert(0, str(args.root))
    import functools
    import importlib

    seconds: dict[str, float] = {}
    depth: dict[str, int] = {}
    first_call: list[float] = []

    def wrap(owner, name, phase):
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*a, **k):
            if not first_call:
                first_call.append(time.time())
            depth[phase] = depth.get(phase, 0) + 1
            started = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                depth[phase] -= 1
                if depth[phase] == 0:
                    seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - started

        setattr(owner, name, timed)

    train_ppo = importlib.import_module("lightrft.cli.train_ppo")
    if not Path(train_ppo.__file__).resolve().is_relative_to(args.root):
        raise SystemExit(f"lightrft was imported from {train_ppo.__file__}, not from {args.root}")
    for module_name, class_name, method, phase in TIMED:
        module = importlib.import_module(module_name)
        wrap(getattr(module, class_name) if class_name else module, method, phase)
    flags = json.loads(args.flags)
    train_ppo.train(train_ppo.parse_args(flags))
    done = time.time()
    Path(args.out).write_text(json.dumps({"seconds": seconds, "first_call": first_call[0], "done": done}))


def rows_of(result: dict, spawned: float, ended: float) -> dict:
    s = result["seconds"]
    get = s.get
    rows = {"interpreter + imports": result["first_call"] - spawned,
            "process group": get("process group", 0.0), "models": get("models", 0.0),
            "DeepSpeed engines": get("DeepSpeed engines", 0.0),
            "steps": get("fit", 0.0) - get("final checkpoint", 0.0),
            "final checkpoint": get("final checkpoint", 0.0), "export": get("export", 0.0),
            "exit": ended - result["done"], "total": ended - spawned}
    rows["tokenizer + data"] = get("build", 0.0) - rows["process group"] - rows["models"] - rows["DeepSpeed engines"]
    return rows


def task_flags(folder: str, out: Path, steps: int) -> list[str]:
    data = out / "train.jsonl"
    with data.open("w") as handle:
        for a, b in [(2, 3), (4, 5), (7, 1), (6, 6)]:
            handle.write(json.dumps({"input": f"What is {a} plus {b}? Answer with the number only.",
                                     "label": str(a + b)}) + "\n")
    return ["--pretrain", folder, "--prompt_data", str(data), "--input_key", "input", "--label_key", "label",
            "--apply_chat_template", "--remote_rm_url", "math", "--advantage_estimator", "group_norm",
            "--n_samples_per_prompt", "4", "--rollout_batch_size", "2", "--micro_rollout_batch_size", "8",
            "--train_batch_size", "8", "--micro_train_batch_size", "4", "--generate_max_len", "8",
            "--prompt_max_len", "64", "--init_kl_coef", "0", "--actor_learning_rate", "1e-6",
            "--max_steps", str(steps), "--zero_stage", "2", "--save_path", str(out / "model"),
            "--ckpt_path", str(out / "ckpt")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1, help="GRPO steps of each run")
    parser.add_argument("--repeats", type=int, default=2, help="runs per checkout")
    parser.add_argument("--threads", type=int, default=2, help="OMP threads of the one process")
    parser.add_argument("--fresh_extensions", action="store_true",
                        help="an empty torch extension cache per run (a machine's first run)")
    parser.add_argument("--lightrft_root", default=None, help="also time the lightrft package of this checkout")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the figures to this JSON file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, default=HERE.parent, help=argparse.SUPPRESS)
    parser.add_argument("--flags", default="[]", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    sys.path.insert(0, str(HERE.parent))
    from lightrft.utils.pretrained import smollm2_folder

    folder = str(smollm2_folder())
    checkouts = {"this checkout": HERE.parent}
    if args.lightrft_root:
        checkouts["--lightrft_root"] = Path(args.lightrft_root).resolve()
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               CUDA_VISIBLE_DEVICES="", WANDB_MODE="offline")
    results: dict[str, list[dict]] = {name: [] for name in checkouts}
    for repeat in range(args.repeats):
        for name, root in checkouts.items():
            with tempfile.TemporaryDirectory(prefix="startup_") as tmp:
                out = Path(tmp)
                run_env = dict(env, PYTHONPATH=str(root))
                if args.fresh_extensions:
                    (out / "extensions").mkdir()
                    run_env["TORCH_EXTENSIONS_DIR"] = str(out / "extensions")
                cmd = [sys.executable, str(HERE / "startup.py"), "--worker", "--root", str(root),
                       "--flags", json.dumps(task_flags(folder, out, args.steps)), "--out", str(out / "phases.json")]
                spawned = time.time()
                proc = subprocess.run(cmd, env=run_env, capture_output=True, text=True, cwd=out)
                ended = time.time()
                if proc.returncode != 0:
                    raise SystemExit(f"{name} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
                rows = rows_of(json.loads((out / "phases.json").read_text()), spawned, ended)
                results[name].append(rows)
                print(f"repeat {repeat + 1}, {name}: total {rows['total']:.1f} s", flush=True)

    names = list(checkouts)
    print(f"\nseconds per phase, median of {args.repeats} run(s), {args.steps} GRPO step(s) each"
          f"{', empty extension cache' if args.fresh_extensions else ''}:")
    print(f"| phase | {' | '.join(names)} |")
    print("|---|" + "---|" * len(names))
    table = {name: {row: statistics.median(r[row] for r in results[name]) for row in ROWS} for name in names}
    for row in ROWS:
        print(f"| {row} | " + " | ".join(f"{table[name][row]:.1f}" for name in names) + " |")
    outside = {name: table[name]["total"] - table[name]["steps"] for name in names}
    print("outside the steps: " + ", ".join(f"{name} {outside[name]:.1f} s" for name in names))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "median": table, "steps": args.steps}, indent=2))


if __name__ == "__main__":
    main()
