"""Run metrics that are not losses: how a step's metrics combine over micro-batches, steps and
ranks, the loss normalisers over ranks, step timings and the reward sources' failure counters.
Each cross-rank reduction is one all-reduce per step or pass, started early and read late."""

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Sequence

import torch

from lightrft.experience.replay_buffer import NaiveReplayBuffer

if TYPE_CHECKING:
    from lightrft.strategy.deepspeed_strategy import PendingReduction


def perf_metrics(timings: dict[str, float], rollout_time: float, train_time: float,
                 samples: int) -> dict[str, float]:
    """perf/*: seconds per phase of the step (the experience maker's generate / reward /
    experience timings among them) and samples per second over the whole step."""
    return {"perf/rollout_time": rollout_time, "perf/train_time": train_time,
            **{f"perf/{k}_time": v for k, v in timings.items()},
            "perf/samples_per_sec": samples / max(rollout_time + train_time, 1e-9)}


def reward_source_counters(sources: Sequence) -> dict[str, float]:
    """This rank's request, retry, timeout, failure and drop counters of the HTTP reward servers
    and reward files (numbered in --remote_rm_url order); sum them over ranks for
    `reward_source_metrics`."""
    return {f"rollout/reward_source{i}_{k}": float(v) for i, source in enumerate(sources) if hasattr(source, "stats")
            for k, v in sorted(source.stats.as_dict().items())}


def reward_source_metrics(totals: dict[str, float]) -> dict[str, float]:
    """The counters of `reward_source_counters` summed over ranks, with per-call failure rates, so a
    slow or flaky source shows up whatever the run length."""
    metrics = dict(totals)
    for prefix in [match.group(1) for match in map(re.compile(r"(rollout/reward_source\d+_)calls").fullmatch, totals)
                   if match]:
        calls = totals[f"{prefix}calls"]
        for k in ("timeouts", "errors", "crashes"):
            if calls and f"{prefix}{k}" in totals:
                metrics[f"{prefix}{k}_rate"] = totals[f"{prefix}{k}"] / calls
    return metrics


EXTREME_SUFFIXES = ("_max", "_min")


def combine_metric(key: str, values: list[float], signed: bool = False) -> float:
    """Combines one training metric over micro-batches, ranks or optimizer steps: the largest of
    a `*_max` metric, the smallest of a `*_min` one, the mean of any other. Extremes skip NaN (what
    a micro-batch with no token to train on reports) and are NaN when nothing is left. `signed`
    returns an extreme as a value to maximise (`*_min` negated, -inf for none): the form the
    cross-rank max all-reduce takes."""
    if not key.endswith(EXTREME_SUFFIXES):
        return sum(values) / len(values)
    kept = [v for v in values if not math.isnan(v)]
    if key.endswith("_max"):
        best = max(kept, default=float("-inf"))
        return best if signed or kept else float("nan")
    best = -min(kept, default=float("inf"))
    return best if signed else (-best if kept else float("nan"))


class GlobalCounts(Mapping):
    """One optimizer step's loss normalisers ("tokens", "seqs") over all ranks, from an all-reduce
    still in flight: reading one waits for it (`PPOTrainer.global_counts`)."""

    def __init__(self, pending: "PendingReduction", index: int):
        self._pending, self._index = pending, index

    def _counts(self) -> dict[str, float]:
        return self._pending.result()[self._index]

    def __getitem__(self, key: str) -> float:
        return self._counts()[key]

    def __iter__(self):
        return iter(self._counts())

    def __len__(self) -> int:
        return len(self._counts())

    def __repr__(self) -> str:
        return f"GlobalCounts({self._counts()})"


def global_counts(strategy, groups: list) -> list[Mapping[str, float]]:
    """Action tokens and sequences of each optimizer step (a group of micro-batches) over all
    ranks, in one all-reduce for the whole pass: the normalisers that make the loss independent
    of how the batch is split. Samples that train on nothing (invalid, filler or masked-out)
    count in neither. The all-reduce starts now; reading a count waits for it, so the forwards
    before the first loss run while the ranks catch up with each other."""
    if not groups:
        return []
    local = torch.tensor([[sum(float(e.loss_mask.sum()) for e in group),
                           sum(float(e.loss_mask.any(dim=1).sum()) for e in group)] for group in groups],
                         dtype=torch.float64)
    # The ranks of a sequence-parallel group hold the same samples: each is counted once.
    repeats = getattr(strategy, "sequence_parallel_size", 1)
    pending = strategy.start_all_reduce(local, op="sum").then(
        lambda totals: [{"tokens": tokens / repeats, "seqs": seqs / repeats} for tokens, seqs in totals.tolist()])
    return [GlobalCounts(pending, index) for index in range(len(groups))]


