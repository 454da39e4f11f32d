"""--micro_train_max_tokens: packed update micro-batches cut by tokens instead of samples. The
optimizer steps keep their samples, so the update and the logged loss must not change."""

import pytest
from safetensors.torch import load_file

from lightrft.trainer.ppo_trainer import PPOTrainer
from tests.trainer.ppo_harness import make_task, max_weight_change, run


class CountingTrainer(PPOTrainer):
    """Counts the update's micro-batches and the samples they train on."""

    micro_batches, samples = 0, 0

    def training_step(self, experience, global_steps, counts):
        type(self).micro_batches += 1
        type(self).samples += len(experience.num_actions)
        return super().training_step(experience, global_steps, counts)


def counted(name: str):
    return type(name, (CountingTrainer,), {})


def test_a_token_budget_changes_the_micro_batches_and_not_the_update(tmp_path):
    task = make_task(tmp_path)
    # Two rollouts of 16 samples of 10 tokens, two optimizer steps of 8 each (the second
    # off-policy, so its loss is not 0), two micro-batches of 4 per step without a budget; 30
    # tokens hold three samples, so a step's 8 make three micro-batches: 3, 3 and 2.
    plain_cls, budget_cls = counted("Plain"), counted("Budget")
    # Adam's first steps move every weight by about the learning rate whatever its gradient's size,
    # so float32 rounding of a near-zero gradient shows at lr scale: a small lr keeps that below 1e-6.
    common = dict(packing_samples=True, train_batch_size=8, micro_train_batch_size=4, actor_learning_rate=1e-5)
    plain_logs, plain = run(task, tmp_path / "plain", trainer_cls=plain_cls, **common)
    budget_logs, budget = run(task, tmp_path / "budget", trainer_cls=budget_cls, micro_train_max_tokens=30, **common)
    loss = plain_logs["train/policy_loss"]        # about -1e-6 at this lr, the sum of near-cancelling terms
    assert abs(loss) > 1e-7 and budget_logs["train/policy_loss"] == pytest.approx(loss, rel=0, abs=1e-7)
    initial = load_file(str(task["model"] / "model.safetensors"))
    assert max_weight_change(initial, plain) > 1e-5
    assert max_weight_change(plain, budget) < 1e-6
    assert plain_cls.micro_batches == 8 and budget_cls.micro_batches == 12
    assert plain_cls.samples == budget_cls.samples == 32
