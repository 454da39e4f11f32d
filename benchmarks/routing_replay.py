"""What routing replay costs: the actor's forward + backward on a mixture-of-experts policy, routed
live against replaying routes (`--routing_replay`, `lightrft.utils.routing`), and the bytes the
routes take per token.

A Qwen3-MoE-shaped model built from a small config (hidden 256, 4 layers, 16 experts, top-4 by
default), a packed row of `--samples` sequences of `--length` tokens, float32 on the CPU (or the
GPU when there is one). Each route runs `--repeats` times after a warm-up; the median is printed.
Figures, not tests: nothing asserts on time.

    python benchmarks/routing_replay.py [--samples 8 --length 256 --experts 16 --top_k 4 --layers 4]
"""

import argparse
import statistics
import time

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from lightrft.models import ActorLanguage


def timed(step, repeats: int) -> float:
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top_k", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = Qwen3MoeConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                            moe_intermediate_size=args.hidden // 2, num_hidden_layers=args.layers,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
                            num_experts=args.experts, num_experts_per_tok=args.top_k)
    torch.manual_seed(0)
    actor = ActorLanguage(Qwen3MoeForCausalLM(config).float().to(device), routing_replay="old")
    lens = [args.length] * args.samples
    actions = [args.length // 2] * args.samples
    ids = torch.randint(4, 1024, (1, sum(lens)), device=device)
    routing = actor.routing
    routing.start_recording()
    with torch.no_grad():
        actor(ids, actions, packed_seq_lens=lens)
    routes = routing.take()[0].unsqueeze(0)
    routing.stop_recording()

    def step(replay: bool):
        def run():
            actor.zero_grad(set_to_none=True)
            log_probs = actor(ids, actions, packed_seq_lens=lens, routes=routes if replay else None)
            log_probs.sum().backward()
        return run

    live, replayed = timed(step(False), args.repeats), timed(step(True), args.repeats)
    tokens = sum(lens)
    print(f"device {device}, {tokens} tokens, {args.layers} MoE layers, {args.experts} experts, top-{args.top_k}")
    print(f"forward + backward, routed live:   {live * 1e3:8.1f} ms")
    print(f"forward + backward, replaying:     {replayed * 1e3:8.1f} ms  ({replayed / live:.3f}x)")
    print(f"routes: {routes.dtype}, {routes.element_size() * routing.layers * args.top_k} bytes per token, "
          f"{routes.numel() * routes.element_size() / 1e6:.3f} MB for the row")


if __name__ == "__main__":
    main()
