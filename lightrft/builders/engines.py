"""The rollout engine of a run when it is not the trainer's own Hugging Face decoding."""

from lightrft.models.tokenizer import stop_token_ids


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
                               # the trainer's precision: vLLM's "auto" runs float32 models in half
                               dtype="bfloat16" if config.distributed.bf16 else "float32",
                               # the longest sequence a rollout makes (prompts are cut to prompt_max_len):
                               # vLLM would otherwise size its KV cache for the model's whole context
                               max_model_len=config.data.prompt_max_len + response,
                               pad_token_id=tokenizer.pad_token_id,
                               eos_token_id=stop_token_ids(tokenizer, model.pretrain))


def build_hf_engine(module, tokenizer, eos_token_ids=None, micro_batch_size: int = 8, synced_gpus: bool = False):
    """A Hugging Face decoding engine over `module` (the policy's transformers model, shared
    live: it never needs a weight sync), padding with the tokenizer's pad id and stopping at
    `eos_token_ids` (default: the tokenizer's end of sequence). `synced_gpus` keeps ranks
    decoding in step under ZeRO-3, where every forward gathers parameters."""
    from lightrft.rollout.hf_engine import HFEngine

    return HFEngine(module, pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=list(eos_token_ids or [tokenizer.eos_token_id]), micro_batch_size=micro_batch_size,
                    synced_gpus=synced_gpus)
