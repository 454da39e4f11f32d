"""Trainer state that goes into a checkpoint next to the DeepSpeed engine state.

DeepSpeed saves weights, optimizer and scheduler. Continuing a run exactly needs more: the step
counters and consumed samples (so the sampler resumes mid-epoch), the KL controller, the RNG
states of every rank, and the options the run was started with (resuming with a different
`--n_samples_per_prompt` silently changes the experiment). This module captures and restores those;
the strategy writes them crash-consistently as the checkpoint's client state.
"""

import os
import random
from typing import Any, Mapping

import numpy as np
import torch

from lightrft.config.run import plain_options
from lightrft.utils.secrets import redact_options


def capture_rng_state() -> dict:
    """This rank's RNG states as plain Python and tensors (loadable with `weights_only=True`)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: Mapping) -> None:
    """Restores what `capture_rng_state` captured on the same rank."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state((np_state["name"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def check_resume_options(saved: Mapping[str, Any], current: Mapping[str, Any], source: str) -> None:
    """Raises if an option that changes the experiment differs from the checkpoint's.

    `saved` and `current` map flag names to values; the error names every flag that changed."""
    changed = [f"--{key}: checkpoint has {saved[key]!r}, this run has {current.get(key)!r}"
               for key in sorted(saved) if key in current and not same_option(saved[key], current[key])]
    if changed:
        raise ValueError(f"cannot resume from {source}: options that must not change between a run and its "
                         "resume differ:\n  " + "\n  ".join(changed) +
                         "\nrestore them, or start a new run with a fresh --ckpt_path")


def same_option(saved: Any, current: Any) -> bool:
    """Equal values, or two spellings of one existing file or folder (`model` and `./model`, or
    its absolute path: a resume from another working directory names the same model)."""
    if saved == current:
        return True
    if isinstance(saved, str) and isinstance(current, str):
        try:
            return os.path.samefile(os.path.expanduser(saved), os.path.expanduser(current))
        except (OSError, ValueError):
            return False
    return False


def pinned_options(args: Any, names: tuple[str, ...]) -> dict:
    """The values of the named flags of `args` (a run config, or an argparse namespace of its
    flags; missing ones skipped; tuples as lists, as a checkpoint stores them), for
    `check_resume_options`."""
    options = redact_options(plain_options(args))      # as written: a secret never reaches a checkpoint
    return {name: options[name] for name in names if name in options}
