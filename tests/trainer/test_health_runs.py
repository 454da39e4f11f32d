"""Health monitors on runs made to fail: with the monitor off the run goes on failing, with `stop`
it stops within the monitor's window of the onset (report written, exit status 4), with
`rollback` it restores the checkpoint before the onset bit for bit and goes on. One rank, in this
process (`ppo_harness`), from a tiny model SFT-warmed on the toy addition task; a healthy run of
the same task triggers nothing."""

import dataclasses
import statistics
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightrft.algorithms.monitors import MONITORS
from lightrft.datasets.toy import arithmetic_splits, sft_warm_start, write_jsonl
from lightrft.trainer.callbacks import TrainerCallback
from lightrft.trainer.ppo_health import EXIT_STATUS, scale_learning_rate
from lightrft.trainer.ppo_trainer import PPOTrainer
from tests.trainer.ppo_harness import run

ONSET = 6      # the 1-based step whose update (or rollout, by the scenario) first goes wrong

# Each reward file counts its calls (one per step: these runs evaluate with another scorer or not at
# all) and turns bad from call ONSET on; `correct` is the task's reward.
REWARDS = {
    "correct": "",
    "hack": "return 1.0 - correct if CALLS[0] >= ONSET else correct",   # a scorer bug: wrong answers pay
    "fail": "if CALLS[0] >= ONSET:\n        raise RuntimeError('reward backend down')\n    return correct",
    "scale": "return 100.0 * correct if CALLS[0] >= ONSET else correct",              # a reward 100x too large
}


def reward_file(root: Path, kind: str) -> Path:
    body = REWARDS[kind] or "return correct"
    path = root / f"reward_{kind}.py"
    path.write_text(f"""
import torch

CALLS = [0]
ONSET = {ONSET}


def score(response, label):
    correct = float(response.strip() == str(label))
    {body}


def reward_func(queries, prompts, labels):
    CALLS[0] += 1
    return torch.tensor([score(q[len(p):], l) for q, p, l in zip(queries, prompts, labels)])
""")
    return path


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("health")
    train_rows, eval_rows = arithmetic_splits(n_train=128, n_eval=16, seed=0, max_operand=20)
    # One thread, as each of the suite's two workers has: the runs below follow the same path.
    torch.set_num_threads(1)
    with torch.random.fork_rng(devices=[]):
        model = sft_warm_start(root / "sft", train_rows, steps=300)
    return {"root": root, "model": model, "train": write_jsonl(train_rows, root / "train.jsonl"),
            "eval": write_jsonl(eval_rows, root / "eval.jsonl")}


class Recorder(TrainerCallback):
    """The health events, the run's per-step logs, and the actor's weights at each rollback."""

    def __init__(self, lr_spike_at: int = 0):
        self.events, self.restored, self.logs, self.lr_spike_at = [], [], {}, lr_spike_at

    def on_rollout_end(self, trainer, experiences):
        # A learning rate 30x too high for step `lr_spike_at` (1-based) alone.
        if not self.lr_spike_at:
            return
        if trainer.global_step + 1 == self.lr_spike_at:
            scale_learning_rate(trainer.actor_scheduler, 30.0)
        elif trainer.global_step + 1 == self.lr_spike_at + 1:
            scale_learning_rate(trainer.actor_scheduler, 1 / 30.0)

    def on_health(self, trainer, event):
        self.events.append(event)
        if event["action"] == "rollback":
            model = trainer.actor.module.model
            self.restored.append({name: p.detach().clone() for name, p in model.state_dict().items()})


class ColderTrainer(PPOTrainer):
    """Samples at temperature 0.02 from step ONSET on: the sampling policy's entropy collapses."""

    temperature = 0.02

    def sampling_params(self, step):
        params = super().sampling_params(step)
        return dataclasses.replace(params, temperature=self.temperature) if step + 1 >= ONSET else params


class LongerTrainer(PPOTrainer):
    """From step ONSET every response runs to --generate_max_len (end-of-sequence held off, as a
    stop-token misconfiguration does). A reward for length makes the same failure, but this tiny
    policy learns it only after 13-18 steps at a temperature of 1.5, too slowly for a test."""

    def sampling_params(self, step):
        params = super().sampling_params(step)
        return dataclasses.replace(params, min_new_tokens=params.max_new_tokens) if step + 1 >= ONSET else params


class HotterTrainer(ColderTrainer):
    """Samples at temperature 2 from step ONSET on, while the trainer's log-probs stay at 1: the
    engine samples from another distribution than the one trained (a misconfigured engine)."""

    temperature = 2.0


