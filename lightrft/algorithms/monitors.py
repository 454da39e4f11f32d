"""Health monitors: a run that watches its own metrics and acts when it is failing.

A monitor reads the history of the metrics a run already logs (`MetricHistory`: one dict of floats
per step, the values every rank computed alike from all-reduced totals) and returns a `Verdict`
when the run is failing in its way, or None. It adds no device read and no collective: every rank
reaches the same verdict from the same numbers.

The monitors (`MONITORS`, a registry: `register_monitor` adds one) and their defaults
(docs/monitors.md gives each rule):

- `entropy_collapse`: the sampling policy's per-token entropy (`rollout/entropy`, the mean
  negative log-prob of the sampled tokens, an unbiased estimate of it) below `--entropy_floor`, or
  fallen by `--entropy_drop_factor` from its start (the mean of the run's first `window` steps).
- `length_blowup`: the share of responses cut at `--generate_max_len` (`rollout/truncated`) above
  `--max_truncated_share` and 0.2 above its start, or the mean response length above
  `--length_change_factor` times its start.
- `length_collapse`: the mean response length below its start divided by `--length_change_factor`.
- `kl_runaway`: KL to the reference (`rollout/kl`) above `--max_ref_kl`, or the step-to-step
  approximate KL of the update (`train/approx_kl`) above `--max_approx_kl`.
- `mismatch_drift`: the engine/trainer mismatch (`train/mismatch_kl_k3` where rollout correction
  logs it, else `rollout/engine_logprob_gap_mean`) above `--max_mismatch`.
- `grad_spike`: the actor's gradient norm above `--grad_spike_factor` times the median of the 20
  steps before.
- `reward_hacking`: over the last `window` evaluations (`--eval_data`), the held-out reward
  (`eval/reward_greedy`) fell by more than `--reward_hacking_margin` while the training reward
  (`rollout/reward`, averaged over the steps between) rose by more than it.
- `reward_sources`: a reward server or file failing (timeouts, errors, crashes) on more than
  `--max_reward_failure_rate` of its calls since the step before.

A condition must hold `window` logged steps in a row (each monitor's default, or `--monitor_window`)
before the monitor acts; the verdict names the first step of that run, its onset. What it does is
the `action` of `--monitors` (`warn`, `stop`, `rollback`, `off`), carried out by the trainer
(`PPOTrainer.act_on_health`): this module only judges.
"""

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable, Optional

ACTIONS = ("off", "warn", "stop", "rollback")


@dataclass(frozen=True)
class MonitorSettings:
    """The thresholds of the monitors (the `--monitors` section's values)."""

    window: Optional[int] = None          # None: each monitor's own default
    entropy_floor: float = 0.02
    entropy_drop_factor: float = 10.0
    max_truncated_share: float = 0.5
    length_change_factor: float = 3.0
    max_ref_kl: float = 1.0
    max_approx_kl: float = 0.5
    max_mismatch: float = 0.05
    grad_spike_factor: float = 10.0
    reward_hacking_margin: float = 0.05
    max_reward_failure_rate: float = 0.2


@dataclass(frozen=True)
class Verdict:
    """A monitor's finding: `metric` was `value` against `threshold` (`relation`: 'below' or
    'above') for `window` logged steps from `onset` to `step`; `history` is the metric's logged
    (step, value) pairs the judgement read, for the report. `healthy_step`: the newest step whose
    weights the monitor holds healthy, what a rollback restores at most. A step's rollout/* metrics
    and gradient norm describe the weights it started from (the step before's), so their healthy
    step is onset - 2; an update's own metric (approximate KL) and an evaluation after the step
    describe the weights it ended with."""

    monitor: str
    metric: str
    value: float
    threshold: float
    relation: str
    window: int
    onset: int
    step: int
    history: tuple = ()
    healthy_step: int = -1


    def describe(self) -> str:
        steps = f"step {self.step}" if self.onset == self.step else f"steps {self.onset}-{self.step}"
        unit = "evaluation" if self.monitor == "reward_hacking" else "logged step"
        return (f"{self.monitor}: {self.metric} = {self.value:.4g}, {self.relation} the threshold {self.threshold:.4g} "
                f"for {self.window} {unit}{'s' if self.window > 1 else ''} ({steps})")


