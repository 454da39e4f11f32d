"""Test hook for the trainers' failure handling, kept out of the training code.

`LIGHTRFT_TRAIN_FAULT="<kind>@<step>[,<kind>@<step>...]"` injects a fault on rank 0 while step
<step> (1-based, the step being made) runs, so tests can check how a run reacts. Kinds:

- `nan-reward`, `nan-logprob`, `nan-advantage`: one sample's reward, rollout log-prob or advantage
  becomes NaN after it is computed (the sample must be skipped and counted);
- `nan-loss`: the first micro-batch's policy loss (SFT: loss) becomes NaN; `nan-grad`: its
  gradient does (the optimizer step must be skipped and counted);
- `sigterm-rollout`, `sigterm-train`, `sigterm-save`: the process sends itself SIGTERM during the
  rollout, during the first optimizer step, or just before the checkpoint of that step is written
  (the run must finish the step, write a complete checkpoint and exit 0);
- `stale-sync`: the weight sync before that step's rollout does not reach rank 0's engine (the
  buckets are still gathered, so ZeRO-3 ranks stay in step); the engine keeps sampling from the
  previous weights, and the run must stop on the engine-vs-trainer log-prob gap. Engines that
  decode with the trainer's own module (`HFEngine`) are never synced, so nothing happens there.

There is one hook point: `install_faults(trainer)`, which the run services call when a run starts.
It wraps the trainer's overridable seams (`make_experience`, `save_checkpoint`, its experience
services' `Generator.generate` / `Scorer.score` / `ExperienceBuilder.advantages`, ...) on this
instance only, so the loops
themselves carry no fault code. Nothing happens when the variable is unset; a malformed value is
an error naming it.
"""

import functools
import os
import signal

import torch

FAULT_ENV = "LIGHTRFT_TRAIN_FAULT"
FAULT_KINDS = ("nan-reward", "nan-logprob", "nan-advantage", "nan-loss", "nan-grad",
               "sigterm-rollout", "sigterm-train", "sigterm-save", "stale-sync")


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


class _Plan:
    """Which faults fire at which step; each (kind, step) fires once, at its first chance."""

    def __init__(self, trainer, plan: dict[str, set[int]]):
        self.trainer, self.plan, self.fired = trainer, plan, set()

    def step(self, offset: int = 1) -> int:
        return self.trainer.global_step + offset

    def due(self, kind: str, offset: int = 1) -> bool:
        key = (kind, self.step(offset))
        if key[1] not in self.plan.get(kind, ()) or key in self.fired:
            return False
        self.fired.add(key)
        return True


def _wrap(obj, name: str, around) -> None:
    """Replaces `obj.name` (a bound method or callable attribute) on this instance with
    `around(original, *args, **kwargs)`."""
    original = getattr(obj, name)
    setattr(obj, name, functools.wraps(original)(lambda *args, **kwargs: around(original, *args, **kwargs)))


def _poison_first(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.clone()
    tensor.view(tensor.size(0), -1)[0, 0] = float("nan")
    return tensor


def install_faults(trainer) -> None:
    """Installs the faults planned in `LIGHTRFT_TRAIN_FAULT` on `trainer` (rank 0 only; a no-op
    when the variable is unset). Works on `PPOTrainer` and the supervised trainers."""
    if FAULT_ENV not in os.environ or int(os.environ.get("RANK", "0")) != 0:
        return
    plan = _Plan(trainer, planned_faults())
    if hasattr(trainer, "experience_services"):
        _install_ppo(trainer, plan)
    elif hasattr(trainer, "batch_loss"):
        def batch_loss(original, *args, **kwargs):
            loss = original(*args, **kwargs)
            return loss * float("nan") if plan.due("nan-loss") else loss
        _wrap(trainer, "batch_loss", batch_loss)


def _install_ppo(trainer, plan: _Plan) -> None:
    services = trainer.experience_services

    def make_experience(original, *args, **kwargs):
        if plan.due("sigterm-rollout"):
            send_sigterm()
        return original(*args, **kwargs)

    def save_checkpoint(original, *args, **kwargs):
        if plan.due("sigterm-save", offset=0):       # the step just completed is being saved
            send_sigterm()
        return original(*args, **kwargs)

    def training_step(original, *args, **kwargs):
        if plan.due("sigterm-train"):
            send_sigterm()
        return original(*args, **kwargs)

    def actor_forward(original, *args, **kwargs):
        log_probs, output = original(*args, **kwargs)
        return (nan_gradient(log_probs) if plan.due("nan-grad") else log_probs), output

    def actor_loss(original, *args, **kwargs):
        loss, metrics = original(*args, **kwargs)
        return (loss * float("nan") if plan.due("nan-loss") else loss), metrics

    def generate(original, *args, stream="train", **kwargs):
        generation = original(*args, stream=stream, **kwargs)
        if stream == "train" and plan.due("nan-logprob"):
            rollout = generation.rollout
            rollout.rollout_log_probs = _poison_first(rollout.rollout_log_probs.float())
        return generation

    def score(original, *args, shaping: bool = True, **kwargs):
        rewards = original(*args, shaping=shaping, **kwargs)
        if shaping and plan.due("nan-reward"):
            rewards.scores = _poison_first(rewards.scores.unsqueeze(1)).squeeze(1)
        return rewards

    def advantages(original, *args, **kwargs):
        outputs = original(*args, **kwargs)
        if plan.due("nan-advantage"):
            outputs.advantages = _poison_first(outputs.advantages)
        return outputs

    def update_weights(original, named_params):
        if plan.step() in plan.plan.get("stale-sync", ()):  # every bucket of that step's sync
            return None
        return original(named_params)

    engine = trainer.rollout.engine
    if trainer.rollout.capabilities.weight_syncs & {"full", "delta"}:     # it is synced through update_weights
        _wrap(engine, "update_weights", update_weights)
    _wrap(trainer, "make_experience", make_experience)
    _wrap(trainer, "save_checkpoint", save_checkpoint)
    _wrap(trainer, "training_step", training_step)
    _wrap(trainer, "_actor_forward", actor_forward)
    _wrap(trainer, "actor_loss_fn", actor_loss)
    _wrap(services.generator, "generate", generate)
    _wrap(services.scorer, "score", score)
    _wrap(services.builder, "advantages", advantages)
