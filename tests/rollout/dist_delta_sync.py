"""Launched by test_delta_sync.py under torchrun (1 rank). argv: rows.jsonl, model folder.

The contract model trains in bf16 under DeepSpeed ZeRO-3 (every parameter sharded, each bucket
gathered) with its first decoder layer frozen, and a bf16 VLLMEngine follows it through a
`RolloutManager` with delta sync. After one optimizer step the delta sync skips the frozen layer;
its greedy tokens and log-probs are then compared with those of the same engine after a full sync
of the same weights (forget, sync again), which any layer the delta missed would change. A sync
with no step in between must send nothing.
"""

import json
import sys
from pathlib import Path

import torch

from lightrft.rollout import RolloutManager, SamplingParams, VLLMEngine
from lightrft.rollout.delta import fused_group
from lightrft.strategy import DeepspeedStrategy, StrategyConfig
from tests.rollout.contract import PROMPTS, build_contract_model
from lightrft.utils.program import run_program

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)


def answers(manager, prompt_ids) -> tuple[list, list]:
    """Greedy tokens and their log-probs (as float bits, so equal means bit for bit)."""
    out = manager.generate(prompt_ids, GREEDY)
    tokens = [out.responses[i, :int(n)].tolist() for i, n in enumerate(out.response_lengths)]
    log_probs = out.rollout_log_probs[out.action_mask].view(torch.int32).tolist()
    return tokens, log_probs


def main(out_path: str, model_dir: str) -> None:
    strategy = DeepspeedStrategy(StrategyConfig(zero_stage=3, bf16=True, train_batch_size=1, micro_train_batch_size=1))
    strategy.setup_distributed()
    tokenizer, model = build_contract_model(seed=0, hidden_size=128)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    model = model.to(torch.bfloat16)
    frozen = [p for n, p in model.named_parameters() if n.startswith("model.layers.0.")]
    for param in frozen:
        param.requires_grad_(False)
    optimizer = strategy.create_optimizer(model, lr=1e-3)
    engine, optimizer, _ = strategy.prepare((model, optimizer, None))
    rollout = VLLMEngine(model_dir, tokenizer.pad_token_id, tokenizer.eos_token_id, seed=0, dtype="bfloat16",
                         kv_cache_gb=0.25, max_model_len=256, enforce_eager=True)
    manager = RolloutManager(rollout, lambda: strategy.iter_parameter_buckets(engine, 0.3), weight_sync="delta")
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    full_bytes = sum(p.ds_numel * p.element_size() for p in strategy.unwrap_model(engine).parameters())
    layers = sorted({fused_group(name) for name, _ in strategy.unwrap_model(engine).named_parameters()})
    sent = []                                          # the layers each engine update carried
    update = rollout.update_weights
    rollout.update_weights = lambda named: (sent.extend(fused_group(n) for n, _ in named), update(named))[1]
    _, before = answers(manager, prompt_ids)          # the first sync: full

    batch = torch.tensor([tokenizer.encode("abcdefgh12345678")])
    strategy.backward(engine(input_ids=batch, labels=batch).loss, engine, optimizer)
    strategy.optimizer_step(optimizer, engine, None)
    manager.mark_stale()
    sent.clear()
    delta_tokens, delta_log_probs = answers(manager, prompt_ids)
    row = {"case": "after a step", "skipped_layers": manager.last_sync_skipped, "delta_bytes": manager.last_sync_bytes,
           "sent_layers": sorted(set(sent)), "layers": layers, "full_bytes": full_bytes, "before_log_probs": before,
           "delta_tokens": delta_tokens, "delta_log_probs": delta_log_probs}
    manager.forget_sent_weights()
    manager.mark_stale()
    row["full_tokens"], row["full_log_probs"] = answers(manager, prompt_ids)
    assert manager.last_sync_bytes == full_bytes, (manager.last_sync_bytes, full_bytes)
    manager.mark_stale()
    answers(manager, prompt_ids)
    unchanged = {"case": "unchanged", "delta_bytes": manager.last_sync_bytes,
                 "skipped_layers": manager.last_sync_skipped, "layers": len(layers)}
    Path(out_path).write_text("".join(json.dumps(r) + "\n" for r in (row, unchanged)))
    rollout.shutdown()


if __name__ == "__main__":
    torch.set_num_threads(1)
    run_program(main, sys.argv[1], sys.argv[2])
