"""Whether finished runs end cleanly: the same short launch repeated N times, its failures counted.

A finished run's rank could abort after its summary line ("terminate called without an active
exception", SIGABRT), so torchrun reported the run as failed (about one two-rank launch in 300 on a
loaded 2-core machine, before `lightrft.utils.program`). Each launch here is a fresh
`torchrun --nproc_per_node 2 -m lightrft.cli.train_ppo`: one GRPO step of a tiny random model under
ZeRO-3 (the stage whose gathers run on gloo's worker threads), the final checkpoint, the export and
the exit; `--explorer_ranks 1` adds an explorer rank (three processes). Launches run one after
another, so the machine's load is the launches' own.

Prints one line per failed launch (its exit status, whether the output holds the abort's signature,
the last lines of its output; the whole output goes to `failures/` under the run folder, kept
with --keep) and a summary: launches, failures, aborts, seconds per launch. Run it from a checkout
nobody edits meanwhile: each launch imports lightrft afresh.

    python benchmarks/clean_exit.py [--launches 300] [--zero_stage 3] [--explorer_ranks 0] [--keep DIR]
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ABORT_SIGNATURES = ("terminate called", "Aborted", "SIGABRT", "exitcode  : -6")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prepare(root: Path) -> tuple[Path, Path]:
    """A tiny random policy with the character tokenizer, and 16 addition prompts."""
    from lightrft.datasets.toy import arithmetic_splits, write_jsonl
    from lightrft.utils.tiny import save_tiny_model

    model = save_tiny_model(root / "model")
    rows, _ = arithmetic_splits(n_train=16, n_eval=4, seed=0)
    return model, write_jsonl(rows, root / "prompts.jsonl")


def launch(model: Path, prompts: Path, out: Path, args) -> subprocess.CompletedProcess:
    trainers = 2
    flags = ["--pretrain", model, "--prompt_data", prompts, "--input_key", "input", "--label_key", "label",
             "--remote_rm_url", "math", "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4",
             "--rollout_batch_size", "8", "--micro_rollout_batch_size", "16", "--train_batch_size", "32",
             "--micro_train_batch_size", "16", "--generate_max_len", "4", "--prompt_max_len", "16",
             "--max_steps", "1", "--zero_stage", str(args.zero_stage), "--save_path", out / "export",
             "--ckpt_path", out / "ckpt", "--seed", "0"]
    if args.explorer_ranks:
        flags += ["--explorer_ranks", str(args.explorer_ranks)]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
               str(trainers + args.explorer_ranks), "--master_addr", "127.0.0.1", "--master_port",
               str(free_port()), "-m", "lightrft.cli.train_ppo", *map(str, flags)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=300)
    parser.add_argument("--zero_stage", type=int, default=3, choices=(0, 1, 2, 3))
    parser.add_argument("--explorer_ranks", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one launch may take")
    parser.add_argument("--keep", default=None, help="folder for the model and runs (default: a temporary one)")
    args = parser.parse_args()
    if args.launches < 1:
        parser.error("--launches must be at least 1")
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="lightrft_clean_exit_"))
    root.mkdir(parents=True, exist_ok=True)
    model, prompts = prepare(root)
    seconds, failures, aborts, timeouts = [], 0, 0, 0
    for index in range(args.launches):
        out = root / "run"
        shutil.rmtree(out, ignore_errors=True)
        started = time.perf_counter()
        try:
            proc = launch(model, prompts, out, args)
        except subprocess.TimeoutExpired:
            timeouts += 1
            failures += 1
            print(f"launch {index + 1}: no exit within {args.timeout:.0f} s", flush=True)
            continue
        seconds.append(time.perf_counter() - started)
        output = proc.stdout + proc.stderr
        finished = '"stop_reason"' in proc.stdout
        if proc.returncode != 0 or not finished:
            failures += 1
            aborted = any(signature in output for signature in ABORT_SIGNATURES)
            aborts += aborted
            log = root / "failures" / f"launch_{index + 1}.log"
            log.parent.mkdir(exist_ok=True)
            log.write_text(output)
            tail = " | ".join(line for line in output.strip().splitlines()[-6:])
            print(f"launch {index + 1}: exit {proc.returncode}, summary line {'printed' if finished else 'missing'}, "
                  f"{'abort at exit' if aborted else 'other failure'} (output: {log}): {tail[-600:]}", flush=True)
        elif (index + 1) % 25 == 0:
            print(f"{index + 1} launches, {failures} failed", flush=True)
    summary = {"launches": args.launches, "failures": failures, "aborts_at_exit": aborts, "timeouts": timeouts,
               "zero_stage": args.zero_stage, "explorer_ranks": args.explorer_ranks,
               "seconds_per_launch_median": round(statistics.median(seconds), 2) if seconds else None,
               "cpus": os.cpu_count()}
    print(json.dumps(summary))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
