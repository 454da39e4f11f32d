"""The replay buffer stores every response position with a per-token loss mask, so a response with
holes (tool output between two turns) keeps its advantages aligned, and whitens over the trained
tokens only."""

from types import SimpleNamespace

import torch

from lightrft.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, compute_advantages
from lightrft.algorithms.whitening import whiten
from lightrft.experience.samples import Experience
from lightrft.experience.replay_buffer import NaiveReplayBuffer

F64 = torch.float64
PAD = 0
GAMMA, LAMBD = 0.9, 0.8

# Row 0: a two-turn response; slot 2 is a tool token between the turns (attended, not trained).
# Row 1: a plain 3-token response, right-padded.
SEQUENCES = torch.tensor([[5, 6, 11, 12, 99, 13, 14],
                          [PAD, 7, 21, 22, 23, PAD, PAD]])
ACTION_MASK = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
ATTENTION = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0, 0]])
REWARDS = torch.tensor([[0.1, 0.0, 7.0, -0.2, 1.0], [0.0, 0.3, 0.5, 0.0, 0.0]], dtype=F64)   # 7.0 on the tool token
VALUES = torch.tensor([[0.5, 0.4, 9.0, 0.3, 0.2], [0.1, 0.6, 0.2, 0.0, 0.0]], dtype=F64)


def verl_masked_gae(rewards, values, mask, gamma, lam):
    """verl's multi-turn GAE: observation tokens carry the next value and advantage through
    unchanged. next_v <- V_t m_t + (1 - m_t) next_v; last <- (delta_t + gamma lam last) m_t + (1 - m_t) last."""
    mask = mask.to(rewards.dtype)
    next_v = torch.zeros(rewards.size(0), dtype=rewards.dtype)
    last = torch.zeros_like(next_v)
    out = []
    for t in reversed(range(rewards.size(1))):
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        candidate = delta + gamma * lam * last
        next_v = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_v
        last = candidate * mask[:, t] + (1 - mask[:, t]) * last
        out.append(last)
    advantages = torch.stack(out[::-1], dim=1)
    return advantages, advantages + values


def openrlhf_cumulative_returns(rewards, mask, gamma):
    """OpenRLHF's returns: G_t = m_t r_t + gamma G_{t+1} over every position."""
    running = torch.zeros(rewards.size(0), dtype=rewards.dtype)
    out = []
    for t in reversed(range(rewards.size(1))):
        running = rewards[:, t] * mask[:, t] + gamma * running
        out.append(running)
    return torch.stack(out[::-1], dim=1)


def test_gae_and_returns_across_a_hole_equal_the_peers_masked_forms():
    inp = AdvantageInputs(action_mask=ACTION_MASK, scores=torch.zeros(2, dtype=F64), token_rewards=REWARDS,
                          values=VALUES, gamma=GAMMA, lambd=LAMBD)
    ours = ADVANTAGE_ESTIMATORS["gae"].fn(inp)
    advantages, returns = verl_masked_gae(REWARDS, VALUES, ACTION_MASK, GAMMA, LAMBD)
    torch.testing.assert_close(ours.advantages[ACTION_MASK], advantages[ACTION_MASK])
    torch.testing.assert_close(ours.returns[ACTION_MASK], returns[ACTION_MASK])
    # REINFORCE++ returns (gamma = 1, where OpenRLHF's form also skips the hole's reward)
    plus = ADVANTAGE_ESTIMATORS["reinforce++"].fn(AdvantageInputs(action_mask=ACTION_MASK, scores=torch.zeros(2),
                                                                  token_rewards=REWARDS, gamma=1.0))
    torch.testing.assert_close(plus.advantages[ACTION_MASK],
                               openrlhf_cumulative_returns(REWARDS, ACTION_MASK.to(F64), 1.0)[ACTION_MASK])


def experience() -> Experience:
    out = compute_advantages(ADVANTAGE_ESTIMATORS["gae"],
                             AdvantageInputs(action_mask=ACTION_MASK, scores=torch.zeros(2, dtype=F64),
                                             token_rewards=REWARDS, values=VALUES, gamma=GAMMA, lambd=LAMBD))
    return Experience(sequences=SEQUENCES, attention_mask=ATTENTION, action_mask=ACTION_MASK, num_actions=5,
                      packed_seq_lens=None, action_log_probs=-torch.arange(1.0, 11.0).reshape(2, 5) * ACTION_MASK,
                      advantages=out.advantages, returns=out.returns, values=VALUES * ACTION_MASK,
                      info={"reward": torch.tensor([1.0, 0.0])})


def test_the_stored_sample_keeps_every_position_and_its_loss_mask():
    exp = experience()
    buffer = NaiveReplayBuffer(2, cpu_offload=False)
    buffer.append(exp)
    first = buffer[0]
    assert first.sequence.tolist() == [5, 6, 11, 12, 99, 13, 14] and first.num_actions == 5
    assert first.action_mask.tolist() == [True, True, False, True, True]
    # the advantage of the token after the hole sits at its own position, not shifted onto the hole
    assert torch.equal(first.per_action["advantages"], exp.advantages[0])
    assert buffer[1].num_actions == 3 and buffer[1].action_mask.tolist() == [True, True, True]
    for packing in (False, True):
        buffer.packing_samples = packing
        batch = buffer.collate_fn([buffer[0], buffer[1]])
        assert torch.equal(batch.action_mask, ACTION_MASK)
        for name in ("advantages", "returns", "values", "action_log_probs"):
            assert torch.equal(getattr(batch, name), getattr(exp, name)), name
        if packing:
            assert batch.packed_seq_lens == [7, 4] and batch.num_actions == [5, 3]
        else:   # the tool token is attended to: it is a real token of the sequence
            assert torch.equal(batch.sequences, SEQUENCES) and torch.equal(batch.attention_mask, ATTENTION)


def test_normalize_whitens_over_the_trained_tokens_only():
    exp = experience()
    buffer = NaiveReplayBuffer(2, cpu_offload=False)
    buffer.append(exp)
    strategy = SimpleNamespace(all_reduce=lambda tensor, op: tensor)     # one rank
    buffer.normalize("advantages", strategy)
    expected = whiten(exp.advantages, ACTION_MASK)
    torch.testing.assert_close(buffer[0].per_action["advantages"], expected[0])
    torch.testing.assert_close(buffer[1].per_action["advantages"], expected[1, :3])
    kept = torch.cat([buffer[0].per_action["advantages"][buffer[0].action_mask], buffer[1].per_action["advantages"]])
    assert abs(kept.mean().item()) < 1e-12 and abs(kept.var(unbiased=False).item() - 1) < 1e-6
    assert buffer[0].per_action["advantages"][2] == 0          # the tool token trains on nothing
