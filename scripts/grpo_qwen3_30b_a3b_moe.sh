#!/usr/bin/env bash
# GRPO on math prompts with Qwen3-30B-A3B, a mixture-of-experts policy, replaying the rollout's
# expert routing in the trainer (docs/moe.md): 1 node x 8 GPUs.
#
# Hardware   8 GPUs per node x 1 node = 8 GPUs, 80 GB each (A100/H100 80GB); host RAM >= 512 GB
# ZeRO       stage 3; offload: Adam states to CPU (--adam_offload)
# Precision  bf16, gradient checkpointing
# Packing    on (--packing_samples; the samples of a prompt share it in packed rows, the load-balancing
#            loss counting each shared prompt token once per sample)
# Rollout    hf: the Hugging Face engine decodes with the live actor and records each token's experts
#            (48 MoE layers x top-8 of 128, int16: 768 bytes per token); every update forward replays
#            them (--routing_replay rollout), and the step logs routing/flip_share and the log-prob
#            gap with and without replay. With --rollout_engine vllm use --routing_replay old.
# Models     actor + reference (KL as a loss term, k3 estimator; the reference replays the routes too);
#            no critic: group_norm advantages; reward: the builtin `math` rule; router load-balancing
#            loss 0.001 (--aux_loss_coef)
# Batches    rollout_batch_size 64 prompts x n_samples_per_prompt 8 = 512 samples per rollout
#            (64 / 8 GPUs = 8 prompts, 64 samples per GPU)
#            train_batch_size 128: 512 / 128 = 4 optimizer steps per rollout (max_epochs 1)
#            micro_train_batch_size 1 x 8 GPUs = 8 samples per forward: 128 / 8 = 16 gradient-accumulation steps
#            micro_rollout_batch_size 4 samples per GPU per forward when scoring experience and decoding
# Lengths    prompt_max_len 1024, generate_max_len 4096
# Memory     per GPU: 30.5B parameters (3.3B active per token); trainer bf16 weights and grads 30.5B x 4
#            bytes / 8 GPUs = 15.3 GB, reference 7.6 GB, KV cache of 4 decoding samples x 5k tokens
#            (96 KiB per token) 2 GB, activations of one 5k-token row with checkpointing ~10 GB; fp32
#            master and Adam (366 GB) in host RAM; the routes of a rollout (512 x 5k tokens x 768
#            bytes) 2 GB of host RAM. Not measured here: no GPU ran this recipe.
# Data       PROMPT_DATA / EVAL_DATA: jsonl (or parquet, ...) rows with "problem" and "answer" fields
#
# Single node; for several nodes set NNODES, NODE_RANK and MASTER_ADDR on each.
# A different GPU count changes the arithmetic above: keep rollout_batch_size divisible by the
# GPU count and train_batch_size divisible by micro_train_batch_size x GPUs.
# Extra flags after the script name are passed to the trainer (the last value of a flag wins).
# Usage: MODEL=... PROMPT_DATA=... bash scripts/grpo_qwen3_30b_a3b_moe.sh [--flag value ...]

set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen3-30B-A3B}
PROMPT_DATA=${PROMPT_DATA:-data/math/train.jsonl}
EVAL_DATA=${EVAL_DATA:-data/math/test.jsonl}
SAVE_DIR=${SAVE_DIR:-./ckpt/grpo_qwen3_30b_a3b}
NNODES=${NNODES:-1}
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
    --rollout_engine hf --routing_replay rollout --aux_loss_coef 0.001 \
    --rollout_batch_size 64 --micro_rollout_batch_size 4 \
    --train_batch_size 128 --micro_train_batch_size 1 \
    --prompt_max_len 1024 --generate_max_len 4096 --temperature 1.0 \
    --actor_learning_rate 5e-7 --lr_warmup_ratio 0.03 \
    --init_kl_coef 1e-3 --use_kl_loss --kl_estimator k3 --eps_clip 0.2 \
    --max_epochs 1 --num_episodes 1 \
    --zero_stage 3 --bf16 --adam_offload --gradient_checkpointing --packing_samples \
    --save_path "$SAVE_DIR/model" --ckpt_path "$SAVE_DIR/checkpoints" \
    --save_steps 20 --max_ckpt_num 3 --load_checkpoint if_present \
    --use_tensorboard "$SAVE_DIR/tensorboard" --logging_steps 1 \
    "$@"
