"""PPOTrainer built by hand trains with the options it is given: `algo` unless a classic keyword
overrides it."""

from types import SimpleNamespace

import pytest
import torch

from lightrft.config.sections import AlgorithmConfig
from lightrft.rollout import HFEngine
from lightrft.trainer.ppo_trainer import PPOTrainer


def build(critic=None, **kwargs) -> PPOTrainer:
    config = SimpleNamespace(seed=0, zero_stage=0, bf16=False)
    strategy = SimpleNamespace(config=config, world_size=1, rank=0, device="cpu")
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    return PPOTrainer(strategy, torch.nn.Linear(1, 1), critic, None, None, None, None, None, None, None,
                      tokenizer=tokenizer, rollout_engine=SimpleNamespace(capabilities=HFEngine.capabilities),
                      reward_sources=[lambda queries, prompts, labels: torch.zeros(len(queries))], **kwargs)


def grpo(**fields) -> AlgorithmConfig:
    return AlgorithmConfig(advantage_estimator="group_norm", n_samples_per_prompt=2, **fields)


def test_algo_values_are_the_ones_trained_with():
    algo = grpo(init_kl_coef=0.05, eps_clip=0.3, value_clip=0.4, kl_horizon=500, ptx_coef=0.1, kl_target=6.0)
    trainer = build(algo=algo)
    assert trainer.algo == algo
    assert trainer.kl_ctl.value == 0.05 and trainer.kl_ctl.target == 6.0 and trainer.kl_ctl.horizon == 500
    assert trainer.actor_loss_fn.eps_clip_low == trainer.actor_loss_fn.eps_clip_high == 0.3


def test_an_explicit_classic_keyword_still_overrides_algo():
    trainer = build(algo=grpo(init_kl_coef=0.05, eps_clip=0.3), init_kl_coef=0.002, value_clip=0.5)
    assert (trainer.algo.init_kl_coef, trainer.algo.eps_clip, trainer.algo.value_clip) == (0.002, 0.3, 0.5)
    assert trainer.kl_ctl.value == 0.002


def test_without_algo_the_classic_defaults_apply():
    trainer = build(critic=torch.nn.Linear(1, 1))      # the default estimator, gae, needs one
    algo = trainer.algo
    assert (algo.init_kl_coef, algo.kl_target, algo.kl_horizon, algo.ptx_coef, algo.eps_clip, algo.value_clip) == (
        0.001, None, 10000, 0.0, 0.2, 0.2)
    assert build(critic=torch.nn.Linear(1, 1), eps_clip=0.25).actor_loss_fn.eps_clip_high == pytest.approx(0.25)
