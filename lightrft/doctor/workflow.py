"""Workflow check (--workflow): the run's workflow plays real episodes on real prompts.

It reports what training would see: turns per episode, tool calls and their errors, how episodes
ended (done, a budget, a tool that hung or crashed, a bug in the workflow), the rewards, the share
of environment tokens in the episodes (attended to, not trained), and the gap between the engine's
log-probs and the actor's on the trained tokens (token in, token out: the episode's ids must be
what the actor scores). Every episode failing is a FAIL with the first traceback; some failing,
budgets cutting most episodes, tools failing, or rewards all equal are warnings."""

import time
from collections import Counter

import torch

from lightrft.doctor.engine import actor_log_probs, sampling_params
from lightrft.doctor.report import CheckResult

GAP_WARN = 0.5       # nats: far beyond any engine's rounding; the sequence is not what was sampled


def check_workflow(run, prompts: list, labels: list) -> CheckResult:
    config, generator = run.args, run.trainer.experience_services.generator
    runner = generator.workflow_runner
    if runner is None:
        result = CheckResult("workflow", "multi-turn episodes")
        result.add("PASS", "no --workflow: one response per prompt (nothing to check)")
        return result
    params = sampling_params(config, config.distributed.seed + run.strategy.rank)
    result = CheckResult("workflow", f"{type(runner.workflow).__name__} on {len(prompts)} prompts x {params.n} "
                                     f"episodes")
    started = time.perf_counter()
    batch = runner.run(run.trainer.rollout, generator.tokenize(prompts), prompts, labels, params,
                       [config.distributed.seed + i for i in range(len(prompts))])
    seconds = time.perf_counter() - started
    records, rollout = batch.records, batch.rollout
    reasons = Counter(r.stop_reason for r in records)
    turns = [r.turns for r in records]
    rewards = [r.reward for r, unscored in zip(records, batch.unscored.tolist()) if not unscored and r.valid]
    response = rollout.attention_mask[:, rollout.prompt_len:].bool()
    environment = int((response & ~rollout.action_mask).sum())
    gap = float("nan")
    if rollout.action_mask.any():
        trained = rollout.action_mask
        gap = float(((actor_log_probs(run, rollout) - rollout.rollout_log_probs).abs() * trained).max())
    result.figures = {"episodes": len(records), "seconds": seconds, "turns_mean": sum(turns) / len(turns),
                      "turns_max": max(turns), "tool_calls": sum(r.stats.tool_calls for r in records),
                      "tool_errors": sum(r.stats.tool_errors for r in records), "stop_reasons": dict(reasons),
                      "reward_min": min(rewards, default=float("nan")),
                      "reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
                      "reward_max": max(rewards, default=float("nan")), "unscored": int(batch.unscored.sum()),
                      "environment_token_share": environment / max(int(response.sum()), 1),
                      "longest_episode_tokens": int(response.sum(dim=1).max()), "logprob_gap_max": gap}
    f = result.figures
    result.rows = [("episodes", "turns mean / max", "tool calls / errors", "ended", "reward min / mean / max",
                    "env tokens", "gap max", "s"),
                   (str(f["episodes"]), f"{f['turns_mean']:.2f} / {f['turns_max']}",
                    f"{f['tool_calls']} / {f['tool_errors']}",
                    ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())),
                    f"{f['reward_min']:.3g} / {f['reward_mean']:.3g} / {f['reward_max']:.3g}",
                    f"{100 * f['environment_token_share']:.0f}%", f"{gap:.2e}", f"{seconds:.2f}")]
    judge(result, records, reasons, rewards, gap, config)
    return result


def judge(result: CheckResult, records: list, reasons: Counter, rewards: list, gap: float, config) -> None:
    failed = [r for r in records if r.stop_reason == "workflow_error"]
    if failed:
        level = "FAIL" if len(failed) == len(records) else "WARN"
        result.add(level, f"{len(failed)} of {len(records)} episodes raised in the workflow (they would not train); "
                          f"the first:\n{failed[0].extra.get('error', '').strip()}")
    budget = reasons.get("max_turns", 0) + reasons.get("token_budget", 0)
    if budget > len(records) / 2:
        result.add("WARN", f"{budget} of {len(records)} episodes ran out of --max_turns ({config.agent.max_turns}) or "
                           f"--max_episode_tokens ({config.agent.max_episode_tokens}); raise them, or end episodes "
                           "in the workflow")
    tool_failures = reasons.get("tool_timeout", 0) + reasons.get("tool_crash", 0)
    if tool_failures:
        result.add("WARN", f"{tool_failures} episodes ended on a tool that hung or crashed (--tool_timeout "
                           f"{config.agent.tool_timeout} s)")
    if len(set(rewards)) == 1 and len(rewards) > 1:
        result.add("WARN", f"every scored episode got the reward {rewards[0]:g}: group estimators learn nothing from "
                           "equal rewards")
    if gap == gap and gap > GAP_WARN:
        result.add("FAIL", f"the actor's log-probs differ from the engine's by up to {gap:.3g} nats on trained "
                           "tokens: the episode's ids are not what the engine sampled from")
    if not result.findings:
        result.add("PASS", "episodes ran, ended and were scored as training needs")
