"""One rank and two ranks take the same PPO steps: the same prompts draw the same samples (seeds
follow the prompt's global position, not the rank), and the loss normalised by global counts gives
the same update whether the batch sits on one rank in two micro-batches or on two ranks in one."""

import json

import pytest
from safetensors.torch import load_file

from tests.conftest import run_torchrun_many
from lightrft.utils.tiny import save_tiny_arch
from tests.trainer.ppo_harness import flags, make_task, run

pytestmark = pytest.mark.dist


# "budget": packed micro-batches of at most 30 tokens (three 10-token samples, --micro_train_max_tokens):
# a step's 16 samples make 6 on one rank and 3 per rank on two, instead of 2 and 1; the accumulation
# boundary DeepSpeed steps at comes from the trainer.
# "moe_replay": a tiny Qwen3-MoE replaying the rollout's routes (--routing_replay rollout) in packed rows.
PACKING = {"padded": {}, "packed": {"packing_samples": True},
           "budget": {"packing_samples": True, "micro_train_max_tokens": 30},
           "moe_replay": {"packing_samples": True, "routing_replay": "rollout"}}


def overrides(root, packing: str, task: dict) -> dict:
    # A small learning rate keeps Adam's first steps (about lr x sign(grad)) away from sign flips of
    # gradients that are zero up to rounding, which would differ by 2 x lr between the runs.
    model = {"pretrain": task["moe"]} if packing == "moe_replay" else {}
    return dict(actor_learning_rate=1e-4, max_steps=2, use_tensorboard=root / packing / "tb", **model,
                **PACKING[packing])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The task, and the two-rank runs of both layouts in one torchrun launch (tests/e2e/run_many.py)."""
    root = tmp_path_factory.mktemp("rank_invariance")
    (root / "task").mkdir()
    task = make_task(root / "task")
    task["moe"] = save_tiny_arch(root / "task" / "moe", "qwen3_moe")
    outputs = run_torchrun_many([flags(task, root / packing / "two", **overrides(root, packing, task))
                                 for packing in PACKING], root)
    return task, root, dict(zip(PACKING, outputs))


@pytest.mark.parametrize("packing", list(PACKING))
def test_one_rank_and_two_ranks_take_the_same_steps(two_ranks, tmp_path, packing):
    """Packed: each micro-batch shares its prompts in one shared row, whose composition differs
    between one rank and two; the steps must not."""
    task, root, stdout = two_ranks
    one_logs, one = run(task, tmp_path / "one", **overrides(tmp_path, packing, task))
    two_logs = json.loads([line for line in stdout[packing].splitlines() if line.startswith("{")][-1])
    two = load_file(str(root / packing / "two" / "model" / "model.safetensors"))

    for key in ("rollout/reward", "rollout/response_length", "train/policy_loss"):
        assert two_logs[key] == pytest.approx(one_logs[key], abs=1e-4), key
    initial = load_file(str((task["moe"] if packing == "moe_replay" else task["model"]) / "model.safetensors"))
    moved = max((one[k].float() - initial[k].float()).abs().max().item() for k in one)
    gap = max((one[k].float() - two[k].float()).abs().max().item() for k in one)
    assert moved > 1e-5                       # the steps changed the weights ...
    assert gap < 0.02 * moved, (gap, moved)   # ... and the two runs changed them alike
