"""Where a lightrft GRPO step goes: per-phase seconds on the quickstart-sized task, one process.

Runs `lightrft.cli.train_ppo`'s own wiring (`train`) in this process on one rank with the
workload of `benchmarks/grpo_step.py` (tiny Qwen2, SFT-warmed; 32 prompts x G = 8 samples of
at most 4 new tokens; two optimizer steps of 128 samples) and times, without a profiler's
overhead, the functions a step is made of: each is wrapped by a timer at class level, so the
figures are inclusive wall seconds per GRPO step, averaged over the steps after the first:

    step                     one rollout + training round, logging and checkpoints included
      generate               tokenising, the rollout manager and the engine's call
        HFEngine.generate    decoding (prompt forward, decode loop, sampling)
      reward                 scoring the responses (the `math` rule)
      experience forwards    old-policy / reference / critic forwards (per kind)
      experience, rest       advantages, masks, splitting into micro-batches
      buffer                 replay-buffer append, normalise, statistics
      train                  `ppo_train`: old log-probs (the later optimizer steps' samples, when the
                             rollout skipped that forward), collate (micro-batches from the
                             buffer), forward + loss, backward, optimizer step
      logging + checkpoints  `save_logs_and_checkpoints`
      other                  the rest of the step (the loop's own work)

`--cprofile FILE` also writes a cProfile of the timed steps (open with `python -m pstats FILE`);
`--lightrft_root DIR` profiles another checkout (e.g. an older commit unpacked with `git archive`)
to compare a breakdown before and after a change.

    python benchmarks/profile_step.py [--steps 12] [--threads 1] [--json OUT] [--cprofile OUT]
"""

