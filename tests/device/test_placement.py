"""Device placement by construction: a rollout that arrives on another device than the one
experience is made on (an engine's output on a GPU) crosses into the trainer at one seam, and the
run computes exactly what it computes when everything is on one device (tests/device/elsewhere.py
makes "another device" on a CPU)."""

import dataclasses

import pytest
import torch
from transformers import AutoTokenizer

from lightrft.models import RewardModel
from lightrft.rollout.hf_engine import HFEngine
from tests.device.elsewhere import elsewhere
from tests.trainer.ppo_harness import make_task, run


def engine_output_elsewhere(monkeypatch):
    """Makes HFEngine return its rollouts on "another device"."""
    generate = HFEngine.generate

    def generate_elsewhere(self, *args, **kwargs):
        out = generate(self, *args, **kwargs)
        return dataclasses.replace(out, **{f.name: elsewhere(getattr(out, f.name)) for f in dataclasses.fields(out)
                                           if isinstance(getattr(out, f.name), torch.Tensor)})

    monkeypatch.setattr(HFEngine, "generate", generate_elsewhere)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("task")
    task = make_task(root)
    reward_model = RewardModel(task["model"], init_value_head=True)
    with torch.no_grad():
        reward_model.model.score.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
    reward_model.save_pretrained(root / "rm", tokenizer=AutoTokenizer.from_pretrained(task["model"]))
    return {**task, "rm": root / "rm"}


CASES = {
    "grpo padded": {},
    "grpo packed": {"packing_samples": True},
    "ppo critic, kl, overlong": {"advantage_estimator": "gae", "critic_pretrain": "actor", "init_kl_coef": 0.05,
                                 "n_samples_per_prompt": 1, "rollout_batch_size": 16, "overlong_buffer_len": 2},
    "reward model and distillation teacher": {"reward_pretrain": "rm", "teacher_pretrain": "actor",
                                              "distill_mode": "loss", "packing_samples": True},
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_rollout_on_another_device_trains_exactly_like_one_on_the_trainer_device(task, tmp_path, monkeypatch, case):
    # "actor": the actor's folder (a critic or teacher starts from it); "rm": a reward model of its shape.
    folders = {"actor": task["model"], "rm": task["rm"]}
    overrides = {key: folders.get(value, value) if isinstance(value, str) else value
                 for key, value in CASES[case].items()}
    logs, weights = run(task, tmp_path / "here", **overrides)
    engine_output_elsewhere(monkeypatch)
    logs_elsewhere, weights_elsewhere = run(task, tmp_path / "elsewhere", **overrides)
    timings = {k for k in logs if k.startswith("perf/")}
    assert {k: v for k, v in logs_elsewhere.items() if k not in timings} == {k: v for k, v in logs.items()
                                                                            if k not in timings}
    assert weights.keys() == weights_elsewhere.keys()
    assert all(torch.equal(weights[k], weights_elsewhere[k]) for k in weights)
