#!/usr/bin/env bash
# GRPO on math prompts with Llama-3.3-70B-Instruct: 4 nodes x 8 GPUs.
#
# Hardware   8 GPUs per node x 4 nodes = 32 GPUs, 80 GB each (A100/H100 80GB); host RAM >= 1024 GB per node
# ZeRO       stage 3; offload: Adam states and parameters to CPU (--adam_offload --zero3_param_offload),
#            the frozen reference model too (--ref_reward_offload)
# Precision  bf16, gradient checkpointing
# Packing    on (--packing_samples; with flash-attn installed the packed rows use its varlen kernel)
# Rollout    vllm, colocated: one engine replica per node (--vllm_tensor_parallel_size 8, 4 replicas),
#            --vllm_gpu_memory_utilization 0.5 while generating, asleep while training
# Models     actor + reference (KL as a loss term, k3 estimator); no critic: group_norm advantages;
#            reward: the builtin `math` rule (1 when the final answer equals the label)
# Batches    rollout_batch_size 64 prompts x n_samples_per_prompt 8 = 512 samples per rollout
#            (64 / 32 GPUs = 2 prompts, 16 samples per GPU)
#            train_batch_size 128: 512 / 128 = 4 optimizer steps per rollout (max_epochs 1)
#            micro_train_batch_size 1 x 32 GPUs = 32 samples per forward: 128 / 32 = 4 gradient-accumulation steps
#            micro_rollout_batch_size 2 samples per GPU per forward when scoring experience
# Lengths    prompt_max_len 1024, generate_max_len 2048
# Memory     trainer: parameters, fp32 master and Adam states live in host RAM (70.6B x 2 + 70.6B x 12
#            bytes = 988 GB, 247 GB per node, plus the reference's 141 GB / 4 = 35 GB); ZeRO-3 brings
#            one layer at a time to the GPU. vLLM per GPU (docs/scaling.md): 141 GB / 8 = 17.7 GB of
#            weights + ~20 GB KV cache (40 KiB per token per GPU: ~520k tokens per replica, all 128 of
#            its sequences at once) inside 0.5 x 80 GB, moved to host RAM while asleep (141 GB per node);
#            sync bucket <= 2.1 GB (the embedding; a layer is 1.7 GB).
# Data       PROMPT_DATA / EVAL_DATA: jsonl (or parquet, ...) rows with "problem" and "answer" fields
#
# Run on every node with NNODES, NODE_RANK (0 .. NNODES-1) and MASTER_ADDR (node 0's address) set.
# A different GPU count changes the arithmetic above: keep rollout_batch_size divisible by the
# GPU count and train_batch_size divisible by micro_train_batch_size x GPUs.
# Extra flags after the script name are passed to the trainer (the last value of a flag wins).
# Usage: MODEL=... PROMPT_DATA=... bash scripts/grpo_llama3_70b.sh [--flag value ...]

set -euo pipefail

MODEL=${MODEL:-meta-llama/Llama-3.3-70B-Instruct}
PROMPT_DATA=${PROMPT_DATA:-data/math/train.jsonl}
EVAL_DATA=${EVAL_DATA:-data/math/test.jsonl}
SAVE_DIR=${SAVE_DIR:-./ckpt/grpo_llama3_70b}
NNODES=${NNODES:-4}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}

torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    --nproc_per_node 8 -m lightrft.cli.train_ppo \
    --pretrain "$MODEL" \
    --prompt_data "$PROMPT_DATA" --input_key problem --label_key answer --apply_chat_template \
    --eval_data "$EVAL_DATA" --eval_steps 10 --eval_n_samples 4 \
    --remote_rm_url math \
    --advantage_estimator group_norm --n_samples_per_prompt 8 \
    --rollout_engine vllm --vllm_tensor_parallel_size 8 --vllm_gpu_memory_utilization 0.5 \
    --rollout_batch_size 64 --micro_rollout_batch_size 2 \
    --train_batch_size 128 --micro_train_batch_size 1 \
    --prompt_max_len 1024 --generate_max_len 2048 --temperature 1.0 \
    --actor_learning_rate 3e-7 --lr_warmup_ratio 0.03 \
    --init_kl_coef 1e-3 --use_kl_loss --kl_estimator k3 --eps_clip 0.2 \
    --max_epochs 1 --num_episodes 1 \
    --zero_stage 3 --bf16 --adam_offload --zero3_param_offload --ref_reward_offload --gradient_checkpointing --packing_samples \
    --save_path "$SAVE_DIR/model" --ckpt_path "$SAVE_DIR/checkpoints" \
    --save_steps 20 --max_ckpt_num 3 --load_checkpoint if_present \
    --use_tensorboard "$SAVE_DIR/tensorboard" --logging_steps 1 \
    "$@"
