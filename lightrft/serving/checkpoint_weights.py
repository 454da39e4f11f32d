"""A policy's weights from a resumable DeepSpeed checkpoint, as a plain Hugging Face model.

train_ppo saves the actor with `DeepspeedStrategy.save_ckpt` to `<ckpt_path>/_actor/global_stepN`;
DeepSpeed's own files sit in its `deepspeed/` subfolder:

- ZeRO-0/1/2: `mp_rank_00_model_states.pt` holds the full module state dict under "module" (in the
  training dtype); only this file is read, never the optimizer shards.
- ZeRO-3: every rank wrote a partition (`zero_pp_rank_R_mp_rank_00_model_states.pt` and the
  optimizer shards, which hold the fp32 master weights); DeepSpeed's `zero_to_fp32` consolidates
  them on the CPU into one fp32 state dict.

The actor is an `ActorLanguage` wrapper, so every key starts with `model.`; that prefix is
dropped. A LoRA run saved the peft-wrapped model (`base_model.model.<name>.base_layer.weight`,
`<name>.lora_A.<adapter>.weight`, ...): the adapters are merged into the base weights with peft, the
rank read from the `lora_A` shapes and `lora_alpha` from the run's `<ckpt_path>/run_config.yaml`.
The weights are loaded, strictly, into the model `from_pretrained` builds from the base model
folder (`--pretrain`: its config; its tokenizer is the policy's tokenizer).
"""

from pathlib import Path

import torch
import yaml
from torch import nn

from lightrft.models.families import load_model

# Reading DeepSpeed's own files is the strategy's business (deepspeed is imported there only).
from lightrft.strategy.ds_weights import CheckpointReadError, module_state_dict, require_complete  # noqa: F401

WRAPPER_PREFIX = "model."          # ActorLanguage keeps the Hugging Face model as `.model`
RUN_CONFIG = "run_config.yaml"


def strip_wrapper_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drops the `model.` every key of an `ActorLanguage` state dict starts with (a state dict
    whose keys do not all start with it is returned unchanged)."""
    if state and all(k.startswith(WRAPPER_PREFIX) for k in state):
        return {k[len(WRAPPER_PREFIX):]: v for k, v in state.items()}
    return state


def run_lora_alpha(ckpt_dir: Path) -> float:
    """`lora_alpha` of the run that wrote `<ckpt_path>/_actor/global_stepN`, from its run_config.yaml
    (nested under `model:`, or flat)."""
    path = Path(ckpt_dir).parent.parent / RUN_CONFIG
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise CheckpointReadError(f"{ckpt_dir} holds LoRA adapters, and merging them needs the run's lora_alpha "
                                  f"from {path}, which cannot be read ({err})") from err
    section = config.get("model") if isinstance(config.get("model"), dict) else config
    if "lora_alpha" not in section:
        raise CheckpointReadError(f"{ckpt_dir} holds LoRA adapters but {path} has no lora_alpha to merge them with")
    return float(section["lora_alpha"])


def merge_lora(base: nn.Module, state: dict[str, torch.Tensor], lora_alpha: float) -> nn.Module:
    """`base` with the LoRA adapters of the peft state dict `state` merged in (W + alpha/r * B A,
    computed by peft's own merge). Rank, adapter name and target modules come from the keys."""
    from peft import LoraConfig, TaskType, get_peft_model

    lora_a = {k: v for k, v in state.items() if ".lora_A." in k}
    ranks = {v.shape[0] for v in lora_a.values()}
    adapters = {k.split(".lora_A.")[1].split(".")[0] for k in lora_a}
    if len(ranks) != 1 or len(adapters) != 1:
        raise ValueError(f"expected one LoRA adapter of one rank, found adapters {sorted(adapters)} of ranks "
                         f"{sorted(ranks)}")
    prefix = "base_model.model."
    targets = sorted({k.split(".lora_A.")[0].removeprefix(prefix) for k in lora_a})
    config = LoraConfig(task_type=TaskType.CAUSAL_LM, r=ranks.pop(), lora_alpha=lora_alpha,
                        target_modules=targets, bias="none")
    peft_model = get_peft_model(base, config, adapter_name=adapters.pop())
    peft_model.load_state_dict(state, strict=True)
    return peft_model.merge_and_unload()


def load_deepspeed_policy(ckpt_dir: str | Path, pretrain: str | Path, *, dtype: torch.dtype = torch.float32,
                          trust_remote_code: bool = False) -> nn.Module:
    """The Hugging Face causal LM of `pretrain`'s architecture holding the weights of the DeepSpeed
    checkpoint `ckpt_dir` (module docstring), in `dtype`, in eval mode. Raises CheckpointReadError
    naming the folder and the reason when the weights cannot be read or do not fit the model."""
    ckpt_dir = Path(ckpt_dir)
    try:
        state = strip_wrapper_prefix(module_state_dict(ckpt_dir))
    except CheckpointReadError:
        raise
    except Exception as err:  # torch.load / DeepSpeed raise many types for a torn or foreign file
        raise CheckpointReadError(f"{ckpt_dir}: DeepSpeed files cannot be read ({type(err).__name__}: {err})") from err
    lora_alpha = run_lora_alpha(ckpt_dir) if any(".lora_A." in k for k in state) else None
    # The base weights are overwritten below; from_pretrained gives the architecture and dtype handling.
    model = load_model(str(pretrain), dtype=torch.float32, trust_remote_code=trust_remote_code)
    try:
        if lora_alpha is not None:
            model = merge_lora(model, state, lora_alpha)
        else:
            model.load_state_dict(state, strict=True)
    except (RuntimeError, ValueError) as err:
        raise CheckpointReadError(f"{ckpt_dir}: the weights do not fit the model of --pretrain {pretrain} "
                                  f"(was the run trained from another model?): {err}") from err
    return model.to(dtype).eval()
