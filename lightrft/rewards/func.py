"""Reward files: a Python file defining `reward_func(queries, prompts, labels)`.

The convention is OpenRLHF's, so files written for it work unchanged: the function gets the full
texts (prompt + response), the prompts and the labels, and returns the rewards as a tensor or a
list, or a dict whose "rewards" entry holds them (other entries such as "scores" are ignored and
"extra_logs" is kept for logging). The file is executed only when a user names it
(`--remote_rm_url path/to/reward.py`); it runs with the trainer's permissions, like any code the
user passes.
"""

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightrft.rewards.base import RewardResult, RewardSourceError, to_reward_tensor


class RewardFuncSource:
    """Calls `reward_func` from a user file and checks what it returns."""

    def __init__(self, path: str | Path, func):
        self.path = Path(path)
        self.func = func

    def __repr__(self) -> str:
        return f"RewardFuncSource({str(self.path)!r})"

    def __call__(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any]) -> torch.Tensor:
        return self.score(queries, prompts, labels).rewards

    def score(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any]) -> RewardResult:
        """Rewards and the file's "extra_logs" (each checked to one finite value per query)."""
        where = f"reward_func in {self.path}"
        try:
            output = self.func(list(queries), list(prompts), list(labels))
        except Exception as err:
            raise RewardSourceError(f"{where} raised {type(err).__name__}: {err}") from err
        extra_logs = {}
        if isinstance(output, dict):
            if "rewards" not in output:
                raise RewardSourceError(f"{where} returned a dict without a 'rewards' entry "
                                        f"(keys: {sorted(output)}); return {{'rewards': [...]}} or the list itself")
            extra_logs = {name: to_reward_tensor(values, len(queries), f"{where}, extra_logs[{name!r}]")
                          for name, values in (output.get("extra_logs") or {}).items()}
            output = output["rewards"]
        rewards = to_reward_tensor(output, len(queries), where)
        return RewardResult(rewards, torch.ones(len(queries), dtype=torch.bool), extra_logs)


def load_reward_func(path: str | Path) -> RewardFuncSource:
    """Imports the reward file at `path` and returns a source calling its `reward_func`.

    Raises FileNotFoundError when the file does not exist, and RewardSourceError when importing
    it fails or it defines no callable `reward_func`; each message names the file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"reward file {path} not found (--remote_rm_url): pass the path of a .py file "
                                "defining reward_func(queries, prompts, labels)")
    # A unique module name per resolved path: two reward files may share a file name.
    module_name = f"lightrft_reward_file_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RewardSourceError(f"reward file {path} cannot be imported as Python (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # lets dataclasses and pickling inside the file find it
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        sys.modules.pop(module_name, None)
        raise RewardSourceError(f"importing reward file {path} failed: {type(err).__name__}: {err}") from err
    func = getattr(module, "reward_func", None)
    if not callable(func):
        raise RewardSourceError(f"reward file {path} defines no function reward_func(queries, prompts, labels)")
    return RewardFuncSource(path, func)
