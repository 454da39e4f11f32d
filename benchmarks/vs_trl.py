"""lightrft against TRL's GRPOTrainer per process, at equal learning, with a plot.

One GRPO workload (`benchmarks/grpo_step.py`'s: tiny Qwen2 SFT-warmed here, identical starting
weights for both; the toy addition task, 320 training and 80 held-out prompts; 32 prompts x G = 8
samples of at most 4 new tokens per step, temperature 1; two AdamW steps of 128 samples per
step, lr 1e-3, PPO clip 0.2, no KL; the exact-answer `math` reward) runs through

  lightrft  `lightrft.cli.train_ppo`'s `train()` in one process (one rank), and
  TRL       `trl.GRPOTrainer` in one process,

each in a fresh child process with the same `--threads`, alternating (lightrft, TRL, lightrft,
TRL, ...) `--repeats` times so that both meet the same machine load; pair k samples with seed
`--seed` + k on both sides, so the accuracy figures average over seeds. Every `--eval_every` steps
each side measures held-out greedy accuracy with the same function on its live model; the clock
is paused meanwhile. Reported per side: GRPO steps/s and samples/s (median over runs and the
spread), held-out accuracy before and after, peak resident memory (ru_maxrss of the child), the
step-time breakdown; then

  * two lightrft ranks (torchrun, 1 thread each) against one rank: samples/s, alternating, at the
    same global batch (`--scaling_mode strong`) or the same batch per rank (`weak`);
  * ZeRO-3 against ZeRO-0 on two ranks: bytes of model + optimizer state held per rank.

`--workload smollm2` runs a real checkpoint instead (`grpo_step.SMOLLM2_WORKLOAD`): the packaged
SmolLM2-135M-Instruct in float32, the toy's addition (operands below 20) asked as a chat question
("What is 17+5? Answer with the number only.", rendered through the model's chat template once, when
the data files are written, so both sides read the same prompt text), 4 prompts x G = 8 samples
of at most 24 new tokens a step, one AdamW step on all 32 (micro-batches of 16), lr 1e-5, no KL,
the `math` reward (the final number equals the label). Held-out reward: the same reward on greedy
answers to 64 held-out questions, before and after, on each side's live model. Per phase for
both: generate, reward, experience (old/reference forwards and the rest), train, weight sync and
the rest of the step, plus the final export (`save`, once a run) and whole-process seconds; the
report ends with markdown tables for docs/benchmarks.md. No scaling or ZeRO part; no plot unless
--png is given.

The PNG holds held-out accuracy against training seconds and against samples, both libraries
on one plot. Needs `trl` and `matplotlib` (a venv: `python -m venv --system-site-packages
/tmp/trl-venv && /tmp/trl-venv/bin/pip install trl==1.16.0 matplotlib`; run the script with
that python). TRL is never a dependency of lightrft.

    /tmp/trl-venv/bin/python benchmarks/vs_trl.py [--repeats 3] [--steps 20] [--threads 1]
        [--png docs/img/vs_trl.png] [--json OUT]
    /tmp/trl-venv/bin/python benchmarks/vs_trl.py --smoke     # 4 steps, 1 repeat: checks it runs
    /tmp/trl-venv/bin/python benchmarks/vs_trl.py --replot vs_trl.json   # redraw the PNG only
    /tmp/trl-venv/bin/python benchmarks/vs_trl.py --workload smollm2 [--repeats 3] [--steps 5] [--json OUT]
    /tmp/trl-venv/bin/python benchmarks/vs_trl.py --workload smollm2 --smoke  # 2 steps, 1 pair
    python benchmarks/vs_trl.py --scaling_only --scaling_batch_factor 4  # 2 ranks vs 1 on 4x the batch
    python benchmarks/vs_trl.py --scaling_only --scaling_mode weak       # 256 samples a step per rank
"""

import argparse
import dataclasses
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
sys.path[:0] = [str(REPO_ROOT), str(HERE)]

import torch  # noqa: E402

import grpo_step  # noqa: E402
from grpo_step import Workload  # noqa: E402

from lightrft.rewards import math_answer_reward  # noqa: E402

PHASES = ("generate", "reward", "experience", "train", "other")
# The real-model workload also splits out the weight sync to the rollout engine (none on either
# side here: both decode with the live module) and reports the final export once per run.
REAL_PHASES = ("generate", "reward", "experience", "train", "sync", "other")


