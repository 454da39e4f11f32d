"""A packed row split over two ranks (Ulysses sequence parallelism) against the same row unsplit.

Run by tests/models/test_sequence_parallel.py with `torchrun --nproc_per_node 2`. For each tiny
model every rank computes, on the same packed row: the unsplit log-probs, entropies, KL and policy
loss and their weight gradients (the reference), and the same through `ActorLanguage` split over
the two ranks, whose weight gradients are summed over the ranks (as the data-parallel reduction
does). Writes one JSON line per model to `--out`.rank<r>.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3MoeConfig

from lightrft.algorithms.kl import compute_approx_kl
from lightrft.models import ActorLanguage, Critic, PolicyLoss
from lightrft.models.sequence_parallel import SequenceParallel
from lightrft.strategy import DeepspeedStrategy, StrategyConfig
from lightrft.utils.program import run_program

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
CONFIGS = {
    # grouped-query attention (4 query, 2 key/value heads); layer 0 full, layer 1 an 8-token window
    "qwen2_gqa_window": lambda: Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "mistral_window": lambda: MistralConfig(**COMMON, sliding_window=8),
    "gemma2_softcap": lambda: Gemma2Config(**{**COMMON, "tie_word_embeddings": True}, head_dim=16, sliding_window=8,
                                           query_pre_attn_scalar=16, attn_logit_softcapping=1.0,
                                           final_logit_softcapping=30.0),
    "llama_mha": lambda: LlamaConfig(**{**COMMON, "num_key_value_heads": 4}),
}
# Three sequences (prompt, response) whose 51 tokens do not divide by 2 (a filler pads the row),
# longer than the window, with a response crossing the middle of the row.
PROMPTS, RESPONSES = (7, 5, 11), (10, 12, 6)
# Vision-language policies (one key/value head: each rank attends with a copy of it).
VLMS = ("idefics3", "qwen_2", "qwen_2.5", "qwen_3")


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().double() - b.detach().double()).abs().max().item()


def row(seed: int):
    generator = torch.Generator().manual_seed(seed)
    lens = [p + r for p, r in zip(PROMPTS, RESPONSES)]
    ids = torch.randint(4, 96, (1, sum(lens)), generator=generator)
    return ids, lens, list(RESPONSES)


def losses(log_probs, entropy, base, advantages, mask):
    policy = PolicyLoss(0.2)(log_probs, log_probs.detach() + 0.05 * base.sin(), advantages, action_mask=mask)
    kl = compute_approx_kl(log_probs, base, mask, kl_estimator="k3")
    total = policy + 0.1 * (kl * mask).sum() / mask.sum() - 0.01 * (entropy * mask).sum() / mask.sum()
    return total, kl


def check_actor(name: str, group: SequenceParallel, checkpointing: bool, compiled: bool = False) -> dict:
    """`compiled`: the split actor's decoder layers under torch.compile (`--torch_compile aot_eager`)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name]()).float()
    state = model.state_dict()
    reference = ActorLanguage(model, gradient_checkpointing=checkpointing)
    twin = AutoModelForCausalLM.from_config(CONFIGS[name]()).float()
    twin.load_state_dict(state)
    split = ActorLanguage(twin, gradient_checkpointing=checkpointing, torch_compile="aot_eager" if compiled else None)
    split.use_sequence_parallel(group)
    reference.train(), split.train()
    ids, lens, actions = row(1)
    base = -3.0 + torch.randn(3, max(actions), generator=torch.Generator().manual_seed(2))
    advantages = torch.randn(3, max(actions), generator=torch.Generator().manual_seed(3))
    mask = (torch.arange(max(actions)).unsqueeze(0) < torch.tensor(actions).unsqueeze(1)).float()
    results = {}
    for key, actor in (("reference", reference), ("split", split)):
        log_probs, output = actor(ids, actions, packed_seq_lens=lens, return_output=True, return_entropy=True)
        total, kl = losses(log_probs, output["entropy"], base, advantages, mask)
        total.backward()
        grads = {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}
        results[key] = (log_probs * mask, output["entropy"] * mask, kl * mask, total, grads, output.logits.size(1))
    summed = {}
    for n, grad in results["split"][4].items():
        summed[n] = grad.clone()
        dist.all_reduce(summed[n], group=group.group)
    ref_grads = results["reference"][4]
    return {
        "check": f"{name}{'_checkpointing' if checkpointing else ''}{'_compiled' if compiled else ''}",
        "compiled_graphs": split.compiled_layers.graphs if compiled else 0,
        "log_probs": max_diff(results["split"][0], results["reference"][0]),
        "entropy": max_diff(results["split"][1], results["reference"][1]),
        "kl": max_diff(results["split"][2], results["reference"][2]),
        "loss": max_diff(results["split"][3], results["reference"][3]),
        "grads": max(max_diff(summed[n], ref_grads[n]) for n in ref_grads),
        "grad_names": sorted(summed) == sorted(ref_grads),
        "grad_scale": max(ref_grads[n].abs().max().item() for n in ref_grads),
        "log_prob_scale": results["reference"][0].abs().max().item(),
        # Each rank's share alone is not the gradient, and computes a part of the row's logits:
        # the split really divides the work.
        "share_vs_reference": max(max_diff(results["split"][4][n], ref_grads[n]) for n in ref_grads),
        "logits_kept": [results["split"][5], results["reference"][5]],
    }


