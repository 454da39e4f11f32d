#!/usr/bin/env bash
# PPO with a reward model and a critic, Llama-3.3-70B-Instruct as the actor: 8 nodes x 8 GPUs.
#
# Hardware   8 GPUs per node x 8 nodes = 64 GPUs, 80 GB each (A100/H100 80GB); host RAM >= 1024 GB per node
# ZeRO       stage 3; offload: Adam states and parameters to CPU (--adam_offload --zero3_param_offload),
#            the frozen reference and reward models too (--ref_reward_offload)
# Precision  bf16, gradient checkpointing
# Packing    on (--packing_samples; with flash-attn installed the packed rows use its varlen kernel)
# Rollout    vllm, colocated: one engine replica per node (--vllm_tensor_parallel_size 8, 8 replicas),
#            --vllm_gpu_memory_utilization 0.5 while generating, asleep while training
# Models     actor, critic (initialised from the reward model), reference, reward model; gae advantages.
#            The reward model must share the actor's tokenizer (it scores the actor's token ids):
#            train it with lightrft.cli.train_rm from the same base model
# Batches    rollout_batch_size 256 prompts x n_samples_per_prompt 1 = 256 samples per rollout
#            (256 / 64 GPUs = 4 prompts, 4 samples per GPU)
#            train_batch_size 128: 256 / 128 = 2 optimizer steps per rollout (max_epochs 1)
#            micro_train_batch_size 1 x 64 GPUs = 64 samples per forward: 128 / 64 = 2 gradient-accumulation steps
#            micro_rollout_batch_size 1 sample per GPU per forward when scoring experience
# Lengths    prompt_max_len 1024, generate_max_len 1024
# Memory     trainer: actor and critic parameters, fp32 master and Adam states in host RAM
#            (2 x 70.6B x 14 bytes = 1.98 TB, 247 GB per node), reference and reward model parameters
#            too (2 x 141 GB / 8 = 35 GB per node); ZeRO-3 brings one layer at a time to the GPU.
#            vLLM per GPU (docs/scaling.md): 141 GB / 8 = 17.7 GB of weights + ~20 GB KV cache inside
#            0.5 x 80 GB, in host RAM while asleep (141 GB per node); sync bucket <= 2.1 GB.
# Data       PROMPT_DATA: jsonl (or parquet, ...) rows with a "prompt" field
#
# Run on every node with NNODES, NODE_RANK (0 .. NNODES-1) and MASTER_ADDR (node 0's address) set.
# A different GPU count changes the arithmetic above: keep rollout_batch_size divisible by the
# GPU count and train_batch_size divisible by micro_train_batch_size x GPUs.
# Extra flags after the script name are passed to the trainer (the last value of a flag wins).
# Usage: MODEL=... PROMPT_DATA=... bash scripts/ppo_llama3_70b.sh [--flag value ...]

set -euo pipefail

MODEL=${MODEL:-meta-llama/Llama-3.3-70B-Instruct}
REWARD_MODEL=${REWARD_MODEL:-./ckpt/rm_llama3_70b}
CRITIC_MODEL=${CRITIC_MODEL:-$REWARD_MODEL}
PROMPT_DATA=${PROMPT_DATA:-data/prompts/train.jsonl}
SAVE_DIR=${SAVE_DIR:-./ckpt/ppo_llama3_70b}
NNODES=${NNODES:-8}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}

torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    --nproc_per_node 8 -m lightrft.cli.train_ppo \
    --pretrain "$MODEL" --reward_pretrain "$REWARD_MODEL" --critic_pretrain "$CRITIC_MODEL" \
    --prompt_data "$PROMPT_DATA" --input_key prompt --apply_chat_template \
    --advantage_estimator gae --gamma 1.0 --lambd 0.95 --n_samples_per_prompt 1 \
    --rollout_engine vllm --vllm_tensor_parallel_size 8 --vllm_gpu_memory_utilization 0.5 \
    --rollout_batch_size 256 --micro_rollout_batch_size 1 \
    --train_batch_size 128 --micro_train_batch_size 1 \
    --prompt_max_len 1024 --generate_max_len 1024 --temperature 1.0 \
    --actor_learning_rate 2e-7 --critic_learning_rate 3e-6 --lr_warmup_ratio 0.03 \
    --init_kl_coef 0.01 --eps_clip 0.2 --value_clip 0.2 \
    --max_epochs 1 --num_episodes 1 \
    --zero_stage 3 --bf16 --adam_offload --zero3_param_offload --ref_reward_offload --gradient_checkpointing --packing_samples \
    --save_path "$SAVE_DIR/model" --ckpt_path "$SAVE_DIR/checkpoints" \
    --save_steps 20 --max_ckpt_num 3 --load_checkpoint if_present \
    --use_tensorboard "$SAVE_DIR/tensorboard" --logging_steps 1 \
    "$@"
