"""Experience split/collate (padded and packed layouts) and dynamic-sampling group filtering."""

import torch

from lightrft.trainer.dynamic_sampling import (fill_to_size, filter_informative_groups, informative_groups,
                                               select_rows)
from lightrft.trainer.experience import Experience, collate_samples, split_experience

PAD = 0


def make_experience(rewards=(1.0, 0.0, 2.0)) -> Experience:
    # Three sequences: prompts [5, 6] / [7] / [8, 9] (left-padded to 2), responses of 3 / 1 / 2
    # real tokens right-padded to A = 3.
    sequences = torch.tensor([[5, 6, 11, 12, 13],
                              [PAD, 7, 21, PAD, PAD],
                              [8, 9, 31, 32, PAD]])
    attention_mask = (sequences != PAD).long()
    action_mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    logp = torch.tensor([[-0.1, -0.2, -0.3], [-0.4, 0.0, 0.0], [-0.5, -0.6, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [2.0, 0.0, 0.0], [3.0, 3.0, 0.0]])
    return Experience(sequences=sequences, attention_mask=attention_mask, action_mask=action_mask, num_actions=3,
                      packed_seq_lens=None, action_log_probs=logp, advantages=adv, returns=adv.clone(),
                      info={"reward": torch.tensor(rewards)})


def test_split_removes_padding_and_keeps_actions():
    samples = split_experience(make_experience())
    assert [s.sequence.tolist() for s in samples] == [[5, 6, 11, 12, 13], [7, 21], [8, 9, 31, 32]]
    assert [s.num_actions for s in samples] == [3, 1, 2]
    assert torch.equal(samples[2].per_action["action_log_probs"], torch.tensor([-0.5, -0.6]))
    assert samples[1].info["reward"].item() == 0.0


def test_padded_collate_rebuilds_the_original_layout():
    exp = make_experience()
    rebuilt = collate_samples(split_experience(exp), PAD, packing=False)
    assert torch.equal(rebuilt.sequences, exp.sequences)
    assert torch.equal(rebuilt.attention_mask, exp.attention_mask)
    assert torch.equal(rebuilt.action_mask, exp.action_mask)
    assert torch.equal(rebuilt.action_log_probs, exp.action_log_probs)
    assert rebuilt.num_actions == 3


def test_packed_collate_concatenates_real_tokens_and_shares_per_action_tensors():
    exp = make_experience()
    samples = split_experience(exp)
    packed = collate_samples(samples, PAD, packing=True)
    padded = collate_samples(samples, PAD, packing=False)
    assert packed.sequences.tolist() == [[5, 6, 11, 12, 13, 7, 21, 8, 9, 31, 32]]
    assert packed.packed_seq_lens == [5, 2, 4]
    assert packed.num_actions == [3, 1, 2]
    assert packed.attention_mask is None
    for name in ("action_mask", "action_log_probs", "advantages", "returns"):
        assert torch.equal(getattr(packed, name), getattr(padded, name)), name


def test_informative_groups_flags_groups_with_different_rewards():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])   # G = 2: groups (1,1) (0,1) (0,0)
    assert informative_groups(rewards, 2).tolist() == [False, True, False]


def test_filter_and_fill_keep_whole_groups_and_exact_size():
    exp = make_experience(rewards=(1.0, 0.0, 2.0))
    # Build a batch of 4 rows = 2 groups of G = 2: group 0 rewards (1, 1) equal, group 1 (0, 2).
    rows = torch.tensor([0, 0, 1, 2])
    four = select_rows(exp, rows)
    four.info["reward"] = torch.tensor([1.0, 1.0, 0.0, 2.0])
    kept, rest = filter_informative_groups([four], group_size=2)
    assert len(kept) == 1 and kept[0].info["reward"].tolist() == [0.0, 2.0]
    assert len(rest) == 1 and rest[0].info["reward"].tolist() == [1.0, 1.0]
    filled = fill_to_size(kept, rest, target=4, group_size=2)
    assert sum(e.batch_size for e in filled) == 4
    assert torch.cat([e.info["reward"] for e in filled]).tolist() == [0.0, 2.0, 1.0, 1.0]
    trimmed = fill_to_size(kept + kept, rest, target=2, group_size=2)
    assert sum(e.batch_size for e in trimmed) == 2
