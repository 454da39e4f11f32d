"""Run metrics that are not losses: step timings and the reward sources' failure counters."""

import re
from typing import Sequence


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
