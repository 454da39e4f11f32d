"""The health monitors' judgements on hand-made metric histories: each fires at the step its rule
says, names the onset, the threshold and the last healthy step, and stays silent on a healthy run."""

import pytest

from lightrft.algorithms.monitors import (MONITORS, HealthWatch, MetricHistory, MonitorSettings, breach_run,
                                          parse_monitor_actions, write_report)

S = MonitorSettings()


def history(**series) -> MetricHistory:
    """Steps 1..N with each named metric's values (None: not logged that step)."""
    h = MetricHistory()
    length = max(len(v) for v in series.values())
    for i in range(length):
        h.record(i + 1, {name.replace("__", "/"): values[i] for name, values in series.items()
                         if i < len(values) and values[i] is not None})
    return h


def judge(name, h, window=None):
    return MONITORS[name].judge(h, S, window or MONITORS[name].window)


def test_breach_run_needs_the_whole_window_and_extends_the_onset_back():
    series = [(1, 0.0), (2, 5.0), (3, 6.0), (4, 7.0)]
    above = lambda i, v: 4.0 if v > 4.0 else None            # noqa: E731
    assert breach_run(series, above, 3) == (2, 7.0, 4.0)       # steps 2-4 breach: onset 2
    assert breach_run(series, above, 4) is None                # step 1 did not
    assert breach_run(series[:3], above, 3) is None
    assert breach_run(series, above, 1) == (2, 7.0, 4.0)       # the onset is the run's first step, not the last


def test_entropy_collapse_against_its_start_and_the_floor():
    # Start (mean of the first 3 steps) 2.0: the limit is max(0.02, 2.0 / 10) = 0.2.
    h = history(rollout__entropy=[2.0, 2.0, 2.0, 1.5, 0.15, 0.1, 0.05])
    verdict = judge("entropy_collapse", h)
    assert (verdict.onset, verdict.step, verdict.threshold, verdict.value) == (5, 7, pytest.approx(0.2), 0.05)
    assert verdict.healthy_step == 3          # the rollout of step 5 came from step 4's weights
    assert judge("entropy_collapse", history(rollout__entropy=[2.0, 2.0, 2.0, 1.5, 0.15, 0.1, 0.5])) is None
    # A run that starts at (near) zero entropy (greedy decoding) has nothing to collapse from.
    assert judge("entropy_collapse", history(rollout__entropy=[0.01] * 8)) is None


def test_length_blowup_on_the_truncated_share_and_on_the_mean_length():
    # Truncated share starts at 0.1: the limit is max(0.5, 0.1 + 0.2) = 0.5.
    h = history(rollout__truncated=[0.1, 0.1, 0.1, 0.3, 0.6, 0.7, 0.9], rollout__response_length=[4] * 7)
    verdict = judge("length_blowup", h)
    assert (verdict.metric, verdict.onset, verdict.step, verdict.threshold) == ("rollout/truncated", 5, 7, 0.5)
    # A run truncated from its start (0.9) needs 0.9 + 0.2: never.
    assert judge("length_blowup", history(rollout__truncated=[0.9] * 8, rollout__response_length=[6] * 8)) is None
    lengths = history(rollout__truncated=[0.0] * 7, rollout__response_length=[10, 10, 10, 20, 31, 40, 50])
    verdict = judge("length_blowup", lengths)
    assert (verdict.metric, verdict.onset, verdict.threshold) == ("rollout/response_length", 5, 30.0)


def test_length_collapse():
    verdict = judge("length_collapse", history(rollout__response_length=[9, 9, 9, 5, 2.9, 2, 1]))
    assert (verdict.onset, verdict.step, verdict.threshold) == (5, 7, 3.0)
    assert judge("length_collapse", history(rollout__response_length=[9, 9, 9, 5, 3, 2, 1])) is None   # 3 is not < 3


def test_kl_runaway_on_the_reference_kl_and_on_the_update():
    verdict = judge("kl_runaway", history(rollout__kl=[0.1, 0.5, 1.2, 1.5]))
    assert (verdict.metric, verdict.onset, verdict.step, verdict.healthy_step) == ("rollout/kl", 3, 4, 1)
    # The update's own KL describes the weights it made: the step before the onset is healthy.
    verdict = judge("kl_runaway", history(train__approx_kl=[0.01, 0.01, 0.9]))
    assert (verdict.metric, verdict.onset, verdict.healthy_step, verdict.threshold) == ("train/approx_kl", 3, 2, 0.5)
    assert judge("kl_runaway", history(train__approx_kl=[0.01, 0.9, 0.01])) is None       # it ended
    assert judge("kl_runaway", history(train__approx_kl=[0.01, 0.9, 0.01, 0.9]), window=2) is None   # not 2 in a row


