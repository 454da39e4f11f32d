"""Run services: what every trainer (PPO, SFT, reward model) needs around its loop, in one place.

- checkpoints: a resumable checkpoint is a list of DeepSpeed engines written in order under one
  tag (the last one's `latest` pointer makes the step resumable); a failed save is counted and
  reported, and never removes the previous checkpoint (`lightrft.strategy.checkpoint_io` writes
  crash-consistently);
- resume: the newest complete checkpoint, with the options that define the experiment checked
  against the current ones, and every rank's RNG states restored;
- preemption: SIGTERM / SIGUSR1 finish the step, save and exit within a grace period;
- non-finite guard: optimizer steps skipped for a NaN/Inf loss or gradient are counted, and a
  streak of them saves and stops the run;
- the fault-injection hook point for tests (`lightrft.utils.faults.install_faults`).

The lock on `--ckpt_path` and the launcher lifeline are process-wide and start with the command
(`lightrft.cli.common.run_command`).
"""

import gc
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from lightrft.strategy.checkpoint_io import CheckpointSaveError
from lightrft.trainer.checkpoint import PreemptionFlag, capture_rng_state, check_resume_options, restore_rng_state
from lightrft.trainer.guards import NonFiniteGuard
from lightrft.utils.faults import install_faults


@dataclass(frozen=True)
class CheckpointPart:
    """One engine of a checkpoint: where it goes, the engine, and its client state."""

    folder: str
    model: Any
    client_state: Optional[dict] = None
    load_optimizer_states: bool = True


class RunServices:
    """Checkpoint save/resume, preemption and the non-finite guard of one run (see module doc)."""

    def __init__(self, strategy, *, preemption_grace: float = 600.0, max_nonfinite_steps: int = 3,
                 max_ckpt_num: int = 3):
        self.strategy = strategy
        self.preemption = PreemptionFlag(preemption_grace)
        self.guard = NonFiniteGuard(max_nonfinite_steps)
        self.max_ckpt_num = max_ckpt_num
        self.failed_saves = 0

    # ------------------------------------------------------------------------------ lifecycle
    def start(self, trainer) -> None:
        """Called when the loop starts: signal handlers, planned test faults, and the collector
        told to leave the objects built so far alone."""
        self.preemption.install()
        install_faults(trainer)
        # Models, tokenizer, DeepSpeed and library state live for the whole run. Left in the
        # collector's oldest generation, each full collection walks all of them again (~170 ms on
        # the benchmark model, every ~10 steps): frozen, a collection walks only the new objects.
        gc.collect()
        gc.freeze()

    def stop(self) -> None:
        self.preemption.restore()
        gc.unfreeze()

    def preempted(self) -> bool:
        """True on every rank once any rank received SIGTERM/SIGUSR1 (one all-reduce)."""
        flag = torch.tensor([1.0 if self.preemption.raised else 0.0], device=self.strategy.device)
        return self.strategy.all_reduce(flag, op="max").item() > 0

    def record_step(self, nonfinite_sources: Sequence[str]) -> None:
        """Records one optimizer step: `nonfinite_sources` names what was not finite (empty if none)."""
        self.guard.record(list(nonfinite_sources))

    def stop_reason(self, ckpt_path: str, preempted: Optional[bool] = None) -> Optional[str]:
        """'preempted' (a signal on any rank), 'nonfinite' (a streak of skipped steps) or None.
        `preempted`: the flag already reduced over ranks (see `preempted`), else it is reduced here."""
        if self.preempted() if preempted is None else preempted:
            return "preempted"
        if self.guard.exhausted:
            self.strategy.print(self.guard.message(ckpt_path))
            return "nonfinite"
        return None

    # ---------------------------------------------------------------------------- checkpoints
    def save(self, parts: Sequence[CheckpointPart], tag: str, where: str) -> bool:
        """Writes `parts` in order under `tag`; returns False (counted, reported) if a save failed.
        The previous checkpoints stay intact either way."""
        try:
            for part in parts:
                self.strategy.save_ckpt(part.model, part.folder, tag, self.max_ckpt_num,
                                        client_state=part.client_state or {})
        except CheckpointSaveError as err:
            # A full disk may clear up before the next save, so the run goes on.
            self.failed_saves += 1
            self.strategy.print(f"checkpoint {tag} was not saved: {err}. The previous checkpoints in {where} are "
                                f"intact; training continues (failed saves so far: {self.failed_saves})")
            return False
        return True

    @staticmethod
    def client_state(counters: Mapping[str, Any], options: Mapping[str, Any]) -> dict:
        """A checkpoint's client state: the trainer's counters, the pinned options and this rank's RNG."""
        return {**counters, "options": dict(options), "rng": capture_rng_state()}

    def load(self, primary: CheckpointPart, others: Sequence[CheckpointPart] = (), *, required: bool,
             options: Mapping[str, Any], unit: str = "samples") -> Optional[dict]:
        """Loads the newest complete checkpoint of `primary` and the same tag of `others`; checks
        the pinned `options` and restores this rank's RNG. Returns the primary client state, or
        None when there is no checkpoint and `required` is False. `unit` names what
        `consumed_samples` counts, for the message."""
        path, state = self.strategy.load_ckpt(primary.model, primary.folder)
        if path is None:
            if required:
                raise FileNotFoundError(f"--load_checkpoint: no complete checkpoint under {primary.folder}; pass "
                                        "--load_checkpoint if_present to start fresh when none exists")
            return None
        check_resume_options(state.get("options", {}), options, path)
        tag = f"global_step{state['global_step']}"
        for part in others:
            try:
                self.strategy.load_ckpt(part.model, part.folder, tag=tag, load_optimizer_states=part.load_optimizer_states,
                                        load_lr_scheduler_states=part.load_optimizer_states)
            except FileNotFoundError as err:
                raise FileNotFoundError(f"the checkpoint {path} has no matching complete checkpoint {tag} under "
                                        f"{part.folder}: {err}") from err
        restore_rng_state(state["rng"])       # each rank saved and loads its own
        self.strategy.print(f"resumed from {path}: step {state['global_step']}, "
                            f"{state['consumed_samples']} {unit} consumed")
        return state
