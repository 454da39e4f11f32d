"""The reward-source protocol and the result container."""

import torch

from lightrft.rewards import RemoteRewardClient, RewardResult, RewardSource, as_reward_result, make_reward_source


def test_every_builtin_kind_is_a_reward_source(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def reward_func(q, p, l):\n    return [0.0] * len(q)\n")
    for source in (make_reward_source("math"), make_reward_source(str(path)),
                   RemoteRewardClient("http://127.0.0.1:1/reward")):
        assert isinstance(source, RewardSource)


def test_as_reward_result():
    plain = as_reward_result(torch.tensor([1.0, 2.0]))
    assert plain.valid.tolist() == [True, True] and plain.rewards.tolist() == [1.0, 2.0]
    assert plain.num_dropped == 0
    mixed = RewardResult(torch.tensor([1.0, 0.0]), torch.tensor([True, False]))
    assert as_reward_result(mixed) is mixed and mixed.num_dropped == 1
