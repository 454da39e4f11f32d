#!/usr/bin/env bash
# SFT of Meta-Llama-3-8B-Instruct on prompt/response pairs: 1 node x 8 GPUs. The first stage before
# rm_llama3_8b.sh and ppo_llama3_8b.sh.
#
# Hardware   8 GPUs per node x 1 node = 8 GPUs, 80 GB each (A100/H100 80GB); host RAM >= 256 GB per node
# ZeRO       stage 2; offload: none
# Precision  bf16, gradient checkpointing
# Packing    on (--packing_samples: rows packed up to max_len, no padding; flash-attn recommended)
# Batches    train_batch_size 256 samples per optimizer step
#            micro_train_batch_size 4 x 8 GPUs = 32 samples per forward: 256 / 32 = 8 gradient-accumulation steps
# Lengths    max_len 4096 (prompt + response)
# Memory     8.0B x 2 bytes (bf16 weights, whole on each GPU under ZeRO-2) = 16 GB
#            + 8.0B x 14 bytes (grads, fp32 master, Adam) / 8 GPUs = 14 GB; activations with checkpointing.
# Data       DATASET: jsonl (or parquet, ...) rows with "prompt" and "response" fields
#
# Single node; for several nodes set NNODES, NODE_RANK and MASTER_ADDR on each.
# Extra flags after the script name are passed to the trainer (the last value of a flag wins).
# Usage: MODEL=... DATASET=... bash scripts/sft_llama3_8b.sh [--flag value ...]

set -euo pipefail

MODEL=${MODEL:-meta-llama/Meta-Llama-3-8B-Instruct}
DATASET=${DATASET:-data/sft/train.jsonl}
SAVE_DIR=${SAVE_DIR:-./ckpt/sft_llama3_8b}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}

torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    --nproc_per_node 8 -m lightrft.cli.train_sft \
    --pretrain "$MODEL" \
    --dataset "$DATASET" --input_key prompt --output_key response --apply_chat_template \
    --eval_split 0.01 --eval_steps 200 \
    --max_len 4096 --train_batch_size 256 --micro_train_batch_size 4 \
    --max_epochs 2 --learning_rate 5e-6 --lr_warmup_ratio 0.03 \
    --zero_stage 2 --bf16 --gradient_checkpointing --packing_samples \
    --save_path "$SAVE_DIR/model" --ckpt_path "$SAVE_DIR/checkpoints" \
    --save_steps 500 --max_ckpt_num 2 --load_checkpoint if_present \
    --use_tensorboard "$SAVE_DIR/tensorboard" --logging_steps 10 \
    "$@"
