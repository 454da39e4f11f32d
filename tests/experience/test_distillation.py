"""On-policy distillation (`--teacher_pretrain`): the teacher's per-token signal on the student's
own samples, checked against formulas written here; the tokenizer a teacher must share; the
options that would drop the signal; a run without a task reward; and both forms training in a
real (in-process, one-rank) run with their distill/* metrics."""

import math
import re
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lightrft.algorithms.distill import distill_loss_per_token, distill_token_rewards
from lightrft.algorithms.kl import FixedKLController
from lightrft.cli.train_ppo import parse_args
from lightrft.experience.maker import ExperienceBuilder
from lightrft.experience.scorer import RewardBatch, Scorer
from lightrft.models import ActorLanguage
from lightrft.rollout.base import RolloutOutput
from lightrft.trainer.ppo_trainer import distill_metrics
from lightrft.utils.tiny import build_char_tokenizer, save_tiny_model
from tests.trainer.ppo_harness import flags, make_task, max_weight_change, run


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The one-rank harness task (an untrained tiny student) and a teacher of another seed."""
    root = tmp_path_factory.mktemp("distill")
    task = make_task(root)
    task["teacher"] = save_tiny_model(root / "teacher", seed=7)
    return task


# ------------------------------------------------------------------------ the per-token signal
def test_the_signal_is_the_teacher_minus_the_student_log_prob_per_token():
    student = torch.tensor([[-1.0, -2.0, -0.5, -4.0], [-0.1, -30.0, -1.0, -1.0]])
    teacher = torch.tensor([[-0.5, -3.0, -0.5, -9.0], [-0.3, -1.0, -2.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    # 0.5 x (teacher - student), by hand; the padding slot is 0, d = -29 is bounded to -10.
    expected = torch.tensor([[0.25, -0.5, 0.0, 0.0], [-0.1, 5.0, -0.5, 0.0]])
    torch.testing.assert_close(distill_token_rewards(student, teacher, mask, coef=0.5), expected)
    # The loss form: (student - teacher)^2 / 2 on the current log-probs, gradient (student - teacher).
    log_probs = student[:1, :3].clone().requires_grad_(True)
    loss = distill_loss_per_token(log_probs, teacher[:1, :3], None)
    torch.testing.assert_close(loss.detach(), torch.tensor([[0.125, 0.5, 0.0]]))
    loss.sum().backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-0.5, 1.0, 0.0]]))


def sampled_log_probs(path, sequences: torch.Tensor, attention_mask: torch.Tensor, a: int) -> torch.Tensor:
    """log p(y_t | y_<t) of the last `a` tokens of each row, from the Hugging Face model alone.
    Shape: (B, A)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=sequences, attention_mask=attention_mask, position_ids=positions).logits
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, sequences[:, 1:, None])[..., 0]
    return log_probs[:, -a:]


def rollout_of(tokenizer, prompts: list[str], responses: list[str]) -> RolloutOutput:
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    return RolloutOutput.from_token_lists([enc(p) for p in prompts], [enc(r) + [tokenizer.eos_token_id]
                                                                     for r in responses],
                                          [[0.0] * (len(r) + 1) for r in responses], tokenizer.pad_token_id,
                                          [tokenizer.eos_token_id])


@pytest.mark.parametrize("mode", ["reward", "loss"])
def test_the_builder_puts_the_teachers_signal_in_the_rewards_before_the_returns(task, mode):
    tokenizer = build_char_tokenizer()
    rollout = rollout_of(tokenizer, ["3+4=", "12+5="], ["7", "170"])
    mask = rollout.action_mask.float()
    a = mask.size(1)
    student = sampled_log_probs(task["model"], rollout.sequences, rollout.attention_mask, a) * mask
    teacher = sampled_log_probs(task["teacher"], rollout.sequences, rollout.attention_mask, a) * mask
    builder = ExperienceBuilder(ActorLanguage(str(task["model"])), None, None, FixedKLController(0.0),
                                SimpleNamespace(device="cpu"), advantage_estimator="reinforce",
                                teacher=ActorLanguage(str(task["teacher"])), distill_coef=0.5, distill_mode=mode)
    scores = torch.tensor([1.0, 0.0])
    exp = builder.experience_from_rollout(rollout, RewardBatch(scores=scores, valid=torch.ones(2, dtype=torch.bool)),
                                          n=1)[0]
    torch.testing.assert_close(exp.teacher_log_probs, teacher, atol=1e-5, rtol=0)
    torch.testing.assert_close(exp.action_log_probs, student, atol=1e-5, rtol=0)
    # reinforce, gamma 1: A_t = sum_{s >= t} r_s, r_s = 0.5 (teacher - student) (reward form only)
    # plus the score on the last response token.
    rewards = torch.zeros_like(mask)
    for row, length in enumerate(mask.sum(1).long().tolist()):
        rewards[row, length - 1] = scores[row]
        if mode == "reward":
            for t in range(length):
                rewards[row, t] += 0.5 * (teacher[row, t] - student[row, t])
    expected = torch.stack([torch.tensor([rewards[r, t:].sum() for t in range(a)]) for r in range(2)]) * mask
    torch.testing.assert_close(exp.advantages, expected, atol=1e-5, rtol=0)
    # The distill/* metrics: per-token means over both samples' 2 + 4 response tokens.
    step = {f"rollout/{k}": float(v.mean()) for k, v in exp.info.items() if k.startswith("distill_")}
    logs = distill_metrics(step)
    assert logs["distill/reverse_kl"] == pytest.approx(float(((student - teacher) * mask).sum() / 6), abs=1e-5)
    assert logs["distill/teacher_logprob"] == pytest.approx(float(teacher.sum() / 6), abs=1e-5)
    assert logs["distill/student_logprob"] == pytest.approx(float(student.sum() / 6), abs=1e-5)
    assert not [k for k in logs if k.startswith("rollout/distill")]