@dataclass
class MetricHistory:
    """The logged metrics of a run, one dict of floats per logged step (`record`), oldest first."""

    steps: list = field(default_factory=list)          # [(step, {name: value})]

    def record(self, step: int, logs: dict) -> None:
        self.steps.append((step, {k: float(v) for k, v in logs.items() if isinstance(v, (int, float))}))

    def series(self, *names: str) -> list[tuple[int, float]]:
        """(step, value) of the first of `names` each step logged (finite values only)."""
        out = []
        for step, values in self.steps:
            value = next((values[n] for n in names if n in values), None)
            if value is not None and math.isfinite(value):
                out.append((step, value))
        return out

    def state_dict(self, keep: int = 200) -> dict:
        return {"steps": [[step, dict(values)] for step, values in self.steps[-keep:]]}

    def load_state_dict(self, state: dict) -> None:
        self.steps = [(int(step), dict(values)) for step, values in state.get("steps", [])]


@dataclass(frozen=True)
class Monitor:
    """One monitor: `judge(history, settings, window)` returns a Verdict or None; `window` is its
    default number of logged steps (evaluations for `reward_hacking`) the condition must hold."""

    name: str
    judge: Callable[[MetricHistory, MonitorSettings, int], Optional[Verdict]]
    window: int
    metrics: tuple
    summary: str


MONITORS: dict[str, Monitor] = {}


def register_monitor(name: str, window: int, metrics: tuple, summary: str):
    """Adds a monitor to the registry (usable in `--monitors` by `name`)."""
    def register(judge):
        MONITORS[name] = Monitor(name, judge, window, metrics, summary)
        return judge
    return register


def breach_run(series: list[tuple[int, float]], breached: Callable[[int, float], Optional[float]],
               window: int) -> Optional[tuple[int, float, float]]:
    """(onset step, last value, threshold) when the last `window` points of `series` all breach,
    else None. `breached(index, value)` returns the threshold crossed at point `index`, or None."""
    if len(series) < window:
        return None
    threshold = None
    for index in range(len(series) - window, len(series)):
        threshold = breached(index, series[index][1])
        if threshold is None:
            return None
    onset = len(series) - window
    while onset > 0 and breached(onset - 1, series[onset - 1][1]) is not None:
        onset -= 1
    return series[onset][0], series[-1][1], threshold


def beyond_start(series: list[tuple[int, float]], window: int, limit: float,
                 relation: str) -> Optional[tuple[int, float, float]]:
    """`breach_run` of the points after the first `window` (the start they are compared with)
    that lie `relation` ('below' or 'above') `limit`."""
    crossed = (lambda v: v < limit) if relation == "below" else (lambda v: v > limit)
    return breach_run(series, lambda i, v: limit if i >= window and crossed(v) else None, window)


def baseline(series: list[tuple[int, float]], window: int) -> Optional[float]:
    """The mean of the first `window` points: where the metric started."""
    return sum(v for _, v in series[:window]) / window if len(series) >= window else None


def _verdict(name, metric, found, relation, window, series, lag: int = 1) -> Optional[Verdict]:
    """The verdict of a breach `found` by `breach_run`; `lag` 1 for a metric of the weights the
    step started from, 0 for one of the weights it ended with."""
    if found is None:
        return None
    onset, value, threshold = found
    return Verdict(name, metric, value, threshold, relation, window, onset, series[-1][0], tuple(series),
                   healthy_step=onset - 1 - lag)


@register_monitor("entropy_collapse", 3, ("rollout/entropy",),
                  "per-token entropy of the sampled responses below --entropy_floor, or fallen by "
                  "--entropy_drop_factor from its start")