import argparse
import cProfile
import functools
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (module, class, method, phase): the timed functions. A missing one (renamed, or absent in an
# older checkout) is skipped and reported.
TIMED = [
    ("lightrft.experience.generation", "Generator", "generate", "generate"),
    ("lightrft.rollout.hf_engine", "HFEngine", "generate", "engine"),
    ("lightrft.experience.scorer", "Scorer", "score_generation", "reward"),
    ("lightrft.experience.builder", "ExperienceBuilder", "build", "experience"),
    ("lightrft.experience.builder", "ExperienceBuilder", "forward", "experience forwards"),
    ("lightrft.experience.replay_buffer", "NaiveReplayBuffer", "append", "buffer"),
    ("lightrft.experience.replay_buffer", "NaiveReplayBuffer", "normalize", "buffer"),
    ("lightrft.experience.replay_buffer", "NaiveReplayBuffer", "info_sums", "buffer"),
    ("lightrft.experience.replay_buffer", "NaiveReplayBuffer", "collate_fn", "collate"),
    ("lightrft.trainer.ppo_trainer", "PPOTrainer", "ppo_train", "train"),
    ("lightrft.trainer.ppo_trainer", "PPOTrainer", "fill_old_log_probs", "old log-probs"),
    ("lightrft.strategy.deepspeed_strategy", "DeepspeedStrategy", "backward", "backward"),
    ("lightrft.strategy.deepspeed_strategy", "DeepspeedStrategy", "optimizer_step", "optimizer step"),
    ("lightrft.trainer.ppo_trainer", "PPOTrainer", "save_logs_and_checkpoints", "logging + checkpoints"),
]
ORDER = ["generate", "  HFEngine.generate", "reward", "experience forwards", "experience, rest", "buffer", "train",
         "  old log-probs", "  collate", "  forward + loss", "  backward", "  optimizer step", "logging + checkpoints", "other"]


class PhaseClock:
    """Accumulates inclusive seconds per phase; `forward kinds` splits the experience forwards by
    the model kind they run (actor, reference, critic)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.forward_kinds: dict[str, float] = {}
        self.depth: dict[str, int] = {}

    def wrap(self, cls, name: str, phase: str) -> None:
        original = getattr(cls, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            # Recursion (a method calling itself through super()) is counted once.
            self.depth[phase] = self.depth.get(phase, 0) + 1
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.depth[phase] -= 1
                if self.depth[phase] == 0:
                    elapsed = time.perf_counter() - started
                    self.seconds[phase] = self.seconds.get(phase, 0.0) + elapsed
                    if name == "forward":       # ExperienceBuilder.forward(model, rollout): which model
                        builder, model = args[0], args[1]
                        kind = next((k for k, m in (("actor", builder.actor), ("reference", builder.initial_model),
                                                    ("critic", builder.critic), ("teacher", builder.teacher))
                                     if m is model), "?")
                        self.forward_kinds[kind] = self.forward_kinds.get(kind, 0.0) + elapsed

        setattr(cls, name, timed)

    def take(self) -> tuple[dict, dict]:
        taken = (self.seconds, self.forward_kinds)
        self.seconds, self.forward_kinds = {}, {}
        return taken


def instrument(clock: PhaseClock) -> list[str]:
    """Wraps every TIMED function that exists; returns the ones that do not."""
    missing = []
    for module_name, class_name, method, phase in TIMED:
        cls = getattr(importlib.import_module(module_name), class_name, None)
        if cls is None or not hasattr(cls, method):
            missing.append(f"{class_name}.{method}")
            continue
        clock.wrap(cls, method, phase)
    return missing


def step_breakdown(step_seconds: float, phases: dict) -> dict:
    """Inclusive phase times of one step turned into the exclusive rows of ORDER."""
    get = phases.get
    rows = {"generate": get("generate", 0.0), "  HFEngine.generate": get("engine", 0.0), "reward": get("reward", 0.0),
            "experience forwards": get("experience forwards", 0.0),
            "experience, rest": max(get("experience", 0.0) - get("experience forwards", 0.0), 0.0),
            "buffer": get("buffer", 0.0), "train": get("train", 0.0),
            "  old log-probs": get("old log-probs", 0.0), "  collate": get("collate", 0.0),
            "  backward": get("backward", 0.0),
            "  optimizer step": get("optimizer step", 0.0), "logging + checkpoints": get("logging + checkpoints", 0.0)}
    inside = rows["  old log-probs"] + rows["  collate"] + rows["  backward"] + rows["  optimizer step"]
    rows["  forward + loss"] = max(rows["train"] - inside, 0.0)
    top = ("generate", "reward", "experience forwards", "experience, rest", "buffer", "train", "logging + checkpoints")
    rows["other"] = max(step_seconds - sum(rows[k] for k in top), 0.0)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12,
                        help="GRPO steps; the first two spans between rollouts are warm-up, not counted")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the one process")
    parser.add_argument("--sft_steps", type=int, default=400, help="SFT warm-up steps of the starting model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                        help="more train_ppo flags, appended last (e.g. --extra --init_kl_coef 0.01)")
    parser.add_argument("--lightrft_root", default=None, help="profile the lightrft package of this checkout")
    parser.add_argument("--cprofile", default=None, metavar="OUT", help="also write a cProfile of the timed steps")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the figures to this JSON file")
    args = parser.parse_args()
    if args.steps < 4:
        parser.error("--steps must be >= 4: the first spans warm up and are not counted")
    root = Path(args.lightrft_root).resolve() if args.lightrft_root else HERE.parent
    sys.path[:0] = [str(root), str(HERE)]
    # Import the package now: grpo_step puts this checkout first on the path, and every lightrft
    # module imported after this one resolves inside the package already loaded.
    import lightrft
    if Path(lightrft.__file__).resolve().parent != root / "lightrft":
        raise SystemExit(f"lightrft was imported from {lightrft.__file__}, not from {root}")
    os.environ.update({"OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false",
                       "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""})

    import torch

    torch.set_num_threads(args.threads)
    import grpo_step
    from lightrft.cli.train_ppo import parse_args, train
    from lightrft.trainer.callbacks import TrainerCallback

    clock = PhaseClock()
    missing = instrument(clock)
    work = grpo_step.Workload()
    out = Path(tempfile.mkdtemp(prefix="profile_step_"))
    data = grpo_step.prepare_workload(out, work, argparse.Namespace(seed=args.seed, sft_steps=args.sft_steps,
                                                                    sft_lr=3e-3, hidden=64, layers=2))
    flags = grpo_step.lightrft_flags(data, work, out / "run", args.steps, args.seed) + list(args.extra)
    steps: list[dict] = []
    profiler = cProfile.Profile() if args.cprofile else None

    class StepMarks(TrainerCallback):
        """A step runs from one rollout's end to the next: one training round, its logging and
        the next rollout. The first such span (first training, warm-up) is not counted."""
        def __init__(self):
            self.last = None

        def on_rollout_end(self, trainer, experiences):
            now = time.perf_counter()
            phases, kinds = clock.take()
            if self.last is not None:
                steps.append({"seconds": now - self.last, "phases": phases, "forward_kinds": kinds})
                if profiler is not None and len(steps) == 1:
                    profiler.enable()
            self.last = now

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    started = time.perf_counter()
    train(parse_args(flags), callbacks=[StepMarks()])
    wall = time.perf_counter() - started
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.cprofile)

    timed = steps[1:]
    rows = [step_breakdown(s["seconds"], s["phases"]) for s in timed]
    mean_step = statistics.mean(s["seconds"] for s in timed)
    table = {k: statistics.mean(r[k] for r in rows) for k in ORDER}
    kinds = {k: statistics.mean(s["forward_kinds"].get(k, 0.0) for s in timed)
             for k in sorted({k for s in timed for k in s["forward_kinds"]})}
    result = {"root": str(root), "threads": args.threads, "steps": args.steps, "timed_steps": len(timed),
              "samples_per_step": work.samples_per_step, "mean_step_seconds": mean_step,
              "median_step_seconds": statistics.median(s["seconds"] for s in timed),
              "breakdown_seconds": table, "experience_forwards_by_kind": kinds, "not_timed": missing,
              "wall_seconds": wall, "load_average": os.getloadavg()[0]}
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def print_table(result: dict) -> None:
    mean_step = result["mean_step_seconds"]
    print(f"\nlightrft GRPO step, one process x {result['threads']} thread(s), {result['samples_per_step']} samples "
          f"per step; {result['timed_steps']} timed steps of {result['root']}; 1-min load {result['load_average']:.1f}")
    print(f"step: mean {mean_step:.3f} s, median {result['median_step_seconds']:.3f} s "
          f"({result['samples_per_step'] / result['median_step_seconds']:.0f} samples/s)")
    for name in ORDER:
        seconds = result["breakdown_seconds"][name]
        print(f"  {name:<24}{seconds:>8.4f} s {seconds / mean_step:>6.1%}")
    if result["experience_forwards_by_kind"]:
        print("  experience forwards by kind: " + ", ".join(
            f"{k} {v:.4f} s" for k, v in result["experience_forwards_by_kind"].items()))
    if result["not_timed"]:
        print(f"  (not found, not timed: {', '.join(result['not_timed'])})")


if __name__ == "__main__":
    main()
