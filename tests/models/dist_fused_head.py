"""The fused log-prob head under ZeRO-3 on two ranks: the LM head's weight is partitioned, and the
fused head must run inside the head module's hooks (`lm_head._as_forward_of`) to see it whole.

Run by tests/models/test_fused_head_actor.py with `torchrun --nproc_per_node 2`; each rank
trains a plain and a fused actor (same weights, tied and untied heads) one step on the same
loss over padded and packed forwards, and writes the log-probs before and after the step, and
how many parameters DeepSpeed gathered outside their module's hooks, as JSON to
`--out`.rank<r>; the test asserts they agree.
"""

import argparse
import json
from pathlib import Path

import torch

import lightrft.strategy.deepspeed_strategy as deepspeed_strategy
from lightrft.models import ActorLanguage
from lightrft.strategy import DeepspeedStrategy, StrategyConfig
from lightrft.strategy.ds_config import get_train_ds_config
from lightrft.utils.program import run_program
from lightrft.utils.tiny import build_tiny_arch
from tests.models.conftest import make_batch


def everything_partitioned(**options) -> dict:
    """The trained models' DeepSpeed config with no parameter kept whole: by default ZeRO-3 keeps
    parameters under 1e5 elements on every rank, the tiny head (100 x 64) included, where a real
    head (151,936 x 896) is partitioned."""
    config = get_train_ds_config(**options)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return config


def train_step(strategy, arch: str, fused: bool, batch) -> dict:
    """Log-probs (padded, packed) of a fresh sharded actor, then of the same after one Adam step
    on a loss over both forwards."""
    with strategy.zero3_init_context():
        actor = ActorLanguage(build_tiny_arch(arch, seed=0), temperature=0.7, fused_head_chunk=3 if fused else None)
    optim = strategy.create_optimizer(actor, lr=1e-2)
    engine, optim, _ = strategy.prepare((actor, optim, None))
    sharded = actor.model.get_output_embeddings().weight.numel() == 0
    mask = batch.action_mask()
    padded, output = engine(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask,
                            return_output=True, return_entropy=True)
    packed = engine(batch.packed_ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens)
    loss = ((padded + packed - 0.1 * output["entropy"]) * mask).sum() / mask.sum()
    strategy.backward(-loss, engine, optim)
    strategy.optimizer_step(optim, engine)
    with torch.no_grad():
        after = engine(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    sharded = sharded and actor.model.get_output_embeddings().weight.numel() == 0
    # Parameters DeepSpeed gathered on access outside their module's hooks ("external" to the
    # module then running), which it keeps whole for that module's whole forward and backward.
    external = sum(len(module.ds_external_parameters()) for module in actor.modules())
    return {"sharded": sharded, "external": external, "padded": padded.tolist(), "packed": packed.tolist(),
            "entropy": output["entropy"].tolist(), "after": after.tolist()}


def replay_under_zero3(strategy, batch) -> dict:
    """Routing replay with every router weight partitioned: a sharded Qwen3-MoE actor replaying
    routes (other than its live ones) gives the log-probs of the same actor unsharded, padded and
    packed, and one Adam step through the replayed forward moves the router weights."""
    reference = ActorLanguage(build_tiny_arch("qwen3_moe", seed=0).float(), routing_replay="old")
    real = batch.attention_mask.bool()
    reference.routing.start_recording()
    with torch.no_grad():
        reference(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    routes = reference.routing.take()[0].view(*batch.sequences.shape, reference.routing.layers, -1)
    reference.routing.stop_recording()
    routes = ((routes.long() + 1) % 4).to(routes.dtype)
    routes[~real] = -1
    with torch.no_grad():
        expected = reference(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask, routes=routes)
        live = reference(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    # Built whole (the reference's weights), partitioned by `prepare`.
    actor = ActorLanguage(build_tiny_arch("qwen3_moe", seed=0).float(), routing_replay="old")
    optim = strategy.create_optimizer(actor, lr=1e-2)
    engine, optim, _ = strategy.prepare((actor, optim, None))
    sharded = all(router.weight.numel() == 0 for router in actor.routing.routers)
    mask = batch.action_mask()
    padded = engine(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask, routes=routes)
    packed = engine(batch.packed_ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens,
                    routes=routes[real].unsqueeze(0))
    routers = [router.weight for router in actor.routing.routers]
    with deepspeed_strategy.deepspeed.zero.GatheredParameters(routers):
        before = [w.detach().clone() for w in routers]
    # One forward per backward: ZeRO-3 reduces an expert weight's gradient once per backward.
    strategy.backward(-(padded * mask).sum() / mask.sum(), engine, optim)
    strategy.optimizer_step(optim, engine)
    with deepspeed_strategy.deepspeed.zero.GatheredParameters(routers):
        moved = min((w.detach() - b).abs().max().item() for w, b in zip(routers, before))
    return {"sharded": sharded, "padded": (padded.detach() - expected).mul(mask).abs().max().item(),
            "packed": (packed.detach() - expected).mul(mask).abs().max().item(),
            "replayed_vs_live": (expected - live).mul(mask).abs().max().item(), "router_moved": moved}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    deepspeed_strategy.get_train_ds_config = everything_partitioned
    strategy = DeepspeedStrategy(StrategyConfig(zero_stage=3, seed=0, micro_train_batch_size=1, train_batch_size=2))
    strategy.setup_distributed()
    batch = make_batch([3, 6, 2], [4, 1, 5], seed=10 + strategy.rank)  # each rank its own batch
    records = {f"{arch}/{'fused' if fused else 'plain'}": train_step(strategy, arch, fused, batch)
               for arch in ("qwen2", "llama_tied") for fused in (False, True)}
    records["moe/replay"] = replay_under_zero3(strategy, make_batch([3, 6, 2], [4, 1, 5], seed=30))
    Path(f"{args.out}.rank{strategy.rank}").write_text(json.dumps(records))
    strategy.barrier()


if __name__ == "__main__":
    run_program(main)
