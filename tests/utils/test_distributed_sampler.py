"""DistributedSampler: disjoint covering slices, deterministic shuffles, exact resume."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightrft.utils.distributed_sampler import DistributedSampler


def slices(n, world, epoch=0, consumed=0, **kwargs):
    samplers = [DistributedSampler(range(n), num_replicas=world, rank=r, **kwargs) for r in range(world)]
    for sampler in samplers:
        sampler.set_epoch(epoch, consumed_samples=consumed)
    return [list(s) for s in samplers], samplers


def interleave(per_rank):
    """Global order: position k is rank k % R's (k // R)-th sample."""
    return [per_rank[k % len(per_rank)][k // len(per_rank)] for k in range(sum(map(len, per_rank)))]


@given(n=st.integers(1, 60), world=st.integers(1, 5), seed=st.integers(0, 3), epoch=st.integers(0, 3),
       shuffle=st.booleans())
@settings(max_examples=60, deadline=None)
def test_slices_are_disjoint_and_cover_with_drop_last(n, world, seed, epoch, shuffle):
    per_rank, samplers = slices(n, world, epoch, seed=seed, shuffle=shuffle, drop_last=True)
    flat = [i for part in per_rank for i in part]
    assert len(flat) == len(set(flat)) == (n // world) * world
    assert all(len(part) == len(s) == n // world for part, s in zip(per_rank, samplers))
    assert set(flat) <= set(range(n))


@given(n=st.integers(1, 60), world=st.integers(1, 5), seed=st.integers(0, 3))
@settings(max_examples=60, deadline=None)
def test_without_drop_last_every_sample_is_read_and_padding_repeats(n, world, seed):
    per_rank, _ = slices(n, world, seed=seed, shuffle=True, drop_last=False)
    flat = [i for part in per_rank for i in part]
    per = -(-n // world)  # ceil(n / world)
    assert all(len(part) == per for part in per_rank)
    assert set(flat) == set(range(n))
    assert len(flat) - len(set(flat)) == per * world - n


def test_known_order_without_shuffle():
    per_rank, _ = slices(10, 3, shuffle=False, drop_last=False)
    # order 0..9 padded to 12 with 0, 1; rank r reads positions r, r+3, r+6, r+9.
    assert per_rank == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]


def test_shuffle_is_deterministic_by_seed_and_epoch():
    first, _ = slices(20, 2, epoch=1, seed=3)
    again, _ = slices(20, 2, epoch=1, seed=3)
    other_epoch, _ = slices(20, 2, epoch=2, seed=3)
    other_seed, _ = slices(20, 2, epoch=1, seed=4)
    assert first == again
    assert first != other_epoch and first != other_seed
    # The order is torch.randperm(20) from a generator seeded with seed + epoch = 4.
    expected = torch.randperm(20, generator=torch.Generator().manual_seed(4)).tolist()
    assert interleave(first) == expected


@given(n=st.integers(1, 50), world=st.integers(1, 4), steps=st.integers(0, 12), seed=st.integers(0, 5))
@settings(max_examples=80, deadline=None)
def test_resume_gives_exactly_the_remaining_indices(n, world, steps, seed):
    full, _ = slices(n, world, epoch=2, seed=seed, drop_last=True)
    order = interleave(full)
    consumed = min(steps * world, len(order))
    resumed, samplers = slices(n, world, epoch=2, consumed=consumed, seed=seed, drop_last=True)
    assert interleave(resumed) == order[consumed:]
    assert [len(s) for s in samplers] == [len(part) for part in resumed]


def test_consumed_samples_in_constructor_applies_to_first_epoch():
    sampler = DistributedSampler(range(8), num_replicas=2, rank=1, seed=0, consumed_samples=4)
    whole = DistributedSampler(range(8), num_replicas=2, rank=1, seed=0)
    assert list(sampler) == list(whole)[2:]
    sampler.set_epoch(1)
    whole.set_epoch(1)
    assert list(sampler) == list(whole)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="consumed_samples=3 must be a non-negative multiple of the number of ranks"):
        DistributedSampler(range(10), num_replicas=2, rank=0, consumed_samples=3)
    with pytest.raises(ValueError, match="exceeds the 10 samples of one epoch"):
        DistributedSampler(range(10), num_replicas=2, rank=0).set_epoch(0, consumed_samples=12)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        DistributedSampler(range(10), num_replicas=2, rank=2)


def test_defaults_without_process_group_are_rank_0_of_1():
    sampler = DistributedSampler(range(5), shuffle=False)
    assert (sampler.rank, sampler.num_replicas, list(sampler)) == (0, 1, [0, 1, 2, 3, 4])