# ----------------------------------------------------------------- refusals and the no-reward case
def test_a_teacher_with_another_tokenizer_is_refused_naming_the_flag_and_the_difference(task, tmp_path):
    from lightrft.builders.ppo_run import check_teacher

    other = save_tiny_model(tmp_path / "other", seed=7)
    tokenizer = build_char_tokenizer()
    vocab = tokenizer.get_vocab()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    tokenizer.save_pretrained(other)
    model = parse_args(flags(task, tmp_path, teacher_pretrain=other, advantage_estimator="reinforce")).model
    with pytest.raises(ValueError, match=f"--teacher_pretrain {other}: the teacher must share") as err:
        check_teacher(model)
    assert "100 tokens, the teacher's 101" in str(err.value) and "'<|im_end|>'" in str(err.value)
    assert len(vocab) == 100
    with pytest.raises(ValueError, match="--teacher_pretrain .*no tokenizer could be loaded"):
        check_teacher(parse_args(flags(task, tmp_path, teacher_pretrain=tmp_path / "missing",
                                       advantage_estimator="reinforce")).model)
    check_teacher(parse_args(flags(task, tmp_path, teacher_pretrain=task["teacher"],
                                   advantage_estimator="reinforce")).model)      # same tokenizer: accepted


@pytest.mark.parametrize("overrides, message", [
    # GRPO's estimator reads one score per sample: the per-token reward would be dropped.
    (dict(teacher_pretrain="TEACHER"), "--teacher_pretrain with --distill_mode reward gives a reward per token, "
                                       "but --advantage_estimator group_norm reads one score per sample"),
    (dict(distill_coef=0.5), "--distill_coef set without --teacher_pretrain"),
    (dict(teacher_pretrain="TEACHER", distill_mode="loss", distill_coef=0), "--distill_coef must be positive"),
    (dict(remote_rm_url=None), "no reward source: .*--teacher_pretrain"),
])
def test_options_that_would_drop_the_signal_are_refused_naming_the_flags(task, tmp_path, capsys, overrides, message):
    overrides = {k: task["teacher"] if v == "TEACHER" else v for k, v in overrides.items()}
    with pytest.raises(SystemExit):
        parse_args(flags(task, tmp_path, **overrides))
    assert re.search(message, capsys.readouterr().err)


def test_a_teacher_alone_is_a_reward_source(task, tmp_path):
    # A teacher alone is enough; GRPO takes it as a loss.
    config = parse_args(flags(task, tmp_path, remote_rm_url=None, teacher_pretrain=task["teacher"],
                              distill_mode="loss"))
    assert config.algorithm.distill_mode == "loss" and config.rewards.remote_rm_url is None


def test_without_a_task_reward_the_scorer_scores_zero_only_when_a_teacher_is_given():
    tokenizer = build_char_tokenizer()
    with pytest.raises(ValueError, match="no reward: .*--teacher_pretrain"):
        Scorer(tokenizer)
    rollout = rollout_of(tokenizer, ["1+1="], ["2"])
    batch = Scorer(tokenizer, task_reward_optional=True).score(rollout, ["1+1="], ["2"], 1)
    assert batch.scores.tolist() == [0.0] and batch.valid.tolist() == [True]


# ------------------------------------------------------------------------ both forms in a real run
@pytest.mark.parametrize("mode, estimator", [("reward", "reinforce"), ("loss", "group_norm")])
def test_a_run_with_only_a_teacher_trains_and_logs_the_distill_metrics(task, tmp_path, mode, estimator):
    common = dict(remote_rm_url=None, advantage_estimator=estimator, teacher_pretrain=task["teacher"],
                  distill_mode=mode, max_steps=1)
    logs, weights = run(task, tmp_path / "teacher", **common)
    for name in ("distill/reverse_kl", "distill/teacher_logprob", "distill/student_logprob"):
        assert math.isfinite(logs[name]), (name, logs)
    # Two unrelated random (near-uniform) models: the student's own tokens are a little likelier
    # under itself (measured 0.017 nats per token).
    assert logs["distill/reverse_kl"] > 0.005
    assert logs["distill/reverse_kl"] == pytest.approx(
        logs["distill/student_logprob"] - logs["distill/teacher_logprob"], abs=1e-4)
    assert logs["rollout/reward"] == 0.0
    if mode == "loss":
        assert logs["train/distill_loss"] > 0
    # The signal moves the weights: a zero-learning-rate control leaves them where they started.
    _, unchanged = run(task, tmp_path / "still", actor_learning_rate=0.0, **common)
    assert max_weight_change(weights, unchanged) > 1e-4


