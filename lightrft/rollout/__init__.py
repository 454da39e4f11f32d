"""Rollout engines: turn prompts into sampled responses with the engine's own log-probs.

`HFEngine` decodes with the live Hugging Face model anywhere; `VLLMEngine` runs vLLM colocated on
the trainer's GPUs or CPUs (vLLM itself is imported only when one is built). Both satisfy the
`RolloutEngine` protocol and declare what they can do in `EngineCapabilities`; each registers its
name (`register_engine`), `make_rollout_engine` builds one by name and `engine_capabilities` answers
for a name before one is built. `hf_engine_for` is the one place an `HFEngine` is built.
`RolloutManager` owns an engine's lifecycle (wake, weight sync when stale, generate, sleep) for
trainers and evaluation.
"""

from lightrft.rollout.base import EngineCapabilities, RolloutEngine, RolloutOutput, SamplingParams
from lightrft.rollout.hf_engine import HFEngine, hf_engine_for
from lightrft.rollout.manager import RolloutManager
from lightrft.rollout.registry import (ROLLOUT_ENGINES, engine_capabilities, engine_names, make_rollout_engine,
                                       register_engine)
from lightrft.rollout.vllm_engine import VLLMEngine

__all__ = ["EngineCapabilities", "HFEngine", "ROLLOUT_ENGINES", "RolloutEngine", "RolloutManager", "RolloutOutput",
           "SamplingParams", "VLLMEngine", "engine_capabilities", "engine_names", "hf_engine_for",
           "make_rollout_engine", "register_engine"]