def test_mismatch_drift_prefers_the_mismatch_kl():
    h = history(train__mismatch_kl_k3=[0.0, 0.06, 0.07, 0.08], rollout__engine_logprob_gap_mean=[0.0] * 4)
    verdict = judge("mismatch_drift", h)
    assert (verdict.metric, verdict.onset, verdict.threshold) == ("train/mismatch_kl_k3", 2, 0.05)
    assert judge("mismatch_drift", history(rollout__engine_logprob_gap_mean=[0.0, 0.1, 0.1])) is None
    assert judge("mismatch_drift", history(rollout__engine_logprob_gap_mean=[0.0, 0.1, 0.1, 0.1])).onset == 2


def test_grad_spike_against_the_running_median():
    # Median of the steps before step 6: 1.0 -> limit 10; 11 is a spike, 9 is not.
    h = history(train__actor_grad_norm=[1.0, 0.8, 1.2, 1.0, 1.1, 11.0])
    verdict = judge("grad_spike", h)
    assert (verdict.onset, verdict.step, verdict.threshold, verdict.healthy_step) == (6, 6, 10.0, 4)
    assert judge("grad_spike", history(train__actor_grad_norm=[1.0, 0.8, 1.2, 1.0, 1.1, 9.0])) is None
    assert judge("grad_spike", history(train__actor_grad_norm=[1.0, 0.8, 20.0])) is None   # too little history


def test_reward_hacking_needs_training_up_and_held_out_down():
    # Evaluations at steps 2, 4, 6 (held-out 0.8 -> 0.6); training reward 0.3 around the first,
    # 0.9 around the last: both moved by more than 0.05.
    train = [0.3, 0.3, 0.5, 0.6, 0.9, 0.9]
    evals = [None, 0.8, None, 0.7, None, 0.6]
    verdict = judge("reward_hacking", history(rollout__reward=train, eval__reward_greedy=evals))
    assert (verdict.onset, verdict.step, verdict.healthy_step) == (2, 6, 2)
    assert verdict.value == 0.6 and verdict.threshold == pytest.approx(0.75)
    # Held-out reward rising with the training reward: learning, not hacking.
    assert judge("reward_hacking", history(rollout__reward=train, eval__reward_greedy=[None, 0.6, None, 0.7, None,
                                                                                     0.8])) is None
    # Without evaluations it cannot judge.
    assert judge("reward_hacking", history(rollout__reward=train)) is None


def test_reward_sources_rate_is_of_the_calls_since_the_step_before():
    # Totals: calls 10, 20, 30, 40; errors 0, 1, 4, 8 -> rates 0.1, 0.3, 0.4 of the new calls.
    h = history(rollout__reward_source0_calls=[10, 20, 30, 40], rollout__reward_source0_errors=[0, 1, 4, 8],
                rollout__reward_source0_timeouts=[0, 0, 0, 0])
    verdict = judge("reward_sources", h)
    assert (verdict.metric, verdict.onset, verdict.step) == ("rollout/reward_source0_failure_rate", 3, 4)
    assert verdict.value == pytest.approx(0.4)
    assert judge("reward_sources", history(rollout__reward_source0_calls=[10, 20, 30],
                                           rollout__reward_source0_errors=[1, 2, 3])) is None


def test_monitor_actions_from_the_flag():
    assert set(parse_monitor_actions("warn").values()) == {"warn"}
    actions = parse_monitor_actions("off,kl_runaway=rollback, grad_spike=stop")
    assert actions["kl_runaway"] == "rollback" and actions["grad_spike"] == "stop"
    assert actions["length_collapse"] == "off"
    with pytest.raises(ValueError, match="no monitor named 'kl'.*entropy_collapse"):
        parse_monitor_actions("kl=stop")
    with pytest.raises(ValueError, match="'halt'.*off, warn, stop, rollback"):
        parse_monitor_actions("grad_spike=halt")


