"""--auto_sync_offset: the rule that moves the explorers' offset, by hand, and its place in the config."""

import pytest

from lightrft.config import ConfigError, PPORunConfig
from lightrft.config.sections import RolesConfig
from lightrft.explorers.staleness import WINDOW, AutoOffset

CALM = {"train/mismatch_kl_k3": 0.01, "train/rollout_ratio_p05": 0.9, "train/rollout_ratio_p95": 1.1,
        "train/tis_clip_frac": 0.005}


def steps(auto: AutoOffset, logs: dict, count: int = WINDOW, wall: float = 1.0) -> int:
    """`count` steps with these logs, then the decision."""
    for _ in range(count):
        auto.observe(logs, wall)
    return auto.decide()


def test_an_idle_trainer_with_calm_samples_lets_the_explorers_run_further_ahead():
    auto = AutoOffset(high=3, offset=1)
    assert WINDOW == 3
    # two steps are not a window yet: it holds
    assert steps(auto, {**CALM, "perf/experience_wait_s": 0.5}, count=2) == 1 and auto.reason == "settling"
    # waited 0.2 + 0.1 + 0.2 s of 3 s: 17% idle > 10%, calm: grow by one
    auto.observe({**CALM, "perf/experience_wait_s": 0.2}, 1.0)
    auto.observe({**CALM, "perf/experience_wait_s": 0.1}, 1.0)
    auto.observe({**CALM, "perf/experience_wait_s": 0.2}, 1.0)
    assert auto.decide() == 2 and auto.reason == "idle"
    # after a change from 1 to 2 it waits 3 + 2 steps: the batches generated under the old offset
    # arrive first, then a whole window of batches generated under the new one
    assert steps(auto, {**CALM, "perf/experience_wait_s": 0.5}, count=4) == 2 and auto.reason == "settling"
    assert steps(auto, {**CALM, "perf/experience_wait_s": 0.5}, count=1) == 3
    assert steps(auto, {**CALM, "perf/experience_wait_s": 0.5}, count=WINDOW + 3) == 3          # the ceiling
    # 5% idle: hold
    assert steps(auto, {**CALM, "perf/experience_wait_s": 0.05}) == 3 and auto.reason == "hold"


def test_explorers_the_bound_never_holds_do_not_run_further_ahead_however_long_the_trainer_waits():
    auto = AutoOffset(high=4, offset=1)
    # held 0.1 + 0 + 0 s of 3 s (3.3% > 2%) while the trainer waited 30%: the bound costs: grow
    for held in (0.1, 0.0, 0.0):
        auto.observe({**CALM, "perf/experience_wait_s": 0.3, "perf/explorer_blocked_s": held}, 1.0)
    assert auto.decide() == 2 and auto.reason == "idle"
    # two ahead: never held (slower than the trainer on average), still 22% idle: a third step
    # ahead would only age the samples
    for _ in range(4):
        assert steps(auto, {**CALM, "perf/experience_wait_s": 0.22, "perf/explorer_blocked_s": 0.0}) == 2
    assert auto.reason == "hold"
    # held 1.5% of the time: within the margin, hold
    assert steps(auto, {**CALM, "perf/experience_wait_s": 0.22, "perf/explorer_blocked_s": 0.015}) == 2
    assert steps(auto, {**CALM, "perf/experience_wait_s": 0.22, "perf/explorer_blocked_s": 0.025}) == 3


@pytest.mark.parametrize("tag, value", [("train/tis_clip_frac", 0.03), ("train/mismatch_kl_k3", 0.06),
                                        ("train/rollout_ratio_p05", 0.4), ("train/rollout_ratio_p95", 2.5)])
def test_samples_far_from_the_trainer_shrink_the_offset_even_when_it_waits(tag, value):
    auto = AutoOffset(high=4, offset=3)
    assert steps(auto, {**CALM, tag: value, "perf/experience_wait_s": 0.9}) == 2 and auto.reason == "off-policy"
    for _ in range(3):
        steps(auto, {**CALM, tag: value})
    assert auto.offset == 1          # the floor


def test_the_window_mean_decides_and_a_margin_band_holds():
    auto = AutoOffset(high=4, offset=2)
    # corrected shares 0.03, 0.01, 0.005: mean 0.015, not above the 0.02 limit; not calm (> 0.01) either
    for share in (0.03, 0.01, 0.005):
        auto.observe({**CALM, "train/tis_clip_frac": share, "perf/experience_wait_s": 1.0}, 1.0)
    assert auto.decide() == 2 and auto.reason == "hold"
    # a ratio tail at 1.8 neither shrinks (<= 2) nor lets it grow (> 1.5); a KL of 0.03 likewise
    assert steps(auto, {**CALM, "train/rollout_ratio_p95": 1.8, "perf/experience_wait_s": 1.0}) == 2
    assert steps(auto, {**CALM, "train/mismatch_kl_k3": 0.03, "perf/experience_wait_s": 1.0}) == 2
    assert auto.reason == "hold"


def test_metrics_the_run_does_not_log_do_not_vote():
    auto = AutoOffset(high=2, offset=1)
    assert steps(auto, {"perf/experience_wait_s": 0.5}) == 2


def test_the_offset_starts_within_its_range_and_resumes():
    assert AutoOffset(high=3, offset=0).offset == 1 and AutoOffset(high=3, offset=7).offset == 3
    auto = AutoOffset(high=3)
    auto.load_state_dict({"offset": 2})
    assert auto.offset == 2 and auto.state_dict() == {"offset": 2}


def test_the_bound_and_the_schedule_follow_the_offset_in_force():
    roles = RolesConfig(explorer_ranks=1, sync_offset=1, sync_interval=2, auto_sync_offset=3)
    assert roles.start_offset == 1 and roles.max_staleness == 3 + 2 - 1
    assert [roles.required_version(b, 3) for b in range(7)] == [0, 0, 0, 0, 0, 2, 2]
    assert [roles.required_version(b) for b in range(5)] == [0, 0, 0, 2, 2]     # --sync_offset 1


BASE = ["--pretrain", "m", "--prompt_data", "p.jsonl", "--remote_rm_url", "math", "--advantage_estimator",
        "group_norm", "--n_samples_per_prompt", "4", "--rollout_batch_size", "8", "--train_batch_size", "32"]


def parse(*flags):
    parser = PPORunConfig.build_parser("train_ppo")
    return PPORunConfig.from_namespace(parser.parse_args(BASE + list(flags)))


def test_auto_offset_needs_explorers_and_a_positive_ceiling():
    assert parse("--explorer_ranks", "1", "--auto_sync_offset", "2").roles.max_staleness == 2
    with pytest.raises(ConfigError, match="--auto_sync_offset 2 applies to explorers"):
        parse("--auto_sync_offset", "2")
    with pytest.raises(ConfigError, match="--auto_sync_offset must be >= 0"):
        parse("--explorer_ranks", "1", "--auto_sync_offset", "-1")