def check_moe(group: SequenceParallel) -> dict:
    """A mixture-of-experts policy's load-balancing loss of a split row: the unsplit row's value,
    and with the policy loss, the unsplit gradients once the ranks' parts are summed."""
    config = lambda: Qwen3MoeConfig(**{**COMMON, "head_dim": 16}, num_experts=4, num_experts_per_tok=2,  # noqa: E731
                                    moe_intermediate_size=32, router_aux_loss_coef=0.01)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config()).float()
    twin = AutoModelForCausalLM.from_config(config()).float()
    twin.load_state_dict(model.state_dict())
    reference, split = ActorLanguage(model), ActorLanguage(twin)
    split.use_sequence_parallel(group)
    reference.train(), split.train()
    ids, lens, actions = row(6)
    advantages = torch.randn(3, max(actions), generator=torch.Generator().manual_seed(7))
    mask = (torch.arange(max(actions)).unsqueeze(0) < torch.tensor(actions).unsqueeze(1)).float()
    results = {}
    for key, actor in (("reference", reference), ("split", split)):
        log_probs, output = actor(ids, actions, packed_seq_lens=lens, return_output=True, return_aux_loss=True)
        policy = PolicyLoss(0.2)(log_probs, log_probs.detach(), advantages, action_mask=mask)
        (policy + 0.5 * output["aux_loss"]).backward()
        results[key] = (output["aux_loss"].detach(), {n: p.grad.clone() for n, p in actor.model.named_parameters()
                                                      if p.grad is not None})
    router = [n for n in results["reference"][1] if ".gate." in n or n.endswith("gate.weight")]
    for grad in results["split"][1].values():
        dist.all_reduce(grad, group=group.group)
    ref_grads = results["reference"][1]
    return {"check": "moe", "aux": max_diff(results["split"][0], results["reference"][0]),
            "aux_value": results["reference"][0].item(),
            "grads": max(max_diff(results["split"][1][n], g) for n, g in ref_grads.items()),
            "router_grads": max(max_diff(results["split"][1][n], ref_grads[n]) for n in router),
            "router_grad_scale": max(ref_grads[n].abs().max().item() for n in router), "routers": len(router)}


