"""The wrappers under ZeRO-3 on two ranks: packed == padded == unsharded reference, a packed
training step, and Hugging Face export of actor and critic through DeepspeedStrategy.save_model.

Run by tests/models/test_wrappers_dist.py with `torchrun --nproc_per_node 2`; writes JSON lines to
`--out`.rank<r>, and the test asserts on them.
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from lightrft.models import ActorLanguage, Critic
from lightrft.strategy import DeepspeedStrategy, StrategyConfig
from lightrft.utils.tiny import build_char_tokenizer
from tests.models.conftest import make_batch
from lightrft.utils.program import run_program


def max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return (a.detach() - b.detach())[mask].abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--actor", required=True)
    parser.add_argument("--critic", required=True, help="a critic folder with a trained head")
    parser.add_argument("--causal_lm", required=True, help="a causal-LM folder (the critic's head starts fresh)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    strategy = DeepspeedStrategy(StrategyConfig(zero_stage=3, seed=0, micro_train_batch_size=1, train_batch_size=2))
    strategy.setup_distributed()
    out = Path(f"{args.out}.rank{strategy.rank}")

    def emit(record: dict) -> None:
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")

    ref_actor, ref_critic = ActorLanguage(args.actor), Critic(args.critic)  # whole weights on every rank
    with strategy.zero3_init_context():
        actor = ActorLanguage(args.actor)
        critic = Critic(args.critic)
        fresh = Critic(args.causal_lm)
    emit({"check": "sharded", "numel": [p.numel() for p in actor.model.model.embed_tokens.parameters()]})
    optim = strategy.create_optimizer(actor, lr=1e-2)
    actor_engine, optim, _ = strategy.prepare((actor, optim, None))
    critic_engine, fresh_engine = strategy.prepare(critic, fresh)

    batch = make_batch([3, 6, 2], [4, 1, 5], seed=10 + strategy.rank)  # each rank its own batch
    mask = batch.action_mask().bool()
    padded = actor_engine(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    packed = actor_engine(batch.packed_ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens)
    reference = ref_actor(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    with torch.no_grad():
        values_padded = critic_engine(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
        values_packed = critic_engine(batch.packed_ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens)
        values_reference = ref_critic(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
        fresh_values = fresh_engine(batch.packed_ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens)
    emit({
        "check": "forward",
        "packed_vs_padded": max_diff(packed, padded, mask),
        "padded_vs_reference": max_diff(padded, reference, mask),
        "values_packed_vs_padded": max_diff(values_packed, values_padded, mask),
        "values_padded_vs_reference": max_diff(values_padded, values_reference, mask),
        "values_scale": values_reference[mask].abs().max().item(),
        "fresh_values_finite": bool(torch.isfinite(fresh_values).all()),
        "fresh_values_scale": fresh_values[mask].abs().max().item(),
    })

    # One optimizer step on the packed log-probs, then export and reload.
    strategy.backward(-(packed * batch.action_mask()).sum() / mask.sum(), actor_engine, optim)
    strategy.optimizer_step(optim, actor_engine)
    trained = actor_engine(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    tokenizer = build_char_tokenizer()
    export = Path(args.out).parent
    strategy.save_model(actor_engine, tokenizer, export / "actor_hf")
    strategy.save_model(critic_engine, tokenizer, export / "critic_hf")
    strategy.barrier()
    exported_actor = ActorLanguage(AutoModelForCausalLM.from_pretrained(export / "actor_hf"))
    exported_critic = Critic(export / "critic_hf")
    with torch.no_grad():
        reloaded = exported_actor(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
        reloaded_values = exported_critic(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    emit({
        "check": "export",
        "step_moved": max_diff(trained, padded, mask),
        "reloaded_vs_trained": max_diff(reloaded, trained, mask),
        "reloaded_values_vs_reference": max_diff(reloaded_values, values_reference, mask),
    })
    strategy.barrier()


if __name__ == "__main__":
    run_program(main)
