"""The pieces compose into learning: a softmax policy over 5 answers to one prompt, trained with
G samples per step, an advantage estimator and a policy loss, puts its mass on the rewarded
answer."""

import pytest
import torch

from lightrft.algorithms.advantages import AdvantageInputs, get_advantage_estimator
from lightrft.algorithms.aggregation import aggregate_loss
from lightrft.algorithms.masked import masked_whiten
from lightrft.algorithms.policy_loss import PolicyLossConfig, get_policy_loss

REWARDS = torch.tensor([0.0, 0.2, 1.0, 0.0, 0.5])  # answer 2 is best


def train(estimator_name, loss_name, eps_low, eps_high, steps=60, G=8, epochs=2):
    gen = torch.Generator().manual_seed(0)
    logits = torch.zeros(5, requires_grad=True)
    optimizer = torch.optim.SGD([logits], lr=0.5)
    estimator = get_advantage_estimator(estimator_name)
    mask = torch.ones(G, 1, dtype=torch.bool)  # one action token per sample
    for _ in range(steps):
        with torch.no_grad():
            actions = torch.multinomial(torch.softmax(logits, -1), G, replacement=True, generator=gen)
            old_log_probs = torch.log_softmax(logits, -1)[actions][:, None]  # (G, 1)
        out = estimator.fn(AdvantageInputs(action_mask=mask, scores=REWARDS[actions], group_size=G))
        advantages = masked_whiten(out.advantages, mask) if estimator.normalize_globally else out.advantages
        for _ in range(epochs):  # the second epoch is off-policy: the ratio and clipping matter
            log_probs = torch.log_softmax(logits, -1)[actions][:, None]
            per_token, _ = get_policy_loss(loss_name)(
                log_probs, old_log_probs, advantages, mask,
                PolicyLossConfig(eps_clip_low=eps_low, eps_clip_high=eps_high),
            )
            optimizer.zero_grad()
            aggregate_loss(per_token, mask, "token-mean").backward()
            optimizer.step()
    return torch.softmax(logits.detach(), -1)


@pytest.mark.parametrize(
    "estimator_name, loss_name, eps_low, eps_high",
    [
        ("group_norm", "ppo", 0.2, 0.28),
        ("rloo", "ppo", 0.2, 0.2),
        ("dr_grpo", "cispo", 0.2, 0.28),
        ("reinforce_baseline", "gspo", 3e-2, 4e-2),
    ],
)
def test_policy_learns_the_rewarded_answer(estimator_name, loss_name, eps_low, eps_high):
    probs = train(estimator_name, loss_name, eps_low, eps_high)
    assert probs.argmax().item() == 2
    assert probs[2] > 0.9, probs