def train(task, out, kind="correct", monitors="off", recorder=None, trainer_cls=None, **flags):
    """A 16-step GRPO run (8 prompts x 8 samples, 2 optimizer steps a step); returns (the final
    logs or the exit status, the recorder)."""
    recorder = recorder or Recorder()
    values = dict(pretrain=task["model"], prompt_data=task["train"], remote_rm_url=reward_file(task["root"], kind),
                  generate_max_len=8, max_steps=16, n_samples_per_prompt=8, rollout_batch_size=8,
                  micro_rollout_batch_size=64, train_batch_size=32, micro_train_batch_size=32,
                  actor_learning_rate=1e-3, monitors=monitors)
    values.update(flags)

    class Logged(trainer_cls or PPOTrainer):
        def save_logs_and_checkpoints(self, args, global_step, bar, logs, **kw):
            super().save_logs_and_checkpoints(args, global_step, bar, logs, **kw)
            recorder.logs[global_step] = dict(self.last_logs)

    try:
        logs, _ = run({"model": task["model"], "train": task["train"], "reward": values.pop("remote_rm_url")}, out,
                      trainer_cls=Logged, callbacks=[recorder], **values)
    except SystemExit as stop:
        return stop.code, recorder
    return logs, recorder


def series(recorder, metric):
    return {step: logs[metric] for step, logs in recorder.logs.items() if metric in logs}


def report_of(out: Path, step: int, monitor: str) -> str:
    path = out / "ckpt" / "health" / f"health-step{step}-{monitor}.md"
    assert path.exists() and path.with_suffix(".png").exists(), sorted((out / "ckpt").rglob("health*"))
    return path.read_text()


def test_a_healthy_run_triggers_nothing(task, tmp_path):
    logs, recorder = train(task, tmp_path, monitors="warn", eval_data=task["eval"], eval_steps=4)
    assert recorder.events == [] and len(recorder.logs) == 16
    assert "health/rollbacks" not in logs


def median_before(recorder, metric):
    return statistics.median(v for step, v in series(recorder, metric).items() if step < ONSET)


