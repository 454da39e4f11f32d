"""Memory per rank of one long packed row's forward + backward, whole (`--sequence_parallel_size 1`)
against split over two ranks (2): peak memory above the rank's memory before the step, and seconds
per step.

Each (length, N) runs in its own two-rank `torchrun` launch, so every peak is that configuration's
own. With N = 1 both ranks train a row of the given length each (data parallel); with N = 2 they
share one. The model is Qwen2-shaped (hidden 256, 4 layers, 8 query and 4 key/value heads; with
`--window W` a sliding window on its last two layers), float32; the row is one sequence, half prompt and half
response, so the log-probs of half the tokens are computed. On the CPU the peak is the resident set
(`VmHWM`, reset before the step); on CUDA the allocator's peak reserved bytes.

    python benchmarks/sequence_parallel_memory.py [--lengths 2048 4096 8192 16384 --repeats 2 --json OUT]
    python benchmarks/sequence_parallel_memory.py --smoke     # 2 short lengths: checks it runs
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = "SP_MEMORY "


def worker(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from lightrft.doctor.memory import MemoryProbe, _proc_status_kib
    from lightrft.models import ActorLanguage
    from lightrft.strategy import DeepspeedStrategy, StrategyConfig

    strategy = DeepspeedStrategy(StrategyConfig(zero_stage=0, seed=0, sequence_parallel_size=args.split))
    strategy.setup_distributed()
    config = Qwen2Config(vocab_size=2048, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=args.length + 64,
                         use_sliding_window=args.window > 0, sliding_window=args.window or None,
                         max_window_layers=2)
    torch.manual_seed(0)
    actor = ActorLanguage(AutoModelForCausalLM.from_config(config).to(strategy.device),
                          gradient_checkpointing=args.checkpointing)
    actor.use_sequence_parallel(strategy.sequence_parallel)
    actor.train()
    generator = torch.Generator().manual_seed(1)

    def step(length: int) -> float:
        ids = torch.randint(4, 2048, (1, length), generator=generator).to(strategy.device)
        started = time.perf_counter()
        log_probs = actor(ids, [length // 2], packed_seq_lens=[length])
        log_probs.sum().backward()
        actor.model.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - started

    step(256)                                          # warm-up: lazily made buffers and kernels
    probe = MemoryProbe()
    seconds = []
    peak = 0.0
    for _ in range(args.repeats):
        before = (torch.cuda.memory_allocated() / 2**30 if probe.cuda else (_proc_status_kib("VmRSS") or 0) / 2**20)
        probe.reset()
        seconds.append(step(args.length))
        peak = max(peak, probe.peak_gib() - before)
    record = {"length": args.length, "split": args.split, "rank": strategy.rank, "peak_gib": peak,
              "seconds": seconds, "resettable": probe.resettable, "device": str(strategy.device)}
    records = [None] * strategy.world_size
    torch.distributed.all_gather_object(records, record)
    if strategy.is_rank_0():
        print(MARK + json.dumps(records), flush=True)
    strategy.close()


def launch(length: int, split: int, repeats: int, checkpointing: bool, window: int) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(29500 + (os.getpid() + length + split) % 2000), __file__, "--worker",
           "--length", str(length), "--split", str(split), "--repeats", str(repeats), "--window", str(window)]
    if checkpointing:
        cmd.append("--checkpointing")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    found = [json.loads(line[len(MARK):]) for line in proc.stdout.splitlines() if line.startswith(MARK)]
    records = found[0] if found else []
    if proc.returncode != 0 or len(records) != 2:
        raise SystemExit(f"length {length}, N {split} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-4000:]}")
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing in both")
    parser.add_argument("--window", type=int, default=0,
                        help="a sliding window of this many tokens on layers 3-4 (on the CPU a window layer builds "
                             "an L x L mask and scores; the varlen kernel on CUDA does not)")
    parser.add_argument("--smoke", action="store_true", help="lengths 256 and 512, one repeat")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--split", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.smoke:
        args.lengths, args.repeats = [256, 512], 1
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs; two ranks per run")
    print(f"{'tokens':>8} {'N':>2} {'peak above start, GiB/rank':>27} {'s/step':>8}")
    rows = []
    for length in args.lengths:
        for split in (1, 2):
            records = launch(length, split, args.repeats, args.checkpointing, args.window)
            peak = max(r["peak_gib"] for r in records)
            seconds = min(min(r["seconds"]) for r in records)
            rows.append({"length": length, "split": split, "peak_gib": peak, "seconds": seconds,
                         "device": records[0]["device"]})
            print(f"{length:>8} {split:>2} {peak:>27.3f} {seconds:>8.2f}", flush=True)
    for length in args.lengths:
        whole, split = (next(r for r in rows if r["length"] == length and r["split"] == n) for n in (1, 2))
        print(f"{length} tokens: N=2 holds {split['peak_gib'] / max(whole['peak_gib'], 1e-9):.2f}x the memory of N=1")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
