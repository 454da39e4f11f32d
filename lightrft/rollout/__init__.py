"""Rollout engines: turn prompts into sampled responses with the engine's own log-probs.

`HFEngine` decodes with the live Hugging Face model anywhere; `VLLMEngine` runs vLLM colocated on
the trainer's GPUs or CPUs (vLLM itself is imported only when one is built). Both satisfy the
`RolloutEngine` protocol; `make_rollout_engine` picks one by name. `RolloutManager` owns an
engine's lifecycle (wake, weight sync when stale, generate, sleep) for trainers and evaluation.
"""

from lightrft.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from lightrft.rollout.hf_engine import HFEngine
from lightrft.rollout.manager import RolloutManager
from lightrft.rollout.vllm_engine import VLLMEngine

ROLLOUT_ENGINES = {"hf": HFEngine, "vllm": VLLMEngine}


def make_rollout_engine(name: str, **kwargs) -> RolloutEngine:
    """Builds the engine registered as `name` ("hf" or "vllm") with the given keyword arguments:
    `make_rollout_engine("hf", model=actor.model, pad_token_id=..., eos_token_id=...,
    synced_gpus=..., micro_batch_size=...)` or `make_rollout_engine("vllm", model_path=...,
    pad_token_id=..., eos_token_id=..., seed=..., gpu_memory_utilization=..., kv_cache_gb=...,
    enable_sleep=..., sync_bucket_mb=...)`."""
    if name not in ROLLOUT_ENGINES:
        raise ValueError(f"unknown rollout engine {name!r} (--rollout_engine): choose one of {sorted(ROLLOUT_ENGINES)}")
    return ROLLOUT_ENGINES[name](**kwargs)


__all__ = ["HFEngine", "ROLLOUT_ENGINES", "RolloutEngine", "RolloutManager", "RolloutOutput", "SamplingParams",
           "VLLMEngine", "make_rollout_engine"]
