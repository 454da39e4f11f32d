"""Property tests over random shapes and edge cases (empty rows, equal rewards, G = 1)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightrft.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, get_advantage_estimator
from lightrft.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss
from lightrft.algorithms.kl import KL_ESTIMATORS, compute_approx_kl
from lightrft.algorithms.masked import masked_mean, masked_whiten
from lightrft.algorithms.policy_loss import POLICY_LOSSES, PolicyLossConfig, get_policy_loss

F64 = torch.float64
SETTINGS = settings(max_examples=40, deadline=None)
GROUP_ESTIMATORS = sorted(n for n, e in ADVANTAGE_ESTIMATORS.items() if e.group)


@st.composite
def batches(draw):
    """A batch of n_prompts x G samples with random masks (some rows empty) and scores, some
    groups having all-equal scores."""
    n_prompts = draw(st.integers(1, 4))
    G = draw(st.integers(2, 5))
    A = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    B = n_prompts * G
    mask = torch.rand(B, A, generator=gen) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    scores = torch.randint(0, 3, (B,), generator=gen).to(F64) / 2  # few distinct values: ties and equal groups
    equal_group = draw(st.integers(0, n_prompts - 1))
    scores[equal_group * G:(equal_group + 1) * G] = draw(st.sampled_from([0.0, 0.1, 1.0]))
    return mask, scores, G, equal_group, gen


@SETTINGS
@given(batches(), st.sampled_from(sorted(ADVANTAGE_ESTIMATORS)))
def test_every_estimator_is_finite_and_zero_off_mask(batch, name):
    mask, scores, G, equal_group, gen = batch
    values = torch.randn(mask.shape, generator=gen, dtype=F64)
    out = get_advantage_estimator(name).fn(
        AdvantageInputs(action_mask=mask, scores=scores, values=values, group_size=G, gamma=0.95, lambd=0.9)
    )
    for tensor in (out.advantages, out.returns):
        assert tensor.shape == mask.shape
        assert torch.isfinite(tensor).all()
        assert torch.all(tensor[~mask] == 0)
    if name in GROUP_ESTIMATORS:
        group_rows = slice(equal_group * G, (equal_group + 1) * G)
        assert out.advantages[group_rows].abs().max() < 1e-9  # equal rewards: zero advantage


@SETTINGS
@given(batches())
def test_group_norm_standardises_each_group(batch):
    mask, scores, G, _, _ = batch
    full = torch.ones(mask.shape[0], 1, dtype=torch.bool)
    adv = get_advantage_estimator("group_norm").fn(
        AdvantageInputs(action_mask=full, scores=scores, group_size=G, eps=1e-12)
    ).advantages[:, 0].reshape(-1, G)
    groups = scores.reshape(-1, G)
    distinct = groups.amax(-1) > groups.amin(-1)
    if not distinct.any():
        return
    torch.testing.assert_close(adv[distinct].mean(-1), torch.zeros(int(distinct.sum()), dtype=F64))
    torch.testing.assert_close(adv[distinct].std(-1), torch.ones(int(distinct.sum()), dtype=F64))


@SETTINGS
@given(st.sampled_from(GROUP_ESTIMATORS), st.integers(1, 6))
def test_group_size_one_is_rejected(name, batch_size):
    with pytest.raises(ValueError, match="--n_samples_per_prompt >= 2"):
        get_advantage_estimator(name).fn(
            AdvantageInputs(action_mask=torch.ones(batch_size, 2), scores=torch.zeros(batch_size), group_size=1)
        )


@SETTINGS
@given(batches(), st.sampled_from(sorted(POLICY_LOSSES)), st.sampled_from(LOSS_AGG_MODES),
       st.sampled_from(sorted(KL_ESTIMATORS)))
def test_losses_are_finite_with_empty_rows(batch, loss_name, mode, kl_name):
    mask, _, _, _, gen = batch
    old = -5 * torch.rand(mask.shape, generator=gen, dtype=F64)
    log_probs = (old + torch.randn(mask.shape, generator=gen, dtype=F64)).requires_grad_(True)
    adv = torch.randn(mask.shape, generator=gen, dtype=F64)
    per_token, metrics = get_policy_loss(loss_name)(log_probs, old, adv, mask, PolicyLossConfig(
        rollout_log_probs=old, tis_cap=2.0))
    kl = compute_approx_kl(log_probs, old, mask, kl_name)
    loss = aggregate_loss(per_token + 0.1 * kl, mask, mode, norm_len=8)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(log_probs.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())
    if not mask.any():
        assert loss.item() == 0.0


@SETTINGS
@given(st.integers(1, 5), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_masked_mean_lies_between_kept_extremes(B, A, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, A, generator=gen, dtype=F64)
    mask = torch.rand(B, A, generator=gen) < 0.5
    mean = masked_mean(x, mask)
    if mask.any():
        assert x[mask].min() - 1e-12 <= mean <= x[mask].max() + 1e-12
    else:
        assert mean.item() == 0.0
    whitened = masked_whiten(x, mask)
    assert torch.isfinite(whitened).all() and torch.all(whitened[~mask] == 0)
