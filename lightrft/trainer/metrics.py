"""Run metrics that are not losses: step timings and the reward sources' failure counters."""

from typing import Sequence

import torch


def perf_metrics(timings: dict[str, float], rollout_time: float, train_time: float,
                 samples: int) -> dict[str, float]:
    """perf/*: seconds per phase of the step (the experience maker's generate / reward /
    experience timings among them) and samples per second over the whole step."""
    return {"perf/rollout_time": rollout_time, "perf/train_time": train_time,
            **{f"perf/{k}_time": v for k, v in timings.items()},
            "perf/samples_per_sec": samples / max(rollout_time + train_time, 1e-9)}


def reward_source_metrics(sources: Sequence, strategy) -> dict[str, float]:
    """Request, retry, timeout, failure and drop counters of the HTTP reward servers and reward
    files (numbered in --remote_rm_url order), summed over ranks, and per-call failure rates.
    Every rank calls it (one all-reduce when any source keeps statistics)."""
    names = [(i, k) for i, source in enumerate(sources) if hasattr(source, "stats")
             for k in sorted(source.stats.as_dict())]
    if not names:
        return {}
    local = torch.tensor([float(sources[i].stats.as_dict()[k]) for i, k in names], dtype=torch.float64)
    totals = strategy.all_reduce(local, op="sum").tolist()
    metrics = {f"rollout/reward_source{i}_{k}": v for (i, k), v in zip(names, totals)}
    # Failure rates per call, so a slow or flaky source shows up whatever the run length.
    for i in sorted({i for i, _ in names}):
        calls = metrics.get(f"rollout/reward_source{i}_calls")
        for k in ("timeouts", "errors", "crashes"):
            if calls and f"rollout/reward_source{i}_{k}" in metrics:
                metrics[f"rollout/reward_source{i}_{k}_rate"] = metrics[f"rollout/reward_source{i}_{k}"] / calls
    return metrics