def reduce_pass_metrics(strategy, steps: list[list[dict]],
                        preempted: bool = False) -> tuple[list[dict[str, float]], bool]:
    """Each optimizer step's micro-batch metrics over its micro-batches and over the ranks, for
    all the steps of a pass at once: averaged in one all-reduce (the only waited host sync of
    the pass), which also tells whether any rank was `preempted` (asked to stop); extremes
    (`*_max`, `*_min`, see `combine_metric`) travel in a max all-reduce in flight beside it.
    Shape: `steps` is (optimizer steps, micro-batches) of dicts of 0-d tensors. Returns (a dict
    per optimizer step, preempted on any rank)."""
    keys = sorted(steps[0][0]) if steps and steps[0] else []
    local = torch.tensor([[combine_metric(k, [float(m[k]) for m in micro], signed=True) for k in keys]
                          for micro in steps], dtype=torch.float64).reshape(len(steps), len(keys))
    extremes = [j for j, k in enumerate(keys) if k.endswith(EXTREME_SUFFIXES)]
    pending = strategy.start_all_reduce(local[:, extremes], op="max") if extremes else None
    totals = strategy.all_reduce_many({"metrics": local, "preempted": torch.tensor([float(preempted)])},
                                           op="sum")
    reduced = totals["metrics"] / strategy.world_size     # (steps, keys)
    if pending is not None:
        signed = pending.result().to(reduced.dtype)
        sign = torch.tensor([1.0 if keys[j].endswith("_max") else -1.0 for j in extremes], dtype=reduced.dtype)
        reduced[:, extremes] = torch.where(torch.isinf(signed), float("nan"), signed * sign)
    return [dict(zip(keys, row)) for row in reduced.tolist()], bool(totals["preempted"].item() > 0)


def combine_step_metrics(step_metrics: list[dict[str, float]]) -> dict[str, float]:
    """A pass's (or a step's) logs from the metrics of its optimizer steps (`combine_metric`),
    with the engine log-prob gap sums turned into its per-token mean."""
    if not step_metrics:
        return {}
    logs = {k: combine_metric(k, [m[k] for m in step_metrics]) for k in step_metrics[0]}
    if "train/engine_logprob_gap_sum" in logs:
        # Means of sums over means of counts: every token weighs the same, wherever it trained.
        gap_sum, tokens = logs.pop("train/engine_logprob_gap_sum"), logs.pop("train/engine_logprob_gap_tokens")
        logs["rollout/engine_logprob_gap_mean"] = gap_sum / tokens if tokens > 0 else float("nan")
        logs["rollout/engine_logprob_gap_max"] = logs.pop("train/engine_logprob_gap_max")
    return logs


def start_step_totals(strategy, rollout_sums: dict[str, torch.Tensor], nonfinite_counts: dict[str, int],
                      reward_sources: Sequence) -> "PendingReduction":
    """The rollout's statistics over all ranks, in one all-reduce started now and read
    (`.result()`, a dict of rollout/* logs) when the step ends: each collective waits for the
    slowest rank, and this one waits while the actor trains. It carries the mean of every
    rollout info field (from `rollout_sums`, the buffer's `info_sums`), the non-finite sample
    counts and the reward sources' counters."""
    nonfinite = dict(nonfinite_counts)
    counters = reward_source_counters(reward_sources)
    pending = strategy.start_all_reduce_many({
        "rollout": torch.stack(list(rollout_sums.values())) if rollout_sums else torch.zeros(0),
        "nonfinite": torch.tensor([float(nonfinite[k]) for k in sorted(nonfinite)]),
        "counters": torch.tensor(list(counters.values()))}, op="sum")

    def logs(totals: dict[str, torch.Tensor]) -> dict[str, float]:
        means = NaiveReplayBuffer.info_means(dict(zip(rollout_sums, totals["rollout"])))
        return {**{f"rollout/{k}": v for k, v in means.items()},
                **{f"rollout/nonfinite_{k}_samples": v
                   for k, v in zip(sorted(nonfinite), totals["nonfinite"].tolist())},
                **reward_source_metrics(dict(zip(counters, totals["counters"].tolist())))}
    return pending.then(logs)
