"""Test hook for the trainers' failure handling.

`LIGHTRFT_TRAIN_FAULT="<kind>@<step>[,<kind>@<step>...]"` injects a fault on rank 0 while step
<step> (1-based, the step being made) runs, so tests can check how a run reacts. Kinds:

- `nan-reward`, `nan-logprob`, `nan-advantage`: one sample's reward, old log-prob or advantage
  becomes NaN after it is computed (the sample must be skipped and counted);
- `nan-loss`: the first micro-batch's policy loss becomes NaN; `nan-grad`: its gradient does
  (the optimizer step must be skipped and counted);
- `sigterm-rollout`, `sigterm-train`, `sigterm-save`: the process sends itself SIGTERM during the
  rollout, during the first optimizer step, or just before the checkpoint of that step is written
  (the run must finish the step, write a complete checkpoint and exit 0).

Nothing happens when the variable is unset; a malformed value is an error naming it.
"""

import os
import signal

import torch

FAULT_ENV = "LIGHTRFT_TRAIN_FAULT"
FAULT_KINDS = ("nan-reward", "nan-logprob", "nan-advantage", "nan-loss", "nan-grad",
               "sigterm-rollout", "sigterm-train", "sigterm-save")


def planned_faults() -> dict[str, set[int]]:
    spec = os.environ.get(FAULT_ENV, "").strip()
    plan: dict[str, set[int]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, _, step = item.partition("@")
        if kind not in FAULT_KINDS or not step.isdigit():
            raise ValueError(f"{FAULT_ENV}={spec!r}: expected <kind>@<step>[,...] with kind one of "
                             f"{', '.join(FAULT_KINDS)}")
        plan.setdefault(kind, set()).add(int(step))
    return plan


def fault_now(kind: str, step: int) -> bool:
    """Whether `kind` is planned for `step` on this process (rank 0 only)."""
    if FAULT_ENV not in os.environ or int(os.environ.get("RANK", "0")) != 0:
        return False
    return step in planned_faults().get(kind, set())


def send_sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


class _NaNGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


def nan_gradient(x: torch.Tensor) -> torch.Tensor:
    """Identity in the forward pass; NaN gradient in the backward pass."""
    return _NaNGrad.apply(x)
