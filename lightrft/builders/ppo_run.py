"""The whole PPO run, built from its config: strategy, models, data, engine, rewards, trainer."""

from dataclasses import dataclass

from lightrft.builders.agents import build_workflow_runner
from lightrft.builders.datasets import build_image_prompts, build_prompt_dataset
from lightrft.builders.engines import build_rollout_engine
from lightrft.builders.models import (build_scoring_policy, check_scorers_take_images, model_kwargs,
                                      policy_model_kwargs, reward_model_paths)
from lightrft.builders.rewards import build_reward_sources
from lightrft.builders.training import build_scheduler, build_tracker
from lightrft.config import PPORunConfig
from lightrft.models.tokenizer import build_tokenizer, stop_token_ids
from lightrft.trainer.ppo_config import PPOModels  # noqa: F401  (re-exported)


@dataclass
class PPORun:
    """A built PPO run (see `build_ppo_run`)."""

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


def build_strategy(config: PPORunConfig):
    """The DeepSpeed strategy of the run, joined to the process group (torchrun's, or a world
    of one)."""
    from lightrft.strategy import get_strategy

    strategy = get_strategy(config)
    strategy.setup_distributed()
    check_world_size(config.rollout.rollout_batch_size, strategy.world_size)
    strategy.sequence_parallel       # the groups of --sequence_parallel_size, refused now if they cannot be made
    return strategy


def check_world_size(rollout_batch_size: int, world_size: int) -> None:
    """Every rank gets the same number of prompts per rollout."""
    if rollout_batch_size % world_size != 0:
        raise ValueError(f"--rollout_batch_size {rollout_batch_size} must be divisible by the number of "
                         f"ranks ({world_size}) so every rank gets the same prompts per rollout")




def build_ppo_models(config: PPORunConfig, strategy) -> PPOModels:
    """The actor, critic, reward models, reference, EMA copy and distillation teacher of the model
    section, built partitioned under ZeRO-3 (nothing changes for other stages); not prepared yet.
    A teacher whose tokenizer is not the actor's is refused before any weight loads."""
    from lightrft.models import ActorLanguage, Critic, RewardModel

    model = config.model
    check_scorers_take_images(config)
    if model.teacher_pretrain:
        check_teacher(model, config.data.prompt_max_len + config.rollout.generate_max_len)
    policy_kwargs = policy_model_kwargs(model, config.distributed)
    scorer_kwargs = model_kwargs(model, config.distributed)
    temperature = config.rollout.temperature
    with strategy.zero3_init_context():
        actor = ActorLanguage(model.pretrain, lora_rank=model.lora_rank, lora_alpha=model.lora_alpha,
                              lora_dropout=model.lora_dropout, target_modules=model.target_modules,
                              gradient_checkpointing=config.distributed.gradient_checkpointing,
                              temperature=temperature, freeze_vision_tower=model.freeze_vision_tower, **policy_kwargs)
        critic = (Critic(model.critic_pretrain, value_head_prefix=model.value_head_prefix,
                         torch_compile=model.torch_compile, **scorer_kwargs) if model.critic_pretrain else None)
        reward_models = [RewardModel(path, value_head_prefix=model.value_head_prefix,
                                     normalize_reward=model.normalize_reward, **scorer_kwargs)
                         for path in reward_model_paths(config)]
        initial_model = None
        if config.algorithm.init_kl_coef > 0:
            # With LoRA the reference is the actor's base model (adapter off): no second copy of the weights.
            initial_model = (actor.adapter_disabled() if model.lora_rank > 0
                             else build_scoring_policy(model.pretrain, model, config.distributed, temperature))
        ema_model = (ActorLanguage(model.pretrain, **{**policy_kwargs, "routing_replay": "off"})
                     if model.enable_ema else None)
        # The teacher is served like the reference: same builder, sharding, offload and packing.
        teacher_model = (build_scoring_policy(model.teacher_pretrain, model, config.distributed, temperature,
                                              flag="--teacher_pretrain") if model.teacher_pretrain else None)
    # The trained models split their packed rows over the sequence-parallel group (rollout-time
    # forwards of padded batches, and the frozen models', run whole).
    for trained in (actor, critic):
        if trained is not None:
            trained.use_sequence_parallel(strategy.sequence_parallel)
    if strategy.sequence_parallel is not None:
        strategy.print(f"--sequence_parallel_size {strategy.sequence_parallel_size}: training rows are split over "
                       f"{strategy.sequence_parallel_size} ranks and do not share their prompts "
                       "(each sample's prompt is computed with it)")
    return PPOModels(actor, critic, reward_models, initial_model, ema_model, teacher_model)


