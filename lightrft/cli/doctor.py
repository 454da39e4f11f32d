"""Pre-flight check of a PPO / GRPO configuration: the same flags as train_ppo, one step, a report.

    torchrun --nproc_per_node 8 -m lightrft.cli.doctor <train_ppo flags> [--doctor_report doctor.json]

Checks (docs/doctor.md): data (rows rejected and why, prompt lengths, what --prompt_max_len cuts),
memory (one step at the longest prompts and responses, peak per phase, the flags to change),
invariance (loss and gradient: 1 vs 2 micro-batches, padded vs packed), engine (rollout log-probs
vs the trainer's, weight-sync round trip), rewards (count, type, finiteness and latency of every
source), workflow (multi-turn episodes of --workflow: turns, tools, how they ended, rewards) and
monitors (the health monitors the flags turn on and what each would do).
Rank 0 prints a table per check and a verdict; the exit code is 0 when nothing failed, 1
when a check failed, 2 for bad flags. Nothing is written to --ckpt_path or --save_path: the run
is built in a temporary folder and thrown away.
"""

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from lightrft.builders.ppo_run import check_world_size  # noqa: F401  (the docs' recipe checks call it)
from lightrft.cli import train_ppo
from lightrft.cli.common import parse_command_line
from lightrft.doctor import (CHECKS, CheckResult, DoctorReport, check_data, check_engine,
                             check_invariance, check_memory, check_moe, check_monitors, check_rewards, check_workflow)
from lightrft.experience.placement import arrive
from lightrft.doctor.engine import sampling_params
from lightrft.doctor.report import LEVELS
from lightrft.models.tokenizer import build_tokenizer
from lightrft.utils.program import run_program

DOCTOR_FLAGS = ("--doctor_checks", "--doctor_memory_budget_gb", "--doctor_reward_calls", "--doctor_report")


def build_parser() -> argparse.ArgumentParser:
    """train_ppo's parser plus the doctor's own flags."""
    parser = train_ppo.build_parser()
    parser.prog = "python -m lightrft.cli.doctor"
    parser.description = __doc__
    group = parser.add_argument_group("doctor", "what the pre-flight check runs and where its report goes")
    group.add_argument("--doctor_checks", type=str, default=",".join(CHECKS),
                       help=f"comma-separated checks to run, in this order: {','.join(CHECKS)}")
    group.add_argument("--doctor_memory_budget_gb", type=float, default=None,
                       help="memory the step must fit in, GiB (default: the GPU's memory; on CPU the available RAM)")
    group.add_argument("--doctor_reward_calls", type=int, default=3,
                       help="calls per reward source, for its latency percentiles")
    group.add_argument("--doctor_report", type=str, default=None, metavar="FILE.json",
                       help="also write the report as JSON here")
    return parser


def parse_args(argv=None):
    """(the doctor's options, the run config `train_ppo` would build from the same flags). Bad
    flags or combinations exit with code 2 and a message naming them, as train_ppo does."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    options = parse_command_line(parser, argv)
    checks = [c.strip() for c in options.doctor_checks.split(",") if c.strip()]
    unknown = [c for c in checks if c not in CHECKS]
    if unknown or not checks:
        parser.error(f"--doctor_checks {options.doctor_checks}: unknown check(s) {unknown}; choose from {list(CHECKS)}")
    if options.doctor_reward_calls < 1:
        parser.error(f"--doctor_reward_calls must be >= 1, got {options.doctor_reward_calls}")
    options.doctor_checks = checks
    return options, train_ppo.parse_args(strip_doctor_flags(argv))


def run_config(argv: list[str], options, workdir: str):
    """The config of the run the doctor builds: the user's flags with the output folders moved into
    `workdir` (a later flag wins in argparse), and bad rows skipped so the other checks still run
    when the data check fails."""
    overrides = ["--ckpt_path", os.path.join(workdir, "ckpt"), "--save_path", os.path.join(workdir, "model"),
                 "--on_bad_row", "skip"]
    if options.use_tensorboard:
        overrides += ["--use_tensorboard", os.path.join(workdir, "tensorboard")]
    return train_ppo.parse_args(strip_doctor_flags(argv) + overrides)


def changed_options(options) -> dict:
    """The train_ppo options of the command line that differ from their defaults."""
    defaults = train_ppo.build_parser()
    return {k: v for k, v in sorted(vars(options).items())
            if not k.startswith("doctor_") and k != "config" and v != defaults.get_default(k)}


def strip_doctor_flags(argv: list[str]) -> list[str]:
    """`argv` without the doctor's flags and their values."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token in DOCTOR_FLAGS:
            skip = True
        elif not token.startswith(tuple(f + "=" for f in DOCTOR_FLAGS)):
            out.append(token)
    return out


