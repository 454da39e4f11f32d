"""What the SFT and reward-model loops read of a run's options (`SupervisedConfig`): the sections
of an SFTRunConfig / RMRunConfig, or of a research script's argparse namespace, whose missing
flags take their defaults."""

import argparse
import json
import subprocess
import sys

import pytest

from lightrft.config import (CheckpointConfig, ConfigError, EvalConfig, LoggingConfig, ModelConfig, RMRunConfig,
                             SFTRunConfig)
from lightrft.config.sections import RMDataConfig, RMModelConfig, SFTDataConfig, SupervisedOptimConfig
from lightrft.trainer.rm_trainer import RM_PINNED_OPTIONS
from lightrft.trainer.sft_trainer import SFT_PINNED_OPTIONS, SupervisedConfig
from tests.conftest import REPO_ROOT, subprocess_env


def test_a_run_config_gives_its_own_sections_and_pinned_options():
    config = SFTRunConfig(model=ModelConfig(pretrain="m", lora_rank=4), data=SFTDataConfig(dataset="d.jsonl"),
                          optim=SupervisedOptimConfig(train_batch_size=16, max_steps=5, learning_rate=1e-5),
                          eval=EvalConfig(eval_steps=3, eval_split=0.25), logging=LoggingConfig(logging_steps=2),
                          checkpoint=CheckpointConfig(ckpt_path="c", save_steps=4))
    loop = SupervisedConfig.of(config, SFT_PINNED_OPTIONS)
    assert (loop.optim, loop.eval, loop.logging, loop.checkpoint) == (config.optim, config.eval, config.logging,
                                                                     config.checkpoint)
    assert loop.pinned == {"pretrain": "m", "dataset": "d.jsonl", "input_key": "input", "output_key": "output",
                           "apply_chat_template": False, "max_len": 2048, "packing_samples": False,
                           "train_batch_size": 16, "micro_train_batch_size": 4, "max_epochs": 1, "seed": 42,
                           "lora_rank": 4, "learning_rate": 1e-5, "eval_split": 0.25}
    rm = RMRunConfig(model=RMModelConfig(pretrain="m", value_head_prefix="v"),
                     data=RMDataConfig(dataset="p.jsonl", prompt_key="q"))
    pinned = SupervisedConfig.of(rm, RM_PINNED_OPTIONS).pinned
    assert (pinned["value_head_prefix"], pinned["prompt_key"], pinned["margin_key"], pinned["learning_rate"]) == \
        ("v", "q", None, 9e-6)
    assert len(pinned) == len(RM_PINNED_OPTIONS)


def test_a_namespace_fills_missing_flags_with_defaults_and_pins_only_what_it_has():
    namespace = argparse.Namespace(train_batch_size=4, micro_train_batch_size=2, adam_betas=[0.8, 0.9], seed=7,
                                   eval_steps=3, ckpt_path="x", pretrain="m", unrelated_flag="u")
    loop = SupervisedConfig.of(namespace, SFT_PINNED_OPTIONS)
    assert (loop.optim.train_batch_size, loop.optim.micro_train_batch_size, loop.optim.adam_betas) == (4, 2, (0.8, 0.9))
    assert (loop.eval.eval_steps, loop.checkpoint.ckpt_path) == (3, "x")
    # Not in the namespace: the defaults of the flags.
    assert (loop.optim.max_steps, loop.logging.logging_steps, loop.checkpoint.save_steps) == (-1, 1, -1)
    assert loop.pinned == {"pretrain": "m", "train_batch_size": 4, "micro_train_batch_size": 2, "seed": 7}
    with pytest.raises(ConfigError, match="--train_batch_size must be positive, got 0"):
        SupervisedConfig.of(argparse.Namespace(train_batch_size=0), SFT_PINNED_OPTIONS)


def test_another_commands_config_is_refused():
    from lightrft.config import PPORunConfig
    from lightrft.config.sections import PPODataConfig, PPOModelConfig, RewardConfig

    ppo = PPORunConfig(model=PPOModelConfig(pretrain="m", critic_pretrain="m"), data=PPODataConfig(prompt_data="p"),
                       rewards=RewardConfig(remote_rm_url="math"))
    with pytest.raises(TypeError, match="SFTRunConfig or RMRunConfig .* got a PPORunConfig"):
        SupervisedConfig.of(ppo, SFT_PINNED_OPTIONS)


FIT_WITH_A_NAMESPACE = """
import argparse, json, os, sys
import torch
from lightrft.datasets import SFTDataset
from lightrft.models import ActorLanguage
from lightrft.strategy import DeepspeedStrategy, StrategyConfig
from lightrft.trainer.sft_trainer import SFTTrainer
from lightrft.utils.tiny import build_char_tokenizer, build_tiny_causal_lm

ckpt = sys.argv[1]
strategy = DeepspeedStrategy(StrategyConfig(seed=0, micro_train_batch_size=2, train_batch_size=4))
strategy.setup_distributed()
tokenizer = build_char_tokenizer()
dataset = SFTDataset([{"input": f"Q{i}:", "output": "ab" * (1 + i % 3)} for i in range(9)], tokenizer, max_len=16)
model = ActorLanguage(build_tiny_causal_lm(tokenizer, seed=0))
optim = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0)
engine, optim, scheduler = strategy.prepare((model, optim, scheduler))
dataloader = strategy.setup_dataloader(dataset, 2, collate_fn=dataset.collate_fn)
trainer = SFTTrainer(strategy, engine, optim, scheduler, tokenizer, max_epochs=2)
# What a research script might pass: no --logging_steps, --save_steps, --max_steps, --eval_steps.
trainer.fit(argparse.Namespace(train_batch_size=4, ckpt_path=ckpt, seed=0, pretrain="tiny"), dataloader)
print(json.dumps({"steps": trainer.global_step, "samples": trainer.consumed_samples, "stop": trainer.stop_reason,
                  "loss": trainer.last_logs["train/loss"], "epoch": trainer.last_logs["train/epoch"],
                  "checkpoints": sorted(n for n in os.listdir(ckpt) if n.startswith("global_step")),
                  "options": trainer.client_state()["options"]}))
strategy.close()
"""


def test_fit_takes_a_research_namespace(tmp_path):
    """`SFTTrainer.fit(namespace, ...)` from research code: flags the namespace lacks run at their
    defaults (log every step, save only at the end, no step cap)."""
    proc = subprocess.run([sys.executable, "-c", FIT_WITH_A_NAMESPACE, str(tmp_path / "ckpt")], cwd=REPO_ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # 9 rows // 4 per step = 2 steps per epoch, 2 epochs.
    assert (result["steps"], result["samples"], result["stop"], result["epoch"]) == (4, 16, None, 2.0)
    assert result["loss"] > 0
    assert result["checkpoints"] == ["global_step4"]
    assert result["options"] == {"pretrain": "tiny", "train_batch_size": 4, "seed": 0}