def check_teacher(model, max_tokens: int | None = None) -> None:
    """Refuses a --teacher_pretrain folder without a tokenizer, or with another tokenizer than
    --pretrain's (`lightrft.models.teacher.check_teacher_tokenizer`); a reward model folder (a value
    head where the LM head should be: distilling from it would use a random LM head); and a teacher
    whose context is shorter than the `max_tokens` (prompt + response) it must score (learned
    positions fail past it, rotary ones score silently out of range). `model` is the model section."""
    from lightrft.models.teacher import check_teacher_folder, check_teacher_tokenizer

    student = build_tokenizer(model.pretrain, model.trust_remote_code)
    try:
        teacher = build_tokenizer(model.teacher_pretrain, model.trust_remote_code, flag="--teacher_pretrain")
    except (OSError, ValueError) as err:
        raise ValueError(f"--teacher_pretrain {model.teacher_pretrain}: no tokenizer could be loaded from it ({err}); "
                         "pass a Hugging Face model folder with its tokenizer files") from None
    check_teacher_tokenizer(student, teacher, f"--pretrain {model.pretrain}",
                            f"--teacher_pretrain {model.teacher_pretrain}")
    check_teacher_folder(model.teacher_pretrain, model.value_head_prefix, max_tokens, model.trust_remote_code)


def prepare_ppo_models(config: PPORunConfig, strategy, models: PPOModels, total_updates: int) -> PPOModels:
    """The optimizers and LR schedules of the trained models (spanning `total_updates` optimizer
    steps), and every model prepared by the strategy."""
    optim = config.optim

    def optimizer(model, lr):
        opt = strategy.create_optimizer(model, lr=lr, betas=tuple(optim.adam_betas), weight_decay=optim.l2)
        return strategy.prepare((model, opt, build_scheduler(opt, optim, lr, total_updates)))

    actor, actor_optim, actor_scheduler = optimizer(models.actor, optim.actor_learning_rate)
    critic = critic_optim = critic_scheduler = None
    if models.critic is not None:
        critic, critic_optim, critic_scheduler = optimizer(models.critic, optim.critic_learning_rate)
    frozen = [strategy.prepare(m) if m is not None else None
              for m in (models.initial_model, models.ema_model, models.teacher_model)]
    return PPOModels(actor, critic, [strategy.prepare(rm) for rm in models.reward_models], *frozen,
                     actor_optim=actor_optim, critic_optim=critic_optim, actor_scheduler=actor_scheduler,
                     critic_scheduler=critic_scheduler)


def build_ppo_data(config: PPORunConfig, tokenizer, reward_models: list, reward_sources: list, images=None):
    """(the prompt dataset, the experience source it calls for, the reward sources): the prompts
    of --prompt_data for the colocated source (None), or the served traffic of --recorded_data for
    a `RecordedSource`, whose recorded rewards score training (a reward model or source, if given,
    scores evaluation)."""
    data = config.data
    if not data.recorded_data:
        return build_prompt_dataset(data, tokenizer, images=images), None, reward_sources
    from lightrft.experience.recorded import (RecordedExperienceDataset, RecordedRewardsOnly, RecordedSource,
                                              check_recorded_algorithm)

    check_recorded_algorithm(config.algorithm.advantage_estimator, config.algorithm.n_samples_per_prompt)
    prompts = RecordedExperienceDataset(data.recorded_data, tokenizer, max_samples=data.max_samples)
    return prompts, RecordedSource(), reward_sources if (reward_models or reward_sources) else [RecordedRewardsOnly()]


