"""A staleness bound that sets itself: `--auto_sync_offset N` (docs/async.md).

The explorers' offset D (how many steps they may run ahead; the bound is D + K - 1 with K =
--sync_interval) moves within [1, N], one step at a time, at each weight sync, from what the
trainers measured since the last one:

- **shrink** (D - 1) when the samples were too far from the trainer's policy: the mismatch KL
  (`train/mismatch_kl_k3`, mean over the steps) above KL_SHRINK, or a ratio tail outside
  [RATIO_LOW, RATIO_HIGH] (`train/rollout_ratio_p05` below, `train/rollout_ratio_p95` above), or
  more than CORRECTED_SHRINK of the tokens truncated or masked by the correction
  (`train/tis_clip_frac`);
- **grow** (D + 1) when none of that holds with a margin (KL at most KL_SHRINK / 2, tails within
  [RATIO_LOW_CALM, RATIO_HIGH_CALM], at most CORRECTED_SHRINK / 2 corrected) and the trainers
  waited for experience more than IDLE_GROW of their time (`perf/experience_wait_s` over the
  wall time between steps): running further ahead would feed them;
- **hold** otherwise. The margins keep it from moving back and forth on noise.

A metric the run does not log (no engine log-probs, no correction) does not vote. The trainers
send D with every version they publish; explorers schedule each batch with the D they last
received. A batch is trained at most D + K - 1 versions old for the D it was generated under, so
the bound of the whole run is N + K - 1.
"""

from dataclasses import dataclass, field
from typing import Optional

KL_SHRINK = 2e-3              # train/mismatch_kl_k3 above this: shrink
RATIO_LOW, RATIO_HIGH = 0.5, 2.0              # p05 below / p95 above: shrink
RATIO_LOW_CALM, RATIO_HIGH_CALM = 0.67, 1.5   # both within these (and the rest calm) to grow
CORRECTED_SHRINK = 0.05       # share of tokens truncated or masked above this: shrink
IDLE_GROW = 0.10              # trainers idle more than this share of the time: grow (if calm)


@dataclass
class AutoOffset:
    """The explorers' offset within [1, `high`], decided at each weight sync (`decide`) from the
    step logs collected since the last one (`observe`)."""

    high: int
    offset: int = 1
    reason: str = "start"
    _seen: list = field(default_factory=list)      # (logs, wall seconds) per step since the last decision

    def __post_init__(self):
        self.offset = min(max(self.offset, 1), self.high)

    def observe(self, logs: dict[str, float], wall_s: float) -> None:
        """One trained step's logs and its wall time (from the previous step's end to this one's)."""
        self._seen.append((dict(logs), wall_s))

    def decide(self) -> int:
        """The offset from what was observed since the last decision (unchanged when nothing was)."""
        seen, self._seen = self._seen, []
        if not seen:
            return self.offset
        kl = _mean(seen, "train/mismatch_kl_k3")
        low, high = _mean(seen, "train/rollout_ratio_p05"), _mean(seen, "train/rollout_ratio_p95")
        corrected = _mean(seen, "train/tis_clip_frac")
        wall = sum(w for _, w in seen)
        idle = sum(logs.get("perf/experience_wait_s", 0.0) for logs, _ in seen) / wall if wall > 0 else 0.0
        if ((kl is not None and kl > KL_SHRINK) or (low is not None and low < RATIO_LOW)
                or (high is not None and high > RATIO_HIGH) or (corrected is not None and corrected > CORRECTED_SHRINK)):
            self.offset, self.reason = max(1, self.offset - 1), "off-policy"
        elif ((kl is None or kl <= KL_SHRINK / 2) and (low is None or low >= RATIO_LOW_CALM)
              and (high is None or high <= RATIO_HIGH_CALM) and (corrected is None or corrected <= CORRECTED_SHRINK / 2)
              and idle > IDLE_GROW):
            self.offset, self.reason = min(self.high, self.offset + 1), "idle"
        else:
            self.reason = "hold"
        return self.offset

    def state_dict(self) -> dict:
        return {"offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.offset = min(max(int(state.get("offset", self.offset)), 1), self.high)


def _mean(seen: list, tag: str) -> Optional[float]:
    values = [logs[tag] for logs, _ in seen if tag in logs]
    return sum(values) / len(values) if values else None
