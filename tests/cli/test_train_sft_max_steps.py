"""train_sft --max_steps on one rank: the run stops after that many optimizer steps, its LR
schedule ends with them, and it saves its checkpoint and exports the model as a finished run does."""

import json
import os

import torch

from lightrft.cli.train_sft import parse_args, train
from lightrft.datasets.toy import arithmetic_splits, write_jsonl
from lightrft.utils.tiny import save_tiny_model
from tests.trainer.ppo_harness import LAUNCH_ENV


def test_max_steps_stops_the_run_and_the_schedule_after_that_many_steps(tmp_path, capsys):
    base = save_tiny_model(tmp_path / "base", seed=0)
    rows, _ = arithmetic_splits(n_train=64, n_eval=1, seed=0)
    data = write_jsonl(rows, tmp_path / "train.jsonl")
    for key in LAUNCH_ENV:          # a fresh one-rank group
        os.environ.pop(key, None)
    # 64 rows / 8 per step = 8 steps in the epoch; --max_steps 2 keeps two.
    logs = train(parse_args([
        "--pretrain", str(base), "--dataset", str(data), "--input_key", "input", "--output_key", "output",
        "--max_len", "16", "--zero_stage", "0", "--train_batch_size", "8", "--micro_train_batch_size", "8",
        "--learning_rate", "1e-3", "--lr_scheduler", "linear", "--lr_warmup_ratio", "0", "--max_steps", "2",
        "--save_path", str(tmp_path / "model"), "--ckpt_path", str(tmp_path / "ckpt")]))
    for key in LAUNCH_ENV:
        os.environ.pop(key, None)
    summary = json.loads([line for line in capsys.readouterr().out.splitlines() if line.startswith("{")][-1])
    assert (summary["step"], summary["stop_reason"]) == (2, "max_steps")
    # A linear decay over the 2 steps run reaches 0 at the last one (over all 8 it would be at 3/4).
    assert logs["train/lr"] == 0.0
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("global_step*")) == ["global_step2"]
    assert (tmp_path / "model" / "config.json").exists()
    from safetensors.torch import load_file

    trained = load_file(tmp_path / "model" / "model.safetensors")
    start = load_file(base / "model.safetensors")
    assert any(not torch.equal(trained[name], start[name]) for name in start)