def run_images(config: PPORunConfig, tokenizer):
    """The policy's `ImagePrompts` when the run reads images (--image_key), else None."""
    if not config.data.image_key:
        return None
    return build_image_prompts(config.model.pretrain, tokenizer, config.model.trust_remote_code)


def export_processor(config: PPORunConfig, tokenizer, images=None):
    """The processor the exports carry: the run's (--image_key), or for a vision-language policy
    trained on text alone its folder's, so the export still loads with `AutoProcessor` (None for
    a text model, or when the folder has no processor: a warning says so)."""
    if images is not None:
        return images.processor
    from transformers import AutoConfig

    from lightrft.models.families import family_for

    model = config.model
    try:
        family = family_for(AutoConfig.from_pretrained(model.pretrain, trust_remote_code=model.trust_remote_code))
    except (OSError, ValueError):
        return None
    if not family.takes_media():
        return None
    try:
        return build_image_prompts(model.pretrain, tokenizer, model.trust_remote_code).processor
    except ValueError as err:
        print(f"warning: {err}; the exports will carry the tokenizer only")
        return None


def build_ppo_run(config: PPORunConfig, *, strategy=None, trainer_cls=None, callbacks=(),
                  experience_source=None) -> PPORun:
    """Everything a PPO run needs, on every rank: the models prepared by the strategy, the data
    loaders, the rollout engine, the reward sources and the trainer (nothing trained yet).
    `strategy` is the one `build_strategy` made (built here when None); `experience_source` is
    where the trainer's experience comes from (`lightrft.builders.explorers.build_explorer_source`;
    by default the colocated source over the prompts, or the recorded traffic of --recorded_data)."""
    from lightrft.trainer.ppo_trainer import PPOTrainer

    strategy = strategy or build_strategy(config)
    tokenizer = build_tokenizer(config.model.pretrain, config.model.trust_remote_code, padding_side="left")
    eos_token_ids = stop_token_ids(tokenizer, config.model.pretrain)
    images = run_images(config, tokenizer)            # a bad folder fails before loading
    workflow_runner = build_workflow_runner(config.agent, tokenizer, eos_token_ids, images,   # a bad file too
                                            max_images=config.data.max_images_per_prompt)
    models = build_ppo_models(config, strategy)
    prompts, data_source, reward_sources = build_ppo_data(config, tokenizer, models.reward_models,
                                                          build_reward_sources(config.rewards), images)
    check_run_vocabulary(config, tokenizer, prompts, models.actor, models.critic, models.reward_models,
                         teacher=models.teacher_model)
    dataloader, eval_dataloader, pretrain_dataloader = build_dataloaders(config, strategy, tokenizer, prompts, images)
    # The schedule spans the optimizer steps the run will take (--max_steps ends it early).
    total_updates = max(1, config.planned_steps(len(prompts)) * config.updates_per_step)
    m = prepare_ppo_models(config, strategy, models, total_updates)
    rollout_engine = None   # None: the trainer decodes with its live actor
    if config.roles.explorer_ranks == 0:  # explorers generate otherwise
        rollout_engine = build_rollout_engine(config, tokenizer, seed=config.distributed.seed + strategy.rank)
    tracker = build_tracker(config, strategy)
    if config.logging.preview_steps > 0:
        from lightrft.trainer.preview import RolloutPreview

        callbacks = [*callbacks, RolloutPreview(every=config.logging.preview_steps)]
    trainer = (trainer_cls or PPOTrainer).from_config(
        strategy, m, config, tokenizer=tokenizer, reward_sources=reward_sources, rollout_engine=rollout_engine,
        tracker=tracker, callbacks=callbacks, experience_source=experience_source or data_source,
        eos_token_ids=eos_token_ids, workflow_runner=workflow_runner,
        processor=export_processor(config, tokenizer, images))
    return PPORun(args=config, strategy=strategy, tokenizer=tokenizer, trainer=trainer, prompts=prompts,
                  dataloader=dataloader, eval_dataloader=eval_dataloader, pretrain_dataloader=pretrain_dataloader,
                  updates_per_step=config.updates_per_step, tracker=tracker)


