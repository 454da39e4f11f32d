"""Launched by test_smollm2_paths.py under torchrun (3 ranks, gloo). argv: result.json, model folder.

One vLLM replica of tensor parallel 3 over all ranks serves SmolLM2-135M-Instruct, each rank holding
a third of every layer (3 of its 9 attention heads, 1 of its 3 key/value heads, a third of the
vocabulary rows). Tensor parallel 2 is not possible on this model: vLLM refuses a tensor-parallel
size that does not divide the 9 attention heads. Each rank holds the whole float32 model as the
trainer. Measured per rank, as mean and max |engine - trainer| log-prob over the sampled tokens:

- as loaded: the engine built from the folder against the trainer's same weights;
- stale: the same rollout against every trainer weight moved by `moved()` (the same draw on all
  ranks), the engine not yet synced: what a sync that never arrived shows;
- synced: after `RolloutManager.for_actor` pushed the moved weights in 64 MB buckets of whole
  layers (the 113 MB embedding, which is also the tied LM head, a bucket of its own), through the
  manager's replica path (each rank passes its own prompt; the replica generates their union).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from lightrft.datasets.prompt_dataset import PromptDataset
from lightrft.models import ActorLanguage
from lightrft.rollout import RolloutManager, SamplingParams, VLLMEngine
from lightrft.strategy import DeepspeedStrategy, StrategyConfig
from tests.real_model.test_smollm2 import IM_END, QUESTIONS, gap, moved, trainer_log_probs
from lightrft.utils.program import run_program

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=8, n=2)
BUCKET_MB = 64


def chat_prompt_ids(tokenizer) -> list[list[int]]:
    dataset = PromptDataset([{"input": q} for q in QUESTIONS], tokenizer, input_key="input", apply_chat_template=True)
    return [list(dataset[i][0].token_ids) for i in range(len(dataset))]      # encoded once, by the dataset


def main(out_path: str, model_dir: str) -> None:
    strategy = DeepspeedStrategy(StrategyConfig())
    strategy.setup_distributed()
    rank = strategy.rank
    prompt_ids = chat_prompt_ids(AutoTokenizer.from_pretrained(model_dir))
    seeds = list(range(len(prompt_ids)))
    actor = ActorLanguage(model_dir).eval()
    engine = VLLMEngine(model_dir, IM_END, IM_END, seed=0, dtype="float32", kv_cache_gb=0.25, max_model_len=256,
                        enforce_eager=True, tensor_parallel_size=strategy.world_size)
    try:
        # Every rank of the replica calls the engine itself with identical requests and gets the
        # same union back; rank 0 compares it with the trainer (the test checks the ranks agree).
        out = engine.generate(prompt_ids, PARAMS, seeds=seeds)
        row = {"rank": rank, "union": [out.responses[out.action_mask].tolist(),
                                       out.rollout_log_probs[out.action_mask].tolist()]}
        trainer = moved(actor)
        if rank == 0:
            row.update(as_loaded=gap(out, trainer_log_probs(actor, out)),
                       stale=gap(out, trainer_log_probs(trainer, out)))

        manager = RolloutManager.for_actor(engine, strategy, trainer, bucket_mb=BUCKET_MB)
        buckets = [[name for name, _ in bucket]
                   for bucket in strategy.iter_parameter_buckets(trainer, BUCKET_MB, prefix="model.")]
        mine = [rank]                                # each rank its prompt: the manager gathers the union
        out = manager.generate([prompt_ids[i] for i in mine], PARAMS, seeds=[seeds[i] for i in mine])
        row.update(synced=gap(out, trainer_log_probs(trainer, out)), synced_rows=out.sequences.size(0),
                   syncs=manager.syncs, sync_bytes=manager.last_sync_bytes, buckets=buckets,
                   model_bytes=sum(p.numel() * p.element_size() for p in trainer.parameters()),
                   replica=manager.replica.ranks)
        rows = [None] * strategy.world_size
        dist.all_gather_object(rows, row)
        if rank == 0:
            Path(out_path).write_text(json.dumps(rows))
    finally:
        # Every rank together, while the group exists; vLLM's teardown then removes the group.
        engine.shutdown()


if __name__ == "__main__":
    torch.set_num_threads(1)
    run_program(main, sys.argv[1], sys.argv[2])
