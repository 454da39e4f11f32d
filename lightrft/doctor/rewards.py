"""Rewards check: every reward source and reward model scores real generated samples a few times.

For each: what type it returns, how many scores (must be one per sample), whether they are finite
numbers, whether a source that drops failures (`--reward_on_failure drop`) dropped any, their
range, and the latency of a whole-batch call (p50 / p90 / max). A call near `--reward_timeout`
is a warning: in training it would time out whenever the grader is a little slower (a judge model
on the rank has no timeout, so it gets no such warning). A source's counters over the check's calls
(`source.stats`: a server's requests and retries, a judge's cache hits and unparsed answers) are
in its figures under "stats".

With a distillation teacher (`--teacher_pretrain`, whose tokenizer the run's build already matched
with the student's), the check also runs the teacher and the student over the same samples and
reports the per-token signal: the mean reverse KL per token, both mean log-probs, and the range of
the per-token reward `--distill_coef` x (log p_teacher - log p_student)."""

import logging
import time
from contextlib import contextmanager

import torch

from lightrft.algorithms.distill import distill_token_rewards
from lightrft.doctor.report import CheckResult, percentile
from lightrft.rewards.remote import redact_url

SLOW_SHARE = 0.5     # a call over half of --reward_timeout is a warning


@contextmanager
def captured_warnings(logger_name: str = "lightrft.rewards"):
    """Collects the warnings reward sources log while dropping samples (the reason of each drop)."""
    messages = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler, logger = Collect(level=logging.WARNING), logging.getLogger(logger_name)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def source_names(remote_rm_url: str | None, sources: list) -> list[str]:
    """A name per reward source: its --remote_rm_url entry (URLs, judge URLs included, without
    credentials), else its repr."""
    specs = [s.strip() for s in (remote_rm_url or "").split(",") if s.strip()]
    if len(specs) != len(sources):
        return [repr(s) for s in sources]
    return [shown_spec(s) for s in specs]


def shown_spec(spec: str) -> str:
    """A --remote_rm_url entry as it may be shown: `http://user:pw@host` as `http://***@host`,
    `judge:http://...` likewise."""
    prefix = "judge:" if spec.startswith("judge:") else ""
    target = spec[len(prefix):]
    return prefix + redact_url(target) if target.startswith(("http://", "https://")) else spec


def describe(output) -> str:
    if isinstance(output, torch.Tensor):
        return f"Tensor {str(output.dtype).replace('torch.', '')} {tuple(output.shape)}"
    return type(output).__name__


def score_source(source, batch: int, call, calls: int) -> dict:
    """Calls `call()` up to `calls` times; stops at the first failure. Returns the figures, with
    the source's counters over these calls under "stats" when it keeps them (`source.stats`:
    requests, timeouts, a judge's cache hits and unparsed answers ...)."""
    figures = {"latencies": [], "type": "-", "count": None, "finite": None, "dropped": 0, "error": None,
               "min": float("nan"), "mean": float("nan"), "max": float("nan"), "distinct": 0}
    before = counters(source)
    try:
        measure(figures, batch, call, calls)
    finally:
        if before is not None:
            figures["stats"] = {k: v - before[k] for k, v in counters(source).items()}
    return figures


def counters(source) -> dict | None:
    stats = getattr(source, "stats", None)
    return stats.as_dict() if hasattr(stats, "as_dict") else None


def measure(figures: dict, batch: int, call, calls: int) -> None:
    """`score_source`'s calls, recorded in `figures`."""
    for _ in range(calls):
        started = time.perf_counter()
        with captured_warnings() as warnings:
            try:
                output = call()
            except Exception as err:            # the check reports any failure of user code
                figures["error"] = f"{type(err).__name__}: {err}"
                figures["latencies"].append(time.perf_counter() - started)
                return
        figures["latencies"].append(time.perf_counter() - started)
        figures["type"] = describe(output)
        if hasattr(output, "valid"):
            figures["dropped"] += int((~output.valid.bool()).sum())
            figures["drop_reasons"] = warnings[:3]
            output = output.rewards
        try:
            scores = torch.as_tensor(output, dtype=torch.float32).detach().cpu().reshape(-1)
        except (TypeError, ValueError, RuntimeError) as err:
            figures["error"] = f"returned {describe(output)}, not numbers ({err})"
            return
        finite = torch.isfinite(scores)
        figures.update(count=scores.numel(), finite=bool(finite.all()), nonfinite=int((~finite).sum()))
        if scores.numel() != batch or not finite.all():
            return
        figures.update(min=scores.min().item(), mean=scores.mean().item(), max=scores.max().item(),
                       distinct=len(set(scores.tolist())))


