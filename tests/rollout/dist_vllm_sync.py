"""Launched by test_vllm_engine.py under torchrun (2 ranks, gloo). argv: rows.jsonl, model folder.

Each rank trains the contract model under DeepSpeed ZeRO-3 (every parameter sharded over the
ranks) and runs its own VLLMEngine (external launcher) built from the pretrained folder. After an
optimizer step the RolloutManager syncs the engine from the shards in buckets of whole layers;
the engine's greedy tokens and log-probs are compared with the trainer's own (HFEngine on the
ZeRO-3 module, and a teacher-forced float32 forward of it). A second step and `mark_stale` check
that the next generate syncs again.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lightrft.rollout import HFEngine, RolloutManager, SamplingParams, VLLMEngine
from lightrft.strategy import DeepspeedStrategy, StrategyConfig
from tests.rollout.contract import PROMPTS, build_contract_model
from lightrft.utils.program import run_program

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=10, n=2)
BUCKET_MB = 0.3


def responses(out) -> list:
    return [out.responses[i, :int(n)].tolist() for i, n in enumerate(out.response_lengths)]


def trainer_log_probs(module, out) -> torch.Tensor:
    """log softmax of the trainer's teacher-forced logits at the sampled tokens (T = 1, no
    filters: what the engine reports for these params). Shape: (B, A)."""
    position_ids = (out.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = module(input_ids=out.sequences, attention_mask=out.attention_mask, position_ids=position_ids).logits
    logits = logits[:, out.prompt_len - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, out.responses.unsqueeze(-1)).squeeze(-1)


def train_step(strategy, engine, optimizer, tokenizer, rank: int, text: str) -> None:
    batch = torch.tensor([tokenizer.encode(text[rank::2])])
    loss = engine(input_ids=batch, labels=batch).loss
    strategy.backward(loss, engine, optimizer)
    strategy.optimizer_step(optimizer, engine, None)


def compare(manager, module, hf, prompt_ids, rank: int, step: int) -> dict:
    greedy = manager.generate(prompt_ids, GREEDY)
    sampled = manager.generate(prompt_ids, SAMPLED, seeds=[100 * step + rank * 10 + i for i in range(len(prompt_ids))])
    expected = hf.generate(prompt_ids, GREEDY)
    gaps = [(out.rollout_log_probs - trainer_log_probs(module, out))[out.action_mask].abs().max().item()
            for out in (greedy, sampled)]
    return {"step": step, "greedy": responses(greedy), "trainer_greedy": responses(expected),
            "greedy_log_prob_gap": gaps[0], "sampled_log_prob_gap": gaps[1], "syncs": manager.syncs,
            "sync_bytes": manager.last_sync_bytes}


def start_with_saved_model(model_dir: str):
    """A two-rank ZeRO-3 strategy and the contract model, saved by rank 0 to `model_dir` (where the
    vLLM engines load it from). Returns (strategy, tokenizer, model, model bytes)."""
    strategy = DeepspeedStrategy(StrategyConfig(zero_stage=3, train_batch_size=2, micro_train_batch_size=1))
    strategy.setup_distributed()
    tokenizer, model = build_contract_model(seed=0, hidden_size=128)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if strategy.rank == 0:
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    dist.barrier()
    return strategy, tokenizer, model, model_bytes


def main(out_path: str, model_dir: str) -> None:
    strategy, tokenizer, model, model_bytes = start_with_saved_model(model_dir)
    rank = strategy.rank
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]

    optimizer = strategy.create_optimizer(model, lr=0.05)
    engine, optimizer, _ = strategy.prepare((model, optimizer, None))
    module = strategy.unwrap_model(engine)
    partitioned = all(p.numel() == 0 for p in module.parameters())
    hf = HFEngine(module, tokenizer.pad_token_id, tokenizer.eos_token_id, synced_gpus=True)

    rollout = VLLMEngine(model_dir, tokenizer.pad_token_id, tokenizer.eos_token_id, seed=rank, dtype="float32",
                         kv_cache_gb=0.25, max_model_len=256, enforce_eager=True)
    pretrained_greedy = responses(rollout.generate(prompt_ids, GREEDY))
    bucket_sizes = []

    def buckets():
        for bucket in strategy.iter_parameter_buckets(engine, BUCKET_MB):
            bucket_sizes.append(sum(t.numel() * t.element_size() for _, t in bucket))
            yield bucket

    manager = RolloutManager(rollout, buckets)
    rows = []
    train_step(strategy, engine, optimizer, tokenizer, rank, "abcdefgh12345678")
    rows.append(compare(manager, module, hf, prompt_ids, rank, step=1))
    manager.sleep()
    train_step(strategy, engine, optimizer, tokenizer, rank, "hello world 1+1=")
    manager.mark_stale()
    rows.append(compare(manager, module, hf, prompt_ids, rank, step=2))
    for row in rows:
        row.update(rank=rank, partitioned=partitioned, pretrained_greedy=pretrained_greedy,
                   max_bucket_bytes=max(bucket_sizes), buckets_per_sync=len(bucket_sizes) // 2,
                   model_bytes=model_bytes, bucket_limit_bytes=BUCKET_MB * 2**20)
    gathered = [None] * strategy.world_size
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        Path(out_path).write_text("".join(json.dumps(row) + "\n" for rank_rows in gathered for row in rank_rows))
    dist.barrier()


if __name__ == "__main__":
    torch.set_num_threads(1)
    run_program(main, sys.argv[1], sys.argv[2])