def check_moe_replay(group: SequenceParallel) -> dict:
    """Routing replay on a split row: each rank replays its slice of the row's routes (routes other
    than the live ones, so replay decides every expert); the unsplit row's log-probs, and its
    gradients (router weights included) once the ranks' parts are summed."""
    config = lambda: Qwen3MoeConfig(**{**COMMON, "head_dim": 16}, num_experts=4, num_experts_per_tok=2,  # noqa: E731
                                    moe_intermediate_size=32)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config()).float()
    twin = AutoModelForCausalLM.from_config(config()).float()
    twin.load_state_dict(model.state_dict())
    reference, split = ActorLanguage(model, routing_replay="old"), ActorLanguage(twin, routing_replay="old")
    split.use_sequence_parallel(group)
    reference.train(), split.train()
    ids, lens, actions = row(8)
    reference.routing.start_recording()
    with torch.no_grad():
        live = reference(ids, actions, packed_seq_lens=lens)
    routes = reference.routing.take()[0]
    reference.routing.stop_recording()
    routes = ((routes.long() + 1) % 4).to(routes.dtype).unsqueeze(0)           # (1, P, L, K), all replayed
    advantages = torch.randn(3, max(actions), generator=torch.Generator().manual_seed(9))
    mask = (torch.arange(max(actions)).unsqueeze(0) < torch.tensor(actions).unsqueeze(1)).float()
    results = {}
    for key, actor in (("reference", reference), ("split", split)):
        log_probs = actor(ids, actions, packed_seq_lens=lens, routes=routes)
        PolicyLoss(0.2)(log_probs, log_probs.detach(), advantages, action_mask=mask).backward()
        results[key] = (log_probs.detach(), {n: p.grad.clone() for n, p in actor.model.named_parameters()
                                             if p.grad is not None})
    for grad in results["split"][1].values():
        dist.all_reduce(grad, group=group.group)
    ref_grads = results["reference"][1]
    router = [n for n in ref_grads if n.endswith("gate.weight")]
    return {"check": "moe_replay", "replayed_vs_live": max_diff(results["reference"][0] * mask, live * mask),
            "log_probs": max_diff(results["split"][0] * mask, results["reference"][0] * mask),
            "grads": max(max_diff(results["split"][1][n], g) for n, g in ref_grads.items()),
            "router_grad_scale": min(ref_grads[n].abs().max().item() for n in router), "routers": len(router)}


def check_critic(group: SequenceParallel, folder: Path) -> dict:
    torch.manual_seed(0)
    if dist.get_rank() == 0:
        AutoModelForCausalLM.from_config(CONFIGS["qwen2_gqa_window"]()).float().save_pretrained(folder)
    dist.barrier()
    reference, split = Critic(folder), Critic(folder)
    with torch.no_grad():                         # a head that is not ~0, the same on both
        for critic in (reference, split):
            critic.model.score.weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(5))
    split.use_sequence_parallel(group)
    ids, lens, actions = row(4)
    values = {}
    for key, critic in (("reference", reference), ("split", split)):
        out = critic(ids, actions, packed_seq_lens=lens)
        (out.square().sum()).backward()
        values[key] = (out, {n: p.grad.clone() for n, p in critic.model.named_parameters() if p.grad is not None})
    for grad in values["split"][1].values():
        dist.all_reduce(grad, group=group.group)
    return {"check": "critic", "values": max_diff(values["split"][0], values["reference"][0]),
            "grads": max(max_diff(values["split"][1][n], g) for n, g in values["reference"][1].items()),
            "grad_scale": max(g.abs().max().item() for g in values["reference"][1].values()),
            "value_scale": values["reference"][0].abs().max().item()}