def entropy_collapse(history: MetricHistory, s: MonitorSettings, window: int) -> Optional[Verdict]:
    series = history.series("rollout/entropy")
    start = baseline(series, window)
    if start is None or start <= s.entropy_floor:
        return None         # greedy decoding, or an engine without log-probs: nothing to collapse from
    limit = max(s.entropy_floor, start / s.entropy_drop_factor)
    found = beyond_start(series, window, limit, "below")
    return _verdict("entropy_collapse", "rollout/entropy", found, "below", window, series)


@register_monitor("length_blowup", 3, ("rollout/truncated", "rollout/response_length"),
                  "share of responses cut at --generate_max_len above --max_truncated_share (and 0.2 above "
                  "its start), or mean response length above --length_change_factor x its start")
def length_blowup(history: MetricHistory, s: MonitorSettings, window: int) -> Optional[Verdict]:
    cut = history.series("rollout/truncated")
    start = baseline(cut, window)
    if start is not None:
        limit = max(s.max_truncated_share, start + 0.2)
        found = beyond_start(cut, window, limit, "above")
        if found is not None:
            return _verdict("length_blowup", "rollout/truncated", found, "above", window, cut)
    lengths = history.series("rollout/response_length")
    start = baseline(lengths, window)
    if start is None:
        return None
    limit = start * s.length_change_factor
    found = beyond_start(lengths, window, limit, "above")
    return _verdict("length_blowup", "rollout/response_length", found, "above", window, lengths)


@register_monitor("length_collapse", 3, ("rollout/response_length",),
                  "mean response length below its start / --length_change_factor")
def length_collapse(history: MetricHistory, s: MonitorSettings, window: int) -> Optional[Verdict]:
    lengths = history.series("rollout/response_length")
    start = baseline(lengths, window)
    if start is None:
        return None
    limit = start / s.length_change_factor
    found = beyond_start(lengths, window, limit, "below")
    return _verdict("length_collapse", "rollout/response_length", found, "below", window, lengths)


@register_monitor("kl_runaway", 1, ("rollout/kl", "train/approx_kl"),
                  "KL to the reference above --max_ref_kl, or the update's step-to-step approximate KL above "
                  "--max_approx_kl")
def kl_runaway(history: MetricHistory, s: MonitorSettings, window: int) -> Optional[Verdict]:
    for metric, limit in (("rollout/kl", s.max_ref_kl), ("train/approx_kl", s.max_approx_kl)):
        series = history.series(metric)
        found = breach_run(series, lambda i, v, limit=limit: limit if v > limit else None, window)
        if found is not None:
            return _verdict("kl_runaway", metric, found, "above", window, series,
                            lag=1 if metric == "rollout/kl" else 0)
    return None


@register_monitor("mismatch_drift", 3, ("train/mismatch_kl_k3", "rollout/engine_logprob_gap_mean"),
                  "engine/trainer mismatch (mismatch KL k3, else the mean log-prob gap) above --max_mismatch")
def mismatch_drift(history: MetricHistory, s: MonitorSettings, window: int) -> Optional[Verdict]:
    for metric in ("train/mismatch_kl_k3", "rollout/engine_logprob_gap_mean"):
        series = history.series(metric)
        if series:
            found = breach_run(series, lambda i, v: s.max_mismatch if v > s.max_mismatch else None, window)
            return _verdict("mismatch_drift", metric, found, "above", window, series)
    return None


GRAD_SPIKE_HISTORY = 20       # steps of the running median
GRAD_SPIKE_MIN_HISTORY = 3    # steps needed before a spike can be judged


@register_monitor("grad_spike", 1, ("train/actor_grad_norm",),
                  "actor gradient norm above --grad_spike_factor x the median of the 20 steps before")
def grad_spike(history: MetricHistory, s: MonitorSettings, window: int) -> Optional[Verdict]:
    series = history.series("train/actor_grad_norm")

    def breached(i, v):
        before = [value for _, value in series[max(0, i - GRAD_SPIKE_HISTORY):i]]
        if len(before) < GRAD_SPIKE_MIN_HISTORY:
            return None
        limit = s.grad_spike_factor * statistics.median(before)
        return limit if v > limit else None

    return _verdict("grad_spike", "train/actor_grad_norm", breach_run(series, breached, window), "above", window,
                    series)


