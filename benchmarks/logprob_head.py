"""Memory and time of the LM head's log-probs and entropies, forward + backward: the plain route
(logits = hidden @ W.T, then `log_probs_from_logits` and `entropy_from_logits`) against the fused
head (`lightrft.algorithms.fused_head.log_probs_from_hidden`, which never holds the logits).

Qwen2-0.5B's head by default: vocabulary 151,936, hidden 896, bf16 weights and hidden states;
the loss takes the log-probs and an entropy bonus (`--no_entropy`: the log-probs only, PPO with
`--entropy_coef 0`). Each (route, tokens) runs in a fresh process: its peak is the resident-set
high-water mark (`VmHWM`, reset after the inputs are allocated; on CUDA the allocator's peak
reserved bytes) above the memory held then, so the inputs (hidden states and weight) are not
counted and the weight's gradient is. A configuration whose estimated need exceeds `--max_gb` is
not run ("skipped (needs X GB)"): the plain route holds the logits and, in the backward pass,
one logit gradient per output in the loss, each tokens x vocabulary in the inputs' dtype.
GB here are 10^9 bytes. Figures, not tests: nothing asserts on time.

    python benchmarks/logprob_head.py [--tokens 4096 8192 16384 32768 --max_gb 10 --threads 1 --json OUT]
    python benchmarks/logprob_head.py --smoke      # 256 and 512 tokens, vocabulary 4096: checks it runs
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = "LOGPROB_HEAD "
GB = 1e9
DTYPES = {"bf16": 2, "fp32": 4}  # bytes per element


def estimated_need_gb(route: str, tokens: int, args) -> float:
    """Bytes (GB) a configuration holds above its inputs at its peak, both with the weight's
    gradient. The plain route: its logits and one logit gradient per loss term, which it cannot do
    without (logprobs.py's float32 blocks, 0.4 GB at most, are left out, so this is a lower bound).
    The fused head: an upper estimate, one chunk's logits, probabilities and gradient (float32,
    plus copies in the inputs' dtype) and its float32 weight-gradient sum."""
    size = DTYPES[args.dtype]
    outputs = 1 if args.no_entropy else 2
    weight_grad = args.vocab * args.hidden * size
    if route == "plain":
        return ((1 + outputs) * tokens * args.vocab * size + weight_grad) / GB
    chunk = min(tokens, args.chunk_tokens)
    return (chunk * args.vocab * (3 * 4 + 2 * size) + args.vocab * args.hidden * 4 + 2 * weight_grad) / GB


def worker(args) -> None:
    import torch

    from lightrft.algorithms.fused_head import log_probs_from_hidden
    from lightrft.algorithms.logprobs import entropy_from_logits, log_probs_from_logits
    from lightrft.doctor.memory import MemoryProbe, _proc_status_kib

    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    generator = torch.Generator().manual_seed(0)
    weight = (0.05 * torch.randn(args.vocab, args.hidden, generator=generator)).to(device, dtype).requires_grad_()

    def inputs(tokens: int):
        hidden = torch.randn(tokens, args.hidden, generator=generator).to(device, dtype).requires_grad_()
        return hidden, torch.randint(0, args.vocab, (tokens,), generator=generator).to(device)

    def step(hidden, labels) -> float:
        """Seconds of one forward + backward of the loss on the log-probs (and entropies)."""
        started = time.perf_counter()
        if args.route == "fused":
            log_probs, entropy = log_probs_from_hidden(hidden, weight, labels, return_entropy=not args.no_entropy,
                                                       chunk_tokens=args.chunk_tokens)
        else:
            logits = hidden @ weight.T  # (N, V)
            log_probs = log_probs_from_logits(logits, labels)
            entropy = None if args.no_entropy else entropy_from_logits(logits)
            del logits
        loss = log_probs.sum() if entropy is None else log_probs.sum() + 0.01 * entropy.sum()
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    step(*inputs(256))                                  # warm-up: kernels and allocator pools
    weight.grad = None
    hidden, labels = inputs(args.count)
    probe = MemoryProbe()
    before = (torch.cuda.memory_allocated() / 2**30 if probe.cuda else (_proc_status_kib("VmRSS") or 0) / 2**20)
    probe.reset()
    seconds = [step(hidden, labels)]
    peak_gb = (probe.peak_gib() - before) * 2**30 / GB
    for _ in range(args.repeats - 1):
        weight.grad, hidden.grad = None, None
        seconds.append(step(hidden, labels))
    print(MARK + json.dumps({"peak_gb": peak_gb, "seconds": min(seconds), "resettable": probe.resettable,
                             "device": str(device)}), flush=True)


def launch(route: str, tokens: int, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--route", route, "--count", str(tokens), "--vocab", str(args.vocab),
           "--hidden", str(args.hidden), "--dtype", args.dtype, "--chunk_tokens", str(args.chunk_tokens),
           "--threads", str(args.threads), "--repeats", str(args.repeats)]
    if args.no_entropy:
        cmd.append("--no_entropy")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    found = [json.loads(line[len(MARK):]) for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or not found:
        raise SystemExit(f"{route} at {tokens} tokens failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-4000:]}")
    return found[0]


def main() -> None:
    from lightrft.algorithms.fused_head import CHUNK_TOKENS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="of the weight and hidden states")
    parser.add_argument("--chunk_tokens", type=int, default=CHUNK_TOKENS, help="the fused head's rows per block")
    parser.add_argument("--no_entropy", action="store_true", help="the loss takes the log-probs only")
    parser.add_argument("--max_gb", type=float, default=10.0,
                        help="skip a configuration whose estimated need above its inputs exceeds this (GB)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="timed steps per configuration (the fastest counts)")
    parser.add_argument("--smoke", action="store_true", help="256 and 512 tokens, vocabulary 4096")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--route", choices=["plain", "fused"], help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.smoke:
        args.tokens, args.vocab = [256, 512], 4096
    loss = "log-probs" if args.no_entropy else "log-probs + 0.01 x entropy"
    print(f"vocabulary {args.vocab}, hidden {args.hidden}, {args.dtype}, loss: {loss}, fused chunk "
          f"{args.chunk_tokens} tokens, {args.threads} thread(s), load average {os.getloadavg()[0]:.2f}")
    print(f"{'route':<6} {'tokens':>7} {'peak above inputs, GB':>22} {'estimate, GB':>13} {'s / fwd+bwd':>12}")
    rows = []
    for tokens in args.tokens:
        for route in ("plain", "fused"):
            need = estimated_need_gb(route, tokens, args)
            row = {"route": route, "tokens": tokens, "estimate_gb": need}
            if need > args.max_gb:
                row["skipped"] = True
                print(f"{route:<6} {tokens:>7} {f'skipped (needs {need:.1f} GB)':>22} {need:>13.2f}", flush=True)
            else:
                row.update(launch(route, tokens, args))
                print(f"{route:<6} {tokens:>7} {row['peak_gb']:>22.2f} {need:>13.2f} {row['seconds']:>12.2f}",
                      flush=True)
            rows.append(row)
    for tokens in args.tokens:
        plain, fused = (next(r for r in rows if r["tokens"] == tokens and r["route"] == route)
                        for route in ("plain", "fused"))
        if fused.get("skipped"):
            continue
        reference = plain["estimate_gb"] if plain.get("skipped") else plain["peak_gb"]
        source = "its estimate" if plain.get("skipped") else "measured"
        print(f"{tokens} tokens: the fused peak is {fused['peak_gb'] / reference:.2f} x the plain route's "
              f"({source}, {reference:.2f} GB)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
