"""Reward sources: reward files, HTTP reward servers, rule rewards and LLM judges, plus reward shaping.

Every source is called as `source(queries, prompts, labels)` and returns one reward per query
(see `RewardSource`); `make_reward_source` builds one from a `--remote_rm_url` entry. `RewardBatch`
is what every source's rewards of a batch combine into.
"""

from lightrft.rewards.base import RewardResult, RewardSource, RewardSourceError, as_reward_result
from lightrft.rewards.batch import RewardBatch
from lightrft.rewards.factory import make_reward_source, make_reward_sources
from lightrft.rewards.func import RewardFuncProcess, RewardFuncSource, RewardFuncStats, load_reward_func
from lightrft.rewards.judge import (JUDGE_PARSERS, JudgeSettings, JudgeSource, JudgeStats, LocalJudge, OpenAIJudge,
                                    register_judge_parser)
from lightrft.rewards.remote import RemoteRewardClient, RemoteRewardStats, redact_url
from lightrft.rewards.rules import (
    RULE_REWARDS,
    RuleRewardSource,
    answers_match,
    extract_final_answer,
    format_reward,
    get_rule_reward,
    math_answer_reward,
    register_rule_reward,
)
from lightrft.rewards.shaping import overlong_penalty

__all__ = [
    "JUDGE_PARSERS", "JudgeSettings", "JudgeSource", "JudgeStats", "LocalJudge", "OpenAIJudge",
    "RULE_REWARDS", "RemoteRewardClient", "RemoteRewardStats", "RewardBatch", "RewardFuncProcess",
    "RewardFuncSource", "RewardFuncStats", "RewardResult", "RewardSource", "RewardSourceError", "RuleRewardSource",
    "answers_match", "as_reward_result", "extract_final_answer", "format_reward", "get_rule_reward",
    "load_reward_func", "make_reward_source", "make_reward_sources", "math_answer_reward", "overlong_penalty",
    "redact_url",
    "register_judge_parser", "register_rule_reward",
]
