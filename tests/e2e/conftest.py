"""Pieces shared by the end-to-end tests: the toy task, an SFT-warmed tiny model, and readers for
what a run leaves behind (TensorBoard scalars, the final JSON summary line)."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from lightrft.datasets.toy import arithmetic_splits, sft_warm_start, write_jsonl
from tests.conftest import to_flags


@pytest.fixture(scope="session")
def toy(tmp_path_factory):
    """Train/held-out addition data and an SFT-warmed model (about 30-40% held-out accuracy)."""
    root = tmp_path_factory.mktemp("toy")
    train_rows, eval_rows = arithmetic_splits(n_train=320, n_eval=80, seed=0, max_operand=20)
    with torch.random.fork_rng(devices=[]):
        torch.set_num_threads(1)
        model = sft_warm_start(root / "sft", train_rows, steps=400)
    return {"root": root, "train_rows": train_rows, "eval_rows": eval_rows, "model": model,
            "train": write_jsonl(train_rows, root / "train.jsonl"), "eval": write_jsonl(eval_rows, root / "eval.jsonl")}


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in a TensorBoard folder as {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def summary_line(stdout: str) -> dict:
    """The JSON summary train_ppo prints on rank 0 as its last line starting with '{'."""
    lines = [line for line in stdout.splitlines() if line.startswith("{") and "stop_reason" in line]
    assert lines, f"no summary line in the output:\n{stdout[-3000:]}"
    return json.loads(lines[-1])


def grpo_flags(toy: dict, out: Path, **overrides) -> list[str]:
    """train_ppo flags for a small GRPO run on the toy task; keyword overrides replace or add flags
    (value None drops a flag, True makes a bare switch)."""
    flags = {
        "pretrain": toy["model"], "prompt_data": toy["train"], "label_key": "label", "input_key": "input",
        "remote_rm_url": "math", "advantage_estimator": "group_norm", "n_samples_per_prompt": 8,
        "rollout_batch_size": 32, "micro_rollout_batch_size": 64, "train_batch_size": 128,
        "micro_train_batch_size": 32, "generate_max_len": 4, "prompt_max_len": 16, "init_kl_coef": 0,
        "actor_learning_rate": 1e-3, "lr_scheduler": "constant", "num_episodes": 1, "zero_stage": 2,
        "save_path": out / "model", "ckpt_path": out / "ckpt", "use_tensorboard": out / "tb", "seed": 0,
    }
    flags.update(overrides)
    return to_flags(flags)


def copy_run(run: Path, out: Path) -> Path:
    """A copy of a run's folder (checkpoints, logs, export) at `out`, which is returned: a run
    stopped in a shared launch (`run_torchrun_many`) is resumed from its copy in a launch of its
    own, since a resume is about what a new process reads from disk."""
    shutil.copytree(run, out, dirs_exist_ok=True)
    return out


def assert_resumed_like_uninterrupted(uninterrupted: Path, resumed: Path) -> None:
    """A run resumed from step 2 logs the same step-3/4 rewards and losses as the uninterrupted
    run (TensorBoard under `tb`) and exports bit-identical weights (under `model`)."""
    from safetensors.torch import load_file

    full = {t: dict(s) for t, s in tensorboard_scalars(uninterrupted / "tb").items()}
    again = {t: dict(s) for t, s in tensorboard_scalars(resumed / "tb").items()}
    for tag in ("rollout/reward", "train/policy_loss"):
        assert [again[tag][s] for s in (3, 4)] == [full[tag][s] for s in (3, 4)], tag
    expected = load_file(uninterrupted / "model" / "model.safetensors")
    got = load_file(resumed / "model" / "model.safetensors")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
