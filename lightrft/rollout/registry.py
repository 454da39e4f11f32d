"""The rollout engines by name, each with the capabilities it declares.

An engine kind is one `register_engine(name, factory, capabilities)` call, made by the module that
defines the engine (importing it registers the name). `make_rollout_engine(name, **kwargs)` builds
one; `engine_capabilities(name)` answers what an engine of that name can do before one is built
(the builders and the doctor ask it), without importing the engine's own dependencies: vLLM is
imported only when a `VLLMEngine` is built.
"""

from collections.abc import Callable
from dataclasses import dataclass

from lightrft.rollout.base import EngineCapabilities, RolloutEngine


@dataclass(frozen=True)
class RegisteredEngine:
    name: str
    factory: Callable[..., RolloutEngine]  # called with the engine's keyword arguments
    capabilities: EngineCapabilities


ROLLOUT_ENGINES: dict[str, RegisteredEngine] = {}


def register_engine(name: str, factory: Callable[..., RolloutEngine], capabilities: EngineCapabilities):
    """Makes `factory` (an engine class, or a function returning an engine) selectable as `name`.
    Every engine it builds must expose these `capabilities` as `engine.capabilities`. Returns
    `factory`."""
    if name in ROLLOUT_ENGINES:
        raise ValueError(f"a rollout engine named {name!r} is already registered")
    if not isinstance(capabilities, EngineCapabilities):
        raise TypeError(f"register_engine({name!r}) needs an EngineCapabilities, got {type(capabilities).__name__}")
    ROLLOUT_ENGINES[name] = RegisteredEngine(name, factory, capabilities)
    return factory


def get_engine(name: str) -> RegisteredEngine:
    if name not in ROLLOUT_ENGINES:
        raise ValueError(f"unknown rollout engine {name!r} (--rollout_engine): choose one of {sorted(ROLLOUT_ENGINES)}")
    return ROLLOUT_ENGINES[name]


def engine_names() -> list[str]:
    return sorted(ROLLOUT_ENGINES)


def engine_capabilities(name: str) -> EngineCapabilities:
    """What the engine registered as `name` can do."""
    return get_engine(name).capabilities


def make_rollout_engine(name: str, **kwargs) -> RolloutEngine:
    """Builds the engine registered as `name` with its own keyword arguments:
    `make_rollout_engine("hf", model=actor.model, pad_token_id=..., eos_token_id=...,
    synced_gpus=..., micro_batch_size=...)` or `make_rollout_engine("vllm", model_path=...,
    pad_token_id=..., eos_token_id=..., seed=..., gpu_memory_utilization=..., kv_cache_gb=...,
    enable_sleep=..., sync_bucket_mb=...)`."""
    entry = get_engine(name)
    engine = entry.factory(**kwargs)
    # Code that asked engine_capabilities(name) before building relies on the same answers.
    if getattr(engine, "capabilities", None) != entry.capabilities:
        raise TypeError(f"the {name!r} rollout engine ({type(engine).__name__}) exposes capabilities "
                        f"{getattr(engine, 'capabilities', None)}, not the {entry.capabilities} it was registered with")
    return engine
