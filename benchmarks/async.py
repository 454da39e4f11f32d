"""Decoupled explorer and trainer against the colocated loop: when does decoupling pay, and how far ahead?

One GRPO workload runs several ways, all `torchrun --nproc_per_node 2 -m lightrft.cli.train_ppo`
with the same flags apart from the roles:

  sync       `--explorer_ranks 0`: both ranks generate and score their half of the batch, then
             both train on it (ZeRO-2), one after the other;
  bound1     `--explorer_ranks 1 --sync_offset 1`: rank 1 only generates and scores (one step
             ahead at most), rank 0 only trains, on the whole batch (`decoupled` names it too);
  bound2, bound4   the same with `--sync_offset 2` and `4`;
  partial    bound1 with `--partial_rollouts`: the explorer takes new weights mid-batch;
  overlap    partial with `--overlap_batches`: the explorer decodes its next batch beside the
             current one's longest responses, in segments (staleness bound 2);
  auto       `--auto_sync_offset 4`: the offset sets itself within [1, 4] at each step.

The workload is `grpo_step.py`'s (a tiny Qwen2 SFT-warmed here; the toy addition task, 320
training and 80 held-out prompts; 32 prompts x G = 8 = 256 samples per step; two AdamW steps of
128 samples, lr 1e-3, PPO clip 0.2, no KL; `--tis_cap 2` on both sides) with two changes that
make it look more like real RL fine-tuning:

  reward latency   the reward comes from an HTTP reward server this script starts on 127.0.0.1
                   (a free port); it answers each request (one per rank and step) after
                   --latency_ms (default 200 ms), scoring with lightrft's own `math` rule, as
                   `--remote_rm_url math` would;
  long tail        the SFT warm-up teaches the model to follow its answer with a run of spaces
                   whose length is long-tailed: none for half of the training rows, otherwise
                   4 x Pareto(1.2) - 4 spaces (median 3, 90th percentile 23), capped to fit
                   --max_new_tokens (default 48). Sampling at temperature 1 reproduces the habit:
                   most responses are a few tokens, some run to the limit, and HF generation of a
                   micro-batch lasts as long as its longest response. Training then moves the
                   tail (longer in some runs, shorter in others). Trailing spaces change neither
                   the `math` reward nor the held-out greedy accuracy (answers are stripped). The
                   reward server keeps the length of every response it scores; their
                   percentiles are printed.

The modes alternate (sync, bound1, ..., sync, ...) --repeats times, each run a fresh torchrun job
with one thread per rank; the k-th round runs with train_ppo's `--seed` set to --seed + k (data
and warm-up keep --seed), so accuracy is seen over several sampling seeds. Reported per mode:
samples/s (a run's steps after its first, timed by when the trainer wrote each step's
TensorBoard scalars; median over runs and the spread), held-out greedy accuracy and held-out
reward (the mean `math` reward of 32 sampled responses per held-out prompt: `held_out_reward`)
of the exported model after the same --steps, so the same samples (mean and spread), the
staleness the trainer logged (min/mean/max over every step of every run), mean seconds per step
spent generating,
scoring, training and (decoupled) waiting for experience, the trainer's idle share (its waits
over the timed steps' wall time), and each mode's samples/s over sync's in each round; auto's
held-out reward against the best fixed bound's (per round) and its samples/s over bound2's; plus
the machine and its load average before and after. A benchmark, not a test: nothing asserts on time.

    python benchmarks/async.py [--repeats 3] [--steps 30] [--latency_ms 200] [--json OUT]
    python benchmarks/async.py --modes sync,bound1      # the colocated loop and one step ahead only
    python benchmarks/async.py --latency_ms 0            # an instant reward server
    python benchmarks/async.py --max_new_tokens 8        # short responses, hardly a tail
    python benchmarks/async.py --smoke                   # 3 steps, 1 run per mode: checks it runs
    python benchmarks/async.py --generation_only         # the explorer's decoding alone, see below

--generation_only times the explorer's decoding without training: the warm-started model, one
thread, the first 6 rollout batches (32 prompts x 8 samples, the run's micro-batches of 64),
decoded batch after batch by one `generate` call each (what an explorer does without
--overlap_batches) and by `OverlappedBatches` (segments of 8 tokens, the next batch admitted at
the same share still going as in a run), alternating for --repeats rounds. One set of weights
throughout, so the responses are drawn from the same policy and the pace is the engine's alone,
not the trained tail's.
"""

