"""Runs `train_ppo`'s own wiring in this process on one rank (no torchrun, no subprocess), so the
PPO layer's behaviour can be checked on numbers: the weights a run ends with, and its logs."""

import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from lightrft.cli.train_ppo import parse_args, train
from lightrft.datasets.toy import arithmetic_splits, write_jsonl
from lightrft.utils.tiny import save_tiny_model
from tests.conftest import to_flags

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


# An untrained model never answers the sum right, so the math rule would give all-zero rewards and
# no gradient; this reward (share of digits in the response) differs between samples from the start.
REWARD_FILE = """
import torch

def reward_func(queries, prompts, labels):
    out = []
    for query, prompt in zip(queries, prompts):
        response = query[len(prompt):]
        out.append(sum(c.isdigit() for c in response) / max(len(response), 1))
    return torch.tensor(out)
"""


def make_task(root: Path) -> dict:
    """A tiny untrained Qwen2-shaped model and the toy addition task (learning is not the point)."""
    train_rows, eval_rows = arithmetic_splits(n_train=32, n_eval=16, seed=0, max_operand=9)
    reward = root / "digits_reward.py"
    reward.write_text(REWARD_FILE)
    return {"model": save_tiny_model(root / "model", seed=0), "train": write_jsonl(train_rows, root / "train.jsonl"),
            "eval": write_jsonl(eval_rows, root / "eval.jsonl"), "eval_rows": eval_rows, "reward": reward}


def flags(task: dict, out: Path, **overrides) -> list[str]:
    """Two GRPO steps on one rank: 4 prompts x 4 samples, one optimizer step of 16 samples each."""
    values = {
        "pretrain": task["model"], "prompt_data": task["train"], "input_key": "input", "label_key": "label",
        "remote_rm_url": task["reward"], "advantage_estimator": "group_norm", "n_samples_per_prompt": 4,
        "rollout_batch_size": 4, "micro_rollout_batch_size": 16, "train_batch_size": 16,
        "micro_train_batch_size": 8, "generate_max_len": 6, "prompt_max_len": 16, "init_kl_coef": 0,
        "actor_learning_rate": 1e-2, "lr_scheduler": "constant", "lr_warmup_ratio": 0, "max_steps": 2,
        "zero_stage": 2, "seed": 3, "temperature": 1.0, "save_path": out / "model", "ckpt_path": out / "ckpt",
    }
    values.update(overrides)
    return to_flags(values)


def run(task: dict, out: Path, trainer_cls=None, callbacks=(), **overrides) -> tuple[dict, dict[str, torch.Tensor]]:
    """Runs train_ppo in-process; returns its last logs and the exported weights."""
    for key in LAUNCH_ENV:          # a fresh one-rank group (and port) for every run
        os.environ.pop(key, None)
    logs = train(parse_args(flags(task, out, **overrides)), trainer_cls=trainer_cls, callbacks=callbacks)
    for key in LAUNCH_ENV:
        os.environ.pop(key, None)
    return logs, load_file(str(Path(out) / "model" / "model.safetensors"))


def max_weight_change(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
