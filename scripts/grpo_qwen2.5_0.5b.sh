#!/usr/bin/env bash
# GRPO on math prompts with Qwen2.5-0.5B-Instruct: 1 node x 4 GPUs.
#
# Hardware   4 GPUs per node x 1 node = 4 GPUs, 24 GB each (RTX 4090 / L4 / A10 class); host RAM >= 64 GB per node
# ZeRO       stage 2; offload: none
# Precision  bf16
# Packing    on (--packing_samples; with flash-attn installed the packed rows use its varlen kernel)
# Rollout    vllm, colocated: one engine per GPU (tensor parallel 1), --vllm_gpu_memory_utilization 0.4
#            while generating, asleep (memory released) while training
# Models     actor + reference (KL as a loss term, k3 estimator); no critic: group_norm advantages;
#            reward: the builtin `math` rule (1 when the final answer equals the label)
# Batches    rollout_batch_size 64 prompts x n_samples_per_prompt 8 = 512 samples per rollout
#            (64 / 4 GPUs = 16 prompts, 128 samples per GPU)
#            train_batch_size 128: 512 / 128 = 4 optimizer steps per rollout (max_epochs 1)
#            micro_train_batch_size 4 x 4 GPUs = 16 samples per forward: 128 / 16 = 8 gradient-accumulation steps
#            micro_train_max_tokens 4096: a packed micro-batch of long samples holds fewer than 4 (same update,
#            more micro-batches per optimizer step)
#            micro_rollout_batch_size 16 samples per GPU per forward when scoring experience,
#            micro_rollout_max_tokens 8192 of them at most (samples x the columns they use: 16 full-length
#            rows would be 16 x 1,536 = 24,576; the same values)
# Lengths    prompt_max_len 512, generate_max_len 1024
# Memory     trainer: 0.49B params x 2 bytes (bf16 weights, whole on each GPU under ZeRO-2)
#            + 0.49B x 14 bytes (grads, fp32 master, Adam) / 4 GPUs = 1 + 1.7 GB; reference 1 GB;
#            vLLM: 1 GB of weights + KV cache inside 0.4 x 24 GB; the rest is activations and
#            the (micro x tokens x 152k vocab) logits, which micro_train_batch_size 4 keeps small.
# Data       PROMPT_DATA / EVAL_DATA: jsonl (or parquet, ...) rows with "problem" and "answer" fields
#
# Single node; for several nodes set NNODES, NODE_RANK and MASTER_ADDR on each.
# A different GPU count changes the arithmetic above: keep rollout_batch_size divisible by the
# GPU count and train_batch_size divisible by micro_train_batch_size x GPUs.
# Extra flags after the script name are passed to the trainer (the last value of a flag wins).
# Usage: MODEL=... PROMPT_DATA=... bash scripts/grpo_qwen2.5_0.5b.sh [--flag value ...]

set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
PROMPT_DATA=${PROMPT_DATA:-data/math/train.jsonl}
EVAL_DATA=${EVAL_DATA:-data/math/test.jsonl}
SAVE_DIR=${SAVE_DIR:-./ckpt/grpo_qwen2.5_0.5b}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}

torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    --nproc_per_node 4 -m lightrft.cli.train_ppo \
    --pretrain "$MODEL" \
    --prompt_data "$PROMPT_DATA" --input_key problem --label_key answer --apply_chat_template \
    --eval_data "$EVAL_DATA" --eval_steps 10 --eval_n_samples 4 \
    --remote_rm_url math \
    --advantage_estimator group_norm --n_samples_per_prompt 8 \
    --rollout_engine vllm --vllm_gpu_memory_utilization 0.4 \
    --rollout_batch_size 64 --micro_rollout_batch_size 16 --micro_rollout_max_tokens 8192 \
    --train_batch_size 128 --micro_train_batch_size 4 --micro_train_max_tokens 4096 \
    --prompt_max_len 512 --generate_max_len 1024 --temperature 1.0 \
    --actor_learning_rate 1e-6 --lr_warmup_ratio 0.03 \
    --init_kl_coef 1e-3 --use_kl_loss --kl_estimator k3 --eps_clip 0.2 \
    --max_epochs 1 --num_episodes 1 \
    --zero_stage 2 --bf16 --packing_samples \
    --save_path "$SAVE_DIR/model" --ckpt_path "$SAVE_DIR/checkpoints" \
    --save_steps 20 --max_ckpt_num 3 --load_checkpoint if_present \
    --use_tensorboard "$SAVE_DIR/tensorboard" --logging_steps 1 \
    "$@"