def test_watch_speaks_once_per_breach_and_forgets_after_a_rollback():
    watch = HealthWatch(parse_monitor_actions("off,kl_runaway=warn"), MonitorSettings(window=2))
    said = [(step, [v.monitor for v in watch.observe(step, {"train/approx_kl": value})])
            for step, value in enumerate([0.0, 0.9, 0.9, 0.9, 0.0, 0.9, 0.9], start=1)]
    assert said == [(1, []), (2, []), (3, ["kl_runaway"]), (4, []), (5, []), (6, []), (7, ["kl_runaway"])]
    watch.forget_after(4)
    assert [s for s, _ in watch.history.steps] == [1, 2, 3, 4] and not watch.active
    state = watch.state_dict()
    again = HealthWatch(parse_monitor_actions("warn"))
    again.load_state_dict(state)
    assert again.history.steps == watch.history.steps
    # Monitors that are off judge nothing and keep no history.
    assert HealthWatch(parse_monitor_actions("off")).observe(1, {"train/approx_kl": 9.0}) == []


def test_report_has_the_history_table_and_a_plot(tmp_path):
    verdict = judge("kl_runaway", history(train__approx_kl=[0.01, 0.02, 0.8, 0.9]), window=2)
    written = write_report(tmp_path, verdict, "stop", "ckpt")
    text = written[0].read_text()
    assert written[0].name == "health-step4-kl_runaway.md" and "| 3 | 0.8 | yes |" in text and "| 2 | 0.02 |  |" in text
    assert "onset: step 3" in text and "action: stop" in text
    assert written[1].suffix == ".png" and written[1].read_bytes()[:4] == b"\x89PNG"


def test_the_doctor_lists_the_monitors_and_what_keeps_one_from_working():
    from lightrft.cli.train_ppo import parse_args
    from lightrft.doctor import check_monitors

    base = ["--pretrain", "m", "--prompt_data", "p.jsonl", "--remote_rm_url", "math", "--advantage_estimator",
            "group_norm", "--n_samples_per_prompt", "4"]
    result = check_monitors(parse_args(base))
    assert result.status == "PASS" and len(result.rows) == 1 + len(MONITORS)
    assert all(row[1] == "warn" for row in result.rows[1:])
    result = check_monitors(parse_args(base + ["--monitors", "off,reward_hacking=stop,kl_runaway=rollback",
                                               "--save_steps", "1", "--max_ckpt_num", "3"]))
    rows = {row[0]: row[1:3] for row in result.rows[1:]}
    assert rows["reward_hacking"] == ("stop", "3") and rows["kl_runaway"] == ("rollback", "1")
    assert rows["grad_spike"] == ("off", "-")
    warnings = [f.text for f in result.findings if f.level == "WARN"]
    assert any("--eval_data" in w for w in warnings) and not any("kept checkpoints" in w for w in warnings)
    result = check_monitors(parse_args(base + ["--monitors", "length_blowup=rollback", "--save_steps", "1",
                                               "--max_ckpt_num", "3"]))
    assert any("kept checkpoints span 3" in f.text for f in result.findings)     # window 3 + 1 steps back
    assert check_monitors(parse_args(base + ["--monitors", "off"])).status == "WARN"


def test_rollback_needs_checkpoints(capsys):
    from lightrft.cli.train_ppo import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--pretrain", "m", "--prompt_data", "p.jsonl", "--remote_rm_url", "math", "--advantage_estimator",
                    "group_norm", "--n_samples_per_prompt", "4", "--monitors", "grad_spike=rollback"])
    assert "--monitors grad_spike=rollback restores the last healthy checkpoint: pass --save_steps N" in \
        capsys.readouterr().err


def test_checkpoints_of_abandoned_steps_are_not_restorable():
    watch = HealthWatch(parse_monitor_actions("warn"))
    for step in range(1, 7):
        watch.observe(step, {"rollout/reward": 0.0})
    watch.forget_after(4)            # a rollback at step 6 to the checkpoint of step 4
    for step in range(7, 9):
        watch.observe(step, {"rollout/reward": 0.0})
    assert [watch.restorable(s) for s in range(1, 9)] == [True] * 4 + [False, False] + [True, True]
    again = HealthWatch(parse_monitor_actions("warn"))
    again.load_state_dict(watch.state_dict())
    assert not again.restorable(6) and again.restorable(7)