@register_monitor("reward_hacking", 3, ("rollout/reward", "eval/reward_greedy"),
                  "over the last evaluations the held-out reward fell by more than --reward_hacking_margin while "
                  "the training reward rose by more than it (needs --eval_data and --eval_steps)")
def reward_hacking(history: MetricHistory, s: MonitorSettings, window: int) -> Optional[Verdict]:
    evals = history.series("eval/reward_greedy")
    if len(evals) < window or window < 2:
        return None
    recent = evals[-window:]
    train = history.series("rollout/reward")

    def train_mean(first: int, last: int) -> Optional[float]:
        values = [v for step, v in train if first <= step <= last]
        return sum(values) / len(values) if values else None

    # The training reward around the first and the last evaluation of the window: the mean of the
    # steps since the evaluation before each.
    before = evals[-window - 1][0] + 1 if len(evals) > window else 0
    first = train_mean(before, recent[0][0])
    last = train_mean(recent[-2][0] + 1, recent[-1][0])
    fell = recent[0][1] - recent[-1][1]
    if first is None or last is None or fell <= s.reward_hacking_margin or last - first <= s.reward_hacking_margin:
        return None
    # The weights evaluated first in the window are the last held healthy.
    return Verdict("reward_hacking", "eval/reward_greedy", recent[-1][1], recent[0][1] - s.reward_hacking_margin,
                   "below", window, recent[0][0], recent[-1][0], tuple(evals), healthy_step=recent[0][0])


@register_monitor("reward_sources", 2, ("rollout/reward_source*_calls",),
                  "a reward server or file failing on more than --max_reward_failure_rate of its calls")
def reward_sources(history: MetricHistory, s: MonitorSettings, window: int) -> Optional[Verdict]:
    if not history.steps:
        return None
    sources = sorted({name[:-len("calls")] for name in history.steps[-1][1]
                      if name.startswith("rollout/reward_source") and name.endswith("_calls")})
    for prefix in sources:
        # The counters are the run's totals: each step's rate is of the calls since the step before.
        totals = [(step, values.get(f"{prefix}calls", 0.0),
                   sum(values.get(f"{prefix}{k}", 0.0) for k in ("timeouts", "errors", "crashes")))
                  for step, values in history.steps if f"{prefix}calls" in values]
        rates = [(step, (failed - totals[i - 1][2]) / (calls - totals[i - 1][1]))
                 for i, (step, calls, failed) in enumerate(totals) if i > 0 and calls > totals[i - 1][1]]
        found = breach_run(rates, lambda i, v: s.max_reward_failure_rate if v > s.max_reward_failure_rate else None,
                           window)
        if found is not None:
            return _verdict("reward_sources", f"{prefix}failure_rate", found, "above", window, rates)
    return None


def parse_monitor_actions(spec: str) -> dict[str, str]:
    """The action of every registered monitor from a `--monitors` value: comma-separated items,
    each `ACTION` (every monitor not named) or `NAME=ACTION`. Raises ValueError naming the item."""
    default, named = "off", {}
    for item in (part.strip() for part in (spec or "off").split(",")):
        if not item:
            continue
        name, _, action = item.rpartition("=")
        if action not in ACTIONS:
            raise ValueError(f"--monitors: {item!r} has the action {action!r}; choose one of {', '.join(ACTIONS)}")
        if not name:
            default = action
        elif name not in MONITORS:
            raise ValueError(f"--monitors: no monitor named {name!r}; the monitors are {', '.join(MONITORS)}")
        else:
            named[name] = action
    return {name: named.get(name, default) for name in MONITORS}


