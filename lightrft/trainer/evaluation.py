"""Evaluation of a policy on held-out prompts: the mean task reward of greedy decoding, and
pass@k with the mean reward of k samples. Shared by `PPOTrainer` (the eval/* metrics during a run)
and anything else that scores a policy, such as `lightrft.cli.bench` over saved checkpoints."""

import dataclasses

import torch

from lightrft.experience.generation import sampling_params
from lightrft.experience.scorer import Scorer


@torch.no_grad()
def evaluate_policy(services, strategy, dataloader, generate_kwargs: dict, k: int = 1) -> dict[str, float]:
    """Scores the policy behind `services` (a run's `RolloutServices`, or a `NaiveExperienceMaker`)
    on every (prompts, labels) batch of `dataloader` (this rank's shard), summed over ranks with
    one all-reduce.

    Rewards are the task's, without training-only shaping (DAPO's overlong penalty). The sampling
    seeds are those of the "eval" stream's rollouts 1, 2, ... of this evaluation, the same at
    every evaluation, so two evaluations of one policy agree and a curve of them moves only with
    the policy (and a resumed run evaluates as the uninterrupted one). Returns
    `eval/reward_greedy` (temperature 0) and, for k > 1, `eval/pass@k` (share of prompts with a
    positive reward among k samples) and `eval/reward_mean` (mean reward of those samples)."""
    services = getattr(services, "services", services)
    greedy_sum = greedy_n = pass_sum = prompts_n = sample_sum = 0.0
    call = 0
    for prompts, labels in dataloader:
        prompts, labels = list(prompts), list(labels)
        call += 1
        greedy = sampling_params(1, **{**generate_kwargs, "temperature": 0.0})
        rewards = services.rollout(prompts, labels, greedy, call, stream="eval", shaping=False)[1].scores
        greedy_sum += rewards.sum().item()
        greedy_n += rewards.numel()
        if k > 1:
            call += 1
            params = sampling_params(k, **generate_kwargs)
            rewards = services.rollout(prompts, labels, params, call, stream="eval", shaping=False)[1]
            scores = rewards.scores.view(-1, k)  # (P, k)
            pass_sum += (scores > 0).any(dim=1).float().sum().item()
            sample_sum += scores.mean(dim=1).sum().item()
            prompts_n += scores.size(0)
    totals = strategy.all_reduce(torch.tensor([greedy_sum, greedy_n, pass_sum, sample_sum, prompts_n],
                                              dtype=torch.float64), op="sum").tolist()
    logs = {"eval/reward_greedy": totals[0] / max(totals[1], 1)}
    if k > 1:
        logs[f"eval/pass@{k}"] = totals[2] / max(totals[4], 1)
        logs["eval/reward_mean"] = totals[3] / max(totals[4], 1)
    return logs


def held_out_services(services, rewards=None):
    """`services` (a run's `RolloutServices`) scored by the sources of `rewards.eval_remote_rm_url`
    (the run config's rewards section) when it names a held-out scorer, with the section's
    timeout, retries and failure policy; `services` itself otherwise."""
    url = getattr(rewards, "eval_remote_rm_url", None)
    if not url:
        return services
    from lightrft.rewards import make_reward_source

    sources = [make_reward_source(spec.strip(), timeout=rewards.reward_timeout, max_retries=rewards.reward_retries,
                                  on_failure=rewards.reward_on_failure) for spec in url.split(",") if spec.strip()]
    scorer = services.scorer
    return dataclasses.replace(services, scorer=Scorer(scorer.tokenizer, reward_sources=sources,
                                                       eos_token_ids=scorer.eos_token_ids))
