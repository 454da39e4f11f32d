"""One rank and two ranks take the same PPO steps: the same prompts draw the same samples (seeds
follow the prompt's global position, not the rank), and the loss normalised by global counts gives
the same update whether the batch sits on one rank in two micro-batches or on two ranks in one."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_torchrun
from tests.trainer.ppo_harness import flags, make_task, run

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_one_rank_and_two_ranks_take_the_same_steps(tmp_path, packing):
    """Packed: each micro-batch shares its prompts in one shared row, whose composition differs
    between one rank and two; the steps must not."""
    (tmp_path / "task").mkdir()
    task = make_task(tmp_path / "task")
    # A small learning rate keeps Adam's first steps (about lr x sign(grad)) away from sign flips of
    # gradients that are zero up to rounding, which would differ by 2 x lr between the runs.
    overrides = dict(actor_learning_rate=1e-4, max_steps=2, use_tensorboard=tmp_path / "tb",
                     **({"packing_samples": True} if packing else {}))
    one_logs, one = run(task, tmp_path / "one", **overrides)
    proc = run_torchrun(["lightrft.cli.train_ppo", *flags(task, tmp_path / "two", **overrides)], module=True)
    two_logs = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    two = load_file(str(tmp_path / "two" / "model" / "model.safetensors"))

    for key in ("rollout/reward", "rollout/response_length", "train/policy_loss"):
        assert two_logs[key] == pytest.approx(one_logs[key], abs=1e-4), key
    initial = load_file(str(task["model"] / "model.safetensors"))
    moved = max((one[k].float() - initial[k].float()).abs().max().item() for k in one)
    gap = max((one[k].float() - two[k].float()).abs().max().item() for k in one)
    assert moved > 1e-5                       # the steps changed the weights ...
    assert gap < 0.02 * moved, (gap, moved)   # ... and the two runs changed them alike
