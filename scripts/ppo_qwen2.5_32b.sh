#!/usr/bin/env bash
# PPO with a reward model and a critic, Qwen2.5-32B-Instruct as the actor: 8 nodes x 8 GPUs.
#
# Hardware   8 GPUs per node x 8 nodes = 64 GPUs, 80 GB each (A100/H100 80GB); host RAM >= 512 GB per node
# ZeRO       stage 3; offload: Adam states to CPU (--adam_offload)
# Precision  bf16, gradient checkpointing
# Packing    on (--packing_samples; with flash-attn installed the packed rows use its varlen kernel)
# Rollout    vllm, colocated: one engine replica per 4 GPUs of a node (--vllm_tensor_parallel_size 4,
#            16 replicas), --vllm_gpu_memory_utilization 0.5 while generating, asleep while training
# Models     actor, critic (initialised from the reward model), reference, reward model; gae advantages.
#            The reward model must share the actor's tokenizer (it scores the actor's token ids):
#            train it with lightrft.cli.train_rm from the same base model
# Batches    rollout_batch_size 512 prompts x n_samples_per_prompt 1 = 512 samples per rollout
#            (512 / 64 GPUs = 8 prompts, 8 samples per GPU)
#            train_batch_size 128: 512 / 128 = 4 optimizer steps per rollout (max_epochs 1)
#            micro_train_batch_size 1 x 64 GPUs = 64 samples per forward: 128 / 64 = 2 gradient-accumulation steps
#            micro_rollout_batch_size 2 samples per GPU per forward when scoring experience
# Lengths    prompt_max_len 1024, generate_max_len 1024
# Memory     per GPU (docs/scaling.md): vLLM 66 GB / 4 = 16.4 GB of weights + ~21 GB KV cache inside
#            0.5 x 80 GB; actor and critic: 32.8B x 4 bytes / 64 GPUs = 2 GB each, fp32 master and Adam
#            (394 GB each) in host RAM, 99 GB per node for both; reference and reward model 1 GB each;
#            sync bucket <= 1.6 GB.
# Data       PROMPT_DATA: jsonl (or parquet, ...) rows with a "prompt" field
#
# Run on every node with NNODES, NODE_RANK (0 .. NNODES-1) and MASTER_ADDR (node 0's address) set.
# A different GPU count changes the arithmetic above: keep rollout_batch_size divisible by the
# GPU count and train_batch_size divisible by micro_train_batch_size x GPUs.
# Extra flags after the script name are passed to the trainer (the last value of a flag wins).
# Usage: MODEL=... PROMPT_DATA=... bash scripts/ppo_qwen2.5_32b.sh [--flag value ...]

set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2.5-32B-Instruct}
REWARD_MODEL=${REWARD_MODEL:-./ckpt/rm_qwen2.5_32b}
CRITIC_MODEL=${CRITIC_MODEL:-$REWARD_MODEL}
PROMPT_DATA=${PROMPT_DATA:-data/prompts/train.jsonl}
SAVE_DIR=${SAVE_DIR:-./ckpt/ppo_qwen2.5_32b}
NNODES=${NNODES:-8}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}

torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    --nproc_per_node 8 -m lightrft.cli.train_ppo \
    --pretrain "$MODEL" --reward_pretrain "$REWARD_MODEL" --critic_pretrain "$CRITIC_MODEL" \
    --prompt_data "$PROMPT_DATA" --input_key prompt --apply_chat_template \
    --advantage_estimator gae --gamma 1.0 --lambd 0.95 --n_samples_per_prompt 1 \
    --rollout_engine vllm --vllm_tensor_parallel_size 4 --vllm_gpu_memory_utilization 0.5 \
    --rollout_batch_size 512 --micro_rollout_batch_size 2 \
    --train_batch_size 128 --micro_train_batch_size 1 \
    --prompt_max_len 1024 --generate_max_len 1024 --temperature 1.0 \
    --actor_learning_rate 3e-7 --critic_learning_rate 5e-6 --lr_warmup_ratio 0.03 \
    --init_kl_coef 0.01 --eps_clip 0.2 --value_clip 0.2 \
    --max_epochs 1 --num_episodes 1 \
    --zero_stage 3 --bf16 --adam_offload --gradient_checkpointing --packing_samples \
    --save_path "$SAVE_DIR/model" --ckpt_path "$SAVE_DIR/checkpoints" \
    --save_steps 20 --max_ckpt_num 3 --load_checkpoint if_present \
    --use_tensorboard "$SAVE_DIR/tensorboard" --logging_steps 1 \
    "$@"
