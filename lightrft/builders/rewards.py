"""The reward sources of `--remote_rm_url`."""

from lightrft.config.sections import RewardConfig


def build_reward_sources(rewards: RewardConfig) -> list:
    """One source per comma-separated `--remote_rm_url` entry (HTTP servers, reward files,
    builtin rules, LLM judges), each with the section's timeout, retries and failure policy;
    judges with the section's judge_* options."""
    if not rewards.remote_rm_url:
        return []
    from lightrft.rewards import make_reward_source

    judge = build_judge_settings(rewards)
    return [make_reward_source(spec.strip(), timeout=rewards.reward_timeout, max_retries=rewards.reward_retries,
                               on_failure=rewards.reward_on_failure, judge=judge)
            for spec in rewards.remote_rm_url.split(",") if spec.strip()]


def build_judge_settings(rewards: RewardConfig):
    """What the run's LLM judges share: the template read from --judge_template (or the built-in
    rubric), the parser, the answer length, the batch size and the model name."""
    from lightrft.rewards.judge import DEFAULT_TEMPLATE, JudgeSettings, read_template

    template = read_template(rewards.judge_template) if rewards.judge_template else DEFAULT_TEMPLATE
    return JudgeSettings(template=template, parser=rewards.judge_parser, max_new_tokens=rewards.judge_max_new_tokens,
                         batch_size=rewards.judge_batch_size, model=rewards.judge_model)
