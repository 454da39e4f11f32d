"""Training, collectives, EMA, data loading and HF export under DeepspeedStrategy.

Run by tests/strategy/test_strategy_dist.py, either with `torchrun --nproc_per_node 2` or as a plain
`python` process (world of 1). Writes JSON lines to `--out` and tensors next to it; the test asserts.
"""

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM

from lightrft.strategy import DeepspeedStrategy, StrategyConfig
from lightrft.utils.tiny import build_char_tokenizer, build_tiny_causal_lm
from lightrft.utils.program import run_program

GLOBAL_BATCH = 4  # sequences per optimizer step over all ranks
SEQ_LEN = 16
STEPS = 6


def global_batch(step: int) -> torch.Tensor:
    """The step's global batch, the same on every rank and in every layout: counting sequences
    (token t+1 = token t + stride, within the 96 printable characters) with a random start and
    stride, which a model learns quickly. Shape: (4, 16)."""
    generator = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, 96, (GLOBAL_BATCH, 1), generator=generator)
    stride = torch.randint(1, 3, (GLOBAL_BATCH, 1), generator=generator)
    return 4 + (start + stride * torch.arange(SEQ_LEN)) % 96


def train(strategy: DeepspeedStrategy, name: str, out_dir: Path, emit) -> None:
    """STEPS optimizer steps on the global batches; every rank takes its contiguous rows, split
    into micro-batches. Emits the per-step loss averaged over ranks and saves the final weights."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, arch="qwen2", seed=0)
    optim = strategy.create_optimizer(model, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0 / (1 + step))
    engine, optim, sched = strategy.prepare((model, optim, sched))
    micro = strategy.config.micro_train_batch_size
    per_rank = GLOBAL_BATCH // strategy.world_size
    losses = []
    for step in range(STEPS):
        rows = global_batch(step)[strategy.rank * per_rank:(strategy.rank + 1) * per_rank]
        step_loss = 0.0
        for start in range(0, per_rank, micro):
            ids = rows[start:start + micro].to(strategy.device)
            loss = engine(input_ids=ids, labels=ids).loss
            strategy.backward(loss, engine, optim)
            strategy.optimizer_step(optim, engine, sched)
            step_loss += loss.item() / (per_rank // micro)
        losses.append(strategy.all_reduce({"loss": step_loss})["loss"])
    state = strategy.full_state_dict(engine)
    if strategy.is_rank_0():
        torch.save(state, out_dir / f"weights_{name}_world{strategy.world_size}.pt")
    emit({"check": "train", "name": name, "world": strategy.world_size, "losses": losses,
          "gas": strategy.accumulated_gradient, "lr": sched.get_last_lr()[0],
          "optimizer": type(optim.optimizer if hasattr(optim, "optimizer") else optim).__name__})
    if strategy.world_size > 1 and name in ("stage0", "stage3"):
        strategy.save_model(engine, tokenizer, out_dir / f"hf_{name}")
        # Saving again over an existing folder swaps it in whole.
        strategy.save_model(engine, tokenizer, out_dir / f"hf_{name}")


def ema(strategy: DeepspeedStrategy, stage: int, out_dir: Path, emit) -> None:
    """Known numbers: the trained model's weights stay fixed (lr=0), so after two optimizer steps
    the EMA is beta^2 * ema0 + (1 - beta^2) * param0, which the test computes from the saved
    initial weights. A third call without an optimizer step must not move it."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, arch="qwen2", seed=0)
    ema_model = build_tiny_causal_lm(tokenizer, arch="qwen2", seed=1)
    if strategy.is_rank_0():
        torch.save({"param0": model.state_dict(), "ema0": ema_model.state_dict()}, out_dir / f"ema_init_stage{stage}.pt")
    optim = strategy.create_optimizer(model, lr=0.0)
    engine, optim, _ = strategy.prepare((model, optim, None))
    ema_engine = strategy.prepare(ema_model)
    moved = []
    ids = global_batch(0)[:1].to(strategy.device)
    for _ in range(2):
        for _ in range(strategy.accumulated_gradient):
            strategy.backward(engine(input_ids=ids, labels=ids).loss, engine, optim)
            strategy.optimizer_step(optim, engine, None)
            moved.append(strategy.moving_average(engine, ema_engine, beta=0.9))
    moved.append(strategy.moving_average(engine, ema_engine, beta=0.9))
    state = strategy.full_state_dict(ema_engine)
    if strategy.is_rank_0():
        torch.save(state, out_dir / f"ema_final_stage{stage}.pt")
    emit({"check": "ema", "stage": stage, "moved": moved})


