"""Gradient clipping under ZeRO-0 in fp32: the strategy's own clipping against DeepSpeed's, and the
step the strategy skips when a gradient is not finite.

Run by tests/strategy/test_optimizer.py with `torchrun --nproc_per_node 2`. Both paths train the same
tiny model with SGD on the same batches (two micro-batches per optimizer step on each rank, `max_norm`
small enough that every step clips) and write the final weights and, per rank, the gradient norm
of each optimizer step and the all-reduces each optimizer step made. The strategy path also reports
`strategy.grad_norm`; the DeepSpeed path measures the norm of the averaged gradients itself, in
float64, right before DeepSpeed clips them.

The `nan` paths (clipping on, and `max_norm` 0) make rank 1's gradient NaN in the second optimizer
step and record, per step, whether the weights moved, the learning-rate scheduler's position and
DeepSpeed's count of skipped steps.
"""

import argparse
import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist

from lightrft.strategy import DeepspeedStrategy, StrategyConfig
from lightrft.utils.tiny import build_char_tokenizer, build_tiny_causal_lm
from lightrft.utils.program import run_program

MAX_NORM = 0.05
STEPS = 3


class DeepSpeedClips(DeepspeedStrategy):
    """The path DeepSpeed takes by itself: `gradient_clipping` in its config, clipped in `step()`."""

    @property
    def clips_gradients(self) -> bool:
        return False

    def optimizer_step(self, optimizer, model, scheduler=None, name: str = "model") -> None:
        if model.is_gradient_accumulation_boundary():
            grads = [p.grad.double() for p in model.module.parameters() if p.grad is not None]
            self.reference_norms.append(torch.sqrt(sum((g ** 2).sum() for g in grads)).item())
        super().optimizer_step(optimizer, model, scheduler, name)


def train(strategy: DeepspeedStrategy, out: Path, name: str, nan_step: int | None = None) -> dict:
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, arch="qwen2", seed=0)
    # Plain SGD: the clip coefficient scales the update itself (Adam would mostly normalise it away).
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0)   # constant; counts its steps
    engine, optim, scheduler = strategy.prepare((model, optim, scheduler))
    calls = []
    original = dist.all_reduce

    def counted(*args, **kwargs):
        calls[-1] += 1
        return original(*args, **kwargs)

    norms, moved, finite, scheduler_steps, skipped = [], [], [], [], []
    dist.all_reduce = counted
    try:
        for step in range(STEPS):
            calls.append(0)
            before = [p.detach().clone() for p in engine.module.parameters()]
            for micro in range(2):
                generator = torch.Generator().manual_seed(100 * step + 10 * strategy.rank + micro)
                ids = 4 + torch.randint(0, 90, (2, 12), generator=generator)
                loss = engine(input_ids=ids, labels=ids).loss
                if step == nan_step and strategy.rank == 1 and micro == 0:
                    loss = loss * float("nan")      # a NaN gradient on one rank reaches both after the all-reduce
                strategy.backward(loss, engine, optim)
                strategy.optimizer_step(optim, engine, scheduler)
            norms.append(strategy.grad_norm(engine))
            moved.append(max((p.detach() - b).abs().max().item() for p, b in zip(engine.module.parameters(), before)))
            finite.append(all(bool(torch.isfinite(p).all()) for p in engine.module.parameters()))
            scheduler_steps.append(scheduler.last_epoch)
            skipped.append(engine.skipped_steps)
    finally:
        dist.all_reduce = original
    state = strategy.full_state_dict(engine)        # on rank 0
    if strategy.is_rank_0():
        torch.save(state, out / f"{name}.pt")
    return {"name": name, "all_reduces": calls, "grad_norms": norms,
            "reference_norms": getattr(strategy, "reference_norms", None),
            "ds_gradient_clipping": strategy.get_ds_train_config()["gradient_clipping"],
            "moved": moved, "finite": finite, "scheduler_steps": scheduler_steps, "skipped_steps": skipped}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    config = StrategyConfig(seed=7, train_batch_size=8, micro_train_batch_size=2, max_norm=MAX_NORM, zero_stage=0)
    ours = DeepspeedStrategy(config)
    ours.setup_distributed()
    theirs = DeepSpeedClips(dataclasses.replace(config))
    theirs.reference_norms = []
    records = [train(ours, out, "strategy"), train(theirs, out, "deepspeed"),
               train(ours, out, "nan", nan_step=1),
               train(DeepspeedStrategy(dataclasses.replace(config, max_norm=0.0)), out, "nan_unclipped", nan_step=1)]
    (out / f"clip_rank{ours.rank}.json").write_text(json.dumps(records))
    ours.close()


if __name__ == "__main__":
    run_program(main)