class HealthWatch:
    """The monitors a run turned on, over its metric history: `observe(step, logs)` records a
    logged step and returns the verdicts of the monitors whose condition holds now, each once per
    breach (a monitor speaks again only after its condition cleared). `reset()` after a rollback
    forgets the steps after the restored checkpoint; the starts (the first steps) stay."""

    def __init__(self, actions: dict[str, str], settings: MonitorSettings = MonitorSettings()):
        self.actions = {name: action for name, action in actions.items() if action != "off"}
        self.settings = settings
        self.history = MetricHistory()
        self.active: set[str] = set()
        self.rollbacks = 0
        self.events: list[dict] = []
        self.abandoned: list[tuple[int, int]] = []     # (restored step, last step) of each rollback

    def window(self, name: str) -> int:
        return self.settings.window or MONITORS[name].window

    def observe(self, step: int, logs: dict) -> list[Verdict]:
        if not self.actions:
            return []
        self.history.record(step, logs)
        verdicts = []
        for name in self.actions:
            verdict = MONITORS[name].judge(self.history, self.settings, self.window(name))
            if verdict is None:
                self.active.discard(name)
            elif name not in self.active:
                self.active.add(name)
                verdicts.append(verdict)
        return verdicts

    def forget_after(self, step: int) -> None:
        """Drops the history after `step` (a restored checkpoint's): the windows start again. The
        steps from `step` to the last one recorded are abandoned: their checkpoints belong to the
        weights the rollback threw away and are never restored (`restorable`)."""
        last = self.history.steps[-1][0] if self.history.steps else step
        if last > step:
            self.abandoned.append((step, last))
        self.history.steps = [(s, values) for s, values in self.history.steps if s <= step]
        self.active.clear()

    def restorable(self, step: int) -> bool:
        """Whether the checkpoint of `step` holds weights of the run as it went on (not of steps a
        rollback abandoned)."""
        return not any(first < step <= last for first, last in self.abandoned)

    def state_dict(self) -> dict:
        return {"history": self.history.state_dict(), "rollbacks": self.rollbacks, "events": list(self.events),
                "abandoned": [list(span) for span in self.abandoned]}

    def load_state_dict(self, state: dict) -> None:
        self.history.load_state_dict(state.get("history", {}))
        self.rollbacks = int(state.get("rollbacks", 0))
        self.events = list(state.get("events", []))
        self.abandoned = [tuple(span) for span in state.get("abandoned", [])]


def write_report(folder, verdict: Verdict, action: str, checkpoint: str) -> list:
    """Writes `health-step{N}-{monitor}.md` (what was seen, the metric's history as a table) and,
    with matplotlib installed (`lightrft[plot]`), the history as a `.png` plot beside it, under
    `folder`; returns the paths written."""
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"health-step{verdict.step}-{verdict.monitor}"
    rows = "\n".join(f"| {step} | {value:.6g} | {'yes' if step >= verdict.onset else ''} |"
                     for step, value in verdict.history)
    written = []
    plot = _plot(verdict, stem.with_suffix(".png"))
    lines = [f"# Health report: {verdict.monitor} at step {verdict.step}", "",
             f"- finding: {verdict.describe()}",
             f"- onset: step {verdict.onset}; last step held healthy: {verdict.healthy_step}",
             f"- action: {action}", f"- checkpoint: {checkpoint}",
             f"- rule: {MONITORS[verdict.monitor].summary}" if verdict.monitor in MONITORS else "", "",
             f"![{verdict.metric}]({plot.name})" if plot else "(plot: `pip install lightrft[plot]` for matplotlib)",
             "", f"| step | {verdict.metric} | in the breach |", "|---|---|---|", rows, ""]
    stem.with_suffix(".md").write_text("\n".join(lines))
    written.append(stem.with_suffix(".md"))
    if plot:
        written.append(plot)
    return written


def _plot(verdict: Verdict, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axes = plt.subplots(figsize=(6, 3.2))
    steps, values = zip(*verdict.history) if verdict.history else ((), ())
    axes.plot(steps, values, marker="o", markersize=3, label=verdict.metric)
    axes.axhline(verdict.threshold, color="tab:red", linestyle="--", label=f"threshold {verdict.threshold:.4g}")
    axes.axvline(verdict.onset, color="tab:gray", linestyle=":", label=f"onset (step {verdict.onset})")
    axes.set_xlabel("step")
    axes.set_title(f"{verdict.monitor}: {verdict.relation} the threshold from step {verdict.onset}")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
