"""A staleness bound that sets itself: `--auto_sync_offset N` (docs/async.md).

The explorers' offset D (how many steps they may run ahead; the bound is D + K - 1 with K =
--sync_interval) moves within [1, N], one step at a time, at weight syncs, from the trainers'
logs of the last WINDOW steps. The first signal is how much of the samples the off-policy
correction had to give up: the share of tokens it truncated or masked (`train/tis_clip_frac`),
which does not depend on the model's scale or the learning rate the way a KL does; the ratio's
tails and the mismatch KL are ceilings on top of it:

- **shrink** (D - 1) when the correction gave up more than CORRECTED_SHRINK of the tokens, or a
  ratio tail lies outside [RATIO_LOW, RATIO_HIGH] (`train/rollout_ratio_p05` below,
  `train/rollout_ratio_p95` above), or the mismatch KL (`train/mismatch_kl_k3`) exceeds KL_SHRINK;
- **grow** (D + 1) when all of them are within a margin (at most CORRECTED_GROW corrected, tails
  within [RATIO_LOW_CALM, RATIO_HIGH_CALM], KL at most KL_GROW), the trainers waited for
  experience more than IDLE_GROW of their time (`perf/experience_wait_s` over the wall time
  between steps), and the explorers waited for weights more than BLOCKED_GROW of it
  (`perf/explorer_blocked_s`, the seconds the bound held them, sent with each batch): running
  further ahead would give them work and feed the trainers. Explorers that never wait for
  weights are slower than the trainers on average, and a larger offset would only age the
  samples: the trainers wait at any offset then;
- **hold** otherwise, and after every change for WINDOW steps plus the larger of the two
  offsets (the batches the explorers had generated under the old offset arrive first), so the
  next decision reads only batches generated under the new offset.

Each signal is the mean over the window; a metric the run does not log (no engine log-probs, no
correction) does not vote. The trainers send D with every version they publish; explorers
schedule each batch with the D they last received. A batch is trained at most D + K - 1 versions
old for the D it was generated under, so the bound of the whole run is N + K - 1.
"""

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

WINDOW = 3                    # steps a decision reads (and held after a change, beside the offset)
CORRECTED_SHRINK, CORRECTED_GROW = 0.02, 0.01   # share of tokens truncated or masked by the correction
RATIO_LOW, RATIO_HIGH = 0.5, 2.0                # p05 below / p95 above: shrink
RATIO_LOW_CALM, RATIO_HIGH_CALM = 0.67, 1.5     # both within these (and the rest calm) to grow
KL_SHRINK, KL_GROW = 0.05, 0.025                # train/mismatch_kl_k3
IDLE_GROW = 0.10              # trainers idle more than this share of the time: grow (if calm) ...
# ... and explorers held by the bound more than this share. On benchmarks/async.py's long tail
# (docs/benchmarks.md) one step ahead held the explorer 6.6% of the time and left the trainer idle
# 31%; two and four steps ahead never held it, and the trainer waited 22% either way.
BLOCKED_GROW = 0.02


@dataclass
class AutoOffset:
    """The explorers' offset within [1, `high`], decided at each weight sync (`decide`) from the
    last WINDOW steps' logs (`observe`)."""

    high: int
    offset: int = 1
    reason: str = "start"
    _seen: deque = field(default_factory=lambda: deque(maxlen=WINDOW))   # (logs, wall seconds) per step
    _steady: int = 0              # steps observed since the offset last changed
    _hold: int = WINDOW           # steps to observe before the next decision

    def __post_init__(self):
        self.offset = min(max(self.offset, 1), self.high)

    def observe(self, logs: dict[str, float], wall_s: float) -> None:
        """One trained step's logs and its wall time (from the previous step's end to this one's)."""
        self._seen.append((dict(logs), wall_s))
        self._steady += 1

    def decide(self) -> int:
        """The offset from the last WINDOW steps (unchanged until the steps after the last change
        are all of batches generated under it)."""
        if self._steady < self._hold or len(self._seen) < WINDOW:
            self.reason = "settling"
            return self.offset
        seen = list(self._seen)
        corrected = _mean(seen, "train/tis_clip_frac")
        low, high = _mean(seen, "train/rollout_ratio_p05"), _mean(seen, "train/rollout_ratio_p95")
        kl = _mean(seen, "train/mismatch_kl_k3")
        wall = sum(w for _, w in seen)
        idle = sum(logs.get("perf/experience_wait_s", 0.0) for logs, _ in seen) / wall if wall > 0 else 0.0
        held = [logs["perf/explorer_blocked_s"] for logs, _ in seen if "perf/explorer_blocked_s" in logs]
        blocked = sum(held) / wall if held and wall > 0 else None
        before = self.offset
        if (_above(corrected, CORRECTED_SHRINK) or _above(kl, KL_SHRINK) or _above(high, RATIO_HIGH)
                or (low is not None and low < RATIO_LOW)):
            self.offset, self.reason = max(1, self.offset - 1), "off-policy"
        elif (not _above(corrected, CORRECTED_GROW) and not _above(kl, KL_GROW) and not _above(high, RATIO_HIGH_CALM)
              and (low is None or low >= RATIO_LOW_CALM) and idle > IDLE_GROW
              and (blocked is None or blocked > BLOCKED_GROW)):
            self.offset, self.reason = min(self.high, self.offset + 1), "idle"
        else:
            self.reason = "hold"
        if self.offset != before:
            self._steady, self._hold = 0, WINDOW + max(before, self.offset)
        return self.offset

    def state_dict(self) -> dict:
        return {"offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.offset = min(max(int(state.get("offset", self.offset)), 1), self.high)


def _mean(seen: list, tag: str) -> Optional[float]:
    values = [logs[tag] for logs, _ in seen if tag in logs]
    return sum(values) / len(values) if values else None


def _above(value: Optional[float], limit: float) -> bool:
    return value is not None and value > limit
