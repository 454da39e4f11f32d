"""Dynamic sampling (DAPO, arXiv 2503.14476 sec. 3.2): keep only groups whose rewards differ.

A group of G samples with identical rewards has zero group-relative advantage, so it adds no
policy gradient but still dilutes token-mean losses. The trainer drops such groups and draws more
prompts until the batch is full again (or a round limit is hit).
"""

from dataclasses import replace

import torch

from lightrft.experience.samples import Experience


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Which groups have rewards that are not all equal. Shape: (B,) -> (B / G,) bool."""
    grouped = rewards.view(-1, group_size)                 # (B / G, G)
    return (grouped.max(dim=1).values - grouped.min(dim=1).values) > 0


def _group_rows(groups: torch.Tensor, group_size: int) -> torch.Tensor:
    """Row indices of the selected groups, each group's G rows in order."""
    return (groups.unsqueeze(1) * group_size + torch.arange(group_size)).reshape(-1)


def filter_informative_groups(experiences: list[Experience],
                              group_size: int) -> tuple[list[Experience], list[Experience]]:
    """Splits each experience into its informative groups and the rest (equal rewards)."""
    kept, rest = [], []
    for exp in experiences:
        mask = informative_groups(exp.info["reward"], group_size)
        if mask.any():
            kept.append(exp.select(_group_rows(mask.nonzero().squeeze(1), group_size)))
        if not mask.all():
            rest.append(exp.select(_group_rows((~mask).nonzero().squeeze(1), group_size)))
    return kept, rest


def without_training_signal(exp: Experience) -> Experience:
    """The same rows marked invalid: they keep ranks in lockstep but count in no loss, normaliser
    or whitening statistic (see `Experience.loss_mask`)."""
    return replace(exp, info={**exp.info, "valid": torch.zeros(exp.batch_size)})


def fill_to_size(kept: list[Experience], fallback: list[Experience], target: int,
                 group_size: int) -> list[Experience]:
    """Exactly `target` samples: the kept ones (whole groups, truncated if over), topped up with
    groups of `fallback` (the uninformative ones) when sampling rounds ran out. Every rank must run
    the same number of micro-batches, so a short batch is filled rather than left short; the
    filler groups are marked invalid, so the step trains on the informative groups alone (with
    their own token and sequence counts as normalisers) instead of diluting them with zeros."""
    out, have = [], 0
    for exp, filler in [(e, False) for e in kept] + [(e, True) for e in fallback]:
        if have >= target:
            break
        take = min(exp.batch_size, target - have)
        take -= take % group_size
        if take <= 0:
            continue
        part = exp.select(torch.arange(take)) if take < exp.batch_size else exp
        out.append(without_training_signal(part) if filler else part)
        have += take
    return out


def _any_rank_short(kept: list[Experience], target: int, strategy) -> bool:
    have = sum(e.batch_size for e in kept)
    short = torch.tensor([1.0 if have < target else 0.0])
    return strategy.all_reduce(short, op="max").item() > 0


def sample_informative_batch(experiences: list[Experience], more, target: int, group_size: int,
                             max_rounds: int, strategy) -> tuple[list[Experience], int, int]:
    """DAPO's dynamic sampling for one step: keeps the informative groups of `experiences` and of
    further rollouts drawn from the iterator `more` until this rank has `target` samples, at most
    `max_rounds` rollouts in all. Every rank draws the same number of rollouts (one all-reduce per
    round), so collective calls stay matched. Returns (exactly `target` samples, dropped groups,
    rounds); a batch still short after the last round is filled as `fill_to_size` describes."""
    kept, rest = filter_informative_groups(experiences, group_size)
    rounds = 1
    while rounds < max_rounds and _any_rank_short(kept, target, strategy):
        extra = next(more, None)
        if extra is None:
            break
        new_kept, new_rest = filter_informative_groups(extra, group_size)
        kept, rest, rounds = kept + new_kept, rest + new_rest, rounds + 1
    dropped = sum(e.batch_size for e in rest) // group_size
    return fill_to_size(kept, rest, target, group_size), dropped, rounds