class Range(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class Wrapper(nn.Module):
    """Holds the Hugging Face model as `.model`, as ActorLanguage does."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, labels=input_ids).loss


class ValueHeadModel(nn.Module):
    """A wrapper with a value head and its own `save_pretrained(output_dir, state_dict=...)`."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.score = nn.Linear(model.config.hidden_size, 1, bias=False)

    def save_pretrained(self, output_dir, state_dict=None):
        save_file({k: v.contiguous() for k, v in state_dict.items()}, Path(output_dir) / "model.safetensors")
        (Path(output_dir) / "value_head.json").write_text(json.dumps({"keys": sorted(state_dict)}))


def export(strategy: DeepspeedStrategy, source: Path, out_dir: Path, emit) -> None:
    """ZeRO-3 only: loading under zero3_init_context comes partitioned; a LoRA model inside a
    `.model` wrapper is exported merged; a value-head wrapper is exported through its own hook."""
    with strategy.zero3_init_context():
        model = AutoModelForCausalLM.from_pretrained(source)
    emit({"check": "zero_init", "all_partitioned": all(hasattr(p, "ds_id") for p in model.parameters()),
          "local_numel": sum(p.ds_tensor.numel() for p in model.parameters()),
          "full_numel": sum(p.ds_numel for p in model.parameters())})
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    actor = Wrapper(get_peft_model(model, lora))
    optim = strategy.create_optimizer(actor, lr=2e-2)
    engine, optim, _ = strategy.prepare((actor, optim, None))
    for step in range(2):
        for _ in range(strategy.accumulated_gradient):
            strategy.backward(engine(global_batch(step)[:2].to(strategy.device)), engine, optim)
            strategy.optimizer_step(optim, engine, None)
    state = strategy.full_state_dict(engine)
    if strategy.is_rank_0():
        torch.save(state, out_dir / "peft_state.pt")
    strategy.save_model(engine, build_char_tokenizer(), out_dir / "hf_peft")

    value_model = ValueHeadModel(build_tiny_causal_lm(build_char_tokenizer(), seed=2))
    frozen = strategy.prepare(value_model)
    state = strategy.full_state_dict(frozen)
    if strategy.is_rank_0():
        torch.save(state, out_dir / "value_state.pt")
    strategy.save_model(frozen, None, out_dir / "hf_value")

    # A failed export (the parent of the target is a file) raises on every rank, naming the target.
    blocker = out_dir / "blocker"
    if strategy.is_rank_0():
        blocker.write_text("a file where a folder is expected")
    strategy.barrier()
    try:
        strategy.save_model(frozen, None, blocker / "hf")
        error = None
    except RuntimeError as err:
        error = str(err)
    emit({"check": "export_error", "error": error, "memory": strategy.report_memory("after export")})


def collectives_and_data(strategy: DeepspeedStrategy, emit) -> None:
    rank = strategy.rank
    # rank r holds [r + 1, 10 (r + 1)]: sums and maxima follow by hand.
    tensor = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
    emit({"check": "all_reduce",
          "mean": strategy.all_reduce(tensor, "mean").tolist(),
          "sum": strategy.all_reduce(tensor, "sum").tolist(),
          "max": strategy.all_reduce(tensor, "max").tolist(),
          "dict_mean": strategy.all_reduce({"a": float(rank), "b": torch.tensor(2.0 * rank)}, "mean"),
          "int_mean": strategy.all_reduce(torch.tensor([rank + 1]), "mean").tolist(),
          "input_unchanged": tensor.tolist()})
    # Collectives in flight: two started (rank 1 a moment later), a blocking one between them and
    # reading them, read back in reverse order; each gives what the blocking call gives.
    first = strategy.start_all_reduce(tensor, "mean")
    if rank == 1:
        time.sleep(0.05)
    many = strategy.start_all_reduce_many({"a": tensor, "b": torch.tensor([[rank], [2 * rank]])}, "sum")
    between = strategy.all_reduce(tensor, "max")
    emit({"check": "in_flight", "many": {k: v.tolist() for k, v in many.result().items()},
          "many_again": many.result()["a"].tolist(), "between": between.tolist(), "first": first.result().tolist(),
          "input_unchanged": tensor.tolist()})
    # rank r holds r + 1 rows of value r: uneven row counts.
    rows = torch.full((rank + 1, 2), float(rank))
    emit({"check": "all_gather", "tensor": strategy.all_gather(rows).tolist(),
          "scalar": strategy.all_gather(torch.tensor(float(rank))).tolist(),
          "dict": strategy.all_gather({"x": rank * 1.5})})
    try:
        strategy.all_reduce(tensor, "median")
        emit({"check": "bad_op", "error": None})
    except ValueError as err:
        emit({"check": "bad_op", "error": str(err)})
    # Resumable data: epoch 0 whole, then epoch 1 after 4 consumed samples (over all ranks).
    loader = strategy.setup_dataloader(Range(11), batch_size=1, shuffle=True, drop_last=True)
    epoch0 = [int(x) for batch in loader for x in batch]
    loader.sampler.set_epoch(1, consumed_samples=4)
    resumed = [int(x) for batch in loader for x in batch]
    loader.sampler.set_epoch(1)
    epoch1 = [int(x) for batch in loader for x in batch]
    emit({"check": "data", "epoch0": epoch0, "epoch1": epoch1, "resumed": resumed})
    # Batch sizes that do not divide over the ranks.
    bad = DeepspeedStrategy(StrategyConfig(train_batch_size=6, micro_train_batch_size=2, zero_stage=2))
    try:
        bad.get_ds_train_config()
        emit({"check": "bad_batch", "error": None})
    except ValueError as err:
        emit({"check": "bad_batch", "error": str(err)})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stages", default="0,2,3")
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--ema", action="store_true")
    parser.add_argument("--collectives", action="store_true")
    parser.add_argument("--offload", action="store_true", help="also ZeRO-2 with DeepSpeedCPUAdam")
    parser.add_argument("--hf_source", help="a tiny HF folder for the ZeRO-3 export checks")
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    out_dir = Path(args.out).parent
    base = StrategyConfig(seed=7, train_batch_size=GLOBAL_BATCH, micro_train_batch_size=args.micro, max_norm=1.0,
                          bf16=args.bf16)
    strategy = DeepspeedStrategy(base)
    strategy.setup_distributed()
    records = []
    emit = records.append
    emit({"check": "env", "rank": strategy.rank, "world": strategy.world_size, "local_rank": strategy.local_rank,
          "backend": torch.distributed.get_backend()})
    for stage in [int(s) for s in args.stages.split(",") if s]:
        staged = DeepspeedStrategy(dataclasses.replace(base, zero_stage=stage))
        train(staged, f"stage{stage}", out_dir, emit)
        if args.ema:
            ema(staged, stage, out_dir, emit)
    if args.offload:
        train(DeepspeedStrategy(dataclasses.replace(base, zero_stage=2, adam_offload=True)), "stage2offload",
              out_dir, emit)
    if args.hf_source:
        export(DeepspeedStrategy(dataclasses.replace(base, zero_stage=3)), Path(args.hf_source), out_dir, emit)
    if args.collectives:
        collectives_and_data(strategy, emit)
    with open(f"{args.out}.rank{strategy.rank}", "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    strategy.close()


if __name__ == "__main__":
    run_program(main)
