"""The DeepSpeed strategy (the only package that imports deepspeed), its config builders and the
crash-consistent checkpoint protocol.

Names resolve on first use: `from lightrft.strategy import StrategyConfig` does not import
deepspeed; `DeepspeedStrategy` and `get_strategy` do.
"""

import importlib

_EXPORTS = {
    "StrategyConfig": "lightrft.strategy.config",
    "DeepspeedStrategy": "lightrft.strategy.deepspeed_strategy",
    "get_strategy": "lightrft.strategy.deepspeed_strategy",
    "get_train_ds_config": "lightrft.strategy.ds_config",
    "get_eval_ds_config": "lightrft.strategy.ds_config",
    "gradient_accumulation_steps": "lightrft.strategy.ds_config",
    "find_latest_complete": "lightrft.strategy.checkpoint_io",
    "CheckpointSaveError": "lightrft.strategy.checkpoint_io",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lightrft.strategy' has no attribute {name!r}")