# ----------------------------------------------------------------------------------- shared parts
def heldout_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int, batch_size: int = 80,
                     score: str = "exact") -> float:
    """Greedy answers on `rows` by a live model (the same function for both sides): the fraction
    that equal row["output"] exactly (`score="exact"`, the toy model's bare answers), or the mean
    `math` reward against row["label"] (`score="math"`: the final number of a chat answer such as
    "17 + 25 = 42"). Prompts are row["input"] as written, tokenized without added special tokens."""
    was_training = model.training
    model.eval()
    correct = 0
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            enc = tokenizer([r["input"] for r in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            if score == "math":
                correct += float(math_answer_reward(texts, [r["label"] for r in chunk]).sum())
            else:
                correct += sum(text.strip() == r["output"] for text, r in zip(texts, chunk))
    tokenizer.padding_side = padding_side
    model.train(was_training)
    return correct / len(rows)


class TrainingClock:
    """Wall seconds of training with evaluation pauses taken out, and the accuracy curve."""

    def __init__(self, samples_per_step: int):
        self.samples_per_step = samples_per_step
        self.started = self.paused = 0.0
        self.curve: list[dict] = []   # {"step", "samples", "seconds", "accuracy"}
        self.step_marks: list[float] = []

    def start(self) -> None:
        self.started, self.paused = time.perf_counter(), 0.0

    def seconds(self) -> float:
        return time.perf_counter() - self.started - self.paused

    def evaluate(self, step: int, accuracy_fn) -> None:
        at, begun = self.seconds(), time.perf_counter()
        self.curve.append({"step": step, "samples": step * self.samples_per_step, "seconds": at,
                           "accuracy": accuracy_fn()})
        self.paused += time.perf_counter() - begun


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# ------------------------------------------------------------------------------- lightrft worker
def lightrft_worker(config: dict) -> dict:
    """train_ppo's `train()` in this process, one rank; phases from profile_step's timers."""
    import profile_step
    from transformers import AutoTokenizer

    from lightrft.cli.train_ppo import parse_args, train
    from lightrft.rollout.manager import RolloutManager
    from lightrft.strategy.deepspeed_strategy import DeepspeedStrategy
    from lightrft.trainer.callbacks import TrainerCallback
    from lightrft.trainer.ppo_trainer import PPOTrainer

    work, eval_rows, steps = Workload(**config["workload"]), config["eval_rows"], config["steps"]
    score = config.get("heldout_score", "exact")
    phase_clock = profile_step.PhaseClock()
    profile_step.instrument(phase_clock)
    # The weight sync runs inside `generate` (when the engine is stale); the final export after the loop.
    phase_clock.wrap(RolloutManager, "sync_weights", "sync")
    phase_clock.wrap(DeepspeedStrategy, "save_model", "save")
    # `on_step_end` fires inside `ppo_train`, whose timer closes after it: a step's training time
    # runs from the start of its `ppo_train` to that callback.
    train_started: list[float] = []
    timed_ppo_train = PPOTrainer.ppo_train

    def marked_ppo_train(self, *args, **kwargs):
        train_started.append(time.perf_counter())
        return timed_ppo_train(self, *args, **kwargs)

    PPOTrainer.ppo_train = marked_ppo_train
    clock = TrainingClock(work.samples_per_step)
    tokenizer = AutoTokenizer.from_pretrained(config["model"])
    per_step: list[dict] = []

    class Probe(TrainerCallback):
        def __init__(self):
            self.optimizer_steps = 0
            self.last = 0.0

        def live_model(self, trainer):
            return trainer.strategy.unwrap_model(trainer.actor).model

        def on_train_begin(self, trainer):
            clock.start()
            clock.evaluate(0, lambda: heldout_accuracy(self.live_model(trainer), tokenizer, eval_rows,
                                                       work.max_new_tokens, score=score))
            phase_clock.take()
            self.last = clock.seconds()

        def on_step_end(self, trainer, metrics):
            self.optimizer_steps += 1
            if self.optimizer_steps % work.optimizer_steps_per_step:
                return
            step = self.optimizer_steps // work.optimizer_steps_per_step
            now, trained = clock.seconds(), time.perf_counter() - train_started[-1]
            phases, _ = phase_clock.take()
            row = profile_step.step_breakdown(now - self.last, phases)
            sync = phases.get("sync", 0.0)
            per_step.append({"step_time": now - self.last, "generate": row["generate"] - sync, "reward": row["reward"],
                             "experience": row["experience forwards"] + row["experience, rest"],
                             "train": trained, "sync": sync})
            if step % config["eval_every"] == 0 or step == steps:
                clock.evaluate(step, lambda: heldout_accuracy(self.live_model(trainer), tokenizer, eval_rows,
                                                              work.max_new_tokens, score=score))
            self.last = clock.seconds()

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    out = Path(config["out"])
    flags = grpo_step.lightrft_flags(config["data"], work, out, steps, config["seed"])
    flags = [f for f in flags if f not in ("--use_tensorboard", str(out / "tb"))] + config.get("lightrft_flags", [])
    train(parse_args(flags), callbacks=[Probe()])
    save = phase_clock.take()[0].get("save", 0.0)     # the export to --save_path, after the last step
    return {"curve": clock.curve, "per_step": per_step, "threads": torch.get_num_threads(), "save_seconds": save,
            "flags": flags, "eval_seconds": clock.paused}


# ------------------------------------------------------------------------------------ TRL worker
def trl_worker(config: dict) -> dict:
    """trl.GRPOTrainer in this process, configured as in grpo_step.py; same probe."""
    import datasets
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    work, eval_rows, steps = Workload(**config["workload"]), config["eval_rows"], config["steps"]
    score = config.get("heldout_score", "exact")
    clock = TrainingClock(work.samples_per_step)
    rounds: list[dict] = []

    TimedGRPOTrainer = grpo_step.timed_grpo_trainer(trl, rounds)

    per_step: list[dict] = []

    class Probe(TrainerCallback):
        def __init__(self):
            self.last = 0.0

        def on_train_begin(self, args, state, control, model=None, **kw):
            clock.start()
            clock.evaluate(0, lambda: heldout_accuracy(model, tokenizer, eval_rows, work.max_new_tokens, score=score))
            self.last = clock.seconds()

        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step % work.optimizer_steps_per_step:
                return
            step = state.global_step // work.optimizer_steps_per_step
            now = clock.seconds()
            phases = rounds[-1] if rounds else {"generate": 0.0, "reward": 0.0, "experience": 0.0}
            # TRL decodes with the live module: no weight sync.
            per_step.append({"step_time": now - self.last, **phases,
                             "train": now - self.last - sum(phases.values()), "sync": 0.0})
            if step % config["eval_every"] == 0 or step == steps:
                clock.evaluate(step, lambda: heldout_accuracy(model, tokenizer, eval_rows, work.max_new_tokens,
                                                              score=score))
            self.last = clock.seconds()

    def exact_answer_reward(prompts, completions, label, **kwargs) -> list[float]:
        return math_answer_reward(list(completions), list(label)).tolist()

    rows = [json.loads(line) for line in Path(config["data"]["train"]).read_text().splitlines()]
    dataset = datasets.Dataset.from_list([{"prompt": r["input"], "label": r["label"]} for r in rows])
    out = Path(config["out"])
    grpo_config = trl.GRPOConfig(
        output_dir=str(out / "trainer"), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        disable_tqdm=True, logging_steps=10**6, seed=config["seed"], gradient_checkpointing=False,
        per_device_train_batch_size=work.micro_batch, gradient_accumulation_steps=work.train_batch // work.micro_batch,
        generation_batch_size=work.samples_per_step, num_generations=work.group_size, num_iterations=1,
        max_completion_length=work.max_new_tokens, temperature=work.temperature, top_p=1.0, top_k=0,
        max_steps=steps * work.optimizer_steps_per_step, learning_rate=work.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch", adam_beta1=work.adam_betas[0],
        adam_beta2=work.adam_betas[1], weight_decay=0.0, max_grad_norm=work.max_grad_norm,
        beta=0.0, epsilon=work.eps_clip, loss_type="dapo", scale_rewards="group", use_vllm=False)
    tokenizer = AutoTokenizer.from_pretrained(config["model"])
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(config["model"], dtype=torch.float32)
    trainer = TimedGRPOTrainer(model=model, reward_funcs=exact_answer_reward, args=grpo_config,
                               train_dataset=dataset, processing_class=tokenizer, callbacks=[Probe()])
    trainer.train()
    if len(rounds) != steps:
        raise SystemExit(f"TRL ran {len(rounds)} generation rounds, expected {steps}: the configuration no longer "
                         "matches the workload")
    save = 0.0
    if config.get("save_final"):
        # The same export lightrft's train() ends with: the Hugging Face weights and the tokenizer.
        started = time.perf_counter()
        trainer.save_model(str(out / "model"))
        save = time.perf_counter() - started
    return {"curve": clock.curve, "per_step": per_step, "threads": torch.get_num_threads(), "version": trl.__version__,
            "save_seconds": save, "eval_seconds": clock.paused}


# --------------------------------------------------------------------- ZeRO state bytes (torchrun)
def zero_state_worker(stage: int, out_path: str) -> None:
    """Under torchrun: the benchmark model prepared at `stage` with AdamW (fp32, or bf16 with
    fp32 master weights when the config says so), one optimizer step taken so Adam's moments
    exist; bytes of parameters, master weights and optimizer state this rank holds, counting each
    storage once (ZeRO-3 parameters share one flat buffer)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from lightrft.strategy import DeepspeedStrategy, StrategyConfig

    config = json.loads(Path(out_path).with_suffix(".config.json").read_text())
    strategy = DeepspeedStrategy(StrategyConfig(zero_stage=stage, train_batch_size=2, micro_train_batch_size=1,
                                                bf16=config["bf16"]))
    strategy.setup_distributed()
    dtype = torch.bfloat16 if config["bf16"] else torch.float32
    model = AutoModelForCausalLM.from_pretrained(config["model"], dtype=dtype)
    optimizer = strategy.create_optimizer(model, lr=1e-3)
    engine, optimizer, _ = strategy.prepare((model, optimizer, None))
    ids = torch.randint(4, 60, (1, 12), generator=torch.Generator().manual_seed(strategy.rank))
    strategy.backward(engine(input_ids=ids, labels=ids).loss, engine, optimizer)
    strategy.optimizer_step(optimizer, engine, None)

    seen, parts = set(), {"parameters": 0, "master weights": 0, "optimizer state": 0}

    def count(part: str, t) -> None:
        if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            parts[part] += t.untyped_storage().nbytes()

    for p in strategy.unwrap_model(engine).parameters():
        count("parameters", p.ds_tensor if hasattr(p, "ds_tensor") else p.data)
    # ZeRO's wrappers keep the torch optimizer inside; ZeRO-3 empties its param_groups between
    # steps, so the state is read by key (the fp32 partitions it updates).
    inner = getattr(optimizer, "optimizer", optimizer)
    for key, state in inner.state.items():
        count("master weights", key)
        for value in state.values():
            count("optimizer state", value)
    for name in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition"):
        for t in getattr(optimizer, name, None) or []:
            count("master weights", t)
    gathered = [None] * strategy.world_size
    dist.all_gather_object(gathered, parts)
    if strategy.is_rank_0():
        Path(out_path).write_text(json.dumps({"stage": stage, "per_rank": gathered}))
    strategy.close()


# ----------------------------------------------------------------------------------------- driver
def run_child(kind: str, config: dict, out: Path, python: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "OMP_NUM_THREADS": str(config["threads"]), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    proc = subprocess.run([python, str(Path(__file__).resolve()), "--worker", kind, str(out / "config.json")],
                          env=env, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    (out / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} run failed (exit {proc.returncode}); log {out / 'log.txt'}:\n"
                         f"{(proc.stdout + proc.stderr)[-3000:]}")
    result = json.loads((out / "result.json").read_text())
    result["process_seconds"] = time.perf_counter() - started
    result["load_average"] = os.getloadavg()[0]
    return result


def alternating_runs(config: dict, out: Path, repeats: int, seed: int, measure: str = "accuracy",
                     sides: dict | None = None) -> dict:
    """Each side in turn (lightrft, TRL, lightrft, TRL, ...), each run in a fresh process;
    {side: runs}. `sides` maps a side's name to (worker kind, extra lightrft flags); default one
    lightrft side with `config`'s flags and TRL."""
    sides = sides or {"lightrft": ("lightrft", config.get("lightrft_flags", [])), "trl": ("trl", [])}
    runs = {name: [] for name in sides}
    for repeat in range(repeats):
        for name, (kind, flags) in sides.items():
            # Pair k samples with seed + k on every side: the accuracy gains average over seeds.
            folder = out / f"{name.replace(' ', '_')}_{repeat}"
            run = run_child(kind, {**config, "lightrft_flags": flags, "seed": seed + repeat, "out": str(folder)},
                            folder, sys.executable)
            runs[name].append(run)
            rate = len(run["per_step"][1:]) / sum(s["step_time"] for s in run["per_step"][1:])
            print(f"{name} run {repeat + 1}: {rate:.3g} steps/s, {measure} {run['curve'][0]['accuracy']:.1%} -> "
                  f"{run['curve'][-1]['accuracy']:.1%}, process {run['process_seconds']:.0f} s, "
                  f"peak RSS {run['peak_rss_mib']:.0f} MiB", flush=True)
    return runs


def summarize(runs: list[dict], work: Workload, phases: tuple = PHASES) -> dict:
    """Per run: steps/s over the timed steps (all but the first, which warms up); medians and
    the min-max spread over runs; phase means over all timed steps (`phases`, the last being
    the rest of the step)."""
    rates = [len(r["per_step"][1:]) / sum(s["step_time"] for s in r["per_step"][1:]) for r in runs]
    timed = [s for r in runs for s in r["per_step"][1:]]
    mean_step = statistics.mean(s["step_time"] for s in timed)
    split = {p: statistics.mean(s[p] for s in timed) for p in phases[:-1]}
    split["other"] = max(mean_step - sum(split.values()), 0.0)
    after = [r["curve"][-1]["accuracy"] for r in runs]
    return {"steps_per_sec": statistics.median(rates), "steps_per_sec_runs": rates,
            "samples_per_sec": statistics.median(rates) * work.samples_per_step,
            "accuracy_before": runs[0]["curve"][0]["accuracy"], "accuracy_after": statistics.mean(after),
            "accuracy_after_runs": after, "gain": statistics.mean(after) - runs[0]["curve"][0]["accuracy"],
            "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in runs),
            "mean_step_time": mean_step, "split_seconds": split,
            "process_seconds": statistics.median(r["process_seconds"] for r in runs),
            "process_seconds_runs": [r["process_seconds"] for r in runs],
            "save_seconds": statistics.median(r.get("save_seconds", 0.0) for r in runs),
            # What a process spends outside its steps and the benchmark's own held-out evaluation:
            # imports, model loading, start-up, the first step's warm-up is inside the steps.
            "outside_seconds": statistics.median(r["process_seconds"] - sum(s["step_time"] for s in r["per_step"])
                                                 - r.get("eval_seconds", 0.0) for r in runs),
            "eval_seconds": statistics.median(r.get("eval_seconds", 0.0) for r in runs), "runs": runs}


# A fixed single-thread loop (~0.4 s alone): what `host_cores` times.
PROBE = """
import time, torch
torch.set_num_threads(1)
layers = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
x = torch.randn(640, 64)
for _ in range(20):
    layers(x).sum().backward()
started = time.perf_counter()
for _ in range(150):
    layers(x).sum().backward()
print(time.perf_counter() - started)
"""


def host_cores() -> float:
    """How many cores' worth of work the host gives two busy processes right now: the probe loop
    alone, then two copies at once; 2 x the time alone / the slower copy's time. About 2.0 on two
    free cores. On a virtual machine whose host takes a vCPU away it drops towards 1.0, and the
    guest shows no steal time for it: a two-rank run measured then says nothing of lightrft."""
    def start():
        return subprocess.Popen([sys.executable, "-c", PROBE], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})

    def seconds(procs):
        return max(float(proc.communicate()[0]) for proc in procs)

    alone = seconds([start()])
    return 2 * alone / seconds([start(), start()])


def scaling(data: dict, work: Workload, out: Path, args) -> dict:
    """lightrft samples/s on 2 ranks x 1 thread against 1 rank x 1 thread, alternating.

    `--scaling_mode strong` keeps the global batch: both run `--scaling_batch_factor` times the
    workload's samples per step and per optimizer step, so each of 2 ranks gets half. `weak`
    keeps the batch per rank (how data-parallel throughput is usually quoted): 2 ranks run twice
    the samples per step and per optimizer step of 1 rank. Per run: the median of the per-step
    samples/s; ratios are taken pair by pair, and also from each configuration's fastest step over
    all runs (the step least disturbed by other jobs on the host). `host_cores` runs before and after
    every 2-rank run; the pairs whose two-rank run had both probes at 1.8 or more are also reported
    apart (`ratio_two_core_pairs`)."""
    factor, mode = args.scaling_batch_factor, args.scaling_mode
    out = out / f"scaling_{mode}_x{factor}"
    rates, fastest, per_step, cores = {1: [], 2: []}, {1: 0.0, 2: 0.0}, {}, []
    for repeat in range(args.repeats):
        for nproc in (1, 2):
            scale = factor * (nproc if mode == "weak" else 1)
            shape = dataclasses.replace(work, prompts_per_step=work.prompts_per_step * scale,
                                        train_batch=work.train_batch * scale)
            per_step[nproc] = shape.samples_per_step
            ns = argparse.Namespace(nproc=nproc, threads=nproc, steps=args.steps, seed=args.seed + repeat)
            before = host_cores() if nproc == 2 else None
            run = grpo_step.run_lightrft(data, shape, out / f"scaling_{nproc}_{repeat}", ns)
            step_rates = [shape.samples_per_step / s["step_time"] for s in run["per_step"][1:]]
            rates[nproc].append(statistics.median(step_rates))
            fastest[nproc] = max(fastest[nproc], max(step_rates))
            host = ""
            if nproc == 2:
                cores.append((before, host_cores()))
                host = f"; host cores before / after: {cores[-1][0]:.2f} / {cores[-1][1]:.2f}"
            print(f"  {nproc} rank(s), run {repeat + 1}: {rates[nproc][-1]:.0f} samples/s "
                  f"({shape.samples_per_step} a step){host}", flush=True)
    ratios = [two / one for one, two in zip(rates[1], rates[2])]
    two_core = [ratio for ratio, probes in zip(ratios, cores) if min(probes) >= 1.8]
    return {"mode": mode, "batch_factor": factor, "samples_per_sec": rates, "ratio_runs": ratios,
            "ratio": statistics.median(ratios), "fastest_samples_per_sec": fastest,
            "fastest_ratio": fastest[2] / fastest[1], "samples_per_step": per_step, "host_cores": cores,
            "ratio_two_core_pairs": two_core}


def scaling_line(s: dict) -> str:
    per_step = " vs ".join(f"{s['samples_per_step'][n]}" for n in (1, 2))
    return (f"2 ranks / 1 rank samples/s ({s['mode']} scaling, {per_step} samples a step): {s['ratio']:.2f}x median "
            f"(pairs {', '.join(f'{r:.2f}' for r in s['ratio_runs'])}); fastest steps {s['fastest_ratio']:.2f}x; "
            + (f"pairs with two free cores: {statistics.median(s['ratio_two_core_pairs']):.2f}x median "
               f"({', '.join(f'{r:.2f}' for r in s['ratio_two_core_pairs'])})" if s.get("ratio_two_core_pairs")
               else "no pair had two free cores"))


def zero_states(model: Path, out: Path) -> dict:
    """Per-rank model + optimizer bytes of ZeRO-0 and ZeRO-3 on two ranks, fp32 and bf16."""
    result = {}
    for bf16 in (False, True):
        precision = "bf16" if bf16 else "fp32"
        for stage in (0, 3):
            path = out / f"zero{stage}_{precision}.json"
            path.with_suffix(".config.json").write_text(json.dumps({"model": str(model), "bf16": bf16}))
            env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
                   "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                   "127.0.0.1", "--master_port", str(grpo_step.free_port()), str(Path(__file__).resolve()),
                   "--zero_state", str(stage), str(path)]
            proc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                # Seen: ZeRO-3 with bf16 aborts in DeepSpeed 0.19.8 on CPU; fp32 is still measured.
                lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "terminate" in line or "Error" in line]
                result[f"{precision} error"] = f"ZeRO-{stage} run failed (exit {proc.returncode}): {lines[:1]}"
                break
            per_rank = json.loads(path.read_text())["per_rank"]
            result[f"{precision} zero{stage}"] = {"per_rank": per_rank,
                                                  "max_bytes": max(sum(r.values()) for r in per_rank)}
        else:
            result[f"{precision} ratio"] = (result[f"{precision} zero3"]["max_bytes"]
                                            / result[f"{precision} zero0"]["max_bytes"])
    return result


