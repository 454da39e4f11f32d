"""The doctor's `monitors` check: which health monitors a configuration turns on, what each would
do, the rule it applies with this run's thresholds, and what keeps one from working (no evaluation
for `reward_hacking`, checkpoints too far apart for a `rollback`). Reads the config only."""

import dataclasses

from lightrft.algorithms.monitors import MONITORS
from lightrft.doctor.report import CheckResult


def check_monitors(args) -> CheckResult:
    """The monitors of `args` (a `PPORunConfig`) as a table: monitor, action, window, rule."""
    result = CheckResult("monitors", "the health monitors this run turns on and what each would do")
    health = args.health
    actions, settings = health.actions(), health.settings()
    result.rows.append(("monitor", "action", "window", "rule"))
    on = {name: action for name, action in actions.items() if action != "off"}
    for name, monitor in MONITORS.items():
        window = settings.window or monitor.window
        idle = name == "reward_hacking" and not (args.data.eval_data and args.data.eval_steps > 0)
        result.rows.append((name, actions[name], str(window) if name in on else "-",
                            monitor.summary + (" [inactive: no evaluation]" if idle and name in on else "")))
    result.figures = {"actions": actions, "settings": dataclasses.asdict(settings)}
    if not on:
        result.add("WARN", "every monitor is off (--monitors off): the run stops only on non-finite losses; "
                           "--monitors warn (the default) names a failing run in its log")
        return result
    data = args.data
    # Warned of only where the user chose an action for it: `warn` is every monitor's default.
    acting = on.get("reward_hacking") in ("stop", "rollback")
    if acting and not (data.eval_data and data.eval_steps > 0):
        result.add("WARN", "reward_hacking needs held-out rewards: pass --eval_data and --eval_steps N, else it never "
                           "judges")
    elif acting and not args.rewards.eval_remote_rm_url:
        result.add("WARN", "reward_hacking compares the training reward with evaluation scored by the same sources; "
                           "--eval_remote_rm_url names a held-out scorer the policy cannot hack with them")
    rollbacks = [name for name, action in on.items() if action == "rollback"]
    if rollbacks:
        ckpt = args.checkpoint
        # A verdict's last healthy step lies up to window + 1 steps back; the kept checkpoints span
        # save_steps x max_ckpt_num steps.
        reach = max((settings.window or MONITORS[name].window) + 1 for name in rollbacks)
        if ckpt.save_steps * ckpt.max_ckpt_num <= reach:
            span = ckpt.save_steps * ckpt.max_ckpt_num
            result.add("WARN", f"{', '.join(rollbacks)} roll back up to {reach} steps, but the kept checkpoints span "
                               f"{span} (--save_steps {ckpt.save_steps} x --max_ckpt_num {ckpt.max_ckpt_num}): a "
                               "rollback may find no healthy checkpoint and stop instead; raise --max_ckpt_num or save "
                               "more often")
    result.add("PASS", f"{len(on)} monitor(s) on: " + ", ".join(f"{n}={a}" for n, a in on.items()))
    return result