# ------------------------------------------------------------------------------------ the doctor
def doctor(task, tmp_path, **overrides):
    import os

    from lightrft.cli.doctor import run_doctor
    from tests.trainer.ppo_harness import LAUNCH_ENV

    argv = flags(task, tmp_path / "user_run", remote_rm_url=None, advantage_estimator="reinforce",
                 **overrides) + ["--doctor_checks", "rewards", "--doctor_reward_calls", "1"]
    for key in LAUNCH_ENV:
        os.environ.pop(key, None)
    try:
        return run_doctor(argv)
    finally:
        for key in LAUNCH_ENV:
            os.environ.pop(key, None)


def test_the_doctors_reward_check_loads_the_teacher_and_reports_its_signal(task, tmp_path):
    report = doctor(task, tmp_path, teacher_pretrain=task["teacher"], distill_coef=0.5)
    rewards = report.check("rewards")
    assert rewards.status == "PASS" and report.exit_code == 0
    figures = rewards.figures["teacher"]
    assert figures["tokens"] > 0 and figures["finite"]
    assert figures["reverse_kl"] == pytest.approx(figures["student_logprob"] - figures["teacher_logprob"], abs=1e-5)
    assert figures["reward_mean"] == pytest.approx(-0.5 * figures["reverse_kl"], abs=1e-5)   # no d past the clamp
    assert any(str(task["teacher"]) in f.text and "nats per token" in f.text for f in rewards.findings)

    other = save_tiny_model(tmp_path / "other", seed=7)
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    tokenizer.save_pretrained(other)
    refused = doctor(task, tmp_path, teacher_pretrain=other)
    assert refused.exit_code == 1
    build = refused.check("build")
    assert build.status == "FAIL" and f"--teacher_pretrain {other}: the teacher must share" in build.findings[0].text


def test_the_teacher_options_come_alike_from_flags_a_yaml_file_and_the_typed_config(task, tmp_path):
    from lightrft.config import AlgorithmConfig, PPODataConfig, PPOModelConfig, PPORunConfig, RewardConfig

    yaml_file = tmp_path / "distill.yaml"
    yaml_file.write_text(f"model:\n  teacher_pretrain: {task['teacher']}\n"
                         "algorithm:\n  advantage_estimator: reinforce\n  distill_coef: 0.5\n  distill_mode: loss\n")
    from_yaml = parse_args(flags(task, tmp_path, remote_rm_url=None, advantage_estimator=None) +
                           ["--config", str(yaml_file)])
    from_flags = parse_args(flags(task, tmp_path, remote_rm_url=None, advantage_estimator="reinforce",
                                  teacher_pretrain=task["teacher"], distill_coef=0.5, distill_mode="loss"))
    typed = PPORunConfig(model=PPOModelConfig(pretrain=str(task["model"]), teacher_pretrain=str(task["teacher"])),
                         algorithm=AlgorithmConfig(advantage_estimator="reinforce", distill_coef=0.5,
                                                   distill_mode="loss"),
                         data=PPODataConfig(prompt_data=str(task["train"])), rewards=RewardConfig())
    for config in (from_yaml, from_flags, typed):
        assert (config.model.teacher_pretrain, config.algorithm.distill_coef, config.algorithm.distill_mode) == (
            str(task["teacher"]), 0.5, "loss")
    assert from_yaml.to_dict() == from_flags.to_dict()


def test_a_reward_model_or_a_short_context_teacher_is_refused(task, tmp_path):
    """A reward model folder as teacher would distil from a random LM head; a teacher whose context
    is shorter than prompt + response either fails mid-run or scores out of range. Both are refused
    before any weight loads, naming the flag and the fix."""
    from lightrft.builders.ppo_run import check_teacher
    from lightrft.models import RewardModel

    reward_folder = tmp_path / "rm"
    rm = RewardModel(str(task["teacher"]), init_value_head=True)
    rm.model.save_pretrained(reward_folder)
    build_char_tokenizer().save_pretrained(reward_folder)
    model = parse_args(flags(task, tmp_path, teacher_pretrain=reward_folder, advantage_estimator="reinforce")).model
    with pytest.raises(ValueError, match=f"--teacher_pretrain {reward_folder} is a reward model folder"):
        check_teacher(model, 64)

    teacher = parse_args(flags(task, tmp_path, teacher_pretrain=task["teacher"], advantage_estimator="reinforce"))
    context = AutoConfig.from_pretrained(task["teacher"]).max_position_embeddings
    check_teacher(teacher.model, context)                                   # exactly its context: accepted
    with pytest.raises(ValueError, match=f"takes {context} positions .* up to {context + 1} tokens"):
        check_teacher(teacher.model, context + 1)
