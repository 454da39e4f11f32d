"""The strategy's typed configuration: built from a run config's distributed and optimisation
sections, or field by field in research code."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from lightrft.strategy.ds_config import GRAD_ACCUM_DTYPES, check_zero_stage

if TYPE_CHECKING:
    from lightrft.config.sections import DistributedConfig, OptimConfig

BACKENDS = ("nccl", "gloo")
# Flag names that differ from the field they set (the flag keeps its OpenRLHF name).
FLAG_ALIASES = {"dist_timeout_minutes": "dist_timeout"}


# DeepSpeed's communication knobs (`get_train_ds_config`), each with its "DeepSpeed's default" value.
ZERO_TUNING = {"overlap_comm": "auto", "zero_reduce_bucket_size": None, "zero3_prefetch_bucket_size": None,
               "zero3_max_live_parameters": None, "zero3_param_persistence_threshold": None}


@dataclass(frozen=True)
class StrategyConfig:
    """What `DeepspeedStrategy` needs to know; the flag of each field has the same name.

    `train_batch_size` counts samples per optimizer step over all ranks and
    `micro_train_batch_size` samples per rank per forward; gradient accumulation is derived once the
    world size is known. `backend=None` picks NCCL on CUDA and gloo on CPU. `ref_reward_offload`
    keeps frozen models (reference, reward) on the CPU under ZeRO-3 between uses.
    `sequence_parallel_size` ranks share each packed training row (`DeepspeedStrategy.sequence_parallel`).
    """

    seed: int = 42
    max_norm: float = 1.0
    micro_train_batch_size: int = 1
    train_batch_size: int = 8
    zero_stage: int = 2
    bf16: bool = False
    adam_offload: bool = False
    zero3_param_offload: bool = False
    grad_accum_dtype: str | None = None
    dist_timeout_minutes: float = 30
    backend: str | None = None
    ref_reward_offload: bool = False
    sequence_parallel_size: int = 1
    overlap_comm: str = "auto"
    zero_reduce_bucket_size: int | None = None
    zero3_prefetch_bucket_size: int | None = None
    zero3_max_live_parameters: int | None = None
    zero3_param_persistence_threshold: int | None = None

    def __post_init__(self):
        check_zero_stage(self.zero_stage)
        if self.micro_train_batch_size < 1:
            raise ValueError(f"--micro_train_batch_size must be >= 1, got {self.micro_train_batch_size}")
        if self.train_batch_size < 1:
            raise ValueError(f"--train_batch_size must be >= 1, got {self.train_batch_size}")
        if self.grad_accum_dtype is not None and self.grad_accum_dtype not in GRAD_ACCUM_DTYPES:
            raise ValueError(f"--grad_accum_dtype {self.grad_accum_dtype!r} is not one of "
                             f"{', '.join(GRAD_ACCUM_DTYPES)}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"--backend {self.backend!r} is not one of {', '.join(BACKENDS)} "
                             f"(leave it unset to pick NCCL on CUDA and gloo on CPU)")
        if self.sequence_parallel_size < 1:
            raise ValueError(f"--sequence_parallel_size must be >= 1, got {self.sequence_parallel_size}")
        zero3_only = [name for name in ("zero3_prefetch_bucket_size", "zero3_max_live_parameters",
                                        "zero3_param_persistence_threshold") if getattr(self, name) is not None]
        if zero3_only and self.zero_stage != 3:
            raise ValueError(f"--{zero3_only[0]} applies to --zero_stage 3 (got --zero_stage {self.zero_stage}): "
                             "drop it or use ZeRO-3")
        if self.overlap_comm not in ("auto", "on", "off"):
            raise ValueError(f"--overlap_comm {self.overlap_comm!r} is not one of auto, on, off")
        if self.dist_timeout_minutes <= 0:
            raise ValueError(f"--dist_timeout_minutes must be > 0, got {self.dist_timeout_minutes}")

    @classmethod
    def from_sections(cls, distributed: DistributedConfig, optim: OptimConfig) -> StrategyConfig:
        """The strategy of a run: processes, precision and ZeRO from its `distributed` section,
        batch sizes and clipping from its `optim` section."""
        return cls(seed=distributed.seed, max_norm=optim.max_norm, micro_train_batch_size=optim.micro_train_batch_size,
                   train_batch_size=optim.train_batch_size, zero_stage=distributed.zero_stage, bf16=distributed.bf16,
                   adam_offload=distributed.adam_offload, zero3_param_offload=distributed.zero3_param_offload,
                   grad_accum_dtype=distributed.grad_accum_dtype, dist_timeout_minutes=distributed.dist_timeout,
                   ref_reward_offload=distributed.ref_reward_offload,
                   **{name: getattr(distributed, name, default) for name, default in ZERO_TUNING.items()},
                   sequence_parallel_size=getattr(distributed, "sequence_parallel_size", 1))

    @classmethod
    def from_args(cls, namespace: argparse.Namespace) -> StrategyConfig:
        """For research code with an argparse namespace of the command-line flags: reads each
        field from the same-named attribute (or its flag alias, e.g. `--dist_timeout` for
        `dist_timeout_minutes`); missing ones keep their defaults. A run config goes through
        `from_sections`."""
        values = {}
        for f in fields(cls):
            for name in (f.name, FLAG_ALIASES.get(f.name)):
                if name is not None and hasattr(namespace, name):
                    values[f.name] = getattr(namespace, name)
                    break
        return cls(**values)
