"""Advantage estimators, one registry entry per `--advantage_estimator` value.

Every estimator has one signature, `fn(inp: AdvantageInputs) -> AdvantageOutputs`. Sequence-level
advantages (one number per sample) are broadcast over the sample's action tokens; positions
outside `action_mask` are 0 in every output. For critic-free estimators `returns` equals the
advantages as computed here, before any global whitening (they are logged, and used as value
targets only by `gae`).

Estimators flagged `normalize_globally` (gae, reinforce, reinforce_baseline, reinforce++, as in
OpenRLHF) must then be whitened over the whole global batch across ranks by the caller (the replay
buffer), with `whitening_moments` summed over ranks and `whiten_with_moments`
(`lightrft.algorithms.whitening`).

Group estimators give exactly 0 to a group whose scores are all equal, in every dtype: the centred
scores are computed in float64 and set to 0 where a group's max equals its min, so neither a
rounded mean nor a std of ~1e-8 divided by (std + eps) can turn equal scores into a signal.

Group estimators compare the G samples of one prompt; those samples sit in contiguous rows
(g*G ... g*G + G - 1), and a batch must hold whole groups.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from lightrft.algorithms.checks import check_ndim, check_same_shape
from lightrft.algorithms.masked import as_bool_mask, fill_masked


@dataclass
class AdvantageInputs:
    """What an advantage estimator may read. Shapes are checked on construction."""

    action_mask: Tensor  # (B, A) 1/True on response tokens
    scores: Tensor  # (B,) one scalar reward per sample
    # (B, A) dense per-token rewards (process rewards, per-turn rewards). Estimators that read token
    # rewards take them as the whole reward r_t; `compute_advantages` first adds the score on the last
    # action token and the KL penalty to them.
    token_rewards: Tensor | None = None
    values: Tensor | None = None  # (B, A) critic values V(s_t)
    group_size: int = 1  # G samples per prompt (`--n_samples_per_prompt`)
    gamma: float = 1.0  # discount (`--gamma`)
    lambd: float = 1.0  # GAE lambda (`--lambd`)
    eps: float = 1e-6  # added to the group std in group_norm

    def __post_init__(self):
        check_ndim("action_mask", self.action_mask, 2, "(B, A)")
        batch = self.action_mask.shape[0]
        if tuple(self.scores.shape) != (batch,):
            raise ValueError(
                f"scores has shape {tuple(self.scores.shape)} but action_mask has shape "
                f"{tuple(self.action_mask.shape)}; scores must have shape (B,) = ({batch},)"
            )
        check_same_shape("action_mask", self.action_mask, token_rewards=self.token_rewards, values=self.values)
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"--n_samples_per_prompt (group_size) must be a positive integer; got {self.group_size!r}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"--gamma must be in [0, 1]; got {self.gamma}")
        if not 0.0 <= self.lambd <= 1.0:
            raise ValueError(f"--lambd must be in [0, 1]; got {self.lambd}")
        if not self.eps > 0.0:
            raise ValueError(f"eps must be > 0 (it bounds nearly equal groups' advantages); got {self.eps}")


@dataclass
class AdvantageOutputs:
    advantages: Tensor  # (B, A), 0 outside action_mask
    returns: Tensor  # (B, A), 0 outside action_mask


AdvantageFn = Callable[[AdvantageInputs], AdvantageOutputs]


@dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    fn: AdvantageFn
    needs_critic: bool  # reads inp.values; the trainer must build a critic
    group: bool  # compares the G samples of a prompt; needs G >= 2
    normalize_globally: bool  # the caller whitens the advantages over the global batch
    uses_token_rewards: bool  # reads inp.token_rewards (KL folded into the reward) rather than scores


# name -> AdvantageEstimator; filled by register_advantage_estimator.
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(
    name: str,
    *,
    needs_critic: bool = False,
    group: bool = False,
    normalize_globally: bool = False,
    uses_token_rewards: bool = False,
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator adding `fn(inp) -> AdvantageOutputs` to ADVANTAGE_ESTIMATORS under `name`,
    selectable with `--advantage_estimator name`; the flags tell the trainer what to prepare."""

    def register(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"an advantage estimator named {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = AdvantageEstimator(
            name, fn, needs_critic, group, normalize_globally, uses_token_rewards
        )
        return fn

    return register


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown --advantage_estimator {name!r}; choose one of: {', '.join(sorted(ADVANTAGE_ESTIMATORS))}"
        )
    return ADVANTAGE_ESTIMATORS[name]


