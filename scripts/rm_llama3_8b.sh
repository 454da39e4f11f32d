#!/usr/bin/env bash
# Reward model from preference pairs, starting from the SFT model of sft_llama3_8b.sh:
# 1 node x 8 GPUs. Its output is the REWARD_MODEL (and critic start) of ppo_llama3_8b.sh.
#
# Hardware   8 GPUs per node x 1 node = 8 GPUs, 80 GB each (A100/H100 80GB); host RAM >= 256 GB per node
# ZeRO       stage 3; offload: none
# Precision  bf16, gradient checkpointing
# Packing    off (train_rm pads each chosen/rejected pair)
# Batches    train_batch_size 256 pairs per optimizer step
#            micro_train_batch_size 1 x 8 GPUs = 8 pairs per forward: 256 / 8 = 32 gradient-accumulation steps
# Lengths    max_len 2048 per sequence; longer pairs are reported as bad rows (--on_bad_row skip drops them)
# Memory     8.0B x 16 bytes (bf16 weights and grads, fp32 master and Adam) / 8 GPUs = 16 GB.
# Data       DATASET: jsonl (or parquet, ...) rows with "prompt", "chosen" and "rejected" fields
#
# Single node; for several nodes set NNODES, NODE_RANK and MASTER_ADDR on each.
# Extra flags after the script name are passed to the trainer (the last value of a flag wins).
# Usage: MODEL=... DATASET=... bash scripts/rm_llama3_8b.sh [--flag value ...]

set -euo pipefail

MODEL=${MODEL:-./ckpt/sft_llama3_8b/model}
DATASET=${DATASET:-data/preference/train.jsonl}
SAVE_DIR=${SAVE_DIR:-./ckpt/rm_llama3_8b}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}

torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    --nproc_per_node 8 -m lightrft.cli.train_rm \
    --pretrain "$MODEL" \
    --dataset "$DATASET" --prompt_key prompt --chosen_key chosen --rejected_key rejected --apply_chat_template \
    --on_bad_row skip --eval_split 0.01 --eval_steps 100 \
    --max_len 2048 --train_batch_size 256 --micro_train_batch_size 1 \
    --max_epochs 1 --learning_rate 9e-6 --lr_warmup_ratio 0.03 \
    --zero_stage 3 --bf16 --gradient_checkpointing \
    --save_path "$SAVE_DIR" --ckpt_path "$SAVE_DIR-checkpoints" \
    --save_steps 200 --max_ckpt_num 2 --load_checkpoint if_present \
    --use_tensorboard "$SAVE_DIR-tensorboard" --logging_steps 10 \
    "$@"
