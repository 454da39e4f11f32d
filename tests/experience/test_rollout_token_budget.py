"""--micro_rollout_max_tokens: the rollout-time forwards (actor, reference, teacher, critic) in
micro-batches of consecutive samples whose rows x columns stay within a token budget, each cut to
the columns its samples use. The chunks are the hand-computed ones, every rank runs as many as the
rank with the most, and the log-probs and values equal those of the plain micro-batches."""

from types import SimpleNamespace

import pytest
import torch

from lightrft.algorithms.kl import FixedKLController
from lightrft.config import ConfigError, PPORunConfig
from lightrft.experience.builder import ExperienceBuilder
from lightrft.models import ActorLanguage, Critic
from lightrft.rollout.base import RolloutOutput
from lightrft.utils.tiny import build_tiny_arch, save_tiny_arch, tiny_tokenizer

PROMPT_WIDTH, ACTIONS = 6, 8
PROMPT_LENS = [6, 2, 3, 2, 4, 2]       # left-padded to PROMPT_WIDTH: first columns 0, 4, 3, 4, 2, 4
RESPONSE_LENS = [8, 1, 2, 1, 3, 8]     # right-padded to ACTIONS: end columns 14, 7, 8, 7, 9, 14


def rollout(vocab: int = 40, seed: int = 0) -> RolloutOutput:
    g = torch.Generator().manual_seed(seed)
    rows = len(PROMPT_LENS)
    sequences = torch.randint(3, vocab, (rows, PROMPT_WIDTH + ACTIONS), generator=g)
    attention_mask = torch.zeros_like(sequences)
    action_mask = torch.zeros(rows, ACTIONS, dtype=torch.bool)
    for r, (p, a) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
        attention_mask[r, PROMPT_WIDTH - p:PROMPT_WIDTH + a] = 1
        action_mask[r, :a] = True
    sequences[attention_mask == 0] = 0
    return RolloutOutput(sequences=sequences, attention_mask=attention_mask, action_mask=action_mask,
                         rollout_log_probs=torch.zeros(rows, ACTIONS), prompt_len=PROMPT_WIDTH)


class OtherRank:
    """The strategy of one of two ranks, whose peer's forward runs `peer` micro-batches: its
    all-reduce (max) returns the larger count."""

    def __init__(self, peer: int):
        self.world_size, self.device, self.peer = 2, "cpu", peer

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        assert op == "max"
        return torch.maximum(tensor, torch.tensor([self.peer]))


def builder(model=None, critic=None, strategy=None, **options) -> ExperienceBuilder:
    return ExperienceBuilder(model, critic, None, FixedKLController(0.0), strategy or SimpleNamespace(device="cpu"),
                             **options)


def chunks(b: ExperienceBuilder) -> list[tuple[list[int], tuple[int, int]]]:
    return [(list(range(rows.start, rows.stop)), columns) for rows, columns in b.forward_chunks(rollout())]


def test_chunks_fill_the_budget_with_consecutive_samples_over_the_columns_they_use():
    # [0]: 1 x 14; [1, 2, 3]: 3 x (8 - 3) = 15; adding 4 would cost 4 x 7 = 28; [4, 5]: 2 x 12 = 24.
    assert chunks(builder(micro_rollout_batch_size=8, micro_rollout_max_tokens=20)) == [
        ([0], (0, 14)), ([1, 2, 3], (3, 8)), ([4], (2, 9)), ([5], (4, 14))]
    # At most --micro_rollout_batch_size samples: [3, 4] costs 2 x (9 - 2) = 14.
    assert chunks(builder(micro_rollout_batch_size=2, micro_rollout_max_tokens=20)) == [
        ([0], (0, 14)), ([1, 2], (3, 8)), ([3, 4], (2, 9)), ([5], (4, 14))]
    # A budget below any sample's columns: one sample each, still cut to its own columns.
    assert [c for _, c in chunks(builder(micro_rollout_max_tokens=1))] == [(0, 14), (4, 7), (3, 8), (4, 7),
                                                                          (2, 9), (4, 14)]
    # Without a budget: --micro_rollout_batch_size samples over every column, as before.
    assert chunks(builder(micro_rollout_batch_size=4)) == [([0, 1, 2, 3], (0, 14)), ([4, 5], (0, 14))]