import argparse
import asyncio
import dataclasses
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from http import HTTPStatus
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
sys.path[:0] = [str(REPO_ROOT), str(HERE)]

import torch  # noqa: E402
import transformers  # noqa: E402
from starlette.routing import Route  # noqa: E402

import grpo_step  # noqa: E402
from lightrft.datasets.toy import arithmetic_splits, greedy_accuracy, sft_warm_start, write_jsonl  # noqa: E402
from lightrft.models.tokenizer import build_tokenizer  # noqa: E402
from lightrft.rewards import make_reward_source  # noqa: E402
from lightrft.serving.http import HTTPSettings  # noqa: E402
from lightrft.serving.server import HTTPServer, build_app, json_response, read_json  # noqa: E402

MODES = {"sync": ["--explorer_ranks", "0"], "bound1": ["--explorer_ranks", "1", "--sync_offset", "1"],
         "bound2": ["--explorer_ranks", "1", "--sync_offset", "2"],
         "bound4": ["--explorer_ranks", "1", "--sync_offset", "4"],
         "partial": ["--explorer_ranks", "1", "--sync_offset", "1", "--partial_rollouts"],
         "overlap": ["--explorer_ranks", "1", "--sync_offset", "1", "--partial_rollouts", "--overlap_batches"],
         "auto": ["--explorer_ranks", "1", "--sync_offset", "1", "--auto_sync_offset", "4"]}
ALIASES = {"decoupled": "bound1"}
PHASES = {"generate": "perf/generate_time", "reward": "perf/reward_time", "experience": "perf/experience_time",
          "train": "perf/train_time", "wait": "perf/experience_wait_s"}
STALENESS = ("rollout/staleness_min", "rollout/staleness_mean", "rollout/staleness_max")
HELD_OUT_SAMPLES = 32   # responses per held-out prompt for the held-out reward
EXTRA = {"offset": "rollout/sync_offset", "token_staleness": "rollout/token_staleness_mean",
         "multi_version": "rollout/multi_version_share"}


# ------------------------------------------------------------------------------------ workload
def tail_length(rng: random.Random, cap: int) -> int:
    """Trailing spaces after one warm-up answer: 0 for half the rows, else 4 x Pareto(1.2) - 4
    (median 3, 90th percentile 23), at most `cap`."""
    if rng.random() < 0.5:
        return 0
    return min(cap, int(4 * rng.paretovariate(1.2)) - 4)


def long_tailed(rows: list[dict], cap: int, seed: int) -> list[dict]:
    """The warm-up rows with each answer followed by a long-tailed run of spaces."""
    rng = random.Random(seed)
    return [{**row, "output": row["output"] + " " * tail_length(rng, cap)} for row in rows]


def prepare_workload(out: Path, work: grpo_step.Workload, args) -> dict:
    """Data files and the SFT-warmed starting model (trained on long-tailed answers)."""
    train_rows, eval_rows = arithmetic_splits(n_train=work.n_train, n_eval=work.n_eval, seed=args.seed,
                                              max_operand=work.max_operand)
    cap = work.max_new_tokens - 3  # room for a two-digit answer and EOS
    started = time.perf_counter()
    model = sft_warm_start(out / "sft", long_tailed(train_rows, cap, args.seed), args.sft_steps, lr=3e-3,
                           seed=args.seed)
    print(f"SFT warm-up on long-tailed answers: {args.sft_steps} steps in {time.perf_counter() - started:.0f} s",
          flush=True)
    return {"model": model, "train": write_jsonl(train_rows, out / "train.jsonl"), "eval_rows": eval_rows,
            "accuracy_before": greedy_accuracy(model, eval_rows, max_new_tokens=work.max_new_tokens),
            "reward_before": held_out_reward(model, eval_rows, work)}


