"""Trainers (PPO/GRPO, SFT, reward model), experience making, the replay buffer and callbacks.

Names resolve on first use, so importing one trainer does not import every other one.
"""

import importlib

_EXPORTS = {
    "AdaptiveKLController": "lightrft.algorithms.kl",
    "FixedKLController": "lightrft.algorithms.kl",
    "Experience": "lightrft.trainer.experience",
    "NaiveExperienceMaker": "lightrft.trainer.experience_maker",
    "NaiveReplayBuffer": "lightrft.trainer.replay_buffer",
    "PPOTrainer": "lightrft.trainer.ppo_trainer",
    "TrainerCallback": "lightrft.trainer.callbacks",
    "SFTTrainer": "lightrft.trainer.sft_trainer",
    "RewardModelTrainer": "lightrft.trainer.rm_trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lightrft.trainer' has no attribute {name!r}")
