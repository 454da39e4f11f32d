"""Trainers (PPO/GRPO, SFT, reward model), their callbacks and run services (checkpoints, resume,
preemption, non-finite guards). What a PPO step trains on is made in `lightrft.experience`;
`Experience`, `NaiveExperienceMaker` and `NaiveReplayBuffer` are re-exported here.

Names resolve on first use, so importing one trainer does not import every other one.
"""

import importlib

_EXPORTS = {
    "AdaptiveKLController": "lightrft.algorithms.kl",
    "FixedKLController": "lightrft.algorithms.kl",
    "Experience": "lightrft.experience.samples",
    "NaiveExperienceMaker": "lightrft.experience.maker",
    "NaiveReplayBuffer": "lightrft.experience.replay_buffer",
    "PPOTrainer": "lightrft.trainer.ppo_trainer",
    "PPOModels": "lightrft.trainer.ppo_config",
    "PPOTrainerConfig": "lightrft.trainer.ppo_config",
    "TrainerCallback": "lightrft.trainer.callbacks",
    "SFTTrainer": "lightrft.trainer.sft_trainer",
    "RewardModelTrainer": "lightrft.trainer.rm_trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lightrft.trainer' has no attribute {name!r}")
