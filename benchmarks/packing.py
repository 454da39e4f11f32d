"""Training throughput of packed vs padded batches (forward + backward of ActorLanguage).

Compares one micro-batch of sequences with skewed lengths (a few long ones among many short
ones, as RL rollouts produce) laid out two ways:
  padded: (B, T) with T the longest sequence, prompts left-padded, responses right-padded;
  packed: one (1, P) row of the real tokens only, P = sum of lengths.
Both compute the same log-probs and gradients (tests/models/test_actor.py). The default mix
(3 x 256 + 13 x 48 tokens) pads to 2.94x its real tokens, so linear layers cost ~2.9x more padded;
attention, quadratic in the padded length, a little more. Prints real-token throughput and the
ratio (the median of alternating timed steps, so a busy machine slows both layouts alike).

    python benchmarks/packing.py [--hidden 256 --layers 4 --repeats 5 --threads 1]

Measured on a shared 2-core CPU, one thread: 2.6x to 3.4x (most runs 3.0x to 3.2x).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout without installing

import torch  # noqa: E402

from lightrft.models import ActorLanguage  # noqa: E402
from lightrft.models.packing import pack_padded  # noqa: E402
from lightrft.utils.tiny import build_char_tokenizer, build_tiny_causal_lm  # noqa: E402


def skewed_batch(long_len: int, short_len: int, num_long: int, num_short: int, seed: int = 0):
    """A padded batch whose second half of each sequence is the response (the actions)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [long_len] * num_long + [short_len] * num_short
    prompt_lens = [n // 2 for n in lengths]
    response_lens = [n - p for n, p in zip(lengths, prompt_lens)]
    max_p, max_r = max(prompt_lens), max(response_lens)
    rows, masks = [], []
    for p, r in zip(prompt_lens, response_lens):
        tokens = torch.randint(4, 100, (p + r,), generator=gen)
        rows.append(torch.cat([torch.zeros(max_p - p, dtype=torch.long), tokens, torch.zeros(max_r - r, dtype=torch.long)]))
        masks.append(torch.cat([torch.zeros(max_p - p), torch.ones(p + r), torch.zeros(max_r - r)]))
    return torch.stack(rows), torch.stack(masks).long(), response_lens


def train_step(actor, step_inputs) -> float:
    """Seconds for one forward + backward; the loss touches every real action token."""
    start = time.perf_counter()
    log_probs, action_mask = step_inputs(actor)
    (log_probs * action_mask).sum().backward()
    actor.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--long_len", type=int, default=256)
    parser.add_argument("--short_len", type=int, default=48)
    parser.add_argument("--num_long", type=int, default=3)
    parser.add_argument("--num_short", type=int, default=13)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (0: torch's default). One thread keeps the ratio stable on a shared "
                             "machine, where threads of a busy neighbour stall multi-threaded kernels unevenly")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, arch="qwen2", hidden_size=args.hidden, num_layers=args.layers,
                                 num_heads=4, num_kv_heads=2, max_position_embeddings=1024)
    actor = ActorLanguage(model)
    actor.train()

    sequences, attention_mask, response_lens = skewed_batch(args.long_len, args.short_len, args.num_long,
                                                           args.num_short)
    packed = pack_padded(sequences, attention_mask)
    num_actions = max(response_lens)
    action_mask = (torch.arange(num_actions).unsqueeze(0) < torch.tensor(response_lens).unsqueeze(1)).float()

    def padded_inputs(a):
        return a(sequences, num_actions, attention_mask=attention_mask), action_mask

    def packed_inputs(a):
        return a(packed.input_ids, response_lens, packed_seq_lens=packed.seq_lens), action_mask

    real_tokens, padded_tokens = int(attention_mask.sum()), sequences.numel()
    print(f"model: qwen2-shaped, hidden {args.hidden}, {args.layers} layers, attention {actor.attn_implementation}, "
          f"{torch.get_num_threads()} threads")
    print(f"batch: {args.num_long} x {args.long_len} + {args.num_short} x {args.short_len} tokens")
    print(f"real tokens {real_tokens}, padded tokens {padded_tokens} ({padded_tokens / real_tokens:.2f}x), "
          f"packed tokens {packed.input_ids.numel()}")

    train_step(actor, padded_inputs)  # warm-up: allocator, kernels
    train_step(actor, packed_inputs)
    padded_times, packed_times = [], []
    for _ in range(args.repeats):  # alternate, so a noisy neighbour hits both layouts alike
        padded_times.append(train_step(actor, padded_inputs))
        packed_times.append(train_step(actor, packed_inputs))
    padded_s, packed_s = statistics.median(padded_times), statistics.median(packed_times)
    print(f"padded: {padded_s:.3f} s/step, {real_tokens / padded_s:,.0f} real tokens/s")
    print(f"packed: {packed_s:.3f} s/step, {real_tokens / packed_s:,.0f} real tokens/s")
    print(f"packed / padded throughput: {padded_s / packed_s:.2f}x")


if __name__ == "__main__":
    main()
