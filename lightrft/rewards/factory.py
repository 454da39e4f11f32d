"""`make_reward_source`: one reward source from one `--remote_rm_url` entry."""

import functools

from lightrft.rewards.base import RewardSource
from lightrft.rewards.func import RewardFuncProcess
from lightrft.rewards.remote import RemoteRewardClient
from lightrft.rewards.rules import RULE_REWARDS, RuleRewardSource


def make_reward_source(spec: str, *, timeout: float = 30.0, max_retries: int = 3, backoff: float = 0.5,
                       on_failure: str = "error", batch_size: int | None = 256, **rule_options) -> RewardSource:
    """Chooses the source by the form of `spec`:

    - `http://...` or `https://...`: a `RemoteRewardClient` with `timeout`, `max_retries`,
      `backoff`, `on_failure` and `batch_size`;
    - a path ending in `.py`: the file's `reward_func`, run in a worker process with `timeout`
      per call and `on_failure` (`RewardFuncProcess`);
    - a builtin rule name (`math`, `format`, ...): that rule, with `rule_options` passed to it
      (for example `pattern=` for `format`).
    """
    spec = spec.strip()
    if spec.startswith(("http://", "https://")):
        return RemoteRewardClient(spec, timeout=timeout, max_retries=max_retries, backoff=backoff,
                                  on_failure=on_failure, batch_size=batch_size)
    if spec.endswith(".py"):
        return RewardFuncProcess(spec, timeout=timeout, on_failure=on_failure)
    if spec in RULE_REWARDS:
        fn = RULE_REWARDS[spec]
        return RuleRewardSource(spec, functools.partial(fn, **rule_options) if rule_options else fn)
    raise ValueError(
        f"unknown reward source {spec!r} (--remote_rm_url): give an http(s):// URL of a reward server, "
        f"a path to a .py file defining reward_func(queries, prompts, labels), or a builtin rule name: "
        f"{', '.join(sorted(RULE_REWARDS))}")
