"""Writing a model's full state dict as a Hugging Face folder.

`DeepspeedStrategy.save_model` gathers the weights (from ZeRO-3 shards when needed) and calls
`export_hf_folder` on rank 0. How a module is written, first match wins:

1. a PEFT model: the adapters are merged into a fresh copy of the base model, which is saved as a
   plain model (`from_pretrained` needs no peft);
2. a module with its own `save_pretrained(output_dir, state_dict=...)` (Hugging Face models, and
   wrappers such as Critic/RewardModel that define one): called with the gathered state dict,
   keyed like the module's own `state_dict()`;
3. a wrapper whose `.model` is a module (ActorLanguage): `.model` is exported with the entries
   under `model.`.
"""

import contextlib
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from lightrft.strategy.checkpoint_io import fsync_dir, fsync_tree


def is_peft_model(module: nn.Module) -> bool:
    """True for a `peft.PeftModel` (peft is imported only if the module's class comes from it)."""
    if not type(module).__module__.startswith("peft"):
        return False
    from peft import PeftModel

    return isinstance(module, PeftModel)


def merged_peft_copy(peft_model: nn.Module, state_dict: dict[str, torch.Tensor]) -> nn.Module:
    """A plain base model with the adapters of `peft_model` merged in, built on the CPU from
    `state_dict` (the PEFT model's full state dict), so the live (maybe sharded) model is untouched."""
    from peft import get_peft_model

    base = peft_model.get_base_model()
    adapter = peft_model.active_adapter
    # Building a model draws random initial weights; fork the RNG so this rank's stream stays in
    # step with the ranks that do not export.
    with torch.random.fork_rng(devices=[]):
        fresh = get_peft_model(type(base)(base.config), peft_model.peft_config[adapter], adapter_name=adapter)
    fresh.load_state_dict(state_dict, strict=True)
    merged = fresh.merge_and_unload()
    dtypes = {t.dtype for t in state_dict.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        merged = merged.to(dtypes.pop())
    return merged


@contextlib.contextmanager
def conversions_that_invert(module: nn.Module):
    """While saving, the weight-name conversions transformers reverts on save are the model's
    default ones when the recorded ones hold a prefix change: a model loaded under ZeRO-3 by
    transformers 5.24 records one (`PrefixChange` to `model.language_model.`, beside the renaming
    that does the same), and reverting both wrote a Qwen-VL's decoder as `model.model.layers.*`,
    names no loader maps back. The defaults are what a model built without `from_pretrained`
    saves with: the checkpoint layout every version reads."""
    recorded = getattr(module, "_weight_conversions", None)
    drop = recorded is not None and any(type(c).__name__ == "PrefixChange" for c in recorded)
    if drop:
        module._weight_conversions = None
    try:
        yield
    finally:
        if drop:
            module._weight_conversions = recorded


def write_module(module: nn.Module, state_dict: dict[str, torch.Tensor], output_dir: Path) -> None:
    """Writes `module` (with weights `state_dict`) as a Hugging Face folder (module docstring)."""
    if is_peft_model(module):
        merged = merged_peft_copy(module, state_dict)
        merged.save_pretrained(output_dir, state_dict=merged.state_dict())
        return
    if callable(getattr(module, "save_pretrained", None)):
        with conversions_that_invert(module):
            module.save_pretrained(output_dir, state_dict=state_dict)
        return
    inner = getattr(module, "model", None)
    if isinstance(inner, nn.Module):
        inner_state = {k[len("model."):]: v for k, v in state_dict.items() if k.startswith("model.")}
        write_module(inner, inner_state, output_dir)
        return
    raise TypeError(f"save_model cannot write a {type(module).__name__} as a Hugging Face folder: give it a "
                    f"save_pretrained(output_dir, state_dict=...) method or a `.model` attribute holding the "
                    f"Hugging Face model")


def export_hf_folder(module: nn.Module, state_dict: dict[str, torch.Tensor], tokenizer, output_dir: str | os.PathLike) -> Path:
    """Writes the folder next to `output_dir` under a temporary name, fsyncs it, then swaps it into
    place, so a failed export never leaves a half-written `output_dir`. Returns `output_dir`."""
    output_dir = Path(output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = output_dir.with_name(f".{output_dir.name}.tmp")
    old = output_dir.with_name(f".{output_dir.name}.old")
    for stale in (tmp, old):
        if stale.exists():
            shutil.rmtree(stale)
    try:
        tmp.mkdir()
        write_module(module, state_dict, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if output_dir.exists():
        os.rename(output_dir, old)
    os.rename(tmp, output_dir)
    fsync_dir(output_dir.parent)
    if old.exists():
        shutil.rmtree(old)
    return output_dir
