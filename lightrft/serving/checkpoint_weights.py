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
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from torch import nn
from transformers import AutoModelForCausalLM

from lightrft.strategy.checkpoint_io import MARKER_NAME, is_complete
from lightrft.strategy.deepspeed_strategy import DS_SUBDIR  # save_ckpt's DeepSpeed tag in each checkpoint folder

FULL_STATES = "mp_rank_00_model_states.pt"
WRAPPER_PREFIX = "model."          # ActorLanguage keeps the Hugging Face model as `.model`
RUN_CONFIG = "run_config.yaml"


class CheckpointReadError(RuntimeError):
    """A checkpoint folder whose weights cannot be read; the message names the path and the reason."""


def require_complete(ckpt_dir: str | Path) -> Path:
    """`ckpt_dir`, when its save finished (the completion marker of `lightrft.strategy.checkpoint_io`
    lists every file with its size); CheckpointReadError otherwise."""
    ckpt_dir = Path(ckpt_dir)
    if not is_complete(ckpt_dir):
        raise CheckpointReadError(f"{ckpt_dir} is incomplete (no valid {MARKER_NAME}, or a file it lists is "
                                  "missing or has another size): a save that crashed or is still being written")
    return ckpt_dir


def module_state_dict(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """The saved module's full state dict (keys as the wrapper names them), on the CPU.

    `ckpt_dir` is one `save_ckpt` folder (`<ckpt_path>/_actor/global_stepN`). Raises
    CheckpointReadError when it is incomplete (a save that crashed or is still being written) or
    holds no DeepSpeed model states."""
    ckpt_dir = require_complete(ckpt_dir)
    ds_dir = ckpt_dir / DS_SUBDIR
    full = ds_dir / FULL_STATES
    if full.is_file():
        # Plain data and tensors only: no pickled code runs from a checkpoint folder.
        states = torch.load(full, map_location="cpu", weights_only=True, mmap=True)
        module = states.get("module") if isinstance(states, dict) else None
        if not module:
            raise CheckpointReadError(f"{full} holds no 'module' state dict: not a DeepSpeed model states file")
        return dict(module)
    if any(ds_dir.glob("zero_pp_rank_*_mp_rank_*_model_states.pt")):
        # ZeRO-3 partitions: DeepSpeed's consolidation reads every rank's shard on the CPU.
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=DS_SUBDIR))
    raise CheckpointReadError(f"{ds_dir} holds no DeepSpeed model states ({FULL_STATES} for ZeRO-0/1/2, "
                              "zero_pp_rank_*_mp_rank_00_model_states.pt for ZeRO-3)")


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
    model = AutoModelForCausalLM.from_pretrained(str(pretrain), dtype=torch.float32,
                                                 trust_remote_code=trust_remote_code)
    try:
        if lora_alpha is not None:
            model = merge_lora(model, state, lora_alpha)
        else:
            model.load_state_dict(state, strict=True)
    except (RuntimeError, ValueError) as err:
        raise CheckpointReadError(f"{ckpt_dir}: the weights do not fit the model of --pretrain {pretrain} "
                                  f"(was the run trained from another model?): {err}") from err
    return model.to(dtype).eval()
