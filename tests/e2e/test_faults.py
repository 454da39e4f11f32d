"""Runs that survive: non-finite values and SIGTERM during a `train_ppo` run on two CPU ranks.

Faults are injected on rank 0 through the LIGHTRFT_TRAIN_FAULT test hook (lightrft.utils.faults)."""

from pathlib import Path

import pytest
import torch

from tests.conftest import run_torchrun, run_torchrun_many
from tests.e2e.conftest import (assert_resumed_like_uninterrupted, copy_run, grpo_flags, summary_line,
                               tensorboard_scalars)

pytestmark = pytest.mark.dist

SMALL = dict(rollout_batch_size=16, n_samples_per_prompt=4, train_batch_size=64, micro_train_batch_size=16,
             micro_rollout_batch_size=32, max_samples=64, save_steps=1, max_ckpt_num=4)  # 4 steps, 1 update each


def launch(toy, out: Path, fault: str | None = None, check: bool = True, **overrides):
    env = {"LIGHTRFT_TRAIN_FAULT": fault} if fault else {}
    flags = grpo_flags(toy, out, **{**SMALL, **overrides})
    return run_torchrun(["lightrft.cli.train_ppo", *flags], module=True, env=env, check=check)


def actor_weights(ckpt: Path, step: int) -> dict[str, torch.Tensor]:
    """The actor's full weights in a checkpoint (ZeRO-0 and ZeRO-2 keep them whole in the model-states file)."""
    files = list((ckpt / "_actor" / f"global_step{step}").rglob("mp_rank_00_model_states.pt"))
    assert len(files) == 1, files
    return torch.load(files[0], map_location="cpu", weights_only=False)["module"]


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


NONFINITE = "nan-reward@1,nan-logprob@2,nan-advantage@3,nan-loss@3,nan-grad@4"
MOMENTS = ("rollout", "train", "save")


@pytest.fixture(scope="module")
def clean_runs(toy, tmp_path_factory):
    """The runs that finish, in one torchrun launch (tests/e2e/run_many.py), each in its own
    folder: the uninterrupted run the preempted ones are compared with, the non-finite
    injections under ZeRO-2 and ZeRO-0 (fp32: the strategy skips the step, not DeepSpeed), and a
    run stopped at step 2 and three stopped by SIGTERM at step 2 (in its rollout, its update or
    its checkpoint), which the resume tests copy and continue in launches of their own (a resume
    is about what a new process reads from disk), and a train_sft run whose step 2 has a NaN loss."""
    root = tmp_path_factory.mktemp("clean_runs")
    runs = {"uninterrupted": ({}, {}), "nonfinite-2": ({"zero_stage": 2}, {"LIGHTRFT_TRAIN_FAULT": NONFINITE}),
            "nonfinite-0": ({"zero_stage": 0}, {"LIGHTRFT_TRAIN_FAULT": NONFINITE}),
            "two_steps": ({"max_steps": 2}, {}),
            **{f"sigterm-{moment}": ({}, {"LIGHTRFT_TRAIN_FAULT": f"sigterm-{moment}@2"}) for moment in MOMENTS}}
    launched = [{"argv": grpo_flags(toy, root / name, **{**SMALL, **extra}), "env": env}
                for name, (extra, env) in runs.items()]
    launched.append({"cli": "train_sft", "argv": sft_flags(toy, root / "sft-nan-loss"),
                     "env": {"LIGHTRFT_TRAIN_FAULT": "nan-loss@2"}})
    outputs = run_torchrun_many(launched, root)
    return {name: (root / name, output) for name, output in zip([*runs, "sft-nan-loss"], outputs)}


