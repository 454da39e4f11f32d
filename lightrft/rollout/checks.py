"""Evidence that a rollout engine samples from the weights the trainer holds.

A rollout engine with its own copy of the weights (vLLM) receives them by a sync after every
optimizer phase. A sync that silently fails to arrive (a tied LM head left behind, a layer the
engine did not reload) leaves every later rollout sampled from other weights, and nothing in the
losses shows it: the PPO ratio compares the trainer with itself, and the mean truncated
importance weight stays near 1 by construction. What does show it is the gap between the log-prob
the engine reported for each sampled token and the trainer's log-prob of the same token, which
every update computes anyway (the "old" log-probs). `engine_logprob_gap` measures it per
micro-batch with no host sync; the trainer logs it every step as
`rollout/engine_logprob_gap_mean` and `_max` and stops past `--engine_logprob_gap_threshold`.

The tolerances are what a correct engine stays under: float32 engines agree with the trainer to
~1e-5 per token (docs/rollout.md), bfloat16 kernels differ more (their own rounding, another
reduction order). The doctor's engine check uses the same numbers.
"""

import torch
from torch import Tensor

# Largest mean / max gap per response token (nats) between engine and trainer log-probs.
ENGINE_GAP_TOLERANCE = {"float32": (1e-3, 2e-2), "bfloat16": (3e-2, 1.0)}


class EngineSyncError(RuntimeError):
    """The rollout engine's log-probs left the trainer's: its weights are not the trained ones."""


def engine_gap_tolerance(bf16: bool) -> tuple[float, float]:
    """(mean, max) tolerance of the engine-vs-trainer log-prob gap at the run's precision."""
    return ENGINE_GAP_TOLERANCE["bfloat16" if bf16 else "float32"]


def engine_logprob_gap(log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Sum, token count and max of |log_probs - rollout_log_probs| over the tokens of `mask`, as
    0-dim float32 tensors (no host sync); the max is NaN where the mask is empty. Sums and counts
    rather than a mean, so the mean over micro-batches and ranks weighs every token once.
    Shape: (B, A) each -> three scalars."""
    mask = mask.bool()
    gap = (log_probs.detach().float() - rollout_log_probs.float()).abs()
    gap = torch.where(mask, gap, torch.zeros_like(gap))
    tokens = mask.sum().float()
    largest = torch.where(tokens > 0, gap.max() if gap.numel() else gap.new_zeros(()), float("nan"))
    return gap.sum(), tokens, largest



class EngineGapCheck:
    """Stops the run (or warns once, action "warn") when a step's rollouts were sampled from other
    weights than the trainer's: a mean engine-vs-trainer log-prob gap (`rollout/engine_logprob_gap_mean`
    of the step's logs) past `threshold` (`--engine_logprob_gap_threshold`). `report` prints a warning."""

    def __init__(self, threshold: float, action: str = "stop", report=print):
        if action not in ("stop", "warn"):
            raise ValueError(f"--engine_logprob_gap_action {action!r}: choose stop or warn")
        self.threshold, self.action, self.report = float(threshold), action, report
        self.warned = False

    def check(self, logs: dict[str, float], step: int, engine_name: str, manager) -> None:
        """Checks step `step`'s logs; `manager` (a `RolloutManager`) names the sync behind them."""
        gap = logs.get("rollout/engine_logprob_gap_mean", float("nan"))
        if not gap > self.threshold:
            return
        message = (f"step {step}: the {engine_name} rollout engine's log-probs differ from the trainer's by "
                   f"{gap:.2e} nats per response token on average (largest "
                   f"{logs.get('rollout/engine_logprob_gap_max', float('nan')):.2e}; "
                   f"--engine_logprob_gap_threshold {self.threshold:.0e}) after weight sync {manager.syncs} "
                   f"({manager.last_sync_bytes / 2**20:.1f} MiB in {manager.last_sync_seconds:.2f} s): the engine "
                   "samples from other weights than the ones trained. `python -m lightrft.cli.doctor` with the same "
                   "flags checks the sync; --engine_logprob_gap_action warn goes on anyway.")
        if self.action == "stop":
            raise EngineSyncError(message)
        if not self.warned:
            self.warned = True
            self.report(f"warning: {message}")
