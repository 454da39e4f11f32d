"""Checkpoints under DeepspeedStrategy with real DeepSpeed: resume in a new process, and kills at
protocol stages. Run by tests/strategy/test_ckpt_dist.py with torchrun, phase by phase:

- save:  ZeRO-2 and ZeRO-3 train 2 steps, save "step2", train 2 more (losses recorded); then the
         ZeRO-2 save of "step4" is killed mid-shard.
- load:  both stages resume (the partial "step4" is ignored) and train the same 2 steps; an
         injected write error raises on every rank; then the ZeRO-2 save of "step4" is killed
         before the pointer moves.
- after: ZeRO-2 resumes from the pointer ("step2", although "step4" is complete), trains a step
         and saves "step5" with max_num=2, which prunes "step2".

A kill while pruning is covered without DeepSpeed in test_checkpoint_io.py (pruning is rank 0's
file operations only).
"""

import argparse
import json
import os
from pathlib import Path

import torch

from lightrft.strategy import CheckpointSaveError, DeepspeedStrategy, StrategyConfig
from lightrft.strategy.checkpoint_io import FAULT_ENV
from lightrft.trainer.checkpoint import capture_rng_state, restore_rng_state
from lightrft.utils.tiny import build_char_tokenizer, build_tiny_causal_lm
from lightrft.utils.program import run_program

MICRO = 2


def build(stage: int):
    strategy = DeepspeedStrategy(StrategyConfig(seed=11, zero_stage=stage, micro_train_batch_size=MICRO,
                                                train_batch_size=2 * MICRO * 2))  # GAS 2 on two ranks
    strategy.setup_distributed()
    model = build_tiny_causal_lm(build_char_tokenizer(), arch="llama", seed=0)
    optim = strategy.create_optimizer(model, lr=5e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0 / (1 + step))
    engine, optim, sched = strategy.prepare((model, optim, sched))
    return strategy, engine, optim, sched


def train_steps(strategy, engine, optim, sched, n: int) -> list[float]:
    """n optimizer steps on data drawn from this rank's global torch RNG (so resuming must restore
    it); returns this rank's mean micro-batch loss per step."""
    losses = []
    for _ in range(n):
        total = 0.0
        for _ in range(strategy.accumulated_gradient):
            ids = torch.randint(4, 100, (MICRO, 12)).to(strategy.device)
            loss = engine(input_ids=ids, labels=ids).loss
            strategy.backward(loss, engine, optim)
            strategy.optimizer_step(optim, engine, sched)
            total += loss.item() / strategy.accumulated_gradient
        losses.append(total)
    return losses


def save(strategy, engine, root: Path, stage: int, tag: str, step: int, max_num: int = 3):
    return strategy.save_ckpt(engine, root / f"zero{stage}", tag, max_num=max_num,
                              client_state={"step": step, "rank": strategy.rank, "rng": capture_rng_state()})


def resume(strategy, engine, root: Path, stage: int):
    path, client = strategy.load_ckpt(engine, root / f"zero{stage}")
    restore_rng_state(client["rng"])
    return path, client


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", required=True, choices=["save", "load", "after"])
    parser.add_argument("--root", required=True)
    args = parser.parse_args()
    root = Path(args.root)
    records = []
    emit = records.append

    def flush():
        rank = int(os.environ["RANK"])
        with open(root / f"{args.phase}.rank{rank}.jsonl", "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))

    if args.phase == "save":
        engines = {}
        for stage in (2, 3):
            strategy, engine, optim, sched = build(stage)
            torch.manual_seed(100 + strategy.rank)  # the ranks draw different data
            before = train_steps(strategy, engine, optim, sched, 2)
            save(strategy, engine, root, stage, "step2", 2)
            after = train_steps(strategy, engine, optim, sched, 2)
            emit({"stage": stage, "before": before, "after": after, "lr": sched.get_last_lr()[0]})
            engines[stage] = engine
        flush()
        os.environ[FAULT_ENV] = "mid-shard"
        save(strategy, engines[2], root, 2, "step4", 4)

    elif args.phase == "load":
        engines = {}
        for stage in (2, 3):
            strategy, engine, optim, sched = build(stage)
            path, client = resume(strategy, engine, root, stage)
            after = train_steps(strategy, engine, optim, sched, 2)
            emit({"stage": stage, "path": Path(path).name, "client_step": client["step"],
                  "client_rank": client["rank"], "after": after, "lr": sched.get_last_lr()[0]})
            engines[stage] = engine
        empty = strategy.load_ckpt(engine, root / "nothing_here")
        try:
            strategy.load_ckpt(engine, root / "zero3", tag="step4")
            missing = None
        except FileNotFoundError as err:
            missing = str(err)
        os.environ[FAULT_ENV] = "before-rename:raise"
        try:
            save(strategy, engine, root, 3, "step4", 4)
            injected = None
        except CheckpointSaveError as err:
            injected = str(err)
        del os.environ[FAULT_ENV]
        emit({"empty": list(empty), "missing_tag_error": missing, "injected_error": injected})
        flush()
        os.environ[FAULT_ENV] = "before-pointer"
        save(strategy, engines[2], root, 2, "step4", 4)

    else:
        strategy, engine, optim, sched = build(2)
        path, client = resume(strategy, engine, root, 2)
        losses = train_steps(strategy, engine, optim, sched, 1)
        save(strategy, engine, root, 2, "step5", 5, max_num=2)
        emit({"path": Path(path).name, "client_step": client["step"], "losses": losses})
        flush()
    strategy.close()


if __name__ == "__main__":
    run_program(main)