@pytest.mark.parametrize("zero_stage", [2, 0])
def test_non_finite_samples_are_dropped_and_non_finite_steps_skipped(clean_runs, zero_stage):
    out, stdout = clean_runs[f"nonfinite-{zero_stage}"]
    summary = summary_line(stdout)
    assert summary["step"] == 4 and summary["stop_reason"] == "finished"
    scalars = {tag: dict(series) for tag, series in tensorboard_scalars(out / "tb").items()}
    # One bad sample per injected source, counted (cumulatively) where it happened; the run went on.
    assert scalars["rollout/nonfinite_reward_samples"] == {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}
    assert scalars["rollout/nonfinite_logprob_samples"] == {1: 0.0, 2: 1.0, 3: 1.0, 4: 1.0}
    assert scalars["rollout/nonfinite_advantage_samples"] == {1: 0.0, 2: 0.0, 3: 1.0, 4: 1.0}
    # 64 samples a step. A bad reward or log-prob takes its whole group of 4 out of training (the
    # group baseline needs every member); a bad advantage only its own sample.
    assert scalars["rollout/valid"][1] == pytest.approx(1 - 4 / 64)
    assert scalars["rollout/valid"][2] == pytest.approx(1 - 4 / 64)
    assert scalars["rollout/valid"][3] == pytest.approx(1 - 1 / 64)
    assert scalars["rollout/valid"][4] == pytest.approx(1.0)
    # Steps 3 (NaN loss) and 4 (NaN gradient) are skipped: the weights do not move.
    assert scalars["train/skipped_steps"] == {1: 0.0, 2: 0.0, 3: 1.0, 4: 2.0}
    ckpt = out / "ckpt"
    w1, w2, w3, w4 = (actor_weights(ckpt, s) for s in (1, 2, 3, 4))
    assert not same_weights(w1, w2)          # a normal step with NaN samples dropped still trains
    assert same_weights(w2, w3) and same_weights(w3, w4)
    assert all(torch.isfinite(t).all() for t in w4.values() if t.is_floating_point())


def test_a_streak_of_non_finite_steps_saves_and_stops_with_the_source(toy, tmp_path):
    proc = launch(toy, tmp_path, fault="nan-loss@1,nan-loss@2", max_nonfinite_steps=2, check=False)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "2 optimizer steps in a row were skipped for non-finite values" in output
    assert "policy_loss" in output.split("skipped for non-finite values")[1].splitlines()[0]
    assert (tmp_path / "ckpt" / "_actor" / "global_step2").is_dir()


@pytest.fixture(scope="module")
def uninterrupted(clean_runs):
    out, stdout = clean_runs["uninterrupted"]
    assert summary_line(stdout)["step"] == 4
    return out


@pytest.mark.parametrize("moment", MOMENTS)
def test_sigterm_ends_with_a_checkpoint_and_the_resumed_run_continues_exactly(toy, tmp_path, clean_runs,
                                                                             uninterrupted, moment):
    out, stdout = clean_runs[f"sigterm-{moment}"]
    summary = summary_line(stdout)
    assert summary["stop_reason"] == "preempted" and summary["step"] == 2
    assert "received SIGTERM" in stdout
    assert (out / "ckpt" / "_actor" / "latest").read_text().strip() == "global_step2"

    copy_run(out, tmp_path)
    resumed = summary_line(launch(toy, tmp_path, load_checkpoint=True).stdout)
    assert resumed["step"] == 4 and resumed["stop_reason"] == "finished"
    assert_resumed_like_uninterrupted(uninterrupted, tmp_path)


def test_a_failed_save_keeps_the_previous_checkpoint_and_the_run_continues(toy, tmp_path, clean_runs):
    copy_run(clean_runs["two_steps"][0], tmp_path)            # stopped at step 2: checkpoints at steps 1 and 2
    env = {"LIGHTRFT_CKPT_FAULT": "mid-shard:raise"}                      # every later save fails mid-write
    flags = grpo_flags(toy, tmp_path, **{**SMALL, "load_checkpoint": True, "max_steps": 3})
    proc = run_torchrun(["lightrft.cli.train_ppo", *flags], module=True, env=env)
    summary = summary_line(proc.stdout)
    assert summary["step"] == 3 and summary["train/failed_saves"] == 1.0
    message = [line for line in proc.stdout.splitlines() if "checkpoint global_step3 was not saved" in line]
    assert message and str(tmp_path / "ckpt") in message[0] and "injected failure" in message[0]
    assert (tmp_path / "ckpt" / "_actor" / "latest").read_text().strip() == "global_step2"
    resumed = launch(toy, tmp_path, load_checkpoint=True, max_steps=3)
    assert "resumed from" in resumed.stdout and "global_step2: step 2" in resumed.stdout


