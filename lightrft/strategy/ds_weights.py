"""The module weights inside a resumable checkpoint written by `DeepspeedStrategy.save_ckpt`,
read without an engine, a process group or the optimizer state (bench uses this to evaluate
checkpoints of runs that saved no Hugging Face export).

- ZeRO-0/1/2: `mp_rank_00_model_states.pt` holds the full module state dict under "module" (in the
  training dtype); only this file is read, never the optimizer shards.
- ZeRO-3: every rank wrote a partition; DeepSpeed's `zero_to_fp32` consolidates them on the CPU
  into one fp32 state dict (from the fp32 master weights of the optimizer shards).
"""

from pathlib import Path

import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from lightrft.strategy.checkpoint_io import MARKER_NAME, is_complete
from lightrft.strategy.deepspeed_strategy import DS_SUBDIR  # save_ckpt's DeepSpeed tag in each checkpoint folder

FULL_STATES = "mp_rank_00_model_states.pt"


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
