"""PPO / GRPO / REINFORCE++ / RLOO training from the command line.

    torchrun --nproc_per_node 8 -m lightrft.cli.train_ppo --pretrain MODEL --prompt_data FILE \
        --advantage_estimator group_norm --n_samples_per_prompt 8 --remote_rm_url math ...

This module parses flags once, checks that they fit together, builds the models through the
strategy and hands explicit arguments to `PPOTrainer`. `--help` lists every flag by group.
"""

import argparse
import sys
from dataclasses import dataclass

from lightrft.cli.common import (announce_config, build_scheduler, make_tracker, parse_run_config, print_summary,
                                 run_command)
from lightrft.config import PPORunConfig


def build_parser() -> argparse.ArgumentParser:
    """The flags, generated from `PPORunConfig` (lightrft/config): `--help` lists them by section."""
    return PPORunConfig.build_parser("python -m lightrft.cli.train_ppo", __doc__)


def parse_args(argv=None) -> PPORunConfig:
    """The typed run config of a command line (`--config FILE.yaml` first, flags over it); a bad
    option or combination exits with a message that names the flags."""
    return parse_run_config(PPORunConfig, build_parser(), argv)


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

    args: PPORunConfig
    strategy: object
    tokenizer: object
    trainer: object
    prompts: object                  # the PromptDataset of --prompt_data
    dataloader: object
    eval_dataloader: object
    pretrain_dataloader: object
    updates_per_step: int
    tracker: object


def check_world_size(args: PPORunConfig, world_size: int) -> None:
    if args.rollout_batch_size % world_size != 0:
        raise ValueError(f"--rollout_batch_size {args.rollout_batch_size} must be divisible by the number of "
                         f"ranks ({world_size}) so every rank gets the same prompts per rollout")


def actor_model_kwargs(args: PPORunConfig) -> dict:
    """How every policy-shaped model of the run is built (actor, reference, EMA, explorer copies)."""
    # Dropout off by default: with it on, even the first on-policy update has ratios != 1.
    return dict(bf16=args.bf16, attn_implementation=args.attn_implementation, trust_remote_code=args.trust_remote_code,
                disable_dropout=not args.keep_dropout, packing_samples=args.packing_samples)


def load_tokenizer(args: PPORunConfig):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.pretrain, trust_remote_code=args.trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def prompt_dataset(args: PPORunConfig, tokenizer):
    from lightrft.datasets import PromptDataset

    return PromptDataset(args.prompt_data, tokenizer, input_key=args.input_key, label_key=args.label_key,
                         apply_chat_template=args.apply_chat_template, prompt_max_len=args.prompt_max_len,
                         on_bad_row=args.on_bad_row, max_samples=args.max_samples,
                         truncate_long_prompts=args.truncate_long_prompts)


def reward_sources(args: PPORunConfig) -> list:
    """The --remote_rm_url sources (HTTP servers, reward files, builtin rules)."""
    if not args.remote_rm_url:
        return []
    from lightrft.rewards import make_reward_source

    return [make_reward_source(spec.strip(), timeout=args.reward_timeout, max_retries=args.reward_retries,
                               on_failure=args.reward_on_failure)
            for spec in args.remote_rm_url.split(",") if spec.strip()]


def make_vllm_engine(args: PPORunConfig, tokenizer, seed: int):
    """A vLLM engine of --pretrain with the run's vLLM options."""
    from lightrft.rollout import make_rollout_engine

    return make_rollout_engine("vllm", model_path=args.pretrain, seed=seed,
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
                               # the longest sequence a rollout makes (prompts are cut to prompt_max_len):
                               # vLLM would otherwise size its KV cache for the model's whole context
                               max_model_len=args.prompt_max_len + args.generate_max_len,
                               pad_token_id=tokenizer.pad_token_id,
                               eos_token_id=stop_token_ids(tokenizer, args.pretrain))


def check_run_vocabulary(args: PPORunConfig, tokenizer, prompts, actor, critic, reward_models) -> None:
    """`check_vocabulary` for the run's models: the actor on the tokens the run feeds it (and on the
    prompt data's ids when the tokenizer is longer than its vocabulary); the critic and reward
    models score the actor's samples, so they also need every id the actor can produce."""
    from lightrft.datasets.prompt_dataset import encode_prompts
    from lightrft.models.vocabulary import check_vocabulary, ids_in_data, vocabulary_rows

    fed = None
    if len(tokenizer) > vocabulary_rows(actor):
        if args.recorded_data:
            fed = ids_in_data((s.prompt_token_ids + s.response_token_ids for s in prompts.samples),
                              f"--recorded_data {args.recorded_data}")
        else:
            fed = ids_in_data(encode_prompts(tokenizer, [p for p, _ in prompts], args.apply_chat_template),
                              f"--prompt_data {args.prompt_data}")
    rows = check_vocabulary(actor, tokenizer, f"--pretrain {args.pretrain}", chat_template=args.apply_chat_template,
                            fed=fed)
    scorers = [(critic, f"--critic_pretrain {args.critic_pretrain}")] if critic is not None else []
    scorers += [(rm, f"--reward_pretrain {path.strip()}") for rm, path in
                zip(reward_models, [p for p in (args.reward_pretrain or "").split(",") if p.strip()])]
    for model, what in scorers:
        check_vocabulary(model, tokenizer, what, chat_template=args.apply_chat_template, fed=fed, produced_by=rows)