def plot(result: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, color in (("lightrft", "tab:blue"), ("trl", "tab:orange")):
        label = "lightrft" if name == "lightrft" else f"TRL {result['trl_version']}"
        curves = [run["curve"] for run in result[name]["runs"]]
        for curve in curves:            # one faint line per seed
            ys = [100 * p["accuracy"] for p in curve]
            axes[0].plot([p["seconds"] for p in curve], ys, color=color, alpha=0.25, lw=1)
            axes[1].plot([p["samples"] for p in curve], ys, color=color, alpha=0.25, lw=1)
        points = min(len(c) for c in curves)   # the mean over seeds at each evaluation
        mean = [[statistics.mean(c[i][key] for c in curves) for i in range(points)]
                for key in ("seconds", "samples", "accuracy")]
        ys = [100 * a for a in mean[2]]
        axes[0].plot(mean[0], ys, color=color, lw=2.5, marker="o", ms=4, label=f"{label}, mean of {len(curves)} seeds")
        axes[1].plot(mean[1], ys, color=color, lw=2.5, marker="o", ms=4, label=f"{label}, mean of {len(curves)} seeds")
    axes[0].set_xlabel("training wall-clock seconds (evaluation excluded)")
    axes[1].set_xlabel("samples generated and trained on")
    for ax in axes:
        ax.set_ylabel("held-out greedy accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"GRPO, one process x {result['threads']} thread each, {result['repeats']} runs per side "
                 f"({result['machine']})", fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def report(result: dict) -> None:
    light, trl = result["lightrft"], result["trl"]
    print("\n" + "=" * 100)
    print(f"{result['date']}; {result['machine']}; {result['threads']} thread(s) per process; "
          f"{result['steps']} steps x {result['repeats']} alternating runs per side; load {result['load']}")
    print(f"{'':<14}{'steps/s (runs)':>34}{'samples/s':>11}{'held-out acc':>18}{'peak RSS':>11}")
    for name, side in (("lightrft", light), (f"TRL {result['trl_version']}", trl)):
        runs = ", ".join(f"{r:.2f}" for r in side["steps_per_sec_runs"])
        acc = f"{side['accuracy_before']:.1%}->{side['accuracy_after']:.1%}"
        print(f"{name:<14}{side['steps_per_sec']:>8.2f} ({runs})".ljust(48) + f"{side['samples_per_sec']:>11.0f}"
              f"{acc:>18}{side['peak_rss_mib']:>8.0f} MiB")
    ratios = [a / b for a, b in zip(light["steps_per_sec_runs"], trl["steps_per_sec_runs"])]
    print(f"lightrft / TRL steps/s: {result['speed_ratio']:.2f}x median of run pairs "
          f"(pairs {', '.join(f'{r:.2f}' for r in ratios)}); accuracy gain lightrft {light['gain']:+.3f}, "
          f"TRL {trl['gain']:+.3f}, difference {light['gain'] - trl['gain']:+.3f} (mean over the seeds)")
    for name, side in (("lightrft", light), ("TRL", trl)):
        print(f"  {name} accuracy after, per seed: " + ", ".join(f"{a:.1%}" for a in side["accuracy_after_runs"]))
    print("step-time breakdown, mean seconds per step (share):")
    print(f"{'':<14}" + "".join(f"{p:>18}" for p in ("step", *PHASES)))
    for name, side in (("lightrft", light), ("TRL", trl)):
        cells = "".join(f"{side['split_seconds'][p]:>9.4f} ({side['split_seconds'][p] / side['mean_step_time']:>4.0%})"
                        for p in PHASES)
        print(f"{name:<14}{side['mean_step_time']:>18.4f}{cells}")
    if "scaling" in result:
        s = result["scaling"]
        print(scaling_line(s))
    if "zero" in result:
        z = result["zero"]
        for precision in ("fp32", "bf16"):
            if f"{precision} error" in z:
                print(f"model + optimizer state per rank, {precision}: {z[f'{precision} error']}")
                continue
            zero0, zero3 = z[f"{precision} zero0"], z[f"{precision} zero3"]
            split = ", ".join(f"{k} {v / 2**10:.0f}" for k, v in zero3["per_rank"][0].items())
            print(f"model + optimizer state per rank, {precision}: ZeRO-0 {zero0['max_bytes'] / 2**10:.0f} KiB, ZeRO-3 "
                  f"{zero3['max_bytes'] / 2**10:.0f} KiB ({z[f'{precision} ratio']:.2f}x; ZeRO-3 rank 0: {split} KiB)")
    print("=" * 100)


# ------------------------------------------------------------------------------ real-model driver
def compare_real(args) -> None:
    """`--workload smollm2`: SmolLM2-135M-Instruct, lightrft against TRL, alternating pairs; prints
    the report and a markdown table for docs/benchmarks.md, writes --json."""
    work = grpo_step.SMOLLM2_WORKLOAD
    import trl  # noqa: F401  (fail early, before the data, when TRL is missing)

    out = Path(args.output_dir or tempfile.mkdtemp(prefix="vs_trl_smollm2_")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    load = [os.getloadavg()[0]]
    data = grpo_step.prepare_smollm2_workload(out, work, args.seed)
    # One update per rollout on every sample (train_batch = samples_per_step), so both sides train
    # on-policy and skip the old-log-prob forward; no reference model either (no KL).
    common = ["--no_prompt_sharing"] if args.unshared else []
    modes = {"packed": ["--packing_samples"], "padded": []}
    sides = {f"lightrft {mode}": ("lightrft", modes[mode] + common) for mode in args.lightrft_modes}
    sides["trl"] = ("trl", [])
    config = {"model": str(data["model"]), "data": {"model": str(data["model"]), "train": str(data["train"]),
                                                    "eval": str(data["eval"])},
              "eval_rows": data["eval_rows"], "workload": dataclasses.asdict(work), "steps": args.steps,
              "threads": args.threads, "seed": args.seed, "eval_every": args.eval_every or args.steps,
              "heldout_score": "math", "save_final": True}
    print(f"SmolLM2-135M-Instruct, {work.prompts_per_step} prompts x G = {work.group_size}, at most "
          f"{work.max_new_tokens} new tokens, {args.steps} steps x {args.repeats} alternating rounds, "
          f"{args.threads} thread(s) per process; sides: "
          + "; ".join(f"{name} ({' '.join(flags) or 'defaults'})" for name, (_, flags) in sides.items()), flush=True)
    try:
        runs = alternating_runs(config, out, args.repeats, args.seed, measure="held-out reward", sides=sides)
    finally:
        if not args.output_dir:
            shutil.rmtree(out, ignore_errors=True)   # 0.5 GB of exported weights a run
    load.append(os.getloadavg()[0])
    summaries = {name: summarize(side_runs, work, REAL_PHASES) for name, side_runs in runs.items()}
    trl_side = summaries["trl"]
    ratios = {}
    for name in sides:
        if name == "trl":
            continue
        light = summaries[name]
        steps = [a / b for a, b in zip(light["steps_per_sec_runs"], trl_side["steps_per_sec_runs"])]
        process = [b / a for a, b in zip(light["process_seconds_runs"], trl_side["process_seconds_runs"])]
        ratios[name] = {"steps_per_sec": statistics.median(steps), "steps_per_sec_runs": steps,
                        "whole_process": statistics.median(process), "whole_process_runs": process}
    result = {"workload": "smollm2", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": grpo_step.machine_description(), "threads": args.threads, "steps": args.steps,
              "repeats": args.repeats, "trl_version": runs["trl"][0]["version"], "model": str(data["model"]),
              "workload_config": dataclasses.asdict(work), "sides": {k: list(v) for k, v in sides.items()},
              "load": " -> ".join(f"{x:.1f}" for x in load), "summaries": summaries, "ratios": ratios}
    print("\n" + real_markdown(result))
    if args.png:
        plot({**result, "lightrft": summaries[next(iter(ratios))], "trl": trl_side}, Path(args.png))
        print(f"plot: {args.png}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
        print(f"json: {args.json}")


def real_markdown(result: dict) -> str:
    """The real-model figures as markdown tables, ready for docs/benchmarks.md: one row per side
    (lightrft packed, lightrft padded, TRL), the ratios to TRL, the per-phase split."""
    summaries = result["summaries"]
    sides = [(f"TRL {result['trl_version']}" if name == "trl" else
              f"{name} ({' '.join(result['sides'][name][1]) or 'defaults'})", summaries[name]) for name in summaries]
    n = result["repeats"]
    lines = [f"{result['date']}; {result['machine']}; {result['threads']} thread(s) per process; "
             f"{result['steps']} steps a run ({result['steps'] - 1} timed) x {n} alternating rounds; "
             f"1-minute load {result['load']}",
             "",
             f"| | steps/s, median ({n} runs) | spread (min-max) | samples/s | whole process, s (runs) "
             f"| held-out reward before -> after (per seed) | peak RSS |",
             "|---|---|---|---|---|---|---|"]
    for name, side in sides:
        rates = side["steps_per_sec_runs"]
        after = ", ".join(f"{100 * a:.1f}" for a in side["accuracy_after_runs"])
        process = ", ".join(f"{s:.0f}" for s in side["process_seconds_runs"])
        lines.append(f"| {name} | {side['steps_per_sec']:.4f} ({', '.join(f'{r:.4f}' for r in rates)}) "
                     f"| {min(rates):.4f}-{max(rates):.4f} | {side['samples_per_sec']:.2f} "
                     f"| {side['process_seconds']:.0f} ({process}) "
                     f"| {side['accuracy_before']:.1%} -> {side['accuracy_after']:.1%} ({after}) "
                     f"| {side['peak_rss_mib']:.0f} MiB |")
    lines.append("")
    for name, ratio in result["ratios"].items():
        lines.append(f"- {name} / TRL: steps/s **{ratio['steps_per_sec']:.2f}x** "
                     f"({', '.join(f'{r:.2f}' for r in ratio['steps_per_sec_runs'])}), whole process "
                     f"**{ratio['whole_process']:.2f}x** ({', '.join(f'{r:.2f}' for r in ratio['whole_process_runs'])}); "
                     f"held-out reward gain {summaries[name]['gain']:+.3f} against TRL's {summaries['trl']['gain']:+.3f}.")
    lines += ["",
              "Mean seconds per timed step (share of the step); *experience* is the old/reference forwards "
              "and the rest of the experience, *save* the final export once per run, *outside* the "
              "whole process less its steps and the benchmark's held-out evaluation (imports, loading, "
              "start-up, save), *eval* that evaluation (before and after, both sides alike):",
              "",
              "| | step | " + " | ".join(REAL_PHASES) + " | save (once) | outside the steps | eval |",
              "|---|---|" + "---|" * len(REAL_PHASES) + "---|---|---|"]
    for name, side in sides:
        cells = " | ".join(f"{side['split_seconds'][p]:.2f} ({side['split_seconds'][p] / side['mean_step_time']:.0%})"
                           for p in REAL_PHASES)
        lines.append(f"| {name} | {side['mean_step_time']:.2f} | {cells} | {side['save_seconds']:.2f} "
                     f"| {side['outside_seconds']:.1f} | {side['eval_seconds']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("toy", "smollm2"), default="toy",
                        help="toy: the SFT-warmed tiny Qwen2 (default); smollm2: the real SmolLM2-135M-Instruct "
                             "on chat-templated addition (lightrft against TRL only)")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default: toy 20, smollm2 5)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per side (>= 3 for a spread)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each side's one process")
    parser.add_argument("--eval_every", type=int, default=None,
                        help="held-out accuracy every this many steps (default: toy 4, smollm2 only before and after)")
    parser.add_argument("--lightrft_modes", nargs="+", choices=("packed", "padded"), default=["packed", "padded"],
                        help="smollm2: the lightrft sides, each against the same TRL runs: packed "
                             "(--packing_samples, as the README recommends) and padded micro-batches")
    parser.add_argument("--unshared", action="store_true",
                        help="smollm2: every lightrft sample computes its own prompt (--no_prompt_sharing), as "
                             "before prompt sharing")
    parser.add_argument("--sft_steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip_scaling", action="store_true", help="leave out 2 ranks vs 1 and ZeRO-3 vs ZeRO-0")
    parser.add_argument("--scaling_only", action="store_true", help="only 2 ranks vs 1 (no TRL, no ZeRO states)")
    parser.add_argument("--scaling_batch_factor", type=int, default=1,
                        help="2 ranks vs 1 on this many times the samples per step and per optimizer step")
    parser.add_argument("--scaling_mode", choices=("strong", "weak"), default="strong",
                        help="strong: the same global batch on 1 and 2 ranks; weak: the same batch per rank")
    parser.add_argument("--smoke", action="store_true",
                        help="checks it runs: toy 4 steps, 1 repeat, 40 SFT steps; smollm2 2 steps, 1 repeat")
    parser.add_argument("--png", default=None,
                        help="the plot (default: docs/img/vs_trl.png for toy, none for smollm2)")
    parser.add_argument("--json", default=None, metavar="OUT")
    parser.add_argument("--output_dir", default=None, help="keep models and logs here")
    parser.add_argument("--replot", default=None, metavar="JSON", help="only redraw --png from a saved --json")
    parser.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--zero_state", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.zero_state:
        zero_state_worker(int(args.zero_state[0]), args.zero_state[1])
        return
    if args.worker:
        kind, config_path = args.worker
        config = json.loads(Path(config_path).read_text())
        config["workload"]["adam_betas"] = tuple(config["workload"]["adam_betas"])
        torch.set_num_threads(config["threads"])
        result = (lightrft_worker if kind == "lightrft" else trl_worker)(config)
        result["peak_rss_mib"] = peak_rss_mib()
        Path(config["out"], "result.json").write_text(json.dumps(result))
        return
    if args.workload == "toy":
        args.png = args.png or str(REPO_ROOT / "docs" / "img" / "vs_trl.png")
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.png))
        print(f"plot: {args.png}")
        return
    if args.unshared and args.workload != "smollm2":
        parser.error("--unshared applies to --workload smollm2 only")
    if args.workload == "smollm2":
        if args.scaling_only:
            parser.error("--scaling_only runs the toy workload: leave out --workload smollm2")
        if args.smoke:
            args.steps, args.repeats = 2, 1
        args.steps = args.steps or 5
        if args.steps < 2:
            parser.error("--steps must be >= 2: each run's first step warms up and is not timed")
        compare_real(args)
        return
    args.steps, args.eval_every = args.steps or 20, args.eval_every or 4
    if args.smoke:
        args.steps, args.repeats, args.sft_steps, args.eval_every = 4, 1, 40, 2
    if not args.scaling_only:
        import trl  # noqa: F401  (fail early, before the warm-up, when TRL is missing)

    work = Workload()
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="vs_trl_")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    load = [os.getloadavg()[0]]
    data = grpo_step.prepare_workload(out, work, argparse.Namespace(seed=args.seed, sft_steps=args.sft_steps,
                                                                    sft_lr=3e-3, hidden=64, layers=2))
    config = {"model": str(data["model"]), "data": {"model": str(data["model"]), "train": str(data["train"]),
                                                    "eval": str(data["eval"])},
              "eval_rows": data["eval_rows"], "workload": dataclasses.asdict(work), "steps": args.steps,
              "threads": args.threads, "seed": args.seed, "eval_every": args.eval_every, "heldout_score": "exact"}
    if args.scaling_only:
        print(f"lightrft, 1 rank vs 2 ranks (torchrun, 1 thread per rank), batch x{args.scaling_batch_factor}, "
              f"{args.scaling_mode} scaling:")
        s = scaling(data, work, out, args)
        print(scaling_line(s))
        if args.json:
            Path(args.json).write_text(json.dumps({"scaling": s}, indent=2))
        return
    runs = alternating_runs(config, out, args.repeats, args.seed)
    load.append(os.getloadavg()[0])
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": grpo_step.machine_description(),
              "threads": args.threads, "steps": args.steps, "repeats": args.repeats,
              "trl_version": runs["trl"][0]["version"],
              "lightrft": summarize(runs["lightrft"], work), "trl": summarize(runs["trl"], work)}
    pairs = [a / b for a, b in zip(result["lightrft"]["steps_per_sec_runs"], result["trl"]["steps_per_sec_runs"])]
    result["speed_ratio"] = statistics.median(pairs)
    result["speed_ratio_runs"] = pairs
    if not args.skip_scaling:
        print("lightrft, 1 rank vs 2 ranks (torchrun, 1 thread per rank):", flush=True)
        result["scaling"] = scaling(data, work, out, args)
        result["zero"] = zero_states(data["model"], out)
    load.append(os.getloadavg()[0])
    result["load"] = " -> ".join(f"{x:.1f}" for x in load)
    plot(result, Path(args.png))
    report(result)
    print(f"plot: {args.png}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
