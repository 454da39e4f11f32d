"""One builder per component of a run, each reading its own config section.

    tokenizer        build_tokenizer, stop_token_ids (they live in lightrft.models.tokenizer, where
                     the reward judge and the served policy load a tokenizer too)
    models           model_kwargs (every model), policy_model_kwargs (actor, reference, EMA and
                     explorer copies alike),
                     build_scoring_policy (the KL reference and the distillation teacher)
    engines          build_rollout_engine (by --rollout_engine), build_vllm_engine, build_hf_engine
    rewards          build_reward_sources (HTTP servers, reward files, builtin rules, LLM judges)
    datasets         build_prompt_dataset
    training         build_scheduler, build_tracker (PPO, SFT and RM runs)
    ppo_run          build_strategy, PPORun, build_ppo_run (the whole PPO run: models, data, trainer)
    explorers        build_explorer_parts, build_explorer (an explorer rank's), build_explorer_source
                     (the trainers' experience source of explorer ranks or thread)

The command line (`lightrft.cli`) parses flags into a run config and calls these; nothing under
`lightrft/` outside `cli/` imports the command line. Names resolve on first use, so importing
this package stays light.
"""

import importlib

_HOMES = {
    "build_tokenizer": "lightrft.models.tokenizer",
    "stop_token_ids": "lightrft.models.tokenizer",
    "model_kwargs": "lightrft.builders.models",
    "policy_model_kwargs": "lightrft.builders.models",
    "build_scoring_policy": "lightrft.builders.models",
    "build_rollout_engine": "lightrft.builders.engines",
    "build_vllm_engine": "lightrft.builders.engines",
    "build_hf_engine": "lightrft.builders.engines",
    "build_reward_sources": "lightrft.builders.rewards",
    "build_prompt_dataset": "lightrft.builders.datasets",
    "build_scheduler": "lightrft.builders.training",
    "build_tracker": "lightrft.builders.training",
    "build_strategy": "lightrft.builders.ppo_run",
    "PPORun": "lightrft.builders.ppo_run",
    "build_ppo_run": "lightrft.builders.ppo_run",
    "build_explorer_parts": "lightrft.builders.explorers",
    "build_explorer": "lightrft.builders.explorers",
    "build_explorer_source": "lightrft.builders.explorers",
    "check_run_vocabulary": "lightrft.builders.ppo_run",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