def build_run(args: PPORunConfig, *, trainer_cls=None, callbacks=()) -> PPORun:
    """Everything a PPO run needs, built from parsed flags on every rank: the process group, the
    models prepared by the strategy, the data loaders and the trainer (nothing trained yet).
    `train` runs it; `lightrft.cli.doctor` builds the same run to check it. `args` is the run
    config (an argparse namespace of the same flags is converted to one)."""
    from lightrft.datasets import PromptDataset, SFTDataset
    from lightrft.models import ActorLanguage, Critic, RewardModel
    from lightrft.strategy import get_strategy
    from lightrft.trainer.ppo_trainer import PPOTrainer

    if isinstance(args, argparse.Namespace):
        args = PPORunConfig.from_namespace(args)
    strategy = get_strategy(args)
    strategy.setup_distributed()
    announce_config(build_parser(), args, strategy, args.ckpt_path)
    check_world_size(args, strategy.world_size)

    model_kwargs = actor_model_kwargs(args)
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

    tokenizer = load_tokenizer(args)

    if args.recorded_data:
        # Served traffic as training data: see lightrft/trainer/recorded.py.
        from lightrft.trainer.recorded import RecordedExperienceDataset, RecordedPPOTrainer

        prompts = RecordedExperienceDataset(args.recorded_data, tokenizer, max_samples=args.max_samples)
        trainer_cls = trainer_cls or RecordedPPOTrainer
    else:
        prompts = prompt_dataset(args, tokenizer)
    check_run_vocabulary(args, tokenizer, prompts, actor, critic, reward_models)
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

    updates_per_step = args.updates_per_step
    total_steps = len(prompts) // args.rollout_batch_size * args.num_episodes
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
    if args.rollout_engine == "vllm" and args.explorer_ranks == 0:   # explorers generate in decoupled runs
        rollout_engine = make_vllm_engine(args, tokenizer, seed=args.seed + strategy.rank)

    tracker = make_tracker(args, strategy)
    if args.preview_steps > 0:
        from lightrft.trainer.preview import RolloutPreview

        callbacks = [*callbacks, RolloutPreview(every=args.preview_steps)]
    remote = reward_sources(args)
    trainer = (trainer_cls or PPOTrainer).from_config(
        args, strategy, actor, critic, reward_models or None, initial_model, ema_model, actor_optim, critic_optim,
        actor_scheduler, critic_scheduler, tokenizer=tokenizer, reward_sources=remote,
        rollout_engine=rollout_engine, tracker=tracker, callbacks=callbacks,
        eos_token_ids=stop_token_ids(tokenizer, args.pretrain))

    return PPORun(args=args, strategy=strategy, tokenizer=tokenizer, trainer=trainer, prompts=prompts,
                  dataloader=dataloader, eval_dataloader=eval_dataloader, pretrain_dataloader=pretrain_dataloader,
                  updates_per_step=updates_per_step, tracker=tracker)


def train(args: PPORunConfig, *, trainer_cls=None, callbacks=()) -> dict:
    """Builds everything from parsed flags and runs PPO; returns the last logged metrics.

    Research code can reuse this wiring: `trainer_cls` replaces `PPOTrainer` (a subclass) and
    `callbacks` are `TrainerCallback` instances, e.g.

        args = parse_args([...])
        train(args, trainer_cls=MyTrainer, callbacks=[MyCallback()])
    """
    if isinstance(args, argparse.Namespace):
        args = PPORunConfig.from_namespace(args)
    link = None
    if args.explorer_ranks > 0:
        # Split the job into explorers and trainers before any process group starts.
        from lightrft.trainer.decoupled import run_explorer
        from lightrft.trainer.roles import join_roles

        link = join_roles(args.explorer_ranks, args.dist_timeout)
        if link.layout.is_explorer:
            return run_explorer(args, link)
    run = build_run(args, trainer_cls=trainer_cls, callbacks=callbacks)
    args, trainer = run.args, run.trainer
    if link is not None:
        from lightrft.trainer.decoupled import trainer_link

        trainer.attach_explorers(trainer_link(args, link))
    elif args.sync_offset > 0:          # colocated, one step ahead: an explorer thread per rank
        from lightrft.trainer.decoupled import start_ahead_explorer

        trainer.attach_explorers(start_ahead_explorer(args, run.strategy))
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
    trainer.rollout.shutdown()      # a vLLM engine's teardown needs the process group the strategy closes
    run.strategy.close()
    if trainer.stop_reason == "nonfinite":
        raise SystemExit(3)
    return logs


def main(argv=None) -> None:
    run_command("train_ppo", train, parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
