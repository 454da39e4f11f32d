import pytest
import torch

from lightrft.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    AdvantageOutputs,
    compute_advantages,
    discounted_returns,
    generalized_advantage_estimation,
    get_advantage_estimator,
    register_advantage_estimator,
    token_rewards_from_scores,
    validate_group_size,
)

F64 = torch.float64


def run(name, **kwargs):
    return get_advantage_estimator(name).fn(AdvantageInputs(**kwargs))


def t(rows):
    return torch.tensor(rows, dtype=F64)


# ---------- hand-computed values ----------


def test_gae_three_steps_by_hand():
    gamma, lambd = 0.9, 0.8
    rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = t([[0.5, 0.6, 0.7], [0.1, 0.2, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # row 1: a 2-token response, right-padded
    out = run("gae", action_mask=mask, scores=t([1.0, 2.0]), token_rewards=rewards, values=values,
              gamma=gamma, lambd=lambd)
    # row 0: delta_2 = 1 - 0.7 = 0.3; delta_1 = 0.9*0.7 - 0.6 = 0.03; delta_0 = 0.9*0.6 - 0.5 = 0.04
    #        A_2 = 0.3; A_1 = 0.03 + 0.72*0.3 = 0.246; A_0 = 0.04 + 0.72*0.246 = 0.21712
    # row 1: delta_1 = 2 - 0.2 = 1.8 (nothing after the last token); delta_0 = 0.9*0.2 - 0.1 = 0.08
    #        A_1 = 1.8; A_0 = 0.08 + 0.72*1.8 = 1.376
    torch.testing.assert_close(out.advantages, t([[0.21712, 0.246, 0.3], [1.376, 1.8, 0.0]]))
    # returns = advantages + values, 0 on the pad
    torch.testing.assert_close(out.returns, t([[0.71712, 0.846, 1.0], [1.476, 2.0, 0.0]]))


def test_gae_skips_holes_in_the_mask():
    # a masked token in the middle (e.g. an environment observation) is skipped: the result on
    # the kept tokens equals GAE on the compressed sequence
    rewards, values = t([[0.0, 9.0, 0.0, 1.0]]), t([[0.5, 9.0, 0.6, 0.7]])
    mask = torch.tensor([[1, 0, 1, 1]])
    holes = generalized_advantage_estimation(rewards, values, mask, 0.9, 0.8)
    compressed = generalized_advantage_estimation(t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]]), torch.ones(1, 3),
                                                  0.9, 0.8)
    torch.testing.assert_close(holes[:, [0, 2, 3]], compressed)
    assert holes[0, 1] == 0


def test_discounted_returns_by_hand():
    # G_2 = 2; G_1 = 0 + 0.5*2 = 1; G_0 = 1 + 0.5*1 = 1.5
    out = discounted_returns(t([[1.0, 0.0, 2.0, 7.0]]), torch.tensor([[1, 1, 1, 0]]), gamma=0.5)
    torch.testing.assert_close(out, t([[1.5, 1.0, 2.0, 0.0]]))


def test_token_rewards_from_scores_by_hand():
    scores = t([1.0, 3.0])
    kl = t([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])  # row 1 has a hole; its last kept token is t=2
    out = token_rewards_from_scores(scores, mask, kl, kl_coef=0.5)
    # -0.5 * kl, plus the score on the last kept token
    torch.testing.assert_close(out, t([[-0.05, -0.1, 1 - 0.15], [-0.2, 0.0, 3 - 0.3]]))
    right_padded = token_rewards_from_scores(scores, torch.tensor([[1, 1, 0], [1, 0, 0]]))
    torch.testing.assert_close(right_padded, t([[0.0, 1.0, 0.0], [3.0, 0.0, 0.0]]))


