"""GRPO step throughput: lightrft against TRL's GRPOTrainer on the same tiny workload.

Both sides get the same workload and hardware:
  model    a tiny Qwen2-shaped causal LM (hidden 64, 2 layers by default; --hidden/--layers for a
           larger one), SFT-warmed briefly here so that about a third of the answers are right;
  task     small-number addition ("7+12=" -> "19"), 320 training prompts, 80 held out;
  step     32 prompts x G = 8 samples = 256 samples generated (at most 4 new tokens each), scored
           by the exact-answer `math` rule, then trained as 2 optimizer steps of 128 samples in
           micro-batches of 32 (one pass, PPO clip 0.2, no KL, token-mean loss, group-normalised
           advantages, AdamW with constant lr 1e-3 (1e-4 above hidden 64), betas (0.9, 0.95),
           grad-norm clip 1.0, float32).
Both get --threads CPU threads (default: --nproc). lightrft runs `torchrun -m
lightrft.cli.train_ppo` on --nproc ranks (ZeRO-2) sharing them; its per-step `perf/*` scalars
and the times they were written are read back from TensorBoard. TRL (when `trl` is importable)
runs `GRPOTrainer` in one process with all the threads, timed per step with a trainer callback.
`--nproc 1 --threads 1` compares one single-threaded process with another.

Reported per side: samples/s (median over the steps after each run's first, which warms up, and
the fastest step), the split of a step into generation, reward, experience forwards and
training, held-out greedy accuracy before and after, and the training reward's trend.
On a shared machine, other processes slow a multi-threaded process far more than
single-threaded ranks (every parallel operation waits for its slowest thread): compare figures
taken at low load (the load average is printed), and use --repeats to alternate the sides.
TRL is only measured here, never a dependency of lightrft (`pip install trl` to include it).

    python benchmarks/grpo_step.py [--steps 20] [--repeats 1] [--nproc 2] [--threads 2] [--json OUT]
    python benchmarks/grpo_step.py --hidden 256 --layers 4      # a larger model
    python benchmarks/grpo_step.py --smoke                      # 2 steps, short warm-up: checks that it runs
"""

import argparse
import dataclasses
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from lightrft.datasets.toy import arithmetic_splits, greedy_accuracy, sft_warm_start, write_jsonl  # noqa: E402

