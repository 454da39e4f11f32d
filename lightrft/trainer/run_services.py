"""Run services: what every trainer (PPO, SFT, reward model) needs around its loop, in one place.

- checkpoints: a resumable checkpoint is a list of DeepSpeed engines written in order under one
  tag (the last one's `latest` pointer makes the step resumable); a failed save is counted and
  reported, and never removes the previous checkpoint (`lightrft.strategy.checkpoint_io` writes
  crash-consistently);
- resume: the newest intact checkpoint (complete, and its files matching their checksums), with
  the options that define the experiment checked against the current ones before DeepSpeed reads
  any state (so a changed --pretrain is named, not reported as a size mismatch), and every rank's
  RNG states restored; `check_resume_before_start` runs the same option check before the run
  writes anything (its run_config.yaml) or builds a model;
- preemption: SIGTERM / SIGUSR1 finish the step, save and exit within a grace period;
- non-finite guard: optimizer steps skipped for a NaN/Inf loss or gradient are counted, and a
  streak of them saves and stops the run;
- the fault-injection hook point for tests (`lightrft.utils.faults.install_faults`).

The lock on `--ckpt_path` and the launcher lifeline are process-wide and start with the command
(`lightrft.cli.common.run_command`).
"""

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from lightrft.strategy import checkpoint_io
from lightrft.strategy.checkpoint_io import CheckpointCorruptError, CheckpointSaveError
from lightrft.trainer.checkpoint import capture_rng_state, check_resume_options, pinned_options, restore_rng_state
from lightrft.trainer.preemption import PreemptionFlag
from lightrft.trainer.guards import NonFiniteGuard
from lightrft.utils.distributed import is_dist_initialized
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
        """Loads the newest intact checkpoint of `primary` and the same tag of `others`; checks
        the pinned `options` and restores this rank's RNG. Returns the primary client state, or
        None when there is no checkpoint and `required` is False. `unit` names what
        `consumed_samples` counts, for the message.

        The options are compared before DeepSpeed reads any state: a run resumed with another
        --pretrain is told which flag changed, not DeepSpeed's size mismatch."""
        picked = self._pick_checkpoint(primary, others)
        if picked is None:
            if required:
                raise nothing_to_load(primary.folder)
            return None
        path, tag = picked
        state = checkpoint_io.load_client_state(Path(path), self.strategy.rank)
        saved = checkpoint_io.saved_ranks(Path(path))
        if saved and saved != self.strategy.world_size:
            # Resumed on another number of ranks: what each saved rank recorded for itself (an
            # explorer run's prompt ledger) is the sum of all of theirs (`ExplorerLink.load_state_dict`).
            state["saved_rank_states"] = [checkpoint_io.load_client_state(Path(path), rank) for rank in range(saved)]
        check_resume_options(state.get("options", {}), options, path)
        for part in (primary, *others):
            self._load_engine(part, tag, path, options)
        restore_rng_state(state["rng"])       # each rank saved and loads its own
        self.strategy.print(f"resumed from {path}: step {state['global_step']}, "
                            f"{state['consumed_samples']} {unit} consumed")
        return state

    def _pick_checkpoint(self, primary: CheckpointPart, others: Sequence[CheckpointPart]) -> Optional[tuple[str, str]]:
        """(folder, tag) of the checkpoint to resume, or None when there is none. Rank 0 picks it
        (clearing stale temporary folders of killed saves, verifying checksums, finding the same tag
        of every other part) and tells the other ranks, so all load the same one; an error is
        raised on every rank."""
        choice = [None]
        if self.strategy.is_rank_0():
            try:
                for part in (primary, *others):
                    checkpoint_io.remove_stale_temporaries(Path(part.folder))
                choice = [("ok", self._find_on_rank_0(primary, others))]
            except CheckpointCorruptError as err:
                choice = [("corrupt", str(err))]
            except FileNotFoundError as err:
                choice = [("missing", str(err))]
        if is_dist_initialized():
            dist.broadcast_object_list(choice, src=0)
        status, value = choice[0]
        if status == "corrupt":
            raise CheckpointCorruptError(value)
        if status == "missing":
            raise FileNotFoundError(value)
        return value

    @staticmethod
    def _find_on_rank_0(primary: CheckpointPart, others: Sequence[CheckpointPart]) -> Optional[tuple[str, str]]:
        path = checkpoint_io.resolve_checkpoint(Path(primary.folder))
        if path is None:
            return None
        tag = checkpoint_io.read_marker(path)["tag"]
        for part in others:
            try:
                checkpoint_io.resolve_checkpoint(Path(part.folder), tag)
            except FileNotFoundError as err:
                raise type(err)(f"the checkpoint {path} has no matching intact checkpoint {tag} under "
                                f"{part.folder}: {err}") from err
        return str(path), tag

    def _load_engine(self, part: CheckpointPart, tag: str, path: str, options: Mapping[str, Any]) -> None:
        try:
            self.strategy.load_ckpt(part.model, part.folder, tag=tag, load_optimizer_states=part.load_optimizer_states,
                                    load_lr_scheduler_states=part.load_optimizer_states)
        except RuntimeError as err:
            # DeepSpeed's words for a model of other shapes: ZeRO-0/1/2 load the module's state dict,
            # ZeRO-3 copies the flat partitions of the optimizer.
            mismatch = next((line.strip() for line in str(err).splitlines()
                             if "size mismatch" in line or "must match the size of tensor" in line), None)
            if mismatch is None:
                raise
            raise ValueError(f"cannot resume from {path}: the model this run built does not have the shapes of the "
                             f"checkpoint in {part.folder} ({mismatch}). Was the model in --pretrain "
                             f"{options.get('pretrain', '')} replaced? Resume with the model the run started from, "
                             "or start a new run with a fresh --ckpt_path") from err


def nothing_to_load(folder) -> FileNotFoundError:
    """The error of a required resume (`--load_checkpoint`) with no complete checkpoint in `folder`."""
    return FileNotFoundError(f"--load_checkpoint: no complete checkpoint under {folder}; pass "
                             "--load_checkpoint if_present to start fresh when none exists")


def check_resume_before_start(ckpt_path: Optional[str], args: Any) -> None:
    """When `args.checkpoint.load_checkpoint` (`args` a run config) asks to resume, refuses before
    the run writes its run_config.yaml or builds any model:
    - a required resume (`--load_checkpoint` without `if_present`) with no complete checkpoint
      anywhere in `ckpt_path` (FileNotFoundError, the message `RunServices.load` would give later);
    - a resume whose pinned options differ from the checkpoint's (ValueError naming every changed flag).
    The checkpoint is the one a resume picks in `ckpt_path` or in one of its folders (e.g. `_actor`),
    read as `RunServices.load` reads it but without hashing its files (`RunServices.load` does that,
    and checks again). Rank 0 only."""
    mode = args.checkpoint.load_checkpoint
    if not mode or not ckpt_path:
        return
    root = Path(ckpt_path)
    folders = [root, *sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))] \
        if root.is_dir() else []
    found = False
    for folder in folders:
        path = checkpoint_io.resolve_checkpoint(folder, verify=False)
        found = found or path is not None
        saved = checkpoint_io.load_client_state(path, 0).get("options") if path is not None else None
        if saved:
            check_resume_options(saved, pinned_options(args, tuple(saved)), str(path))
    if not found and mode == "required":
        raise nothing_to_load(ckpt_path)