def test_reinforce_plus_plus_with_kl_in_the_reward_by_hand():
    mask = torch.ones(1, 3)
    rewards = token_rewards_from_scores(t([1.0]), mask, t([[0.1, 0.2, 0.3]]), kl_coef=0.5)  # [-0.05, -0.1, 0.85]
    out = run("reinforce++", action_mask=mask, scores=t([1.0]), token_rewards=rewards)
    # gamma = 1: suffix sums 0.85, 0.85 - 0.1 = 0.75, 0.75 - 0.05 = 0.7
    torch.testing.assert_close(out.advantages, t([[0.7, 0.75, 0.85]]))
    torch.testing.assert_close(out.returns, out.advantages)
    # without token rewards the score sits on the last action token
    plain = run("reinforce", action_mask=torch.tensor([[1, 1, 0]]), scores=t([2.0]), gamma=0.5)
    torch.testing.assert_close(plain.advantages, t([[1.0, 2.0, 0.0]]))


SCORES = t([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])  # two prompts, G = 4
MASK = torch.tensor([[1, 1, 0]] * 7 + [[0, 0, 0]])  # the last sample has no action tokens

# group 0: mean 0.25; deviations 0.75, -0.25 x3; unbiased var (0.5625 + 3*0.0625) / 3 = 0.25, std 0.5
# group 1: all equal -> 0
GROUP_EXPECTED = {
    "group_norm": [0.75 / (0.5 + 1e-6), -0.25 / (0.5 + 1e-6), -0.25 / (0.5 + 1e-6), -0.25 / (0.5 + 1e-6), 0, 0, 0, 0],
    "dr_grpo": [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0],
    # s_i - mean of the other three: 1 - 0 = 1; 0 - 1/3
    "rloo": [1.0, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0],
    "reinforce_baseline": [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0],
}


@pytest.mark.parametrize("name", sorted(GROUP_EXPECTED))
def test_group_estimators_by_hand(name):
    out = run(name, action_mask=MASK, scores=SCORES, group_size=4, eps=1e-6)
    expected = t(GROUP_EXPECTED[name])[:, None] * MASK  # broadcast over the action tokens, 0 on pads
    torch.testing.assert_close(out.advantages, expected)
    torch.testing.assert_close(out.returns, expected)


def test_group_norm_eps_keeps_equal_groups_at_zero():
    # 0.1 is not exact in binary: a mean rounded in the scores' dtype would differ from 0.1 and the
    # std would be ~1e-17; equal groups are set to exactly 0
    scores = t([0.1, 0.1, 0.1, 0.7, 0.7, 0.7])
    out = run("group_norm", action_mask=torch.ones(6, 2), scores=scores, group_size=3)
    assert torch.equal(out.advantages, torch.zeros(6, 2, dtype=F64))
    with pytest.raises(ValueError, match="eps must be > 0"):
        AdvantageInputs(action_mask=MASK, scores=SCORES, eps=0.0)


def test_registry_flags():
    # Global whitening follows OpenRLHF (gae, reinforce, reinforce_baseline; its `reinforce` is REINFORCE++),
    # so its recipes port unchanged; GRPO-family estimators are not whitened globally.
    flags = {name: (e.needs_critic, e.group, e.normalize_globally) for name, e in ADVANTAGE_ESTIMATORS.items()}
    assert flags == {
        "gae": (True, False, True),
        "group_norm": (False, True, False),
        "dr_grpo": (False, True, False),
        "rloo": (False, True, False),
        "reinforce": (False, False, True),
        "reinforce_baseline": (False, True, True),
        "reinforce++": (False, False, True),
    }


# ---------- loop references vs the vectorised code ----------


def loop_gae(rewards, values, mask, gamma, lambd):
    out = []
    for r_row, v_row, m_row in zip(rewards.tolist(), values.tolist(), mask.tolist()):
        kept = [i for i, m in enumerate(m_row) if m]
        row = [0.0] * len(m_row)
        next_value = next_adv = 0.0
        for i in reversed(kept):
            delta = r_row[i] + gamma * next_value - v_row[i]
            next_adv = delta + gamma * lambd * next_adv
            next_value = v_row[i]
            row[i] = next_adv
        out.append(row)
    return t(out)