def check_rewards(run, prompts: list[str], labels: list, rollout, calls: int) -> CheckResult:
    config, services = run.args, run.trainer.experience_services
    scorer = services.scorer
    result = CheckResult("rewards", f"each reward source on {rollout.sequences.size(0)} generated samples, "
                                    f"{calls} calls")
    n = config.algorithm.n_samples_per_prompt
    batch = rollout.sequences.size(0)
    queries, sample_prompts = scorer.decode(rollout, prompts, n)
    sample_labels = [label for label in labels for _ in range(n)]
    entries = [(name, source, lambda s=source: s(queries, sample_prompts, sample_labels))
               for name, source in zip(source_names(config.rewards.remote_rm_url, scorer.reward_sources),
                                       scorer.reward_sources)]
    reward_pretrain = config.model.reward_pretrain
    for i, model in enumerate(scorer.reward_models):
        path = reward_pretrain.split(",")[i].strip() if reward_pretrain else f"model {i}"
        entries.append((f"reward model {path}", model, lambda m=model: reward_model_scores(run, m, rollout)))
    result.rows.append(("source", "returns", "count", "finite", "min / mean / max", "p50 / p90 / max s"))
    for name, source, call in entries:
        figures = score_source(source, batch, call, calls)
        lat = figures["latencies"]
        figures.update(p50=percentile(lat, 50), p90=percentile(lat, 90), latency_max=max(lat, default=float("nan")))
        result.figures[name] = figures
        count = "-" if figures["count"] is None else figures["count"]
        finite = "-" if figures["finite"] is None else ("yes" if figures["finite"] else "no")
        result.rows.append((name, figures["type"], f"{count}/{batch}", finite,
                            f"{figures['min']:.3g} / {figures['mean']:.3g} / {figures['max']:.3g}",
                            f"{figures['p50']:.3f} / {figures['p90']:.3f} / {figures['latency_max']:.3f}"))
        # A judge model on this rank has no timeout (None): its calls are bounded by its answer length.
        judge_source(result, name, figures, batch, getattr(source, "timeout", config.rewards.reward_timeout))
    if not entries:
        result.add("PASS", "no reward source or model: the workflow (--workflow) or the teacher scores")
    elif not result.findings:
        result.add("PASS", f"{len(entries)} reward source(s) return {batch} finite scores per call")
    if services.builder.teacher is not None:
        check_teacher_signal(result, run, rollout)
    return result


@torch.no_grad()
def check_teacher_signal(result: CheckResult, run, rollout) -> None:
    """The teacher's per-token signal on the generated samples, as the experience builder computes
    it: a row of the table, its figures under "teacher", and a FAIL where it is not finite."""
    config, builder = run.args, run.trainer.experience_services.builder
    algo = config.algorithm
    builder.eval_models()
    mask = rollout.action_mask.bool()
    started = time.perf_counter()
    teacher = builder.forward(builder.teacher, rollout)
    seconds = time.perf_counter() - started
    student = builder.forward(builder.actor, rollout)
    rewards = distill_token_rewards(student, teacher, mask, algo.distill_coef, algo.kl_clamp)
    tokens = int(mask.sum())
    finite = bool(torch.isfinite(teacher[mask]).all() and torch.isfinite(student[mask]).all())

    def mean(x):
        return float(x[mask].mean()) if tokens else float("nan")

    figures = {"tokens": tokens, "finite": finite, "teacher_seconds": seconds, "reverse_kl": mean(student - teacher),
               "teacher_logprob": mean(teacher), "student_logprob": mean(student), "reward_mean": mean(rewards),
               "reward_min": float(rewards[mask].min()) if tokens else float("nan"),
               "reward_max": float(rewards[mask].max()) if tokens else float("nan")}
    result.figures["teacher"] = figures
    name = f"teacher --teacher_pretrain {config.model.teacher_pretrain}"
    result.rows.append((name, f"per-token {algo.distill_mode}", f"{tokens} tokens", "yes" if finite else "no",
                        f"{figures['reward_min']:.3g} / {figures['reward_mean']:.3g} / {figures['reward_max']:.3g}",
                        f"{seconds:.3f} (one forward)"))
    if not finite:
        result.add("FAIL", f"{name}: its log-probs of the student's samples are not finite; check the teacher's "
                           "weights and precision (--bf16)")
        return
    result.add("PASS", f"{name}: shares the student's tokenizer; on {tokens} sampled tokens the reverse KL is "
                       f"{figures['reverse_kl']:.3f} nats per token (teacher log-prob "
                       f"{figures['teacher_logprob']:.3f}, student {figures['student_logprob']:.3f}); per-token "
                       f"{algo.distill_mode} with --distill_coef {algo.distill_coef:g}")


@torch.no_grad()
def reward_model_scores(run, model, rollout) -> torch.Tensor:
    micro, device = run.args.rollout.micro_rollout_batch_size, run.strategy.device
    return torch.cat([model(rollout.sequences[i:i + micro].to(device),
                            attention_mask=rollout.attention_mask[i:i + micro].to(device)).float().cpu()
                      for i in range(0, rollout.sequences.size(0), micro)])


def judge_source(result: CheckResult, name: str, f: dict, batch: int, timeout: float | None) -> None:
    if f["error"]:
        result.add("FAIL", f"{name}: {f['error']}")
        return
    if f["count"] != batch:
        result.add("FAIL", f"{name}: returned {f['count']} scores for {batch} samples; reward_func must return one "
                           "score per query, in order")
    elif not f["finite"]:
        result.add("FAIL", f"{name}: {f['nonfinite']} of {batch} scores are NaN or infinite; return finite numbers "
                           "(a failed grade is a low score, not NaN)")
    if f["dropped"]:
        reasons = "; ".join(f.get("drop_reasons") or []) or "see the warnings above"
        result.add("FAIL", f"{name}: dropped {f['dropped']} samples under --reward_on_failure drop ({reasons})")
    if not name.startswith("reward model") and timeout is not None and f["latency_max"] > SLOW_SHARE * timeout:
        result.add("WARN", f"{name}: a call took {f['latency_max']:.2f} s, over {SLOW_SHARE:.0%} of --reward_timeout "
                           f"{timeout:g}; raise --reward_timeout or speed the source up")
    if f["count"] == batch and f["finite"] and f["distinct"] == 1 and batch > 1:
        result.add("WARN", f"{name}: every sample got the same score {f['min']:.3g}; with group estimators "
                           "(group_norm, rloo, ...) identical scores give zero advantages and no gradient")