def held_out_reward(model_path: Path, rows: list[dict], work: grpo_step.Workload, samples: int = HELD_OUT_SAMPLES,
                    seed: int = 0) -> float:
    """The mean `math` reward of `samples` responses per held-out prompt, sampled as training
    samples them (temperature, no top-p/top-k, up to max_new_tokens): the policy's expected reward
    on unseen prompts, the quantity RL raises. It moves smoothly with the policy, where greedy
    accuracy flips whole prompts (1.25 points each of 80), so modes compare at a fraction of the
    noise. The same sampling seed for every model (common random numbers)."""
    tokenizer = build_tokenizer(str(model_path), padding_side="left")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    rule = make_reward_source("math")
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    total = 0.0
    try:
        with torch.no_grad():
            for start in range(0, len(rows), 16):
                chunk = rows[start:start + 16]
                enc = tokenizer([row["input"] for row in chunk], return_tensors="pt", padding=True,
                                add_special_tokens=False)
                out = model.generate(**enc, max_new_tokens=work.max_new_tokens, do_sample=True,
                                     temperature=work.temperature, top_p=1.0, top_k=0, num_return_sequences=samples,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
                texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
                prompts = [row["input"] for row in chunk for _ in range(samples)]
                labels = [row["label"] for row in chunk for _ in range(samples)]
                total += float(rule([p + t for p, t in zip(prompts, texts)], prompts, labels).sum())
    finally:
        torch.random.set_rng_state(generator_state)
    return total / (len(rows) * samples)


# ------------------------------------------------------------------------------- reward server
class SlowRewardServer:
    """An HTTP reward server on 127.0.0.1 (a free port; lightrft's own HTTP stack) that answers
    each request after `latency_s`, scored by lightrft's `math` rule; it keeps the length in
    characters (= tokens of the character tokenizer, EOS not counted) of every response it scores."""

    def __init__(self, latency_s: float):
        self.latency_s = latency_s
        self.rule = make_reward_source("math")
        self.lengths: list[int] = []
        self._lock = threading.Lock()
        settings = HTTPSettings()

        async def score(request):
            body = await read_json(request, settings)
            await asyncio.sleep(self.latency_s)           # other requests are answered meanwhile
            queries, prompts = body["query"], body["prompts"]
            rewards = self.rule(queries, prompts, body["labels"])
            with self._lock:
                self.lengths += [len(q) - len(p) for q, p in zip(queries, prompts)]
            return json_response(HTTPStatus.OK, {"rewards": rewards.tolist()})

        app = build_app([Route("/get_reward", score, methods=["POST"])], settings, lambda e: {"error": str(e)},
                        "POST /get_reward")
        self._server = HTTPServer(app, "127.0.0.1", 0, settings, lambda e: {"error": str(e)})
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/get_reward"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def take_lengths(self) -> list[int]:
        """The response lengths scored since the last call."""
        with self._lock:
            lengths, self.lengths = self.lengths, []
        return lengths

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()


# ---------------------------------------------------------------------------------------- runs
def train_ppo_command(mode: str, data: dict, work: grpo_step.Workload, out: Path, url: str, steps: int,
                      seed: int) -> list[str]:
    flags = grpo_step.lightrft_flags(data, work, out, steps, seed, zero_stage=2, micro_rollout=64)
    flags[flags.index("--remote_rm_url") + 1] = url
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(grpo_step.free_port()), "-m", "lightrft.cli.train_ppo", *flags,
            "--tis_cap", "2", *MODES[mode]]


