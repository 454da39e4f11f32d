"""Launched by test_vllm_tp.py under torchrun (2 ranks, gloo). argv: rows.jsonl, model folder.

One vLLM engine replica with tensor parallel 2 spans both ranks (each holds half of every layer);
the trainer holds the same model under ZeRO-3. The ranks pass different, unevenly many prompts to
their RolloutManager, which generates the union on both ranks and hands each its own rows. Checked
per rank: the engine's raw outputs for the union are identical on both ranks; the manager's rows
equal the union's rows of this rank's prompts; greedy tokens equal the trainer's (HFEngine on the
ZeRO-3 module) and the float32 log-probs the trainer's teacher-forced ones; after each optimizer
step the bucketed sync from the shards brings the sharded engine to the new weights.
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lightrft.rollout import HFEngine, RolloutManager, SamplingParams, VLLMEngine
from tests.rollout.contract import PROMPTS
from tests.rollout.dist_vllm_sync import responses, start_with_saved_model, train_step, trainer_log_probs
from lightrft.utils.program import run_program

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=10, n=2)
BUCKET_MB = 0.3
RANK_PROMPTS = {0: PROMPTS[:1], 1: PROMPTS[1:] + ["7*8=", "xyz"]}  # 1 and 4 prompts


def as_lists(out) -> dict:
    return {"tokens": responses(out), "log_probs": [out.rollout_log_probs[i, :int(n)].tolist()
                                                   for i, n in enumerate(out.response_lengths)]}


def compare(manager, rollout, module, hf, tokenizer, rank: int, step: int) -> dict:
    mine = [tokenizer.encode(p) for p in RANK_PROMPTS[rank]]
    seeds = [1000 * step + 10 * rank + i for i in range(len(mine))]
    greedy = manager.generate(mine, GREEDY)
    sampled = manager.generate(mine, SAMPLED, seeds=seeds)
    expected = hf.generate(mine, GREEDY)
    # The union as the manager builds it (rank 0's prompts first), straight from the engine.
    union = [tokenizer.encode(p) for r in (0, 1) for p in RANK_PROMPTS[r]]
    union_seeds = [1000 * step + 10 * r + i for r in (0, 1) for i in range(len(RANK_PROMPTS[r]))]
    raw = rollout.generate(union, SAMPLED, seeds=union_seeds)
    offset = 0 if rank == 0 else len(RANK_PROMPTS[0])
    gaps = [(out.rollout_log_probs - trainer_log_probs(module, out))[out.action_mask].abs().max().item()
            for out in (greedy, sampled)]
    return {"step": step, "rank": rank, "greedy": responses(greedy), "trainer_greedy": responses(expected),
            "sampled": as_lists(sampled), "raw_union": as_lists(raw),
            "raw_rows_of_mine": as_lists(raw.rows(offset * 2, (offset + len(mine)) * 2)),
            "sampled_shape": list(sampled.sequences.shape), "sampled_prompt_len": sampled.prompt_len,
            "greedy_log_prob_gap": gaps[0], "sampled_log_prob_gap": gaps[1], "syncs": manager.syncs,
            "sync_seconds": manager.last_sync_seconds, "sync_bytes": manager.last_sync_bytes}


def main(out_path: str, model_dir: str) -> None:
    strategy, tokenizer, model, model_bytes = start_with_saved_model(model_dir)
    rank = strategy.rank
    optimizer = strategy.create_optimizer(model, lr=0.05)
    engine, optimizer, _ = strategy.prepare((model, optimizer, None))
    module = strategy.unwrap_model(engine)
    hf = HFEngine(module, tokenizer.pad_token_id, tokenizer.eos_token_id, synced_gpus=True)

    started = time.perf_counter()
    rollout = VLLMEngine(model_dir, tokenizer.pad_token_id, tokenizer.eos_token_id, seed=rank, dtype="float32",
                         kv_cache_gb=0.25, max_model_len=256, enforce_eager=True, tensor_parallel_size=2)
    start_seconds = time.perf_counter() - started
    manager = RolloutManager(rollout, lambda: strategy.iter_parameter_buckets(engine, BUCKET_MB))
    rows = []
    started = time.perf_counter()
    train_step(strategy, engine, optimizer, tokenizer, rank, "abcdefgh12345678")
    rows.append(compare(manager, rollout, module, hf, tokenizer, rank, step=1))
    first_seconds = time.perf_counter() - started
    manager.sleep()
    train_step(strategy, engine, optimizer, tokenizer, rank, "hello world 1+1=")
    manager.mark_stale()
    started = time.perf_counter()
    rows.append(compare(manager, rollout, module, hf, tokenizer, rank, step=2))
    second_seconds = time.perf_counter() - started
    for row in rows:
        row.update(model_bytes=model_bytes, engine_start_seconds=start_seconds, first_compare_seconds=first_seconds,
                   second_compare_seconds=second_seconds, replica_ranks=manager.replica.ranks)
    gathered = [None] * strategy.world_size
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        Path(out_path).write_text("".join(json.dumps(row) + "\n" for rank_rows in gathered for row in rank_rows))
    dist.barrier()


if __name__ == "__main__":
    torch.set_num_threads(1)
    run_program(main, sys.argv[1], sys.argv[2])
