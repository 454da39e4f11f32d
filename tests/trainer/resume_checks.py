"""What `RunServices.load` does with a corrupted checkpoint and with a model that changed, on real
DeepSpeed engines (ZeRO-2) in one process. Run by tests/trainer/test_run_services.py; writes one
JSON record to --out:

- two checkpoints (steps 1 and 2) are saved, then 4 KiB inside step 2's model states are
  overwritten with 3.4e38 (same size): a resume loads step 1, with a warning naming the file, and
  the weights are step 1's;
- a bigger model resumed with another --pretrain is told the flag changed (before DeepSpeed reads
  any state), and one resumed with the same --pretrain gets the shapes in the error.
"""

import argparse
import json
import logging
from pathlib import Path

import torch

from lightrft.strategy import DeepspeedStrategy, StrategyConfig
from lightrft.strategy.deepspeed_strategy import DS_SUBDIR
from lightrft.trainer.run_services import CheckpointPart, RunServices
from lightrft.utils.tiny import build_char_tokenizer, build_tiny_causal_lm
from lightrft.utils.program import run_program


def build(strategy, hidden: int):
    model = build_tiny_causal_lm(build_char_tokenizer(), arch="llama", hidden_size=hidden, num_layers=1, seed=0)
    optim = strategy.create_optimizer(model, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0)
    engine, optim, sched = strategy.prepare((model, optim, sched))
    return engine, optim, sched


def train_step(strategy, engine, optim, sched) -> None:
    ids = torch.randint(4, 100, (1, 8))
    strategy.backward(engine(input_ids=ids, labels=ids).loss, engine, optim)
    strategy.optimizer_step(optim, engine, sched)


def weights(strategy, engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in strategy.full_state_dict(engine).items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    root, record = Path(args.root), {}
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda rec: warnings.append(rec.getMessage())
    logging.getLogger("lightrft").addHandler(handler)

    strategy = DeepspeedStrategy(StrategyConfig(seed=3, zero_stage=2, micro_train_batch_size=1,
                                                train_batch_size=1))
    strategy.setup_distributed()
    services = RunServices(strategy)
    small = {"pretrain": "small"}
    engine, optim, sched = build(strategy, 32)
    saved = {}
    for step in (1, 2):
        train_step(strategy, engine, optim, sched)
        state = RunServices.client_state({"global_step": step, "consumed_samples": 10 * step}, small)
        assert services.save([CheckpointPart(str(root), engine, state)], f"global_step{step}", str(root))
        saved[step] = weights(strategy, engine)

    # 4 KiB of 3.4e38 (float32 0x7F7FFFFF) in the middle of the weights, the file's size kept.
    states = root / "global_step2" / DS_SUBDIR / "mp_rank_00_model_states.pt"
    size = states.stat().st_size
    with open(states, "r+b") as f:
        f.seek(size // 2)
        f.write(bytes.fromhex("ffff7f7f") * 1024)
    record["corrupted"] = str(states)
    record["size_kept"] = states.stat().st_size == size

    fresh, _, _ = build(strategy, 32)
    state = services.load(CheckpointPart(str(root), fresh), required=True, options=small)
    loaded = weights(strategy, fresh)
    record["resumed_step"] = state["global_step"]
    record["max_diff_to_step1"] = max((loaded[k] - saved[1][k]).abs().max().item() for k in loaded)
    record["max_diff_to_step2"] = max((loaded[k] - saved[2][k]).abs().max().item() for k in loaded)
    record["max_abs_weight"] = max(v.abs().max().item() for v in loaded.values())
    record["warnings"] = warnings

    bigger, _, _ = build(strategy, 48)
    for name, options in (("changed_flag", {"pretrain": "big"}), ("same_flag", small)):
        try:
            services.load(CheckpointPart(str(root), bigger), required=True, options=options)
            record[name] = None
        except ValueError as err:
            record[name] = str(err)
    Path(args.out).write_text(json.dumps(record))
    strategy.close()


if __name__ == "__main__":
    run_program(main)