def percentile(values: list[float], q: float) -> float:
    """The `q` quantile (0..1), nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def step_figures(scalars: dict, samples_per_step: int) -> dict:
    """Samples/s, mean phase seconds and the logged staleness over a run's steps after the first
    (which pays for start-up); samples/s from when each step's scalars were written. Also the
    mean response length of the first and the last step (training moves the tail)."""
    written = sorted(scalars["rollout/reward"].items())
    times = [wall for _, (wall, _) in written]
    steps = len(written)

    def values(tag):  # one per step after the first
        return [value for _, (_, value) in sorted(scalars.get(tag, {}).items())][1:]

    lengths = [value for _, (_, value) in sorted(scalars["rollout/response_length"].items())]
    return {"samples_per_sec": (steps - 1) * samples_per_step / (times[-1] - times[0]), "steps": steps,
            "idle_share": sum(values(PHASES["wait"])) / (times[-1] - times[0]),
            "extra": {name: statistics.mean(values(tag)) for name, tag in EXTRA.items() if values(tag)},
            "mean_length_first_last": (lengths[0], lengths[-1]),
            "phases": {name: statistics.mean(values(tag)) for name, tag in PHASES.items() if values(tag)},
            "staleness": {tag.rsplit("_", 1)[1]: values(tag) for tag in STALENESS if values(tag)}}


def run_mode(mode: str, data: dict, work: grpo_step.Workload, out: Path, server: SlowRewardServer, steps: int,
             seed: int) -> dict:
    """One torchrun job of `mode` (`steps` steps, train_ppo's `--seed seed`); its figures, the
    response lengths the server saw, and the held-out accuracy of its exported model."""
    # One thread per rank, CPU only, nothing downloaded; lightrft is imported from REPO_ROOT (the cwd).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    shutil.rmtree(out, ignore_errors=True)  # TensorBoard files of an earlier run would mix in
    server.take_lengths()
    started = time.perf_counter()
    proc = subprocess.run(train_ppo_command(mode, data, work, out, server.url, steps, seed), env=env,
                          cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    (out / "train_ppo.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed (exit {proc.returncode}); log {out / 'train_ppo.log'}:\n"
                         f"{(proc.stdout + proc.stderr)[-3000:]}")
    figures = step_figures(grpo_step.tensorboard_scalars(out / "tb"), work.samples_per_step)
    if figures["steps"] != steps:
        raise SystemExit(f"{mode} logged {figures['steps']} steps, expected {steps}; log {out / 'train_ppo.log'}")
    return {**figures, "mode": mode, "seed": seed, "wall_seconds": wall, "lengths": server.take_lengths(),
            "load_average": os.getloadavg()[0],
            "accuracy_after": greedy_accuracy(out / "model", data["eval_rows"], max_new_tokens=work.max_new_tokens),
            "reward_after": held_out_reward(out / "model", data["eval_rows"], work)}


# -------------------------------------------------------------------------------------- report
def spread(values: list[float], fmt: str = ".0f") -> str:
    """'median (min-max)' of `values`."""
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def summarize(runs: list[dict]) -> dict:
    """One mode's figures over its runs."""
    rates = [run["samples_per_sec"] for run in runs]
    lengths = [n for run in runs for n in run["lengths"]]
    staleness = {kind: [v for run in runs for v in run["staleness"].get(kind, [])] for kind in ("min", "mean", "max")}
    return {"samples_per_sec": statistics.median(rates), "samples_per_sec_runs": rates,
            "idle_share": statistics.mean(run["idle_share"] for run in runs),
            "extra": {name: statistics.mean(run["extra"][name] for run in runs)
                      for name in EXTRA if all(name in run["extra"] for run in runs)},
            "accuracy_after": statistics.mean(run["accuracy_after"] for run in runs),
            "accuracy_after_runs": [run["accuracy_after"] for run in runs],
            "reward_after": statistics.mean(run["reward_after"] for run in runs),
            "reward_after_runs": [run["reward_after"] for run in runs],
            "staleness": ({"min": min(staleness["min"]), "mean": statistics.mean(staleness["mean"]),
                           "max": max(staleness["max"])} if staleness["max"] else None),
            "phases": {name: statistics.mean(run["phases"][name] for run in runs)
                       for name in PHASES if all(name in run["phases"] for run in runs)},
            "response_length": {"p50": percentile(lengths, 0.5), "p90": percentile(lengths, 0.9),
                                "max": max(lengths), "mean": statistics.mean(lengths), "count": len(lengths)},
            "mean_length_first_last": [statistics.mean(run["mean_length_first_last"][i] for run in runs)
                                       for i in (0, 1)],
            "wall_seconds": statistics.median(run["wall_seconds"] for run in runs)}


def report(result: dict) -> None:
    width = 118
    print("\n" + "=" * width)
    print(f"{result['date']}; {result['machine']}; load average (1, 5, 15 min) "
          f"{result['load_average']['start']} at start, {result['load_average']['end']} at end")
    work = result["workload"]
    print(f"{work['prompts_per_step'] * work['group_size']} samples per step (<= {work['max_new_tokens']} new tokens, "
          f"long-tailed), {result['steps']} steps x {result['repeats']} alternating run(s) per mode; reward server "
          f"latency {result['latency_ms']:.0f} ms per request; 2 ranks x 1 thread")
    print("-" * width)
    print(f"warm-started model: held-out greedy accuracy {result['accuracy_before']:.1%}, held-out reward "
          f"{result['reward_before']:.3f} ({HELD_OUT_SAMPLES} samples per prompt)")
    modes = result["modes"]
    print(f"{'':<9}{'samples/s median (min-max)':>28}{'idle':>7}{'accuracy after, mean (min-max)':>32}"
          f"{'reward after, mean (min-max)':>30}{'staleness min/mean/max':>24}{'resp. len p50/p90/max':>23}")
    for mode in modes:
        side = result[mode]
        stale = side["staleness"]
        stale_text = f"{stale['min']:.0f} / {stale['mean']:.2f} / {stale['max']:.0f}" if stale else "0 (colocated)"
        length = side["response_length"]
        accs = side["accuracy_after_runs"]
        acc = f"{side['accuracy_after']:.1%} ({min(accs):.1%}-{max(accs):.1%})"
        rewards = side["reward_after_runs"]
        reward = f"{side['reward_after']:.3f} ({min(rewards):.3f}-{max(rewards):.3f})"
        print(f"{mode:<9}{spread(side['samples_per_sec_runs']):>28}{side['idle_share']:>7.1%}{acc:>32}{reward:>30}"
              f"{stale_text:>24}{length['p50']:>11} / {length['p90']} / {length['max']}")
    print("-" * width)
    print("mean seconds per step after the first (rank 0's logs; decoupled: generate and reward are the "
          "explorer's, the rest the trainer's):")
    for mode in modes:
        cells = ", ".join(f"{name} {seconds:.3f}" for name, seconds in result[mode]["phases"].items())
        print(f"  {mode:<10} {cells}; whole job {result[mode]['wall_seconds']:.0f} s (median, start-up included)")
    print("response length: mean of all responses, and mean of the first -> last step's (averaged over runs):")
    for mode in modes:
        length = result[mode]["response_length"]
        first, last = result[mode]["mean_length_first_last"]
        print(f"  {mode:<10} {length['mean']:.1f} tokens over {length['count']} responses; {first:.1f} -> {last:.1f}")
    extras = {mode: result[mode]["extra"] for mode in modes if result[mode]["extra"]}
    for mode, extra in extras.items():
        print(f"  {mode:<10} " + ", ".join(f"{name} {value:.3f}" for name, value in extra.items())
              + " (mean over steps and runs)")
    for (top, bottom), ratios in result["ratio_runs"].items():
        print(f"{top} / {bottom} samples/s: {spread(ratios, '.2f')} over the alternating rounds "
              f"({', '.join(f'{r:.2f}' for r in ratios)})")
    if "auto_against_bounds" in result:
        verdict = result["auto_against_bounds"]
        print(f"auto against the best fixed bound by held-out reward ({verdict['best']}, mean "
              f"{verdict['best_reward']:.3f}): {verdict['difference']:+.3f}, per round "
              f"{', '.join(f'{d:+.3f}' for d in verdict['per_round'])}; samples/s over bound2's median "
              f"{verdict['rate_over_bound2']:.2f}")
    print("=" * width)


def auto_against_bounds(result: dict) -> dict | None:
    """auto's mean held-out reward minus the best fixed bound's (bound1/2/4, whichever ran), with the
    per-round differences (paired by run seed), and auto's samples/s median over bound2's."""
    bounds = [mode for mode in ("bound1", "bound2", "bound4") if mode in result["modes"]]
    if "auto" not in result["modes"] or "bound2" not in bounds:
        return None
    best = max(bounds, key=lambda mode: result[mode]["reward_after"])
    auto, top = result["auto"]["reward_after_runs"], result[best]["reward_after_runs"]
    return {"best": best, "best_reward": result[best]["reward_after"],
            "difference": result["auto"]["reward_after"] - result[best]["reward_after"],
            "per_round": [a - b for a, b in zip(auto, top)],
            "rate_over_bound2": result["auto"]["samples_per_sec"] / result["bound2"]["samples_per_sec"]}


def generation_pace(data: dict, work: grpo_step.Workload, repeats: int, seed: int, batches: int = 6) -> None:
    """--generation_only: samples/s of the explorer's decoding, plain and overlapped (module doc)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightrft.explorers.overlap import OverlappedBatches, may_admit
    from lightrft.rollout import HFEngine, SamplingParams

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(data["model"])
    model = AutoModelForCausalLM.from_pretrained(data["model"], dtype=torch.float32).eval()
    engine = HFEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id, micro_batch_size=64)
    params = SamplingParams(temperature=work.temperature, max_new_tokens=work.max_new_tokens, n=work.group_size)
    rows = [json.loads(line) for line in Path(data["train"]).read_text().splitlines()]
    size = work.prompts_per_step
    prompts = [[tokenizer.encode(row["input"]) for row in rows[b * size:(b + 1) * size]] for b in range(batches)]

    def seeds(batch: int, round_: int) -> list[int]:
        return [seed * 1_000_003 + round_ * 10_007 + batch * size + i for i in range(size)]

    def plain(round_: int) -> tuple[float, int]:
        started, tokens = time.perf_counter(), 0
        for batch, batch_prompts in enumerate(prompts):
            tokens += int(engine.generate(batch_prompts, params, seeds=seeds(batch, round_)).action_mask.sum())
        return time.perf_counter() - started, tokens

    def overlapped(round_: int) -> tuple[float, int]:
        decoder = OverlappedBatches(engine, params, tokenizer.pad_token_id, [tokenizer.eos_token_id])
        queue, started, tokens = list(enumerate(prompts)), time.perf_counter(), 0
        while queue or decoder.in_flight:
            # As in a run whose next weights are one sync away: the next batch starts early (or
            # when nothing is in flight, as if its weights had just arrived).
            if queue and (not decoder.in_flight or may_admit(decoder.in_flight, newest=0, required=1,
                                                             sync_interval=1)):
                batch, batch_prompts = queue.pop(0)
                decoder.admit(batch, batch_prompts, seeds(batch, round_), version=0)
                continue
            decoder.decode_segment(version=0)
            tokens += sum(int(done.rollout.action_mask.sum()) for done in decoder.finished())
        return time.perf_counter() - started, tokens

    samples = batches * work.samples_per_step
    pace = {"plain": [], "overlapped": []}
    with torch.no_grad():
        for round_ in range(repeats):
            for name, decode in (("plain", plain), ("overlapped", overlapped)):
                seconds, tokens = decode(round_)
                pace[name].append(samples / seconds)
                print(f"round {round_ + 1} {name:10s} {samples / seconds:6.0f} samples/s, {tokens / seconds:6.0f} "
                      f"tokens/s ({tokens / samples:.1f} tokens per response)", flush=True)
    ratios = [o / p for o, p in zip(pace["overlapped"], pace["plain"])]
    print(f"{grpo_step.machine_description()}; one thread; {batches} batches of {samples // batches} samples, "
          f"<= {work.max_new_tokens} new tokens")
    for name, values in pace.items():
        print(f"{name:10s} samples/s: {spread(values, '.0f')}")
    print(f"overlapped / plain: {spread(ratios, '.2f')} ({', '.join(f'{r:.2f}' for r in ratios)})")


def ratio_runs(runs: dict[str, list[dict]]) -> dict[tuple[str, str], list[float]]:
    """Samples/s of each mode over sync's, round by round, and partial and overlap over bound1
    (the same schedule without partial rollouts); only pairs of modes that ran."""
    pairs = [(mode, "sync") for mode in runs if mode != "sync"] + [("partial", "bound1"), ("overlap", "bound1"),
                                                                   ("auto", "bound2")]
    return {(top, bottom): [a["samples_per_sec"] / b["samples_per_sec"] for a, b in zip(runs[top], runs[bottom])]
            for top, bottom in pairs if top in runs and bottom in runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per mode (>= 3 for a spread)")
    parser.add_argument("--steps", type=int, default=30, help="GRPO steps per run (the first is not timed)")
    parser.add_argument("--latency_ms", type=float, default=200.0, help="reward server delay per request")
    parser.add_argument("--max_new_tokens", type=int, default=48, help="generation limit; caps the long tail")
    parser.add_argument("--sft_steps", type=int, default=400, help="SFT warm-up steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first_round", type=int, default=0,
                        help="number the rounds from here (round k runs train_ppo with --seed seed + k): more "
                             "run seeds on the same data and warm start, to add to an earlier run's rounds")
    parser.add_argument("--smoke", action="store_true", help="3 steps, 1 run per mode, 40 SFT steps, 16 new tokens")
    parser.add_argument("--output_dir", default=None, help="keep models and logs here (default: a temporary folder)")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the figures to this JSON file")
    parser.add_argument("--generation_only", action="store_true",
                        help="time the explorer's decoding alone, plain and overlapped (see above)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, run in this order each round, of {', '.join(MODES)}")
    args = parser.parse_args()
    modes = [ALIASES.get(mode, mode) for mode in args.modes.split(",")]
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or len(set(modes)) != len(modes):
        parser.error(f"--modes {args.modes}: each of {', '.join(MODES)} at most once (unknown: {unknown})")
    if args.smoke:
        args.steps, args.repeats, args.sft_steps, args.max_new_tokens = 3, 1, 40, 16
    if args.steps < 2:
        parser.error("--steps must be >= 2: the first step is a warm-up and is not timed")
    torch.set_num_threads(2)
    transformers.utils.logging.disable_progress_bar()

    load_start = os.getloadavg()
    work = dataclasses.replace(grpo_step.Workload(), max_new_tokens=args.max_new_tokens)
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="async_bench_")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        data = prepare_workload(out, work, args)
        print(f"held-out greedy accuracy after SFT: {data['accuracy_before']:.1%}, held-out reward "
              f"{data['reward_before']:.3f}", flush=True)
        if args.generation_only:
            generation_pace(data, work, args.repeats, args.seed)
            return
        runs = {mode: [] for mode in modes}
        with SlowRewardServer(args.latency_ms / 1000) as server:
            for repeat in range(args.repeats):
                for mode in modes:
                    run = run_mode(mode, data, work, out / f"{mode}_{repeat}", server, args.steps,
                                   args.seed + args.first_round + repeat)
                    runs[mode].append(run)
                    print(f"{mode} run {repeat + 1} (--seed {run['seed']}): {run['samples_per_sec']:.0f} samples/s, "
                          f"held-out accuracy {run['accuracy_after']:.1%}, reward {run['reward_after']:.3f}, "
                          f"{run['wall_seconds']:.0f} s, "
                          f"load {run['load_average']:.1f}", flush=True)
        result = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "machine": grpo_step.machine_description(),
                  "steps": args.steps, "repeats": args.repeats, "latency_ms": args.latency_ms,
                  "workload": dataclasses.asdict(work), "accuracy_before": data["accuracy_before"],
                  "reward_before": data["reward_before"],
                  **{mode: summarize(mode_runs) for mode, mode_runs in runs.items()},
                  "modes": modes, "ratio_runs": ratio_runs(runs),
                  "load_average": {"start": " ".join(f"{x:.2f}" for x in load_start),
                                   "end": " ".join(f"{x:.2f}" for x in os.getloadavg())}}
        verdict = auto_against_bounds(result)
        if verdict:
            result["auto_against_bounds"] = verdict
        report(result)
        if args.json:
            result["ratio_runs"] = {f"{top}/{bottom}": ratios for (top, bottom), ratios in result["ratio_runs"].items()}
            for mode in modes:
                for run in runs[mode]:
                    run.pop("lengths")
                result[mode]["runs"] = runs[mode]
            Path(args.json).write_text(json.dumps(result, indent=2))
    finally:
        if not args.output_dir:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
