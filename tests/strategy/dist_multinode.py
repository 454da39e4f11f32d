"""One optimizer step by two "nodes" (two torchrun launches with --nnodes 2, one rank each).

Run by tests/strategy/test_multinode.py; writes JSON lines to `--out`.rank<r>.
"""

import argparse
import json
import os

import torch

from lightrft.strategy import DeepspeedStrategy, StrategyConfig
from lightrft.utils.tiny import build_char_tokenizer, build_tiny_causal_lm
from lightrft.utils.program import run_program


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    strategy = DeepspeedStrategy(StrategyConfig(seed=5, zero_stage=2, micro_train_batch_size=2, train_batch_size=4))
    strategy.setup_distributed()
    model = build_tiny_causal_lm(build_char_tokenizer(), arch="llama", seed=0)
    initial = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    optim = strategy.create_optimizer(model, lr=1e-2)
    engine, optim, _ = strategy.prepare((model, optim, None))
    ids = torch.randint(4, 100, (2, 12), generator=strategy.rank_generator()).to(strategy.device)  # per node
    loss = engine(input_ids=ids, labels=ids).loss
    strategy.backward(loss, engine, optim)
    strategy.optimizer_step(optim, engine, None)
    weights = torch.cat([p.detach().flatten() for p in engine.module.parameters()]).cpu()
    record = {
        "rank": strategy.rank, "world": strategy.world_size, "local_rank": strategy.local_rank,
        "group_rank": int(os.environ["GROUP_RANK"]), "loss": loss.item(),
        "losses": strategy.all_gather({"loss": loss.item()})["loss"],
        "moved": (weights - initial).abs().max().item(),
        # the same weights on both nodes after the step: gather a checksum from each
        "checksums": strategy.all_gather(weights.double().sum().reshape(1)).tolist(),
    }
    with open(f"{args.out}.rank{strategy.rank}", "w") as f:
        f.write(json.dumps(record) + "\n")
    strategy.close()


if __name__ == "__main__":
    run_program(main)
