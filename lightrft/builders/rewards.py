"""The reward sources of `--remote_rm_url`."""

from lightrft.config.sections import RewardConfig


def build_reward_sources(rewards: RewardConfig) -> list:
    """One source per comma-separated `--remote_rm_url` entry (HTTP servers, reward files,
    builtin rules), each with the section's timeout, retries and failure policy."""
    if not rewards.remote_rm_url:
        return []
    from lightrft.rewards import make_reward_source

    return [make_reward_source(spec.strip(), timeout=rewards.reward_timeout, max_retries=rewards.reward_retries,
                               on_failure=rewards.reward_on_failure)
            for spec in rewards.remote_rm_url.split(",") if spec.strip()]