# scenario: (flags, the monitor, what the run without it shows at the verdict's step)
SCENARIOS = {
    "length": (dict(trainer_cls=LongerTrainer, engine_logprob_gap_action="warn"), "length_blowup",
               lambda off, step: off.logs[step]["rollout/truncated"] > 0.5 > max(
                   off.logs[s]["rollout/truncated"] for s in range(1, ONSET))),
    "entropy": (dict(trainer_cls=ColderTrainer, engine_logprob_gap_action="warn"), "entropy_collapse",
                lambda off, step: off.logs[step]["rollout/entropy"] < median_before(off, "rollout/entropy") / 10),
    "mismatch": (dict(trainer_cls=HotterTrainer, engine_logprob_gap_action="warn"), "mismatch_drift",
                 lambda off, step: off.logs[step]["train/mismatch_kl_k3"] > 0.05
                 > max(off.logs[s]["train/mismatch_kl_k3"] for s in range(1, ONSET))),
    "reward_source": (dict(kind="fail", reward_on_failure="drop"), "reward_sources",
                      lambda off, step: off.logs[step]["rollout/reward_source0_errors"] > 0
                      == off.logs[ONSET - 1]["rollout/reward_source0_errors"]),
    "grad_spike": (dict(kind="scale", advantage_estimator="rloo"), "grad_spike",
                   lambda off, step: off.logs[step]["train/actor_grad_norm"]
                   > 10 * median_before(off, "train/actor_grad_norm")),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_a_failing_run_goes_on_without_the_monitor_and_stops_with_it(task, tmp_path, name):
    flags, monitor, failed = SCENARIOS[name]
    logs, off = train(task, tmp_path / "off", **flags)
    assert isinstance(logs, dict) and len(off.logs) == flags.get("max_steps", 16) and off.events == []   # to the end
    status, on = train(task, tmp_path / "on", monitors=f"off,{monitor}=stop", **flags)
    assert status == EXIT_STATUS, status
    (event,) = on.events
    assert event["monitor"] == monitor and event["action"] == "stop"
    # Nothing before the failure began; the verdict at the end of the monitor's window from the
    # onset; no step after it; and what it saw is in the unmonitored run's logs at that step.
    assert event["onset"] >= ONSET and event["step"] == event["onset"] + MONITORS[monitor].window - 1, event
    assert max(on.logs) == event["step"] and failed(off, event["step"])
    text = report_of(tmp_path / "on", event["step"], monitor)
    assert f"| {event['step']} | " in text and f"onset: step {event['onset']}" in text


def test_a_learning_rate_spike_is_rolled_back_to_the_checkpoint_before_it(task, tmp_path):
    flags = dict(save_steps=1, save_hf_ckpt=True, max_ckpt_num=4, eval_data=task["eval"], eval_steps=1,
                 eval_remote_rm_url="math")
    logs, off = train(task, tmp_path / "off", recorder=Recorder(lr_spike_at=ONSET), **flags)
    assert off.logs[ONSET]["train/approx_kl"] > 0.5 > max(off.logs[s]["train/approx_kl"] for s in range(1, ONSET))

    status, stopped = train(task, tmp_path / "stop", recorder=Recorder(lr_spike_at=ONSET),
                            monitors="off,kl_runaway=stop", **flags)
    assert status == EXIT_STATUS and [(e["onset"], e["step"]) for e in stopped.events] == [(ONSET, ONSET)]
    report_of(tmp_path / "stop", ONSET, "kl_runaway")

    recorder = Recorder(lr_spike_at=ONSET)
    logs, recorder = train(task, tmp_path / "rollback", recorder=recorder, monitors="off,kl_runaway=rollback", **flags)
    (event,) = recorder.events
    assert event["action"] == "rollback" and event["restored_step"] == ONSET - 1
    # The actor's weights right after the restore are the step-5 checkpoint's, bit for bit.
    saved = load_file(tmp_path / "rollback" / "ckpt" / f"global_step{ONSET - 1}_hf" / "model.safetensors")
    restored = recorder.restored[0]
    assert saved and all(torch.equal(restored[name], saved[name]) for name in saved)
    # ...which are not the weights the spike made.
    spiked = load_file(tmp_path / "rollback" / "ckpt" / f"global_step{ONSET}_hf" / "model.safetensors")
    assert any(not torch.equal(restored[name], spiked[name]) for name in spiked)
    # The run goes on to its last step at half the learning rate, and ends no worse on held-out
    # prompts than the restored checkpoint was.
    assert len(recorder.logs) == 16 and logs["train/actor_lr"] == pytest.approx(0.5e-3)
    assert logs["eval/reward_greedy"] >= recorder.logs[ONSET - 1]["eval/reward_greedy"]


def test_reward_hacking_against_a_held_out_scorer(task, tmp_path):
    # From step ONSET the training reward pays for wrong answers (a scorer bug); the held-out scorer
    # is the math rule.
    flags = dict(kind="hack", eval_data=task["eval"], eval_steps=2, eval_remote_rm_url="math", max_steps=24,
                 num_episodes=2)
    logs, off = train(task, tmp_path / "off", **flags)
    held_out, reward = series(off, "eval/reward_greedy"), series(off, "rollout/reward")
    mean = lambda steps: sum(reward[s] for s in steps) / len(steps)      # noqa: E731
    assert min(v for s, v in held_out.items() if s > ONSET) < held_out[ONSET - 2] - 0.1        # held-out fell
    assert mean(range(21, 25)) > mean(range(ONSET, ONSET + 4)) + 0.1 and len(off.logs) == 24   # training rose
    status, on = train(task, tmp_path / "on", monitors="off,reward_hacking=stop", **flags)
    assert status == EXIT_STATUS
    (event,) = on.events
    # The verdict comes at the third evaluation of the fall; the first is the last healthy one,
    # at or after the evaluation before the hack began.
    assert event["monitor"] == "reward_hacking" and event["step"] - event["onset"] == 4, event
    assert event["onset"] >= ONSET - 2 and held_out[event["step"]] == event["value"]
    report_of(tmp_path / "on", event["step"], "reward_hacking")


def test_a_failure_that_outlives_its_rollbacks_stops_the_run(task, tmp_path):
    """A reward 100x too large from step ONSET on: each rollback restores a checkpoint from before
    the spike that followed (bit for bit), the spike comes back with the reward, and after
    --max_rollbacks 2 the third verdict stops the run."""
    out = tmp_path / "run"
    status, recorder = train(task, out, kind="scale", advantage_estimator="rloo", monitors="off,grad_spike=rollback",
                             save_steps=1, save_hf_ckpt=True, max_ckpt_num=4, max_steps=24, num_episodes=2)
    assert status == EXIT_STATUS
    assert [e["action"] for e in recorder.events] == ["rollback", "rollback", "stop"], recorder.events
    for event, restored in zip(recorder.events, recorder.restored):
        assert event["restored_step"] <= event["onset"] - 2          # a gradient describes the step before's weights
        saved = load_file(out / "ckpt" / f"global_step{event['restored_step']}_hf" / "model.safetensors")
        assert all(torch.equal(restored[name], saved[name]) for name in saved)
    assert recorder.logs[recorder.events[2]["step"]]["train/actor_lr"] == pytest.approx(0.25e-3)   # halved twice
    report_of(out, recorder.events[2]["step"], "grad_spike")
