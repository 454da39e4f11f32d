"""The rewards of a batch of samples, combined over every source: what scoring hands to the
experience builder. It lives with the rewards, below the agents' workflow runner and the explorers,
which make one without scoring through `lightrft.experience`."""

from dataclasses import dataclass, field
from typing import Optional

from torch import Tensor


@dataclass
class RewardBatch:
    scores: Tensor   # (B,) float32 combined score per sample
    valid: Tensor    # (B,) bool; False where a reward source failed and dropped the sample
    # (B, A) per-token rewards over the response slots (per-turn rewards of an agent episode, on
    # each turn's last sampled token), or None. Estimators that read token rewards (gae,
    # reinforce, reinforce++) take them in place; the others see their sum added to `scores`.
    token_rewards: Optional[Tensor] = None
    # (B,) per-sample numbers logged as rollout/<key> means (an agent episode's turns, tool calls...)
    info: dict[str, Tensor] = field(default_factory=dict)

    def to(self, device) -> "RewardBatch":
        """This batch with every tensor on `device` (the tensors themselves where already there)."""
        return RewardBatch(scores=self.scores.to(device), valid=self.valid.to(device),
                           token_rewards=None if self.token_rewards is None else self.token_rewards.to(device),
                           info={key: value.to(device) for key, value in self.info.items()})
