"""`make_reward_source`: one reward source from one `--remote_rm_url` entry."""

import functools

from lightrft.rewards.base import RewardSource
from lightrft.rewards.func import RewardFuncProcess
from lightrft.rewards.judge import JudgeSettings, make_judge
from lightrft.rewards.remote import RemoteRewardClient
from lightrft.rewards.rules import RULE_REWARDS, RuleRewardSource

JUDGE_PREFIX = "judge:"


def make_reward_source(spec: str, *, timeout: float = 30.0, max_retries: int = 3, backoff: float = 0.5,
                       on_failure: str = "error", batch_size: int | None = 256, judge: JudgeSettings | None = None,
                       **rule_options) -> RewardSource:
    """Chooses the source by the form of `spec`:

    - `judge:PATH_OR_URL`: an LLM judge (`lightrft.rewards.judge`): a model folder loaded on this
      rank, or an OpenAI-compatible server, with the template, parser and sizes of `judge`
      (default `JudgeSettings()`) and `timeout`, `max_retries`, `backoff` and `on_failure`;
    - `http://...` or `https://...`: a `RemoteRewardClient` with `timeout`, `max_retries`,
      `backoff`, `on_failure` and `batch_size`;
    - a path ending in `.py`: the file's `reward_func`, run in a worker process with `timeout`
      per call and `on_failure` (`RewardFuncProcess`);
    - a builtin rule name (`math`, `format`, ...): that rule, with `rule_options` passed to it
      (for example `pattern=` for `format`).
    """
    spec = spec.strip()
    if spec.startswith(JUDGE_PREFIX):
        return make_judge(spec[len(JUDGE_PREFIX):], judge, timeout=timeout, max_retries=max_retries, backoff=backoff,
                          on_failure=on_failure)
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
        f"a path to a .py file defining reward_func(queries, prompts, labels), judge:PATH_OR_URL for an LLM judge "
        f"(a model folder or an OpenAI-compatible server), or a builtin rule name: {', '.join(sorted(RULE_REWARDS))}")


def make_reward_sources(remote_rm_url) -> list[RewardSource]:
    """One source with default options per entry of `remote_rm_url`: a comma-separated string or
    a list of specs (the classic `remote_rm_url` argument); empty entries are skipped."""
    if not remote_rm_url:
        return []
    specs = remote_rm_url if isinstance(remote_rm_url, (list, tuple)) else remote_rm_url.split(",")
    return [make_reward_source(spec.strip()) for spec in specs if spec.strip()]
