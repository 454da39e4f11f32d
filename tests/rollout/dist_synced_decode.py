"""Launched by test_hf_engine.py under torchrun (2 ranks, gloo): greedy decoding with and without
synced_gpus on prompts whose responses end at different steps on the two ranks. Writes one JSON
line per (rank, synced) with the responses and the number of model forwards."""

import json
import sys

import torch
import torch.distributed as dist

from lightrft.rollout import HFEngine, SamplingParams
from tests.rollout.contract import build_contract_model


def main(out_path):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokenizer, model = build_contract_model()
    # Greedy responses of these prompts end after 4 and 6 tokens; the limit is 12 (see contract
    # model): the ranks finish at different steps.
    prompts = {0: ["abc"], 1: ["1+1="]}[rank]
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    forwards = []
    model.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    results = []
    for synced in (False, True):
        forwards.clear()
        engine = HFEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id, synced_gpus=synced)
        out = engine.generate(prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=12))
        responses = [out.responses[i, :int(n)].tolist() for i, n in enumerate(out.response_lengths)]
        results.append({"rank": rank, "synced": synced, "responses": responses, "forwards": len(forwards)})
    all_results = [None] * dist.get_world_size()
    dist.all_gather_object(all_results, results)
    if rank == 0:
        with open(out_path, "w") as f:
            for rows in all_results:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
