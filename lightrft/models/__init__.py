"""Model wrappers (actor, critic, reward model) and the loss fronts.

Names resolve on first use, so `import lightrft.models` does not import transformers until a
wrapper is asked for.
"""

import importlib

_EXPORTS = {
    "ActorLanguage": "lightrft.models.actor",
    "Critic": "lightrft.models.critic",
    "RewardModel": "lightrft.models.reward_model",
    "PolicyLoss": "lightrft.models.loss",
    "ValueLoss": "lightrft.models.loss",
    "GPTLMLoss": "lightrft.models.loss",
    "PairWiseLoss": "lightrft.models.loss",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lightrft.models' has no attribute {name!r}")
