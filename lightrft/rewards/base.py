"""What a reward source is, what it returns, and the checks every source applies to its scores."""

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


class RewardSourceError(RuntimeError):
    """A reward source could not score a batch. The message names the source (file, URL with
    credentials removed, or rule name) and the cause."""


@runtime_checkable
class RewardSource(Protocol):
    """Scores B samples given as text.

    `queries[i]` is the full text of sample i (prompt followed by response), `prompts[i]` its
    prompt and `labels[i]` its reference answer or other per-row data (None when the dataset has
    no label column). Returns the rewards, Shape: (B,) float32.

    Sources may also take `truncated`, a list of B bools (True where the response was cut at the
    length limit instead of ending with a stop token); `call_reward_source` passes it to those
    whose `__call__` accepts it, so sources written for the three-argument form keep working.

    A `RemoteRewardClient` built with `on_failure="drop"` returns a `RewardResult` instead, so
    that code unaware of dropped samples fails loudly rather than training on placeholders.
    """

    def __call__(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any]) -> torch.Tensor:
        ...


@dataclass
class RewardResult:
    """Rewards with a validity mask, from sources that may drop samples.

    `rewards[i]` is 0.0 wherever `valid[i]` is False: the value is a placeholder, never a reward.
    The caller decides what to do with invalid samples (the experience maker zeroes their
    advantages). `extra_logs` carries per-sample values a reward file returned for logging.
    """

    rewards: torch.Tensor  # (B,) float32, 0.0 where not valid
    valid: torch.Tensor  # (B,) bool
    extra_logs: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (B,) float32

    @property
    def num_dropped(self) -> int:
        return int((~self.valid).sum())


def accepts_keyword(fn, name: str) -> bool:
    """Whether calling `fn` with the keyword argument `name` is valid (named or `**kwargs`)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) or p.kind is p.VAR_KEYWORD
               for p in params)


def call_reward_source(source, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any],
                       truncated: Sequence[bool] | None = None):
    """Calls a reward source, with `truncated` when it takes it (see `RewardSource`)."""
    if truncated is not None and accepts_keyword(source, "truncated"):
        return source(queries, prompts, labels, truncated=list(truncated))
    return source(queries, prompts, labels)


class FailurePolicySource:
    """Shared front of the reward sources that can fail (servers, reward-file workers): `score`
    returns a `RewardResult`; calling the source gives what the trainer takes under the source's
    `on_failure` policy: the rewards under "error", the whole result (with validity) under "drop"."""

    on_failure: str

    def __call__(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any],
                 truncated: Sequence[bool] | None = None):
        """Rewards, Shape: (B,) float32, under on_failure="error"; a `RewardResult` under "drop"."""
        result = self.score(queries, prompts, labels, truncated=truncated)
        return result if self.on_failure == "drop" else result.rewards

    def score(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any],
              truncated: Sequence[bool] | None = None) -> "RewardResult":
        raise NotImplementedError


def check_batch_lengths(queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any]) -> None:
    """A reward call takes one prompt and one label per query."""
    if not len(queries) == len(prompts) == len(labels):
        raise ValueError(f"queries, prompts and labels must have the same length, got "
                         f"{len(queries)}, {len(prompts)} and {len(labels)}")


def as_reward_result(output: torch.Tensor | RewardResult) -> RewardResult:
    """A `RewardResult` for the output of any reward source (a plain tensor is all valid)."""
    if isinstance(output, RewardResult):
        return output
    rewards = torch.as_tensor(output, dtype=torch.float32).reshape(-1)
    return RewardResult(rewards, torch.ones(rewards.shape[0], dtype=torch.bool))


def to_reward_tensor(values: Any, expected: int, source: str) -> torch.Tensor:
    """Converts a list, array or tensor of scores into a float32 CPU tensor of shape (expected,),
    raising a `RewardSourceError` naming `source` when the count is wrong, an entry is not a
    number, or a score is NaN or infinite."""
    try:
        if isinstance(values, torch.Tensor):
            tensor = values.detach().to(device="cpu", dtype=torch.float32)
        else:
            if any(isinstance(v, (bool, str, bytes)) or v is None for v in _flat(values)):
                raise TypeError("entries must be numbers")
            tensor = torch.as_tensor(values, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as err:
        raise RewardSourceError(f"{source}: rewards must be numbers (a list or a tensor), got "
                                f"{_preview(values)} ({err})") from None
    if tensor.numel() != expected or tensor.dim() > 2 or (tensor.dim() == 2 and tensor.shape[1] != 1):
        raise RewardSourceError(f"{source}: expected {expected} rewards (one per query), got shape "
                                f"{tuple(tensor.shape)}")
    tensor = tensor.reshape(expected)
    bad = (~torch.isfinite(tensor)).nonzero().flatten().tolist()
    if bad:
        raise RewardSourceError(f"{source}: rewards at positions {bad[:10]} are NaN or infinite "
                                f"({[tensor[i].item() for i in bad[:10]]})")
    return tensor


def _flat(values: Any):
    if isinstance(values, (list, tuple)):
        for v in values:
            yield from _flat(v)
    else:
        yield values


def _preview(values: Any, limit: int = 80) -> str:
    text = repr(values)
    return text if len(text) <= limit else text[:limit] + "..."


def is_finite_number(value: Any) -> bool:
    """True for an int or float (not a bool) that is neither NaN nor infinite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