def sft_flags(toy, out: Path, **extra) -> list:
    flags = ["--pretrain", toy["model"], "--dataset", toy["train"], "--input_key", "input", "--output_key",
             "output", "--max_len", "16", "--train_batch_size", "32", "--micro_train_batch_size", "8",
             "--max_samples", "128", "--learning_rate", "1e-3", "--save_path", out / "model", "--ckpt_path",
             out / "ckpt", "--save_steps", "1", "--max_ckpt_num", "4", "--use_tensorboard", out / "tb"]
    for key, value in extra.items():
        flags += [f"--{key}", str(value)]
    return flags


def test_sft_skips_a_non_finite_step_and_stops_after_a_streak(toy, tmp_path, clean_runs):
    one = clean_runs["sft-nan-loss"][0]
    skipped = dict(tensorboard_scalars(one / "tb")["train/skipped_steps"])
    assert skipped == {1: 0.0, 2: 1.0, 3: 1.0, 4: 1.0}
    assert same_weights(actor_weights_sft(one / "ckpt", 1), actor_weights_sft(one / "ckpt", 2))
    assert not same_weights(actor_weights_sft(one / "ckpt", 2), actor_weights_sft(one / "ckpt", 3))

    proc = run_torchrun(["lightrft.cli.train_sft", *sft_flags(toy, tmp_path / "streak", max_nonfinite_steps=2)],
                        module=True, check=False, env={"LIGHTRFT_TRAIN_FAULT": "nan-loss@2,nan-loss@3"})
    assert proc.returncode != 0
    assert "2 optimizer steps in a row were skipped for non-finite values (loss" in proc.stdout + proc.stderr
    assert (tmp_path / "streak" / "ckpt" / "latest").read_text().strip() == "global_step3"


def actor_weights_sft(ckpt: Path, step: int) -> dict[str, torch.Tensor]:
    files = list((ckpt / f"global_step{step}").rglob("mp_rank_00_model_states.pt"))
    assert len(files) == 1, files
    return torch.load(files[0], map_location="cpu", weights_only=False)["module"]


def test_a_run_saved_on_two_ranks_resumes_on_one(toy, tmp_path, clean_runs):
    """GRPO saved on 2 ranks resumes on 1 (DeepSpeed's universal checkpoint): rollouts are seeded by
    their place in the global batch, so steps 3 and 4 sample what the uninterrupted 2-rank run
    sampled (same rewards), and the weights end where that run's did up to float rounding."""
    from safetensors.torch import load_file

    copy_run(clean_runs["two_steps"][0], tmp_path)            # stopped at step 2: checkpoints at steps 1 and 2
    proc = run_torchrun(["lightrft.cli.train_ppo", *grpo_flags(toy, tmp_path, **{**SMALL, "load_checkpoint": True})],
                        nproc=1, module=True)
    assert "was saved by 2 rank(s) and this job has 1: converting it" in proc.stdout
    assert summary_line(proc.stdout)["step"] == 4
    uninterrupted = clean_runs["uninterrupted"][0]
    full = {t: dict(s) for t, s in tensorboard_scalars(uninterrupted / "tb").items()}
    again = {t: dict(s) for t, s in tensorboard_scalars(tmp_path / "tb").items()}
    assert [again["rollout/reward"][s] for s in (3, 4)] == [full["rollout/reward"][s] for s in (3, 4)]
    start, end = actor_weights(uninterrupted / "ckpt", 2), actor_weights(uninterrupted / "ckpt", 4)
    assert max((end[k].float() - start[k].float()).abs().max().item() for k in end) > 1e-4     # steps 3-4 trained
    expected = load_file(uninterrupted / "model" / "model.safetensors")
    got = load_file(tmp_path / "model" / "model.safetensors")
    assert max((expected[k] - got[k]).abs().max().item() for k in expected) < 1e-5