def loop_returns(rewards, mask, gamma):
    out = []
    for r_row, m_row in zip(rewards.tolist(), mask.tolist()):
        row, running = [0.0] * len(m_row), 0.0
        for i in reversed(range(len(m_row))):
            if m_row[i]:
                running = r_row[i] + gamma * running
                row[i] = running
        out.append(row)
    return t(out)


def loop_group(scores, G, kind):
    out = []
    s = scores.tolist()
    for g in range(0, len(s), G):
        group = s[g:g + G]
        mean = sum(group) / G
        std = (sum((x - mean) ** 2 for x in group) / (G - 1)) ** 0.5
        for i, x in enumerate(group):
            others = (sum(group) - x) / (G - 1)
            out.append({"group_norm": (x - mean) / (std + 1e-6), "dr_grpo": x - mean, "rloo": x - others,
                        "reinforce_baseline": x - mean}[kind])
    return t(out)


def random_batch(seed, B=12, A=9):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, A, generator=gen) < 0.75  # holes and pads anywhere
    mask[0] = False  # one empty row
    rewards = torch.randn(B, A, generator=gen, dtype=F64)
    values = torch.randn(B, A, generator=gen, dtype=F64)
    scores = torch.randn(B, generator=gen, dtype=F64)
    return mask, rewards, values, scores


