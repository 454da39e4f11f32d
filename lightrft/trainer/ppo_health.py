"""What a PPO run does when a health monitor (`lightrft.algorithms.monitors`) finds it failing.

After each step's logs (and evaluation) `act_on_health` gives the step's metrics to the run's
`HealthWatch` and carries out the action `--monitors` chose for each verdict:

- `warn`: one line naming the monitor, the metric, its value, threshold and window;
- `stop`: a report (`health-step{N}-{monitor}.md`, with the metric's history as a table and a plot)
  under `{ckpt_path}/health`, then the run saves and ends with stop_reason `monitor:<name>` (the
  command exits with status 4);
- `rollback`: the newest checkpoint at or before the verdict's last healthy step is restored (the
  actor's, critic's and EMA's weights and optimizer states, and the KL controller, bit for bit);
  the learning rates are multiplied by `--rollback_lr_scale` and the KL coefficient by
  `--rollback_kl_scale`; the prompts drawn since stay consumed (the run skips them) and the step
  counter goes on, so logs, schedules and explorers' weight versions keep moving forward. A run
  takes at most `--max_rollbacks`; a verdict after them, or one with no healthy checkpoint left,
  stops it as `stop` does.

Every action is printed, logged to the trackers (`health/<monitor>` = 1, `health/rollbacks`),
passed to the callbacks' `on_health` and listed in the closing summary line (`health`).

`PPOHealth` is a base class of `PPOTrainer`, not used alone.
"""

from pathlib import Path
from typing import Any, Optional

from lightrft.algorithms.monitors import HealthWatch, Verdict, write_report

EXIT_STATUS = 4      # the exit status of a run a monitor stopped (3: non-finite steps)


class PPOHealth:
    """Health-monitor actions of `PPOTrainer` (see the module docstring)."""

    strategy: Any
    actor_scheduler: Any
    critic_scheduler: Any
    kl_ctl: Any
    callbacks: Any
    rollout: Any
    global_step: int
    checkpoint_steps: Any              # PPOCheckpoints
    restore_checkpoint: Any

    def start_health(self, config, state: Optional[dict] = None) -> HealthWatch:
        """The run's monitors from `config.health`, continuing a resumed run's `state`."""
        self.health = HealthWatch(config.health.actions(), config.health.settings())
        if state:
            self.health.load_state_dict(state)
        return self.health

    def act_on_health(self, config, logs: dict) -> Optional[str]:
        """Judges this step's `logs` and acts (module docstring); returns 'monitor:<name>' when
        the run must stop, else None."""
        health = getattr(self, "health", None)
        if health is None:
            return None
        for verdict in health.observe(self.global_step, logs):
            action = health.actions[verdict.monitor]
            restored, why = None, ""
            if action == "rollback":
                if health.rollbacks >= config.health.max_rollbacks:
                    action, why = "stop", f" (the run took its --max_rollbacks {config.health.max_rollbacks})"
                else:
                    restored = self.rollback(config, verdict)
                    if restored is None:
                        action, why = "stop", (f" (no checkpoint at or before the last healthy step "
                                               f"{verdict.healthy_step} is left in {config.checkpoint.ckpt_path})")
            event = {"monitor": verdict.monitor, "metric": verdict.metric, "value": verdict.value,
                     "threshold": verdict.threshold, "onset": verdict.onset, "step": verdict.step, "action": action}
            if restored is not None:
                event["restored_step"] = restored
            health.events.append(event)
            self.strategy.print(f"health: {verdict.describe()}; action {action}{why}"
                                + (f": restored the checkpoint of step {restored}, learning rates x "
                                   f"{config.health.rollback_lr_scale}, KL coefficient x "
                                   f"{config.health.rollback_kl_scale}" if restored is not None else ""))
            self.log({f"health/{verdict.monitor}": 1.0, "health/rollbacks": float(health.rollbacks)},
                     step=self.global_step)
            self.callbacks.on_health(self, event)
            if action == "stop":
                if self.strategy.is_rank_0():
                    written = write_report(Path(config.checkpoint.ckpt_path) / "health", verdict, action + why,
                                           str(config.checkpoint.ckpt_path))
                    self.strategy.print(f"health report: {written[0]}")
                return f"monitor:{verdict.monitor}"
            if action == "rollback":
                return None        # the restored run starts its windows again
        return None

    def rollback(self, config, verdict: Verdict) -> Optional[int]:
        """Restores the newest checkpoint at or before `verdict.healthy_step` (of the weights the run
        went on with: none of the steps an earlier rollback abandoned) and applies the rollback
        changes; returns its step, or None when there is none."""
        healthy = [(step, folder) for step, folder in self.checkpoint_steps(config)
                   if step <= verdict.healthy_step and self.health.restorable(step)]
        if not healthy:
            return None
        step, folder = max(healthy)
        state = self.restore_checkpoint(config, folder)
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.kl_ctl.value *= config.health.rollback_kl_scale
        for scheduler in (self.actor_scheduler, self.critic_scheduler):
            scale_learning_rate(scheduler, config.health.rollback_lr_scale)
        self.rollout.mark_stale()        # the engine samples with the restored weights next
        self.health.rollbacks += 1
        self.health.forget_after(step)
        return step


def scale_learning_rate(scheduler, scale: float) -> None:
    """Multiplies a learning-rate schedule (and its optimizer's current rates) by `scale`."""
    if scheduler is None:
        return
    if hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * scale for lr in scheduler.base_lrs]
    for group in scheduler.optimizer.param_groups:
        group["lr"] *= scale
    if hasattr(scheduler, "_last_lr"):
        scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
