"""The typed run config: frozen dataclasses that hold every option and its default.

The command lines are generated from it (`PPORunConfig.build_parser`), `--config FILE.yaml`
loads into it, and research code builds trainers from it without argparse (see
docs/configuration.md and docs/extending.md)."""

from lightrft.config.options import add_section_flags, option, section_from_namespace
from lightrft.config.run import PPORunConfig, RMRunConfig, RunConfig, SFTRunConfig
from lightrft.config.sections import (AgentConfig, AlgorithmConfig, CheckpointConfig, ConfigError, DataConfig,
                                      DistributedConfig, EvalConfig, LoggingConfig, ModelConfig, OptimConfig,
                                      PPODataConfig, PPODistributedConfig, PPOLoggingConfig, PPOModelConfig,
                                      PPOOptimConfig, RewardConfig, RMDataConfig, RMModelConfig, RMOptimConfig,
                                      RolesConfig, RolloutConfig, SFTDataConfig, SupervisedOptimConfig)

__all__ = ["AgentConfig", "AlgorithmConfig", "CheckpointConfig", "ConfigError", "DataConfig", "DistributedConfig",
           "EvalConfig", "LoggingConfig", "ModelConfig", "OptimConfig", "PPODataConfig", "PPOLoggingConfig",
           "PPODistributedConfig", "PPOModelConfig", "PPOOptimConfig", "PPORunConfig", "RMDataConfig",
           "RMModelConfig", "RMOptimConfig", "RMRunConfig", "RewardConfig", "RolesConfig", "RolloutConfig", "RunConfig",
           "SFTDataConfig", "SFTRunConfig", "SupervisedOptimConfig", "add_section_flags", "option", "section_from_namespace"]