def run_doctor(argv: list[str], *, prepare=None) -> DoctorReport:
    """Runs the checks `argv` asks for on this rank and returns the report (every rank gets the same
    verdict). `prepare(run)` may change the built `PPORun` before the checks (research code that
    brings its own engine or reward sources; the tests plant faults this way). Rank 0 prints the
    report and writes `--doctor_report`."""
    workdir = tempfile.mkdtemp(prefix="lightrft-doctor-")
    try:
        options, user_args = parse_args(argv)
        run_args = run_config(list(argv), options, workdir)
        os.environ.setdefault("WANDB_MODE", "disabled")      # a pre-flight check logs no run
        results = []
        if "data" in options.doctor_checks:
            model = user_args.model
            tokenizer = lambda: build_tokenizer(model.pretrain, model.trust_remote_code, padding_side="left")  # noqa: E731
            results.append(guarded("data", lambda: check_data(user_args, tokenizer())))
        if "monitors" in options.doctor_checks:
            results.append(guarded("monitors", lambda: check_monitors(user_args)))
        model_checks = [c for c in options.doctor_checks if c not in ("data", "monitors")]
        if model_checks:
            results += run_model_checks(run_args, options, model_checks, prepare)
        report = DoctorReport(results, config=changed_options(options))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if int(os.environ.get("RANK", "0")) == 0:
        print(report.render(), flush=True)
        if options.doctor_report:
            Path(options.doctor_report).write_text(report.to_json())
    return report


def run_model_checks(args, options, checks: list[str], prepare) -> list[CheckResult]:
    """Builds the run and runs the checks that need models, in CHECKS order, on every rank."""
    from lightrft.rewards.base import RewardSourceError

    try:
        run = train_ppo.build_run(args)
    except (ValueError, FileNotFoundError, OSError, RewardSourceError) as err:
        failed = CheckResult("build", "building the run from the flags")
        failed.add("FAIL", f"the run cannot be built, so {', '.join(checks)} did not run: {err}")
        return [failed]
    results = []
    try:
        if prepare is not None:
            prepare(run)
        begin_training(run)
        if "memory" in checks:
            results.append(agree(guarded("memory", lambda: check_memory(run, options.doctor_memory_budget_gb)), run))
        sampled = [c for c in checks if c in ("invariance", "engine", "moe", "rewards", "workflow")]
        if sampled:
            try:
                prompts, labels, prompt_ids, rollout = sample_batch(run)
            except Exception as err:
                for name in sampled:
                    results.append(agree(stopped(name, err, "sampling the responses the check needs"), run))
                return results
            runners = {"invariance": lambda: check_invariance(run, rollout),
                       "engine": lambda: check_engine(run, prompts, prompt_ids, rollout),
                       "moe": lambda: check_moe(run, prompts, prompt_ids),
                       "rewards": lambda: check_rewards(run, prompts, labels, rollout, options.doctor_reward_calls),
                       "workflow": lambda: check_workflow(run, prompts, labels)}
            for name in sampled:
                results.append(agree(guarded(name, runners[name]), run))
    finally:
        for source in run.trainer.experience_services.scorer.reward_sources:
            if hasattr(source, "close"):
                source.close()
        run.tracker.close()
        run.trainer.rollout.shutdown()      # a vLLM engine's teardown needs the process group the strategy closes
        run.strategy.close()
    return results


def begin_training(run) -> None:
    """What a step needs from `PPOTrainer.fit`'s start, so it can run outside `fit`: the
    pretraining data stream of the PPO-ptx loss."""
    run.trainer.set_pretrain_data(run.pretrain_dataloader)


def sample_batch(run):
    """Real prompts of this rank's first rollout batch (enough for one micro-batch of samples, at
    least 2 samples) and their responses from the run's rollout manager."""
    args, strategy = run.args, run.strategy
    prompts, labels = next(iter(run.dataloader))
    needed = -(-max(args.micro_rollout_batch_size, args.micro_train_batch_size, 2) // args.n_samples_per_prompt)
    prompts, labels = list(prompts)[:needed], list(labels)[:needed]
    generator = run.trainer.experience_services.generator
    prompt_ids = generator.tokenize(prompts)
    params = sampling_params(args, args.seed + strategy.rank)
    inputs = generator.engine_inputs(prompts)
    rollout = generator.with_media(run.trainer.rollout.generate(prompt_ids, params, **inputs), inputs.get("media"),
                                   params.n)
    return prompts, labels, prompt_ids, arrive(rollout)


def guarded(name: str, check) -> CheckResult:
    """Runs one check; an exception becomes its FAIL line (LIGHTRFT_TRACEBACK=1 re-raises it)."""
    try:
        return check()
    except Exception as err:
        if os.environ.get("LIGHTRFT_TRACEBACK"):
            raise
        return stopped(name, err, "running the check")


def stopped(name: str, err: Exception, during: str) -> CheckResult:
    result = CheckResult(name, "did not finish")
    hint = ""
    if isinstance(err, torch.OutOfMemoryError):
        hint = (" (out of memory: see the memory check's recommendations, or lower --micro_train_batch_size / "
                "--micro_rollout_batch_size)")
    result.add("FAIL", f"{type(err).__name__} while {during}: {err}{hint}")
    return result


def agree(result: CheckResult, run) -> CheckResult:
    """Every rank ends with the worst status any rank found; ranks other than 0 print their
    WARN/FAIL lines (rank 0 prints the report)."""
    strategy = run.strategy
    level = LEVELS.index(result.status)
    worst = int(strategy.all_reduce(torch.tensor([float(level)]), op="max").item())
    if worst > level:
        result.add(LEVELS[worst], f"another rank found a {LEVELS[worst]} in this check; its stderr has the details")
    if strategy.rank != 0:
        for finding in result.findings:
            if finding.level != "PASS":
                print(f"[rank {strategy.rank}] doctor {result.name}: {finding.level}: {finding.text}", file=sys.stderr)
    return result


def main(argv=None) -> None:
    report = run_doctor(sys.argv[1:] if argv is None else argv)
    sys.exit(report.exit_code)


if __name__ == "__main__":
    run_program(main)
