"""The module weights inside a resumable checkpoint written by `DeepspeedStrategy.save_ckpt`,
read without an engine, a process group or the optimizer state (bench uses this to evaluate
checkpoints of runs that saved no Hugging Face export).

- ZeRO-0/1/2: `mp_rank_00_model_states.pt` holds the full module state dict under "module" (in the
  training dtype); only this file is read, never the optimizer shards.
- ZeRO-3: every rank wrote a partition; DeepSpeed's `zero_to_fp32` consolidates them on the CPU
  into one fp32 state dict (from the fp32 master weights of the optimizer shards).

Nothing read here runs code from the folder. The ZeRO-0/1/2 file is loaded as plain data
(`load_plain`). DeepSpeed's consolidation unpickles with `weights_only=False`, so every file it
reads is first parsed as plain data too, allowing only the DeepSpeed classes its optimizer states
hold (`DEEPSPEED_DATA_CLASSES`: an enum and the loss scalers, whose unpickling only sets
attributes); a file holding anything else is refused before DeepSpeed opens it. The files read are
checked against the checksums recorded at save (`lightrft.strategy.checkpoint_io`).
"""

import logging
from pathlib import Path

import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from lightrft.strategy.checkpoint_io import (MARKER_NAME, CheckpointCorruptError, UnsafePickleError, is_complete,
                                             load_plain, verify_checksums)
from lightrft.strategy.deepspeed_strategy import DS_SUBDIR  # save_ckpt's DeepSpeed tag in each checkpoint folder

FULL_STATES = "mp_rank_00_model_states.pt"
DEEPSPEED_DATA_CLASSES = (ZeroStageEnum, LossScaler, DynamicLossScaler)

logger = logging.getLogger(__name__)


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


def require_intact(ckpt_dir: Path, only) -> None:
    """CheckpointReadError naming the file when one of the files of `ckpt_dir` for which
    `only(relative path)` holds differs from the checksum recorded at save."""
    try:
        if not verify_checksums(ckpt_dir, only):
            logger.warning(f"checkpoint {ckpt_dir} was saved without checksums (before lightrft recorded them): "
                           "only its file sizes are checked")
    except CheckpointCorruptError as err:
        raise CheckpointReadError(str(err)) from None


def module_state_dict(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """The saved module's full state dict (keys as the wrapper names them), on the CPU.

    `ckpt_dir` is one `save_ckpt` folder (`<ckpt_path>/_actor/global_stepN`). Raises
    CheckpointReadError when it is incomplete (a save that crashed or is still being written),
    corrupted (a file read differs from its checksum), holds objects other than plain data (module
    docstring) or holds no DeepSpeed model states."""
    ckpt_dir = require_complete(ckpt_dir)
    ds_dir = ckpt_dir / DS_SUBDIR
    full = ds_dir / FULL_STATES
    try:
        if full.is_file():
            require_intact(ckpt_dir, lambda rel: rel == f"{DS_SUBDIR}/{FULL_STATES}")
            states = load_plain(full, str(full), mmap=True)
            module = states.get("module") if isinstance(states, dict) else None
            if not module:
                raise CheckpointReadError(f"{full} holds no 'module' state dict: not a DeepSpeed model states file")
            return dict(module)
        if any(ds_dir.glob("zero_pp_rank_*_mp_rank_*_model_states.pt")):
            # ZeRO-3 partitions: DeepSpeed's consolidation reads every rank's shard on the CPU, and
            # unpickles them with weights_only=False, so each is parsed as plain data first.
            require_intact(ckpt_dir, lambda rel: rel.startswith(f"{DS_SUBDIR}/"))
            for path in sorted(ds_dir.glob("*.pt")):
                load_plain(path, str(path), allow=DEEPSPEED_DATA_CLASSES, mmap=True)
            return dict(get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=DS_SUBDIR))
    except UnsafePickleError as err:
        raise CheckpointReadError(str(err)) from None
    raise CheckpointReadError(f"{ds_dir} holds no DeepSpeed model states ({FULL_STATES} for ZeRO-0/1/2, "
                              "zero_pp_rank_*_mp_rank_00_model_states.pt for ZeRO-3)")
