"""Launched by test_hf_engine.py under torchrun (2 ranks, gloo). Writes JSON lines to argv[1].

1. "lockstep": greedy decoding of a plain model with and without synced_gpus, on prompts whose
   responses end at different steps on the two ranks: responses and the number of forwards.
2. "zero3": the same model under DeepSpeed ZeRO-3 (parameters partitioned over the ranks) decoded
   by HFEngine(synced_gpus=True): sampled tokens and log-probs against the plain model, then one
   optimizer step and greedy decoding against a plain copy of the gathered new weights, also
   with micro_batch_size chunking that gives the ranks different numbers of chunks.
"""

import json
import sys

import torch
import torch.distributed as dist

from lightrft.rollout import HFEngine, SamplingParams
from lightrft.strategy import DeepspeedStrategy, StrategyConfig
from tests.rollout.contract import build_contract_model
from lightrft.utils.program import run_program

# Greedy responses end after 4 tokens for "abc" and 6 for "1+1=" (limit 12): the ranks finish at
# different steps.
RANK_PROMPTS = {0: ["abc"], 1: ["1+1="]}
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=17)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


def responses(out) -> list:
    return [out.responses[i, :int(n)].tolist() for i, n in enumerate(out.response_lengths)]


def lockstep(model, tokenizer, prompt_ids, rank) -> list:
    forwards = []
    handle = model.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    rows = []
    for synced in (False, True):
        forwards.clear()
        engine = HFEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id, synced_gpus=synced)
        out = engine.generate(prompt_ids, GREEDY)
        rows.append({"check": "lockstep", "rank": rank, "synced": synced, "responses": responses(out),
                     "forwards": len(forwards)})
    handle.remove()
    return rows


def zero3(strategy, model, tokenizer, prompt_ids, rank) -> dict:
    plain = HFEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id).generate(prompt_ids, SAMPLING)

    optimizer = strategy.create_optimizer(model, lr=0.05)
    engine, optimizer, _ = strategy.prepare((model, optimizer, None))
    module = strategy.unwrap_model(engine)
    partitioned = all(p.numel() == 0 for p in module.parameters())
    rollout = HFEngine(module, tokenizer.pad_token_id, tokenizer.eos_token_id, synced_gpus=True)
    sharded = rollout.generate(prompt_ids, SAMPLING)
    greedy_before = rollout.generate(prompt_ids, GREEDY)

    # One optimizer step: the engine samples from the new weights without any transfer.
    batch = torch.tensor([tokenizer.encode("abcdefgh"), tokenizer.encode("12345678")])[rank:rank + 1]
    loss = engine(input_ids=batch, labels=batch).loss
    strategy.backward(loss, engine, optimizer)
    strategy.optimizer_step(optimizer, engine, None)
    greedy_after = rollout.generate(prompt_ids, GREEDY)

    state = [strategy.full_state_dict(engine)]
    dist.broadcast_object_list(state, src=0)
    _, fresh = build_contract_model()
    fresh.load_state_dict(state[0])
    expected_after = HFEngine(fresh, tokenizer.pad_token_id, tokenizer.eos_token_id).generate(prompt_ids, GREEDY)
    # Uneven chunking: rank 0 decodes 1 chunk, rank 1 two (micro_batch_size 2, 3 prompts); the
    # short rank must keep joining the ZeRO-3 gathers instead of leaving the other waiting.
    uneven = [tokenizer.encode(p) for p in (["abc"] if rank == 0 else ["1+1=", "hello world", "abc"])]
    chunked = HFEngine(module, tokenizer.pad_token_id, tokenizer.eos_token_id, synced_gpus=True,
                       micro_batch_size=2).generate(uneven, GREEDY)
    expected_chunked = HFEngine(fresh, tokenizer.pad_token_id, tokenizer.eos_token_id).generate(uneven, GREEDY)
    return {
        "check": "zero3", "rank": rank, "partitioned": partitioned,
        "same_samples": torch.equal(plain.sequences, sharded.sequences),
        "log_prob_max_diff": (plain.rollout_log_probs - sharded.rollout_log_probs).abs().max().item(),
        "greedy_before": responses(greedy_before), "greedy_after": responses(greedy_after),
        "expected_after": responses(expected_after),
        "chunked": responses(chunked), "expected_chunked": responses(expected_chunked),
    }


def main(out_path):
    strategy = DeepspeedStrategy(StrategyConfig(zero_stage=3, train_batch_size=2, micro_train_batch_size=1))
    strategy.setup_distributed()
    rank = strategy.rank
    tokenizer, model = build_contract_model()
    prompt_ids = [tokenizer.encode(p) for p in RANK_PROMPTS[rank]]
    rows = lockstep(model, tokenizer, prompt_ids, rank) + [zero3(strategy, model, tokenizer, prompt_ids, rank)]
    gathered = [None] * strategy.world_size
    dist.all_gather_object(gathered, rows)
    if strategy.is_rank_0():
        with open(out_path, "w") as f:
            for rank_rows in gathered:
                for row in rank_rows:
                    f.write(json.dumps(row) + "\n")
    strategy.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    run_program(main, sys.argv[1])