def validate_group_size(name: str, group_size: int) -> None:
    """Start-up check: group estimators need at least two samples per prompt."""
    estimator = get_advantage_estimator(name)
    if estimator.group and group_size < 2:
        raise ValueError(
            f"--advantage_estimator {name} compares the samples of each prompt with each other and "
            f"needs --n_samples_per_prompt >= 2; got {group_size}"
        )


def token_rewards_from_scores(
    scores: Tensor, action_mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """Per-token rewards r_t = -kl_coef * KL_t, plus the sequence score on the last action token:
    the KL-penalised reward of Ziegler et al. 2019 (section 2.2) spread over the tokens, so that
    its undiscounted sum is score - kl_coef * sum_t KL_t. Rows without action tokens are 0.
    Shape: scores (B,), action_mask (B, A), kl (B, A) -> (B, A)."""
    check_ndim("action_mask", action_mask, 2, "(B, A)")
    check_same_shape("action_mask", action_mask, kl=kl)
    mask = as_bool_mask(action_mask, action_mask)
    # the last kept position is where the running count first reaches the row total
    counts = mask.long().cumsum(-1)
    is_last = mask & (counts == counts[:, -1:])
    dtype = scores.dtype if scores.is_floating_point() else torch.get_default_dtype()
    rewards = torch.where(is_last, scores.to(dtype)[:, None], torch.zeros((), dtype=dtype, device=scores.device))
    if kl is not None:
        rewards = rewards - kl_coef * fill_masked(kl, mask)
    return fill_masked(rewards, mask)


def discounted_returns(rewards: Tensor, action_mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{t+1} over the kept positions, read right to left; positions outside
    the mask are skipped (the next kept token's return carries over them) and are 0.
    Shape: rewards, action_mask (B, A) -> (B, A)."""
    mask = as_bool_mask(action_mask, rewards)
    rewards = fill_masked(rewards, mask)
    running = torch.zeros_like(rewards[:, 0])  # (B,) return of the next kept token
    out = []
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        out.append(fill_masked(running, mask[:, t]))
    return torch.stack(out[::-1], dim=1)


def generalized_advantage_estimation(
    rewards: Tensor, values: Tensor, action_mask: Tensor, gamma: float, lambd: float
) -> Tensor:
    """GAE (Schulman et al. 2016, eq. 16), read right to left over the kept positions:

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lambd * A_{t+1}

    where t+1 is the next kept token; after the last kept token V and A are 0 (the episode ends).
    Positions outside the mask are skipped and are 0, so padding never enters the recursion.
    Shape: rewards, values, action_mask (B, A) -> (B, A)."""
    mask = as_bool_mask(action_mask, rewards)
    rewards, values = fill_masked(rewards, mask), fill_masked(values, mask)
    next_value = torch.zeros_like(rewards[:, 0])  # (B,)
    next_advantage = torch.zeros_like(rewards[:, 0])  # (B,)
    out = []
    for t in reversed(range(rewards.shape[1])):
        keep = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lambd * next_advantage
        next_advantage = torch.where(keep, advantage, next_advantage)
        next_value = torch.where(keep, values[:, t], next_value)
        out.append(fill_masked(advantage, keep))
    return torch.stack(out[::-1], dim=1)


def _token_rewards(inp: AdvantageInputs) -> Tensor:
    if inp.token_rewards is not None:
        return inp.token_rewards
    return token_rewards_from_scores(inp.scores, inp.action_mask)


def _groups(inp: AdvantageInputs, name: str) -> Tensor:
    """Scores as (B / G, G): row g holds the samples of prompt g."""
    validate_group_size(name, inp.group_size)
    batch = inp.scores.shape[0]
    if batch % inp.group_size:
        raise ValueError(
            f"--advantage_estimator {name}: {batch} scores do not split into groups of "
            f"--n_samples_per_prompt={inp.group_size}; a batch must hold whole groups, each in contiguous rows"
        )
    scores = inp.scores if inp.scores.is_floating_point() else inp.scores.to(torch.get_default_dtype())
    return scores.reshape(-1, inp.group_size)  # (B, ) -> (B / G, G)


def _centred(groups: Tensor) -> Tensor:
    """s_i - mean_g in float64, exactly 0 in a group whose scores are all equal: a mean rounded in
    the scores' dtype (float32 0.7 x 8 is one ulp off) must not become a signal.
    Shape: (B / G, G) -> (B / G, G) float64."""
    wide = groups.double()
    centred = wide - wide.mean(-1, keepdim=True)
    equal = groups.amax(-1, keepdim=True) == groups.amin(-1, keepdim=True)  # (B / G, 1)
    return torch.where(equal, torch.zeros((), dtype=wide.dtype, device=wide.device), centred)


def _sequence_level(per_sample: Tensor, inp: AdvantageInputs) -> AdvantageOutputs:
    """Broadcasts one advantage per sample (B / G, G) or (B,) over its action tokens (B, A), in the
    dtype of the scores."""
    dtype = inp.scores.dtype if inp.scores.is_floating_point() else torch.get_default_dtype()
    per_sample = per_sample.to(dtype)
    advantages = fill_masked(per_sample.reshape(-1, 1).expand(inp.action_mask.shape), inp.action_mask)
    return AdvantageOutputs(advantages=advantages, returns=advantages)


@register_advantage_estimator("gae", needs_critic=True, normalize_globally=True, uses_token_rewards=True)
def gae(inp: AdvantageInputs) -> AdvantageOutputs:
    """PPO with a critic: GAE(gamma, lambd) advantages on the per-token rewards, and value
    targets returns = advantages + values (Schulman et al. 2016). The advantages (not the returns)
    are then whitened over the global batch, as OpenRLHF and most PPO implementations do."""
    if inp.values is None:
        raise ValueError(
            "--advantage_estimator gae needs critic values; build a critic or choose a critic-free "
            f"estimator ({', '.join(n for n, e in sorted(ADVANTAGE_ESTIMATORS.items()) if not e.needs_critic)})"
        )
    advantages = generalized_advantage_estimation(
        _token_rewards(inp), inp.values, inp.action_mask, inp.gamma, inp.lambd
    )
    returns = fill_masked(advantages + inp.values, inp.action_mask)
    return AdvantageOutputs(advantages=advantages, returns=returns)


@register_advantage_estimator("group_norm", group=True)
def group_norm(inp: AdvantageInputs) -> AdvantageOutputs:
    """GRPO (Shao et al. 2024, DeepSeekMath, section 4.1.2): A_i = (s_i - mean_g) / (std_g + eps)
    with the unbiased (n - 1) sample std of the prompt's G scores, as `torch.std` computes it,
    eps = 1e-6 (verl's epsilon; OpenRLHF adds 1e-9). Computed in float64; a group of equal scores
    gives exactly A = 0 in any dtype (module docstring)."""
    groups = _groups(inp, "group_norm")
    centred = _centred(groups)
    std = centred.square().sum(-1, keepdim=True).div(inp.group_size - 1).sqrt()
    return _sequence_level(centred / (std + inp.eps), inp)


@register_advantage_estimator("dr_grpo", group=True)
def dr_grpo(inp: AdvantageInputs) -> AdvantageOutputs:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783):
    A_i = s_i - mean_g, without dividing by the group std (which favours easy and hard prompts)."""
    groups = _groups(inp, "dr_grpo")
    return _sequence_level(_centred(groups), inp)


@register_advantage_estimator("rloo", group=True)
def rloo(inp: AdvantageInputs) -> AdvantageOutputs:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics", arXiv 2402.14740): leave-one-out
    baseline A_i = s_i - (1 / (G - 1)) sum_{j != i} s_j = G / (G - 1) * (s_i - mean_g), computed in
    the second form (exactly 0 for a group of equal scores)."""
    groups = _groups(inp, "rloo")
    G = inp.group_size
    return _sequence_level(_centred(groups) * (G / (G - 1)), inp)


@register_advantage_estimator("reinforce", normalize_globally=True, uses_token_rewards=True)
def reinforce(inp: AdvantageInputs) -> AdvantageOutputs:
    """REINFORCE (Williams 1992): A_t = G_t, the discounted return of the per-token rewards,
    whitened over the global batch by the caller. This is what OpenRLHF's `reinforce` computes,
    so its recipes port unchanged; it equals `reinforce++` (the name of the paper)."""
    returns = discounted_returns(_token_rewards(inp), inp.action_mask, inp.gamma)
    return AdvantageOutputs(advantages=returns, returns=returns)


@register_advantage_estimator("reinforce_baseline", group=True, normalize_globally=True)
def reinforce_baseline(inp: AdvantageInputs) -> AdvantageOutputs:
    """REINFORCE++-baseline (Hu et al. 2025, arXiv 2501.03262): A_i = s_i - mean_g, then
    whitened over the global batch by the caller. Reads scores only: put the KL penalty in the
    loss (`--use_kl_loss`)."""
    groups = _groups(inp, "reinforce_baseline")
    return _sequence_level(_centred(groups), inp)


@register_advantage_estimator("reinforce++", normalize_globally=True, uses_token_rewards=True)
def reinforce_plus_plus(inp: AdvantageInputs) -> AdvantageOutputs:
    """REINFORCE++ (Hu et al. 2025, arXiv 2501.03262): A_t = G_t, the discounted return of the
    per-token rewards with the KL penalty folded in, then whitened over the global batch by the
    caller."""
    returns = discounted_returns(_token_rewards(inp), inp.action_mask, inp.gamma)
    return AdvantageOutputs(advantages=returns, returns=returns)


def sequence_advantages_with_kl(out: AdvantageOutputs, kl: Tensor | None, action_mask: Tensor, kl_coef: float,
                                gamma: float) -> AdvantageOutputs:
    """Adds the per-token KL penalty to the advantages of an estimator that reads only the
    sequence scores (group_norm, dr_grpo, rloo, reinforce_baseline), as OpenRLHF does: the
    shaped score sits on the last token, r_t = -kl_coef * KL_t is added on every token, and the
    advantage is the discounted return of that sum. Returns are linear in the rewards, so
        A_t = A_seq + sum_{s >= t} gamma^(s - t) * (-kl_coef * KL_s)
    where A_seq is the estimator's sequence advantage (broadcast over the tokens).
    Shape: kl, action_mask (B, A); out.advantages (B, A)."""
    if kl is None or kl_coef == 0.0:
        return out
    penalty = discounted_returns(-kl_coef * fill_masked(kl, as_bool_mask(action_mask, kl)), action_mask, gamma)
    advantages = out.advantages + penalty.to(out.advantages.dtype)
    return AdvantageOutputs(advantages=advantages, returns=advantages)


def compute_advantages(estimator: AdvantageEstimator, inp: AdvantageInputs, kl: Tensor | None = None,
                       kl_coef: float = 0.0) -> AdvantageOutputs:
    """Runs `estimator` with the KL penalty in the reward wherever it belongs: folded into the
    per-token rewards for estimators that read them (gae, reinforce, reinforce++), added to the
    sequence advantages for those that read only scores. `kl_coef = 0` (or `kl=None`) means no
    penalty. This is what the experience maker calls.

    Dense rewards in `inp.token_rewards` (process or per-turn rewards) are added to the per-token
    rewards: r_t = token_rewards_t - kl_coef * KL_t, plus the score on the last action token.
    Estimators that read only the scores cannot use them and refuse them.
    Shape: kl (B, A) like `inp.action_mask`."""
    if estimator.uses_token_rewards:
        token_rewards = token_rewards_from_scores(inp.scores, inp.action_mask, kl, kl_coef)
        if inp.token_rewards is not None:
            dense = fill_masked(inp.token_rewards, as_bool_mask(inp.action_mask, inp.token_rewards))
            token_rewards = token_rewards + dense.to(token_rewards.dtype)
        return estimator.fn(replace(inp, token_rewards=token_rewards))
    if inp.token_rewards is not None:
        readers = ", ".join(n for n, e in sorted(ADVANTAGE_ESTIMATORS.items()) if e.uses_token_rewards)
        raise ValueError(
            f"--advantage_estimator {estimator.name} reads one score per sample and would drop the dense "
            f"per-token rewards passed in AdvantageInputs.token_rewards; use an estimator that reads them "
            f"({readers}), or add them into the sample's score"
        )
    return sequence_advantages_with_kl(estimator.fn(inp), kl, inp.action_mask, kl_coef, inp.gamma)
