"""One GRPO step of `train_ppo` per tiny architecture, all in one torchrun launch (CPU, gloo).

    torchrun --nproc_per_node 2 tests/models/arch_matrix_dist.py OUT_DIR ARCH [ARCH ...]

For each architecture a tiny model folder is saved under OUT_DIR/ARCH/pretrain and
`lightrft.cli.train_ppo.train` runs one packed GRPO step on random-model rollouts; rank 0 writes
OUT_DIR/results.json: {arch: {"ratio_max": ..., "ratio_min": ..., "ratio_mean": ..., "error": ...}}
(the first optimizer step's importance ratios over the action tokens, from the logged train/*
metrics). The experience is made in micro-batches of 8 and trained in micro-batches of 4, so the
packed rows of the two forwards hold different neighbours: only exact packing (and no dropout)
gives a ratio of exactly 1. Launching once for all architectures saves a torchrun start
(imports, process group) per architecture: the process group is joined once here, and
`train()`'s closing of it is reduced to a barrier until the last architecture is done.
"""

import json
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from lightrft.cli.train_ppo import parse_args, train
from lightrft.datasets.toy import arithmetic_rows, write_jsonl
from lightrft.strategy.deepspeed_strategy import DeepspeedStrategy, skip_shared_memory_comm_op
from lightrft.utils.tiny import save_tiny_arch
from lightrft.utils.program import run_program


def flags(pretrain: Path, prompts: Path, out: Path) -> list[str]:
    """A GRPO step of 8 prompts x 2 samples with 12-token responses (sequences of 16-20 tokens,
    longer than the tiny 8-token sliding windows), packed, ZeRO-2."""
    return [
        "--pretrain", str(pretrain), "--prompt_data", str(prompts), "--input_key", "input", "--label_key", "label",
        "--remote_rm_url", "math", "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2",
        "--rollout_batch_size", "8", "--micro_rollout_batch_size", "8", "--train_batch_size", "16",
        "--micro_train_batch_size", "4", "--generate_max_len", "12", "--prompt_max_len", "16",
        "--init_kl_coef", "0", "--actor_learning_rate", "1e-3", "--num_episodes", "1", "--max_steps", "1",
        "--zero_stage", "2", "--packing_samples", "--seed", "0", "--disable_ds_ckpt", "--dist_timeout", "3",
        "--save_path", str(out / "model"), "--ckpt_path", str(out / "ckpt"),
    ]


def main(out_dir: str, archs: list[str]) -> None:
    torch.set_num_threads(1)
    skip_shared_memory_comm_op()     # as the strategy does: no JIT build of an op lightrft never calls (~75 s)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False,
                               timeout=timedelta(minutes=3))
    DeepspeedStrategy.close = lambda self: dist.barrier()
    rank0 = dist.get_rank() == 0
    root = Path(out_dir)
    prompts = root / "prompts.jsonl"
    if rank0:
        write_jsonl(arithmetic_rows(16, seed=0), prompts)
    results = {}
    for arch in archs:
        out = root / arch
        if rank0:
            save_tiny_arch(out / "pretrain", arch, seed=1)
        dist.barrier()
        start = time.perf_counter()
        try:
            logs = train(parse_args(flags(out / "pretrain", prompts, out)))
            results[arch] = {key: logs.get(f"train/{key}") for key in ("ratio_max", "ratio_min", "ratio_mean")}
        except Exception as err:  # recorded per architecture; the test reports it
            results[arch] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        results[arch]["seconds"] = round(time.perf_counter() - start, 1)
    if rank0:
        (root / "results.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    run_program(main, sys.argv[1], sys.argv[2:])