def test_every_rank_runs_as_many_micro_batches_as_the_rank_with_the_most():
    options = {"micro_rollout_batch_size": 8, "micro_rollout_max_tokens": 20}
    # The peer has 6: the chunk with the most tokens among those of several samples is halved, in place.
    assert chunks(builder(strategy=OtherRank(peer=6), **options)) == [
        ([0], (0, 14)), ([1], (4, 7)), ([2], (3, 8)), ([3], (4, 7)), ([4], (2, 9)), ([5], (4, 14))]
    assert chunks(builder(strategy=OtherRank(peer=5), **options)) == [
        ([0], (0, 14)), ([1], (4, 7)), ([2, 3], (3, 8)), ([4], (2, 9)), ([5], (4, 14))]
    assert len(chunks(builder(strategy=OtherRank(peer=2), **options))) == 4     # fewer: its own
    with pytest.raises(RuntimeError, match="--micro_rollout_max_tokens: another rank runs 7 rollout micro-batches"):
        chunks(builder(strategy=OtherRank(peer=7), **options))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])      # rotary positions; learned absolute positions
def test_log_probs_equal_the_plain_micro_batches(arch):
    tokenizer = tiny_tokenizer(arch)
    actor = ActorLanguage(build_tiny_arch(arch, tokenizer, seed=1)).eval()
    batch = rollout(vocab=len(tokenizer))
    plain = builder(actor, micro_rollout_batch_size=4).forward(actor, batch)
    budget = builder(actor, micro_rollout_batch_size=8, micro_rollout_max_tokens=20)
    assert len(budget.forward_chunks(batch)) == 4
    cut = budget.forward(actor, batch)
    assert cut.shape == (6, ACTIONS) and bool((cut[batch.action_mask] != 0).all())
    torch.testing.assert_close(cut, plain, atol=1e-5, rtol=0)
    assert bool((cut[~batch.action_mask] == 0).all())


def test_critic_values_equal_the_plain_micro_batches(tmp_path):
    critic = Critic(save_tiny_arch(tmp_path / "qwen2", "qwen2", seed=1)).eval()
    batch = rollout(vocab=len(tiny_tokenizer("qwen2")))
    plain = builder(critic=critic, micro_rollout_batch_size=6).forward(critic, batch)
    cut = builder(critic=critic, micro_rollout_max_tokens=20).forward(critic, batch)
    torch.testing.assert_close(cut, plain, atol=1e-5, rtol=0)


def test_the_flag_reaches_the_config_and_refuses_zero():
    parser = PPORunConfig.build_parser("train_ppo")
    flags = ["--pretrain", "m", "--prompt_data", "p.jsonl", "--advantage_estimator", "group_norm",
             "--n_samples_per_prompt", "2", "--remote_rm_url", "math"]
    config = PPORunConfig.from_namespace(parser.parse_args([*flags, "--micro_rollout_max_tokens", "4096"]))
    assert config.rollout.micro_rollout_max_tokens == 4096
    with pytest.raises(ConfigError, match="micro_rollout_max_tokens"):
        PPORunConfig.from_namespace(parser.parse_args([*flags, "--micro_rollout_max_tokens", "0"]))


def test_train_ppo_with_a_rollout_token_budget_trains_as_without(tmp_path):
    """Through train_ppo's own wiring (ZeRO-2, two GRPO steps, a KL reference whose forward runs
    under the budget): the same weights and losses as the plain micro-batches."""
    from tests.trainer.ppo_harness import make_task, max_weight_change, run as run_ppo

    task = make_task(tmp_path)
    flags = dict(init_kl_coef=0.01, use_kl_loss=True, micro_rollout_batch_size=8)
    plain_logs, plain = run_ppo(task, tmp_path / "plain", **flags)
    budget_logs, budget = run_ppo(task, tmp_path / "budget", micro_rollout_max_tokens=24, **flags)
    assert max_weight_change(plain, budget) < 1e-5
    for key in ("train/policy_loss", "train/kl_loss", "rollout/kl"):
        assert budget_logs[key] == pytest.approx(plain_logs[key], rel=1e-4, abs=1e-6), key