@pytest.mark.parametrize("seed", range(3))
def test_vectorised_equals_loops(seed):
    mask, rewards, values, scores = random_batch(seed)
    for gamma, lambd in [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)]:
        torch.testing.assert_close(generalized_advantage_estimation(rewards, values, mask, gamma, lambd),
                                   loop_gae(rewards, values, mask, gamma, lambd), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(discounted_returns(rewards, mask, gamma), loop_returns(rewards, mask, gamma),
                                   rtol=1e-6, atol=1e-6)
    for kind in GROUP_EXPECTED:
        for G in (2, 3, 4):
            out = run(kind, action_mask=mask, scores=scores, group_size=G)
            expected = loop_group(scores, G, kind)[:, None] * mask
            torch.testing.assert_close(out.advantages, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
@pytest.mark.parametrize("garbage", [1e6, float("nan")])
def test_garbage_outside_mask_changes_nothing(name, garbage):
    mask, rewards, values, scores = random_batch(7)
    clean = run(name, action_mask=mask, scores=scores, token_rewards=rewards * mask, values=values * mask,
                group_size=3, gamma=0.9, lambd=0.95)
    dirty = run(name, action_mask=mask, scores=scores, token_rewards=rewards.masked_fill(~mask, garbage),
                values=values.masked_fill(~mask, garbage), group_size=3, gamma=0.9, lambd=0.95)
    assert isinstance(dirty, AdvantageOutputs)
    torch.testing.assert_close(dirty.advantages, clean.advantages)
    torch.testing.assert_close(dirty.returns, clean.returns)
    assert torch.all(dirty.advantages[~mask] == 0) and torch.all(dirty.returns[~mask] == 0)


# ---------- errors ----------


@pytest.mark.parametrize("name", ["group_norm", "dr_grpo", "rloo", "reinforce_baseline"])
def test_group_size_one_is_rejected(name):
    with pytest.raises(ValueError, match=rf"--advantage_estimator {name} .*--n_samples_per_prompt >= 2; got 1"):
        validate_group_size(name, 1)
    with pytest.raises(ValueError, match="--n_samples_per_prompt >= 2"):
        run(name, action_mask=MASK, scores=SCORES, group_size=1)


def test_group_size_checks():
    validate_group_size("gae", 1)
    validate_group_size("reinforce++", 1)
    with pytest.raises(ValueError, match=r"8 scores do not split into groups of --n_samples_per_prompt=3"):
        run("rloo", action_mask=MASK, scores=SCORES, group_size=3)


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        get_advantage_estimator("grpo")
    assert "unknown --advantage_estimator 'grpo'" in str(err.value)
    for name in ADVANTAGE_ESTIMATORS:
        assert name in str(err.value)


def test_input_shape_errors():
    with pytest.raises(ValueError, match=r"scores has shape \(7,\) but action_mask has shape \(8, 3\)"):
        AdvantageInputs(action_mask=MASK, scores=SCORES[:7])
    with pytest.raises(ValueError, match=r"token_rewards has shape \(8, 2\) but action_mask has shape \(8, 3\)"):
        AdvantageInputs(action_mask=MASK, scores=SCORES, token_rewards=torch.zeros(8, 2))
    with pytest.raises(ValueError, match=r"action_mask must have shape \(B, A\)"):
        AdvantageInputs(action_mask=torch.ones(8), scores=SCORES)
    with pytest.raises(ValueError, match="--gamma must be in"):
        AdvantageInputs(action_mask=MASK, scores=SCORES, gamma=1.5)
    with pytest.raises(ValueError, match="--advantage_estimator gae needs critic values"):
        run("gae", action_mask=MASK, scores=SCORES)


def test_a_new_estimator_is_one_registered_function():
    @register_advantage_estimator("test_constant_one")
    def constant_one(inp):
        ones = torch.ones_like(inp.action_mask, dtype=F64) * inp.action_mask
        return AdvantageOutputs(ones, ones)

    try:
        out = get_advantage_estimator("test_constant_one").fn(AdvantageInputs(action_mask=MASK, scores=SCORES))
        torch.testing.assert_close(out.advantages, MASK.to(F64))
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("test_constant_one")(constant_one)
    finally:
        del ADVANTAGE_ESTIMATORS["test_constant_one"]


# ---------- the KL penalty in the reward reaches every estimator ----------

def test_group_estimators_take_the_kl_penalty_per_token_before_the_returns():
    # G = 2, one prompt; scores (1, 0) give group_norm A_seq = +-(0.5 / (std + eps)) with std = 0.7071.
    mask = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    kl = t([[0.2, 0.4, 0.6], [1.0, 2.0, 9.0]])        # 9.0 sits on padding and must not count
    inp = AdvantageInputs(action_mask=mask, scores=t([1.0, 0.0]), group_size=2, gamma=1.0)
    estimator = ADVANTAGE_ESTIMATORS["group_norm"]
    out = compute_advantages(estimator, inp, kl=kl, kl_coef=0.5)
    a_seq = 0.5 / (0.5 ** 0.5 + 1e-6)
    # A_t = A_seq - 0.5 * sum_{s >= t} KL_s (gamma = 1), written out by hand:
    expected = t([[a_seq - 0.5 * 1.2, a_seq - 0.5 * 1.0, a_seq - 0.5 * 0.6],
                             [-a_seq - 0.5 * 3.0, -a_seq - 0.5 * 2.0, 0.0]])
    assert torch.allclose(out.advantages, expected, atol=1e-6)
    # Without a coefficient the penalty is gone, and the estimator's own output is unchanged.
    assert torch.equal(compute_advantages(estimator, inp, kl=kl, kl_coef=0.0).advantages, estimator.fn(inp).advantages)


def test_the_kl_penalty_of_group_estimators_is_discounted_like_openrlhf_returns():
    # OpenRLHF: r_t = -beta * KL_t, plus the shaped score on the last token; A_t = sum_s gamma^(s-t) r_s.
    mask = torch.ones(2, 3, dtype=F64)
    kl = t([[0.3, 0.1, 0.2], [0.5, 0.0, 0.4]])
    inp = AdvantageInputs(action_mask=mask, scores=t([2.0, 1.0]), group_size=2, gamma=0.9)
    out = compute_advantages(ADVANTAGE_ESTIMATORS["dr_grpo"], inp, kl=kl, kl_coef=0.1)
    a_seq = t([0.5, -0.5])
    penalty = -0.1 * kl
    ref = torch.zeros(2, 3, dtype=F64)
    for b in range(2):
        for i in range(3):
            ref[b, i] = a_seq[b] + sum(0.9 ** (j - i) * penalty[b, j] for j in range(i, 3))
    assert torch.allclose(out.advantages, ref, atol=1e-6)


def test_token_reward_estimators_fold_the_kl_into_their_rewards():
    mask = torch.ones(1, 2, dtype=F64)
    kl = t([[0.4, 0.2]])
    inp = AdvantageInputs(action_mask=mask, scores=t([1.0]), gamma=1.0)
    out = compute_advantages(ADVANTAGE_ESTIMATORS["reinforce++"], inp, kl=kl, kl_coef=0.5)
    # r = (-0.2, 1 - 0.1): returns G_0 = 0.7, G_1 = 0.9.
    assert torch.allclose(out.advantages, t([[0.7, 0.9]]), atol=1e-6)


# ---------- groups of equal scores ----------

GROUP_ESTIMATORS = ["group_norm", "dr_grpo", "rloo", "reinforce_baseline"]


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_group_of_equal_scores_gets_exactly_zero(name, dtype):
    # float32 0.7 x 8 has a mean one ulp off and a std of ~1e-8: (s - mean) / (std + 1e-6) was 0.056
    for G in range(2, 17):
        for score in (0.1, 0.3, 0.7, 1 / 3):
            scores = torch.full((2 * G,), score, dtype=dtype)
            scores[G:] = 2 * score          # a second, different constant group
            out = run(name, action_mask=torch.ones(2 * G, 3), scores=scores, group_size=G)
            assert out.advantages.dtype == dtype
            assert torch.equal(out.advantages, torch.zeros(2 * G, 3, dtype=dtype)), (G, score)


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_other_groups_still_match_the_float64_reference(name, dtype, tol):
    gen = torch.Generator().manual_seed(0)
    for G in (2, 5, 8, 16):
        scores = torch.rand(4 * G, generator=gen, dtype=F64).to(dtype)
        scores[:G] = scores[0]                          # one degenerate group among them
        got = run(name, action_mask=torch.ones(4 * G, 1), scores=scores, group_size=G).advantages[:, 0]
        want = loop_group(scores.double(), G, name)
        want[:G] = 0.0
        torch.testing.assert_close(got.double(), want.to(F64), rtol=tol, atol=tol)


# ---------- dense per-token rewards ----------


def test_compute_advantages_adds_dense_token_rewards_to_the_score_and_the_kl():
    import lightrft.algorithms

    assert lightrft.algorithms.compute_advantages is compute_advantages
    mask = torch.tensor([[1.0, 1.0, 1.0]], dtype=F64)
    dense = t([[0.5, 0.0, 0.25]])           # e.g. process rewards per step
    kl = t([[0.2, 0.4, 0.6]])
    inp = AdvantageInputs(action_mask=mask, scores=t([1.0]), token_rewards=dense, gamma=1.0)
    out = compute_advantages(ADVANTAGE_ESTIMATORS["reinforce++"], inp, kl=kl, kl_coef=0.5)
    # r = dense - 0.5 * kl + score on the last token = (0.4, -0.2, 0.25 - 0.3 + 1 = 0.95)
    # returns (gamma = 1): 0.4 - 0.2 + 0.95 = 1.15, -0.2 + 0.95 = 0.75, 0.95
    torch.testing.assert_close(out.advantages, t([[1.15, 0.75, 0.95]]))
    # gae with zero values and lambda = 1 gives the same returns
    gae_inp = AdvantageInputs(action_mask=mask, scores=t([1.0]), token_rewards=dense,
                              values=torch.zeros(1, 3, dtype=F64), gamma=1.0, lambd=1.0)
    torch.testing.assert_close(compute_advantages(ADVANTAGE_ESTIMATORS["gae"], gae_inp, kl=kl, kl_coef=0.5).advantages,
                               t([[1.15, 0.75, 0.95]]))


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_estimators_reading_scores_refuse_dense_token_rewards(name):
    inp = AdvantageInputs(action_mask=torch.ones(2, 2), scores=t([1.0, 0.0]), token_rewards=torch.ones(2, 2),
                          group_size=2)
    readers = r"\(gae, reinforce, reinforce\+\+\)"
    with pytest.raises(ValueError, match=rf"--advantage_estimator {name} reads one score per sample.*"
                                         rf"token_rewards; use an estimator that reads them {readers}"):
        compute_advantages(ADVANTAGE_ESTIMATORS[name], inp)