def build_dataloaders(config: PPORunConfig, strategy, tokenizer, prompts, images=None):
    """(prompt loader, --eval_data loader or None, --pretrain_data loader or None); `images`: the
    policy's `ImagePrompts` for --image_key."""
    from lightrft.datasets import SFTDataset

    data = config.data
    batch = config.rollout.rollout_batch_size
    if len(prompts) < batch:
        raise ValueError(f"--{'recorded' if data.recorded_data else 'prompt'}_data "
                         f"{data.recorded_data or data.prompt_data} has {len(prompts)} usable rows, fewer than "
                         f"--rollout_batch_size {batch}")
    per_rank = batch // strategy.world_size
    dataloader = strategy.setup_dataloader(prompts, per_rank, shuffle=True, collate_fn=prompts.collate_fn,
                                           drop_last=True)
    eval_dataloader = None
    if data.eval_data:
        eval_set = build_prompt_dataset(data, tokenizer, path=data.eval_data, images=images)
        eval_dataloader = strategy.setup_dataloader(eval_set, max(1, config.rollout.micro_rollout_batch_size),
                                                    shuffle=False, collate_fn=eval_set.collate_fn, drop_last=False)
    pretrain_dataloader = None
    if data.pretrain_data:
        ptx = SFTDataset(data.pretrain_data, tokenizer, input_key=data.input_key, output_key=data.pretrain_output_key,
                         apply_chat_template=data.apply_chat_template,
                         max_len=data.prompt_max_len + config.rollout.generate_max_len, flag="--pretrain_data")
        pretrain_dataloader = strategy.setup_dataloader(ptx, config.optim.micro_train_batch_size, shuffle=True,
                                                        collate_fn=ptx.collate_fn)
    return dataloader, eval_dataloader, pretrain_dataloader


def check_run_vocabulary(config: PPORunConfig, tokenizer, prompts, actor, critic, reward_models,
                         teacher=None) -> None:
    """`check_vocabulary` for the run's models: the actor on the tokens the run feeds it (and on the
    prompt data's ids when the tokenizer is longer than its vocabulary); the critic, reward models
    and teacher score the actor's samples, so they also need every id the actor can produce."""
    from lightrft.models.vocabulary import check_vocabulary, ids_in_data, vocabulary_rows

    model, data = config.model, config.data
    fed = None
    if len(tokenizer) > vocabulary_rows(actor):
        if data.recorded_data:
            fed = ids_in_data((s.prompt_token_ids + s.response_token_ids for s in prompts.samples),
                              f"--recorded_data {data.recorded_data}")
        else:
            fed = ids_in_data(prompts.token_ids(), f"--prompt_data {data.prompt_data}")
    rows = check_vocabulary(actor, tokenizer, f"--pretrain {model.pretrain}", chat_template=data.apply_chat_template,
                            fed=fed)
    scorers = [(critic, f"--critic_pretrain {model.critic_pretrain}")] if critic is not None else []
    scorers += [(rm, f"--reward_pretrain {path}") for rm, path in zip(reward_models, reward_model_paths(config))]
    if teacher is not None:
        scorers.append((teacher, f"--teacher_pretrain {model.teacher_pretrain}"))
    for scorer, what in scorers:
        check_vocabulary(scorer, tokenizer, what, chat_template=data.apply_chat_template, fed=fed, produced_by=rows)