PHASES = ("generate", "reward", "experience", "train")


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one benchmark step does, identical for both trainers."""
    n_train: int = 320
    n_eval: int = 80
    max_operand: int = 20
    prompts_per_step: int = 32      # rollout batch, over all ranks
    group_size: int = 8             # G samples per prompt
    train_batch: int = 128          # samples per optimizer step, over all ranks
    micro_batch: int = 32           # samples per forward/backward
    max_new_tokens: int = 4
    prompt_max_len: int = 16
    learning_rate: float = 1e-3
    adam_betas: tuple = (0.9, 0.95)
    eps_clip: float = 0.2
    max_grad_norm: float = 1.0
    temperature: float = 1.0

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def optimizer_steps_per_step(self) -> int:
        return self.samples_per_step // self.train_batch


# ------------------------------------------------------------------------------------- workload
def prepare_workload(out: Path, work: Workload, args) -> dict:
    """Writes the data files and the SFT-warmed starting model; measures its held-out accuracy."""
    train_rows, eval_rows = arithmetic_splits(n_train=work.n_train, n_eval=work.n_eval, seed=args.seed,
                                              max_operand=work.max_operand)
    started = time.perf_counter()
    model = sft_warm_start(out / "sft", train_rows, args.sft_steps, lr=args.sft_lr, seed=args.seed,
                           hidden_size=args.hidden, num_layers=args.layers)
    print(f"SFT warm-up: {args.sft_steps} steps in {time.perf_counter() - started:.0f} s", flush=True)
    return {"model": model, "train": write_jsonl(train_rows, out / "train.jsonl"),
            "eval": write_jsonl(eval_rows, out / "eval.jsonl"), "train_rows": train_rows, "eval_rows": eval_rows,
            "accuracy_before": greedy_accuracy(model, eval_rows, max_new_tokens=work.max_new_tokens)}


# A real checkpoint on the toy's task (`vs_trl.py --workload smollm2`): SmolLM2-135M-Instruct as
# packaged, float32. Sized for a 2-core CPU: 4 prompts x G = 8 = 32 samples of at most 24 new
# tokens a step (a chat answer "17 + 5 = 22" takes about 10), one optimizer step on all 32 in
# micro-batches of 16, no KL. Operands below 20: the model answers about a quarter right greedily
# and about as many samples at temperature 1 are right, so few groups of 8 are all wrong (no
# signal); with operands below 50 about half the groups were. lr 1e-5 with AdamW moved TRL's
# held-out reward by 4 points in 2 steps in the smoke run.
SMOLLM2_WORKLOAD = Workload(n_train=256, n_eval=64, max_operand=20, prompts_per_step=4, group_size=8,
                            train_batch=32, micro_batch=16, max_new_tokens=24, prompt_max_len=96,
                            learning_rate=1e-5)
SMOLLM2_QUESTION = "What is {a}+{b}? Answer with the number only."


def chat_rows(rows: list[dict], tokenizer) -> list[dict]:
    """Arithmetic rows ("a+b=") as the question SMOLLM2_QUESTION in one user message, rendered
    through the tokenizer's chat template with the generation prompt. Rendered once, when the data
    files are written, so that every trainer reads the same prompt text (and tokenizes it without
    adding special tokens: the template already holds them)."""
    rendered = []
    for row in rows:
        a, b = row["input"].rstrip("=").split("+")
        messages = [{"role": "user", "content": SMOLLM2_QUESTION.format(a=a, b=b)}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        rendered.append({**row, "input": text})
    return rendered


def prepare_smollm2_workload(out: Path, work: Workload, seed: int) -> dict:
    """Writes the chat-templated data files of the real-model workload; the model is the packaged
    SmolLM2-135M-Instruct folder (`python -m lightrft.utils.pretrained` prepares it)."""
    from transformers import AutoTokenizer

    from lightrft.utils.pretrained import smollm2_folder

    model = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(model)
    train_rows, eval_rows = arithmetic_splits(n_train=work.n_train, n_eval=work.n_eval, seed=seed,
                                              max_operand=work.max_operand)
    train_rows, eval_rows = chat_rows(train_rows, tokenizer), chat_rows(eval_rows, tokenizer)
    longest = max(len(tokenizer(r["input"], add_special_tokens=False)["input_ids"]) for r in train_rows + eval_rows)
    if longest > work.prompt_max_len:
        raise SystemExit(f"a templated prompt has {longest} tokens, over the workload's prompt_max_len "
                         f"{work.prompt_max_len}: raise SMOLLM2_WORKLOAD.prompt_max_len")
    return {"model": model, "train": write_jsonl(train_rows, out / "train.jsonl"),
            "eval": write_jsonl(eval_rows, out / "eval.jsonl"), "train_rows": train_rows, "eval_rows": eval_rows}


def reward_trend(rewards: list[float]) -> tuple[float, float]:
    """Mean training reward over the first and over the last quarter of the steps (at least one
    step each): single batches of 32 prompts are too noisy to show a trend."""
    k = max(1, len(rewards) // 4)
    return statistics.mean(rewards[:k]), statistics.mean(rewards[-k:])


def summarize_runs(runs: list[dict], samples_per_step: int) -> dict:
    """Figures over the timed steps of one side's runs: every step but each run's first, which
    pays for one-off work (allocator, first kernels). `samples_per_sec` is the median; `best` uses
    the fastest step, the least disturbed by other processes; phase seconds are means, `other`
    being the part of the mean step that no phase accounts for. Each run's `per_step` holds
    dicts with `step_time` and the PHASES in seconds."""
    timed = [step for run in runs for step in run["per_step"][1:]]
    times = [step["step_time"] for step in timed]
    split = {p: statistics.mean(step[p] for step in timed) for p in PHASES}
    split["other"] = max(statistics.mean(times) - sum(split.values()), 0.0)
    return {"samples_per_sec": statistics.median(samples_per_step / t for t in times),
            "best_samples_per_sec": samples_per_step / min(times), "median_step_time": statistics.median(times),
            "mean_step_time": statistics.mean(times), "split_seconds": split, "timed_steps": len(timed),
            "accuracy_after": statistics.mean(run["accuracy_after"] for run in runs),
            "reward_first": statistics.mean(run["reward_first"] for run in runs),
            "reward_last": statistics.mean(run["reward_last"] for run in runs), "runs": runs}


# ------------------------------------------------------------------------------------- lightrft
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def lightrft_flags(data: dict, work: Workload, out: Path, steps: int, seed: int, nproc: int = 1,
                   zero_stage: int = 0, micro_rollout: int | None = None) -> list[str]:
    """train_ppo's flags for the workload on `nproc` ranks. By default a rank decodes and scores its
    whole share of the rollout in one batch (`micro_rollout`; TRL decodes its 256 at once too) and
    ZeRO stage 0: the model is small enough to replicate, and on one rank stages 1-2 only add
    gradient-bucket copies to every backward."""
    steps_per_episode = work.n_train // work.prompts_per_step
    micro_rollout = micro_rollout or work.samples_per_step // nproc
    return [
        "--pretrain", str(data["model"]), "--prompt_data", str(data["train"]), "--input_key", "input",
        "--label_key", "label", "--remote_rm_url", "math", "--advantage_estimator", "group_norm",
        "--n_samples_per_prompt", str(work.group_size), "--rollout_batch_size", str(work.prompts_per_step),
        "--micro_rollout_batch_size", str(micro_rollout), "--train_batch_size", str(work.train_batch),
        "--micro_train_batch_size", str(work.micro_batch), "--generate_max_len", str(work.max_new_tokens),
        "--prompt_max_len", str(work.prompt_max_len), "--temperature", str(work.temperature),
        "--actor_learning_rate", str(work.learning_rate), "--lr_scheduler", "constant",
        "--adam_betas", *map(str, work.adam_betas), "--eps_clip", str(work.eps_clip),
        "--max_norm", str(work.max_grad_norm), "--loss_agg_mode", "token-mean", "--init_kl_coef", "0",
        "--max_epochs", "1", "--num_episodes", str(math.ceil(steps / steps_per_episode)), "--max_steps", str(steps),
        "--zero_stage", str(zero_stage), "--seed", str(seed), "--disable_ds_ckpt", "--save_path", str(out / "model"),
        "--ckpt_path", str(out / "ckpt"), "--use_tensorboard", str(out / "tb"),
    ]


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, tuple[float, float]]]:
    """Every scalar series under `log_dir` as {tag: {step: (wall-clock time written, value)}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series: dict[str, dict[int, tuple[float, float]]] = {}
    for event_dir in sorted({p.parent for p in log_dir.rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(event_dir))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            series.setdefault(tag, {}).update({e.step: (e.wall_time, e.value) for e in acc.Scalars(tag)})
    return series


def lightrft_steps(scalars: dict) -> list[dict]:
    """Per-step seconds from train_ppo's scalars. A step's wall time is the gap between the times
    its logs and the previous step's were written (everything the loop did, as TRL's side is
    timed); the first step, with nothing before it, counts its rollout + training time."""
    def value(tag, step):
        return scalars[tag][step][1]

    step_ids = sorted(scalars["perf/train_time"])
    written = [scalars["perf/train_time"][s][0] for s in step_ids]
    steps = []
    for i, s in enumerate(step_ids):
        step_time = written[i] - written[i - 1] if i else value("perf/rollout_time", s) + value("perf/train_time", s)
        steps.append({"step_time": step_time, "generate": value("perf/generate_time", s),
                      "reward": value("perf/reward_time", s), "experience": value("perf/experience_time", s),
                      "train": value("perf/train_time", s), "logged_samples_per_sec": value("perf/samples_per_sec", s),
                      "reward_mean": value("rollout/reward", s)})
    return steps


def run_lightrft(data: dict, work: Workload, out: Path, args) -> dict:
    """Runs train_ppo under torchrun and reads its per-step perf/* scalars."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "lightrft.cli.train_ppo",
           *lightrft_flags(data, work, out, args.steps, args.seed, nproc=args.nproc)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads // args.nproc), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",  # a CPU benchmark, like TRL's side
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    print(f"lightrft: torchrun --nproc_per_node {args.nproc} -m lightrft.cli.train_ppo, "
          f"{args.threads // args.nproc} thread(s) per rank ({args.steps} steps)", flush=True)
    started = time.perf_counter()
    proc = subprocess.run(cmd, check=False, env=env, cwd=REPO_ROOT, capture_output=True, text=True)
    (out / "train_ppo.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise SystemExit(f"lightrft train_ppo failed (exit {proc.returncode}); log {out / 'train_ppo.log'}:\n{tail}")
    wall = time.perf_counter() - started

    steps = lightrft_steps(tensorboard_scalars(out / "tb"))
    if len(steps) != args.steps:
        raise SystemExit(f"lightrft logged {len(steps)} steps, expected {args.steps}; log {out / 'train_ppo.log'}")
    first, last = reward_trend([step["reward_mean"] for step in steps])
    return {"wall_seconds": wall, "reward_first": first, "reward_last": last, "per_step": steps,
            "load_average": os.getloadavg()[0],
            "accuracy_after": greedy_accuracy(out / "model", data["eval_rows"], max_new_tokens=work.max_new_tokens)}


# ------------------------------------------------------------------------------------------ TRL
def trl_available() -> str | None:
    """TRL's version when it can be imported, else None."""
    try:
        import trl
    except ImportError:
        return None
    return trl.__version__


def run_trl(data: dict, work: Workload, out: Path, args) -> dict:
    """Runs the TRL side in a fresh process (its own thread count, no state shared with this one)."""
    out.mkdir(parents=True, exist_ok=True)
    config = {"model": str(data["model"]), "train": str(data["train"]), "eval": str(data["eval"]),
              "out": str(out), "steps": args.steps, "threads": args.threads, "seed": args.seed,
              "workload": dataclasses.asdict(work)}
    (out / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    print(f"TRL: GRPOTrainer, one process, {args.threads} thread(s) ({args.steps} steps)", flush=True)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--trl_worker", str(out / "config.json")],
                          check=False, env=env, cwd=REPO_ROOT, capture_output=True, text=True)
    (out / "trl.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
        return {"error": f"TRL run failed (exit {proc.returncode}): {lines[-1] if lines else 'no output'}; "
                         f"full log in {out / 'trl.log'}"}
    result = json.loads((out / "result.json").read_text())
    first, last = reward_trend(result["rewards"])
    return {**result, "reward_first": first, "reward_last": last, "wall_seconds": time.perf_counter() - started,
            "load_average": os.getloadavg()[0],
            "accuracy_after": greedy_accuracy(out / "model", data["eval_rows"], max_new_tokens=work.max_new_tokens)}


def timed_grpo_trainer(trl, rounds: list[dict]):
    """A `trl.GRPOTrainer` subclass that appends, per generation round, the seconds spent
    generating, scoring and computing the rest of the experience (old log-probs, advantages) to
    `rounds` (also used by vs_trl.py)."""

    class TimedGRPOTrainer(trl.GRPOTrainer):
        """GRPOTrainer that records, per generation round, the seconds spent generating, scoring
        and computing the rest of the experience (old log-probs, advantages) in `rounds`."""

        def _generate_and_score_completions(self, inputs):
            rounds.append(dict.fromkeys(("generate", "reward"), 0.0))
            started = time.perf_counter()
            result = super()._generate_and_score_completions(inputs)
            current = rounds[-1]
            current["experience"] = time.perf_counter() - started - current["generate"] - current["reward"]
            return result

        def _generate(self, prompts):
            started = time.perf_counter()
            result = super()._generate(prompts)
            rounds[-1]["generate"] += time.perf_counter() - started
            return result

        def _calculate_rewards(self, *a, **kw):
            started = time.perf_counter()
            result = super()._calculate_rewards(*a, **kw)
            rounds[-1]["reward"] += time.perf_counter() - started
            return result

    return TimedGRPOTrainer


def trl_worker(config_path: str) -> None:
    """The TRL side of the benchmark (runs in its own process, see `run_trl`)."""
    import datasets
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from lightrft.rewards import math_answer_reward

    config = json.loads(Path(config_path).read_text())
    work = Workload(**{**config["workload"], "adam_betas": tuple(config["workload"]["adam_betas"])})
    out = Path(config["out"])
    torch.set_num_threads(config["threads"])

    rounds: list[dict] = []  # per generation round: seconds generating, scoring, and the rest of the experience

    TimedGRPOTrainer = timed_grpo_trainer(trl, rounds)

    class StepClock(TrainerCallback):
        """Wall-clock time at the start of training and at the end of every optimizer step."""
        def __init__(self):
            self.marks: list[float] = []

        def on_train_begin(self, *a, **kw):
            self.marks = [time.perf_counter()]

        def on_step_end(self, *a, **kw):
            self.marks.append(time.perf_counter())

    mean_rewards: list[float] = []  # one entry per generation round: the reward function scores a whole round

    def exact_answer_reward(prompts, completions, label, **kwargs) -> list[float]:
        """The `math` rule lightrft's run uses: 1.0 when the final answer equals the label."""
        if len(completions) != work.samples_per_step:
            raise SystemExit(f"TRL scored {len(completions)} completions in one round, expected "
                             f"{work.samples_per_step}: the configuration no longer matches the workload")
        rewards = math_answer_reward(list(completions), list(label))
        mean_rewards.append(float(rewards.mean()))
        return rewards.tolist()

    rows = [json.loads(line) for line in Path(config["train"]).read_text().splitlines()]
    dataset = datasets.Dataset.from_list([{"prompt": r["input"], "label": r["label"]} for r in rows])
    grpo_config = trl.GRPOConfig(
        output_dir=str(out / "trainer"), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        disable_tqdm=True, logging_steps=10**6, seed=config["seed"], gradient_checkpointing=False,
        # one optimizer step = train_batch samples in micro-batches of micro_batch ...
        per_device_train_batch_size=work.micro_batch,
        gradient_accumulation_steps=work.train_batch // work.micro_batch,
        # ... and one generation round = prompts_per_step x G samples, reused for no second pass.
        generation_batch_size=work.samples_per_step, num_generations=work.group_size, num_iterations=1,
        max_completion_length=work.max_new_tokens, temperature=work.temperature, top_p=1.0, top_k=0,
        max_steps=config["steps"] * work.optimizer_steps_per_step, learning_rate=work.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch", adam_beta1=work.adam_betas[0],
        adam_beta2=work.adam_betas[1], weight_decay=0.0, max_grad_norm=work.max_grad_norm,
        beta=0.0, epsilon=work.eps_clip, loss_type="dapo", scale_rewards="group", use_vllm=False,
    )
    tokenizer = AutoTokenizer.from_pretrained(config["model"])
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(config["model"], dtype=torch.float32)
    clock = StepClock()
    trainer = TimedGRPOTrainer(model=model, reward_funcs=exact_answer_reward, args=grpo_config,
                               train_dataset=dataset, processing_class=tokenizer, callbacks=[clock])
    if getattr(trainer.model, "is_activation_checkpointing", False):
        raise SystemExit("TRL turned on activation checkpointing; the comparison needs it off on both sides")
    trainer.train()
    trainer.save_model(str(out / "model"))
    tokenizer.save_pretrained(out / "model")

    per_opt = work.optimizer_steps_per_step
    marks = clock.marks
    if len(rounds) != config["steps"] or len(marks) != config["steps"] * per_opt + 1:
        raise SystemExit(f"TRL ran {len(rounds)} generation rounds and {len(marks) - 1} optimizer steps, expected "
                         f"{config['steps']} and {config['steps'] * per_opt}")
    per_step = []
    for k, phases in enumerate(rounds):
        step_time = marks[(k + 1) * per_opt] - marks[k * per_opt]  # `per_opt` optimizer steps per round
        per_step.append({"step_time": step_time, **phases,
                         "train": step_time - sum(phases.values())})
    (out / "result.json").write_text(json.dumps({
        "version": trl.__version__, "threads": torch.get_num_threads(), "per_step": per_step,
        "rewards": mean_rewards}))


# -------------------------------------------------------------------------------------- report
def print_report(result: dict) -> None:
    sides = [("lightrft", result["lightrft"])]
    trl_result = result.get("trl")
    if trl_result and "error" not in trl_result:
        sides.append((f"TRL {trl_result['version']}", trl_result))
    work, width = result["workload"], 104
    print("\n" + "=" * width)
    print(f"GRPO step benchmark, {result['date']}; {result['machine']}; 1-min load average "
          f"{result['load_average']['start']:.1f} at start, {result['load_average']['end']:.1f} at end")
    print(f"qwen2 hidden {result['hidden']}, {result['layers']} layers; {result['samples_per_step']} samples per step "
          f"({work['prompts_per_step']} prompts x G={work['group_size']}, <= {work['max_new_tokens']} new tokens), "
          f"{work['train_batch']} per optimizer step; {result['steps']} steps x {result['repeats']} run(s) per side")
    layout = f"lightrft: {result['nproc']} rank(s) x {result['threads'] // result['nproc']} thread(s)"
    print(layout + (f"; TRL: 1 process x {result['threads']} thread(s)" if len(sides) > 1 else ""))
    print("samples/s: median step (fastest step); phases: mean seconds per step (share of the mean step)")
    print("-" * width)
    print(f"{'':<12}{'samples/s':>18}{'step s':>8}" + "".join(f"{p:>13}" for p in (*PHASES, "other")))
    for name, side in sides:
        split, mean_step = side["split_seconds"], side["mean_step_time"]
        rate = f"{side['samples_per_sec']:.0f} ({side['best_samples_per_sec']:.0f})"
        cells = "".join(f"{split[p]:>7.3f} ({split[p] / mean_step:>3.0%})" for p in (*PHASES, "other"))
        print(f"{name:<12}{rate:>18}{side['median_step_time']:>8.3f}{cells}")
    print("-" * width)
    print(f"{'':<12}{'held-out greedy accuracy':>30}{'train reward, first -> last quarter':>40}")
    for name, side in sides:
        accuracy = f"{result['accuracy_before']:.1%} -> {side['accuracy_after']:.1%}"
        print(f"{name:<12}{accuracy:>30}{side['reward_first']:>28.3f} -> {side['reward_last']:.3f}")
    print("-" * width)
    if "trl" not in result:
        print("TRL: skipped (--skip_trl)")
    elif trl_result is None:
        print("TRL: not measured (`trl` is not importable; `pip install trl` to compare)")
    elif "error" in trl_result:
        print(f"TRL: {trl_result['error']}")
    else:
        print(f"lightrft / TRL samples/s: {result['ratio']:.2f}x median, {result['best_ratio']:.2f}x fastest steps")
    logged = [step["logged_samples_per_sec"] for run in result["lightrft"]["runs"] for step in run["per_step"][1:]]
    print(f"lightrft's own perf/samples_per_sec (rollout + training time, without logging): "
          f"{statistics.median(logged):.0f} median")
    print("=" * width)


def machine_description() -> str:
    cpu = "unknown CPU"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} x {cpu}, torch {torch.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps (rollout rounds) per side")
    parser.add_argument("--nproc", type=int, default=2, help="lightrft ranks (processes)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads per side (default: --nproc): lightrft's ranks share them evenly, TRL's "
                             "single process gets them all")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size of the tiny Qwen2 model (e.g. 256)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the tiny model (e.g. 4)")
    parser.add_argument("--lr", type=float, default=None,
                        help="GRPO learning rate, both sides (default: 1e-3 for hidden <= 64, else 1e-4)")
    parser.add_argument("--sft_steps", type=int, default=400, help="SFT warm-up steps before GRPO")
    parser.add_argument("--sft_lr", type=float, default=None,
                        help="SFT warm-up learning rate (default: 3e-3 for hidden <= 64, else 1e-3; either leaves "
                             "about a third of the held-out answers right)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per side, alternating lightrft and TRL so both meet the same machine load; "
                             "figures pool the timed steps of all runs")
    parser.add_argument("--skip_trl", action="store_true", help="measure lightrft only")
    parser.add_argument("--smoke", action="store_true", help="2 steps, 40 SFT steps: checks the script end to end")
    parser.add_argument("--output_dir", default=None, help="keep models and logs here (default: a temporary folder)")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the figures to this JSON file")
    parser.add_argument("--trl_worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(args.trl_worker)
        return
    if args.smoke:
        args.steps, args.sft_steps = 2, 40
    if args.steps < 2:
        parser.error("--steps must be >= 2: the first step is a warm-up and is not timed")
    args.threads = args.threads or args.nproc
    args.sft_lr = args.sft_lr or (3e-3 if args.hidden <= 64 else 1e-3)
    if args.threads % args.nproc != 0:
        parser.error(f"--threads {args.threads} must be a multiple of --nproc {args.nproc} so every lightrft rank "
                     "gets the same number of threads")
    torch.set_num_threads(args.threads)

    load_start = os.getloadavg()[0]  # other processes on the machine slow both sides; it is reported
    work = Workload(learning_rate=args.lr or (1e-3 if args.hidden <= 64 else 1e-4))
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="grpo_step_")).resolve()
    if args.output_dir and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        data = prepare_workload(out, work, args)
        print(f"held-out greedy accuracy after SFT: {data['accuracy_before']:.1%}", flush=True)
        result = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
                  "machine": machine_description(), "threads": args.threads, "hidden": args.hidden,
                  "layers": args.layers, "steps": args.steps, "repeats": args.repeats, "nproc": args.nproc,
                  "samples_per_step": work.samples_per_step, "workload": dataclasses.asdict(work),
                  "accuracy_before": data["accuracy_before"]}
        trl_version = None if args.skip_trl else trl_available()
        lightrft_runs, trl_runs = [], []
        for repeat in range(args.repeats):
            lightrft_runs.append(run_lightrft(data, work, out / f"lightrft_{repeat}", args))
            if trl_version and not (trl_runs and "error" in trl_runs[-1]):
                trl_runs.append(run_trl(data, work, out / f"trl_{repeat}", args))
        result["lightrft"] = summarize_runs(lightrft_runs, work.samples_per_step)
        if not args.skip_trl:
            failed = [run for run in trl_runs if "error" in run]
            if trl_version is None or failed:
                result["trl"] = failed[0] if failed else None
            else:
                result["trl"] = {"version": trl_version, **summarize_runs(trl_runs, work.samples_per_step)}
                result["ratio"] = result["lightrft"]["samples_per_sec"] / result["trl"]["samples_per_sec"]
                result["best_ratio"] = (result["lightrft"]["best_samples_per_sec"]
                                        / result["trl"]["best_samples_per_sec"])
        result["load_average"] = {"start": load_start, "end": os.getloadavg()[0]}
        print_report(result)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    finally:
        if not args.output_dir:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