def vlm_row(name: str, tokenizer, model):
    """A packed row of three sequences holding 1, 0 and 2 images, with an image's run of
    placeholders crossing the split (the middle of the row), and its merged media."""
    for lead in range(60):
        ids, lens, actions, media = vlm_row_with(name, tokenizer, model, "s" * lead)
        middle, image = -(-ids.size(1) // 2), model.config.image_token_id
        if ids[0, middle - 1] == ids[0, middle] == image:
            return ids, lens, actions, media
    raise AssertionError("no row of this shape puts an image across the split")


def vlm_row_with(name: str, tokenizer, model, lead: str):
    from lightrft.models.families import family_of

    generator = torch.Generator().manual_seed(11)
    config = model.config
    if name == "idefics3":
        around, image = tokenizer.convert_tokens_to_ids(["<fake_token_around_image>", "<image>"])

        def run(_):
            return [around] + [image] * 4 + [around]
        media = [{"pixel_values": torch.randn(n, 3, 56, 56, generator=generator)} if n else None for n in (1, 0, 2)]
    else:
        patch = config.vision_config.patch_size
        width = config.vision_config.in_channels * config.vision_config.temporal_patch_size * patch ** 2
        grids = [[(1, 4, 4)], [], [(1, 4, 6), (1, 2, 2)]]
        media = [{"pixel_values": torch.randn(sum(t * h * w for t, h, w in g), width, generator=generator),
                  "image_grid_thw": torch.tensor(g)} if g else None for g in grids]
        queue = [grid for g in grids for grid in g]

        def run(_):
            t, h, w = queue.pop(0)
            return [config.vision_start_token_id] + [config.image_token_id] * (t * h * w // 4) + [
                config.vision_end_token_id]
    texts = [("see", 1, "red"), ("c", 0, "bluer"), ("two", 2, "okay")]
    seqs, actions = [], []
    for prompt, images, answer in texts:
        ids = tokenizer.encode(prompt)
        for k in range(images):
            ids += run(k)
        ids += tokenizer.encode({0: "and the rest of it", 1: "", 2: lead}[images])
        seqs.append(ids + tokenizer.encode(answer))
        actions.append(len(tokenizer.encode(answer)))
    return (torch.tensor([sum(seqs, [])]), [len(q) for q in seqs], actions,
            family_of(model).merge_media(media))


def check_vlm(name: str, group: SequenceParallel) -> dict:
    """A vision-language policy's split row (the vision tower on every rank, each keeping its
    slice): the unsplit log-probs, entropies and losses, and once the ranks' parts are summed,
    the unsplit gradients of the decoder and the vision tower."""
    from lightrft.utils.tiny import (build_qwen_vl_tokenizer, build_tiny_idefics3, build_tiny_qwen_vl,
                                     build_vlm_tokenizer)

    if name == "idefics3":
        tokenizer = build_vlm_tokenizer()
        build = lambda: build_tiny_idefics3(tokenizer, seed=4)  # noqa: E731
    else:
        tokenizer = build_qwen_vl_tokenizer()
        build = lambda: build_tiny_qwen_vl(name.split("_")[1], tokenizer, seed=4)  # noqa: E731
    reference, split = ActorLanguage(build(), packing_samples=True), ActorLanguage(build(), packing_samples=True)
    split.use_sequence_parallel(group)
    reference.train(), split.train()
    ids, lens, actions, media = vlm_row(name, tokenizer, reference.model)
    base = -3.0 + torch.randn(3, max(actions), generator=torch.Generator().manual_seed(2))
    advantages = torch.randn(3, max(actions), generator=torch.Generator().manual_seed(3))
    mask = (torch.arange(max(actions)).unsqueeze(0) < torch.tensor(actions).unsqueeze(1)).float()
    results = {}
    for key, actor in (("reference", reference), ("split", split)):
        log_probs, output = actor(ids, actions, packed_seq_lens=lens, return_output=True, return_entropy=True,
                                  media=media)
        total, _ = losses(log_probs, output["entropy"], base, advantages, mask)
        total.backward()
        results[key] = (log_probs * mask, output["entropy"] * mask, total,
                        {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None})
    summed = {n: grad.clone() for n, grad in results["split"][3].items()}
    for grad in summed.values():
        dist.all_reduce(grad, group=group.group)
    ref_grads = results["reference"][3]
    vision = [n for n in ref_grads if n.startswith(reference.family.vision_modules(reference.model))]
    return {"check": f"vlm_{name}", "log_probs": max_diff(results["split"][0], results["reference"][0]),
            "entropy": max_diff(results["split"][1], results["reference"][1]),
            "loss": max_diff(results["split"][2], results["reference"][2]),
            "grads": max(max_diff(summed[n], g) for n, g in ref_grads.items()),
            "grad_names": sorted(summed) == sorted(ref_grads),
            "vision_grads": max(max_diff(summed[n], ref_grads[n]) for n in vision),
            "vision_grad_scale": max(ref_grads[n].abs().max().item() for n in vision), "vision": len(vision),
            "log_prob_scale": results["reference"][0].abs().max().item(),
            # Each rank's share alone is not the vision tower's gradient: both halves hold images.
            "vision_share_vs_reference": max(max_diff(results["split"][3][n], ref_grads[n]) for n in vision)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    strategy = DeepspeedStrategy(StrategyConfig(zero_stage=0, seed=0))
    strategy.setup_distributed()
    group = SequenceParallel(dist.new_group([0, 1]), 2, strategy.rank)
    out = Path(f"{args.out}.rank{strategy.rank}")
    records = [check_actor(name, group, False) for name in CONFIGS]
    records.append(check_actor("qwen2_gqa_window", group, True))
    records.append(check_actor("qwen2_gqa_window", group, False, compiled=True))
    records.append(check_critic(group, out.parent / "critic"))
    records.append(check_moe(group))
    records.append(check_moe_replay(group))
    records += [check_vlm(name, group) for name in VLMS]
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    strategy.close()


if __name__ == "__main__":
    run_program(main)
