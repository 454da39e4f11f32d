"""Where experience lives, and the one seam rollouts cross to get there.

Experience is made and kept in host memory (`EXPERIENCE_DEVICE`, the CPU): the replay buffer
holds it there, each micro-batch goes to its model's device for a forward or a training step, and
the forward's outputs come back. Rollouts and their rewards come from elsewhere: the HF engine
decodes with the actor on its device (a GPU), vLLM, a workflow's episodes, an explorer rank's
batch, a recorded file. `arrive` moves them to the experience device, and it is called where a
rollout enters the experience package (`Scorer.score`, `Scorer.score_generation`,
`ExperienceBuilder.build`), so the code after it never mixes devices.
"""

import torch

EXPERIENCE_DEVICE = torch.device("cpu")


def arrive(rollout, rewards=None):
    """`rollout` (a `RolloutOutput`) and `rewards` (a `RewardBatch`, when given) with every tensor
    on the experience device: the rollout alone, or the pair. Tensors already there are kept as
    they are (no copy)."""
    rollout = rollout.to(EXPERIENCE_DEVICE)
    return rollout if rewards is None else (rollout, rewards.to(EXPERIENCE_DEVICE))
