"""Experience split/collate (padded and packed layouts) and dynamic-sampling group filtering."""

from dataclasses import fields

import torch
import torch.nn.functional as F

from lightrft.experience.dynamic_sampling import fill_to_size, filter_informative_groups, informative_groups
from lightrft.experience.samples import (PER_ACTION_FIELDS, Experience, Sample, collate_samples,
                                         split_experience)

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


# The per-row split and collate the vectorised ones replaced, kept here as the reference.
def reference_split(exp: Experience) -> list[Sample]:
    samples, width = [], exp.action_mask.size(1)
    for i in range(exp.batch_size):
        # keep the response up to its last attended or trained slot, holes in the loss mask included
        occupied = (exp.action_mask[i] | exp.attention_mask[i, -width:].bool()).tolist()
        a_i = max((t + 1 for t, o in enumerate(occupied) if o), default=0)
        prompt = exp.sequences[i, :-width][exp.attention_mask[i, :-width].bool()]
        per_action = {name: getattr(exp, name)[i, :a_i] for name in PER_ACTION_FIELDS if getattr(exp, name) is not None}
        samples.append(Sample(sequence=torch.cat([prompt, exp.sequences[i, -width:][:a_i]]), num_actions=a_i,
                              action_mask=exp.action_mask[i, :a_i], per_action=per_action,
                              info={k: v[i] for k, v in exp.info.items()}))
    return samples


def reference_collate(samples: list[Sample], pad: int, packing: bool) -> Experience:
    def pad_rows(rows, length, value=0.0):
        return torch.stack([F.pad(r, (0, length - r.numel()), value=value) for r in rows])
    num_actions = [s.num_actions for s in samples]
    width = max(max(num_actions), 1)
    slots = pad_rows([torch.ones(a, dtype=torch.bool) for a in num_actions], width, False)
    action_mask = pad_rows([s.action_mask for s in samples], width, False)
    per_action = {name: pad_rows([s.per_action[name] for s in samples], width)
                  for name in PER_ACTION_FIELDS if name in samples[0].per_action}
    per_action.setdefault("action_log_probs", None)
    info = {k: torch.stack([s.info[k] for s in samples]) for k in samples[0].info}
    prompts = [s.sequence[: s.sequence.numel() - s.num_actions] for s in samples]
    if packing:
        # Each sample's group: the first sample with an equal prompt.
        groups = [next(j for j in range(i + 1) if torch.equal(prompts[j], prompts[i])) for i in range(len(samples))]
        return Experience(sequences=torch.cat([s.sequence for s in samples]).unsqueeze(0), attention_mask=None,
                          action_mask=action_mask, num_actions=num_actions,
                          packed_seq_lens=[s.sequence.numel() for s in samples], info=info, prompt_groups=groups,
                          **per_action)
    responses = [s.sequence[s.sequence.numel() - s.num_actions:] for s in samples]
    prompt_width = max(p.numel() for p in prompts)
    left = torch.stack([F.pad(p, (prompt_width - p.numel(), 0), value=pad) for p in prompts])
    prompt_mask = torch.stack([F.pad(torch.ones_like(p), (prompt_width - p.numel(), 0)) for p in prompts])
    return Experience(sequences=torch.cat([left, pad_rows(responses, width, pad)], dim=1),
                      attention_mask=torch.cat([prompt_mask, slots.long()], dim=1), action_mask=action_mask,
                      num_actions=width, packed_seq_lens=None, info=info, **per_action)


def random_experience(gen: torch.Generator, batch: int, prompt_width: int, width: int) -> Experience:
    """Left-padded prompts (some of full width), right-padded responses (some empty, some full),
    the action slots past a response holding junk, and an action mask with holes."""
    prompt_lens = torch.randint(1, prompt_width + 1, (batch,), generator=gen)
    prompt_lens[0] = prompt_width
    response_lens = torch.randint(0, width + 1, (batch,), generator=gen)
    response_lens[1] = width
    slots = torch.arange(prompt_width + width) - prompt_width
    real = (slots >= -prompt_lens.unsqueeze(1)) & (slots < response_lens.unsqueeze(1))
    sequences = torch.where(real, torch.randint(1, 50, real.shape, generator=gen), PAD)
    action_mask = torch.arange(width) < response_lens.unsqueeze(1)
    if response_lens[2] > 1:
        action_mask[2, 0] = False          # a hole: the split keeps the slot, out of the loss mask
    per_action = {name: torch.randn(batch, width, generator=gen) for name in ("action_log_probs", "advantages",
                                                                               "returns", "kl")}
    attention_mask = torch.cat([real[:, :prompt_width].long(), action_mask.long()], dim=1)
    return Experience(sequences=sequences, attention_mask=attention_mask,
                      action_mask=action_mask, num_actions=width, packed_seq_lens=None,
                      info={"reward": torch.randn(batch, generator=gen), "valid": torch.ones(batch)}, **per_action)


def assert_same_experience(got: Experience, want: Experience) -> None:
    for f in fields(Experience):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if f.name == "info":
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f.name
        elif isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), f.name
        else:
            assert a == b, f.name


def test_vectorised_split_and_collate_equal_the_per_row_reference():
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        exp = random_experience(gen, batch=int(torch.randint(3, 12, (1,), generator=gen)),
                                prompt_width=int(torch.randint(1, 6, (1,), generator=gen)),
                                width=int(torch.randint(1, 5, (1,), generator=gen)))
        got, want = split_experience(exp), reference_split(exp)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert torch.equal(g.sequence, w.sequence) and g.num_actions == w.num_actions
            assert g.per_action.keys() == w.per_action.keys()
            assert all(torch.equal(g.per_action[k], w.per_action[k]) for k in g.per_action)
            assert all(torch.equal(g.info[k], w.info[k]) for k in w.info)
        # A micro-batch mixing rows of this experience in another order, packed and padded.
        order = torch.randperm(len(want), generator=gen).tolist()
        rows = [want[i] for i in order]
        for packing in (False, True):
            assert_same_experience(collate_samples(rows, PAD, packing), reference_collate(rows, PAD, packing))


def test_informative_groups_flags_groups_with_different_rewards():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])   # G = 2: groups (1,1) (0,1) (0,0)
    assert informative_groups(rewards, 2).tolist() == [False, True, False]


def test_filter_and_fill_keep_whole_groups_and_exact_size():
    exp = make_experience(rewards=(1.0, 0.0, 2.0))
    # Build a batch of 4 rows = 2 groups of G = 2: group 0 rewards (1, 1) equal, group 1 (0, 2).
    rows = torch.tensor([0, 0, 1, 2])
    four = exp.select(rows)
    four.info["reward"] = torch.tensor([1.0, 1.0, 0.0, 2.0])
    kept, rest = filter_informative_groups([four], group_size=2)
    assert len(kept) == 1 and kept[0].info["reward"].tolist() == [0.0, 2.0]
    assert len(rest) == 1 and rest[0].info["reward"].tolist() == [1.0, 1.0]
    filled = fill_to_size(kept, rest, target=4, group_size=2)
    assert sum(e.batch_size for e in filled) == 4
    assert torch.cat([e.info["reward"] for e in filled]).tolist() == [0.0, 2.0, 1.0, 1.0]
    trimmed = fill_to_size(kept + kept, rest, target=2, group_size=2)
    assert sum(e.batch_size for e in trimmed) == 2
