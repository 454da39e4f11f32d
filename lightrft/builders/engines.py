"""The rollout engine of a run, picked by `--rollout_engine` from the engine registry
(`lightrft.rollout.register_engine`) and driven by the capabilities its name declares."""

from pathlib import Path

from lightrft.models.tokenizer import stop_token_ids
from lightrft.config.sections import ConfigError


def build_vllm_engine(config, tokenizer, seed: int):
    """A vLLM engine of `--pretrain` with the rollout section's vLLM options. `config` is the
    `PPORunConfig`: the engine also reads the model (path, LoRA rank), the precision and the
    longest sequence a rollout makes."""
    from lightrft.rollout import make_rollout_engine

    model, rollout, agent = config.model, config.rollout, config.agent
    # A multi-turn episode's response is its turns and the environment's messages together.
    response = ((agent.max_episode_tokens or agent.max_turns * rollout.generate_max_len) if agent.workflow
                else rollout.generate_max_len)
    return make_rollout_engine("vllm", model_path=model.pretrain, seed=seed,
                               gpu_memory_utilization=rollout.vllm_gpu_memory_utilization,
                               kv_cache_gb=rollout.vllm_kv_cache_gb,
                               enable_sleep={"auto": None, "on": True, "off": False}[rollout.vllm_enable_sleep],
                               sync_bucket_mb=rollout.vllm_sync_bucket_mb, weight_sync=rollout.weight_sync,
                               **({"enforce_eager": True} if rollout.vllm_enforce_eager else {}),
                               **({"tensor_parallel_size": rollout.vllm_tensor_parallel_size}
                                  if rollout.vllm_tensor_parallel_size != 1 else {}),
                               # a LoRA actor syncs only its adapter (RolloutManager.for_actor)
                               **({"lora_rank": model.lora_rank} if model.lora_rank > 0 else {}),
                               # images per prompt, which vLLM budgets its encoder memory for
                               **({"max_images_per_prompt": config.data.max_images_per_prompt}
                                  if config.data.image_key else {}),
                               banned_token_ids=banned_token_ids(config),
                               # the trainer's precision: vLLM's "auto" runs float32 models in half
                               dtype="bfloat16" if config.distributed.bf16 else "float32",
                               # the longest sequence a rollout makes (prompts are cut to prompt_max_len):
                               # vLLM would otherwise size its KV cache for the model's whole context
                               max_model_len=config.data.prompt_max_len + response,
                               pad_token_id=tokenizer.pad_token_id,
                               eos_token_id=stop_token_ids(tokenizer, model.pretrain))


# How a run builds each registered engine that holds its own copy of the weights from its config:
# the rollout section's options of that engine mapped onto its arguments. An engine that shares the
# trainer's module needs the prepared actor instead (`hf_engine_for`).
ENGINE_BUILDERS = {"vllm": build_vllm_engine}


def build_rollout_engine(config, tokenizer, seed: int):
    """The `--rollout_engine` of a run (`config`, the `PPORunConfig`) when it holds its own copy of
    the weights, loaded from `--pretrain` (`seed`: this rank's engine seed). None for an engine
    that decodes with the policy's live module (`EngineCapabilities.shares_live_weights`): the
    trainer builds that one over its actor, an explorer over its policy copy."""
    from lightrft.rollout import engine_capabilities

    name = config.rollout.rollout_engine
    check_engine_serves_family(config)
    if engine_capabilities(name).shares_live_weights:
        return None
    if name not in ENGINE_BUILDERS:
        raise ConfigError(f"--rollout_engine {name}: a registered engine with no builder from the run config; add "
                          "one to lightrft.builders.engines.ENGINE_BUILDERS, or build it with make_rollout_engine "
                          "and pass it as PPOTrainer(..., rollout_engine=...)")
    return ENGINE_BUILDERS[name](config, tokenizer, seed)


def banned_token_ids(config) -> tuple[int, ...]:
    """The ids the policy's model family never lets a rollout sample (image placeholders); () for
    a folder whose config cannot be read here (a Hub id: no network call before the run)."""
    from transformers import AutoConfig

    from lightrft.models.families import family_for

    path = Path(config.model.pretrain).expanduser()
    if not (path / "config.json").is_file():
        return ()
    hf_config = AutoConfig.from_pretrained(path, trust_remote_code=config.model.trust_remote_code)
    return tuple(family_for(hf_config).banned_token_ids(hf_config))


def check_engine_serves_family(config) -> None:
    """Refuses a `--rollout_engine` that the model family of `--pretrain` does not list among its
    `rollout_engines` (e.g. vLLM for a RoBERTa decoder, an architecture vLLM cannot load)."""
    from transformers import AutoConfig

    from lightrft.models.families import family_for

    name, pretrain = config.rollout.rollout_engine, config.model.pretrain
    if not (Path(pretrain).expanduser() / "config.json").is_file():
        return      # a Hub id is not looked up here (no network call before the run)
    try:
        hf_config = AutoConfig.from_pretrained(Path(pretrain).expanduser(), trust_remote_code=config.model.trust_remote_code)
    except (OSError, ValueError):
        return      # loading the actor names what is wrong with the folder
    family = family_for(hf_config)
    problem = family.engine_problem(name)
    if problem:
        raise ConfigError(f"--rollout_engine {name}: --pretrain {pretrain} is a {family.name} model (model_type "
                          f"{hf_config.model_type!r}); {problem}")


def check_engine_roles(config) -> None:
    """Refuses a `--rollout_engine` the run's roles cannot hold: with --sync_offset and no
    explorer ranks an explorer thread builds a second engine in each trainer's process, which an
    engine that takes a process for itself (`EngineCapabilities.one_per_process`) cannot share."""
    from lightrft.rollout import engine_capabilities

    name, roles = config.rollout.rollout_engine, config.roles
    if roles.explorer_ranks == 0 and roles.sync_offset > 0 and engine_capabilities(name).one_per_process:
        raise ConfigError(f"--sync_offset {roles.sync_offset} without --explorer_ranks (an explorer thread per rank) "
                          f"cannot be combined with --rollout_engine {name}: a process holds one {name} engine, "
                          "and the explorer thread would build a second beside the trainer's; use --explorer_ranks N")


def build_hf_engine(module, tokenizer, eos_token_ids=None, micro_batch_size: int = 8, synced_gpus: bool = False,
                    kv_cache: str = "dynamic", compile_decode: bool = False):
    """A Hugging Face decoding engine over `module` (the policy's transformers model, shared
    live: it never needs a weight sync), decoding `micro_batch_size` samples at once with the
    `kv_cache` and `compile_decode` of `--hf_kv_cache` and `--hf_compile_decode`
    (`lightrft.rollout.hf_engine_for`, which this names among the builders)."""
    from lightrft.models.families import family_of
    from lightrft.rollout.hf_engine import hf_engine_for

    return hf_engine_for(module, tokenizer, eos_token_ids, micro_batch_size, synced_gpus=synced_gpus,
                         family=family_of(module), kv_cache=kv_cache, compile_decode=compile_decode)
