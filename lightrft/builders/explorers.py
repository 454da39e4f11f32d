"""The explorers of a run whose rollouts are made apart from the trainers (`train_ppo
--explorer_ranks N`, or the one-step-ahead thread of `--sync_offset D`), and the trainers'
experience source that receives them. `lightrft.explorers` runs an explorer on parts built here:
it sits below the builders, so it never builds a tokenizer, an engine or a reward source itself."""

import os

import torch

from lightrft.builders.agents import build_workflow_runner
from lightrft.builders.datasets import build_image_prompts, build_prompt_dataset
from lightrft.builders.engines import build_hf_engine, build_rollout_engine, check_engine_roles
from lightrft.builders.models import model_kwargs, policy_model_kwargs, reward_model_paths
from lightrft.builders.rewards import build_reward_sources
from lightrft.config import PPORunConfig
from lightrft.experience.services import build_rollout_services
from lightrft.explorers.explorer import Explorer, ExplorerParts
from lightrft.explorers.link import start_ahead_explorer, trainer_link
from lightrft.models.tokenizer import build_tokenizer, stop_token_ids
from lightrft.strategy.seeding import set_seed
from lightrft.utils.threads import configure_threads


def build_explorer_parts(config: PPORunConfig, rank: int) -> ExplorerParts:
    """What an explorer needs besides its channels: its own tokenizer, policy copy and engine
    (a plain module with `HFEngine`, with the run's LoRA adapter when --lora_rank is set; or vLLM
    seeded with the run's seed + `rank`, serving the adapter the trainers publish), the run's
    generation and scoring services over that engine (the reward models of --reward_pretrain, the
    reward sources, the workflow runner of --workflow) and the prompts."""
    from lightrft.models import ActorLanguage, RewardModel

    model = config.model

    def load_tokenizer():
        return build_tokenizer(config.model.pretrain, config.model.trust_remote_code, padding_side="left")

    tokenizer = load_tokenizer()
    eos = stop_token_ids(tokenizer, config.model.pretrain)
    # A vision-language policy's prompts carry images, read with its processor (--image_key).
    images = (build_image_prompts(model.pretrain, tokenizer, model.trust_remote_code)
              if config.data.image_key else None)
    module = None
    engine = build_rollout_engine(config, tokenizer, seed=config.distributed.seed + rank)
    device = None
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    if engine is None:      # an engine over the live module: the explorer's own policy copy
        # The trainers publish every weight of the actor, a LoRA adapter's under peft's names.
        actor = ActorLanguage(model.pretrain, lora_rank=model.lora_rank, lora_alpha=model.lora_alpha,
                              lora_dropout=model.lora_dropout, target_modules=model.target_modules,
                              **{**policy_model_kwargs(model, config.distributed),
                                 # The copy records the routes of what it samples, for the trainers to replay.
                                 "routing_replay": "rollout" if model.routing_replay == "rollout" else "off"})
        module = actor.model.to(device).eval() if device is not None else actor.model.eval()
        engine = build_hf_engine(module, tokenizer, eos, config.rollout.micro_rollout_batch_size,
                                 kv_cache=config.rollout.hf_kv_cache, compile_decode=config.rollout.hf_compile_decode)
    # Reward models are frozen: the explorer scores with its own copy, as the trainers would.
    reward_models = [RewardModel(path, value_head_prefix=model.value_head_prefix,
                                 normalize_reward=model.normalize_reward,
                                 **model_kwargs(model, config.distributed)).eval()
                     for path in reward_model_paths(config)]
    if device is not None:
        reward_models = [rm.to(device) for rm in reward_models]
    # The trainer's generation and scoring services over the explorer's engine, without an
    # experience builder. The scorer decodes on its own thread: it gets its own tokenizer.
    services = build_rollout_services(
        engine, tokenizer, algo=config.algorithm, prompt_max_len=config.data.prompt_max_len,
        micro_rollout_batch_size=config.rollout.micro_rollout_batch_size,
        apply_chat_template=config.data.apply_chat_template, reward_models=reward_models,
        reward_sources=build_reward_sources(config.rewards), device=device,
        eos_token_ids=eos, workflow_runner=build_workflow_runner(config.agent, tokenizer, eos, images,
                                                                 max_images=config.data.max_images_per_prompt),
        seed=config.distributed.seed, scorer_tokenizer=load_tokenizer(),
        # the trainers' teacher scores, or the workflow
        task_reward_optional=bool(config.model.teacher_pretrain or config.agent.workflow))
    return ExplorerParts(engine, module, services, build_prompt_dataset(config.data, tokenizer, images=images))


def build_explorer(config: PPORunConfig, link) -> Explorer:
    """The explorer of an explorer rank (`link`, this rank's `lightrft.explorers.roles.JobLink`
    from `join_roles`), for `lightrft.explorers.explorer.run_explorer`. The process is set up as a
    trainer's strategy sets up its own (thread counts, the run's seed) before the parts load."""
    configure_threads()
    set_seed(config.distributed.seed)
    layout = link.layout
    return Explorer(config, link.experience, link.control, build_explorer_parts(config, layout.rank),
                    index=layout.role_rank, explorers=layout.explorers, trainers=layout.trainers)


def build_explorer_source(config: PPORunConfig, strategy, link=None):
    """The experience source of a run whose rollouts explorers make: the trainer's end of
    explorer ranks (`link`, this rank's `lightrft.explorers.roles.JobLink` from `join_roles`), or of
    an explorer thread one step ahead on this rank (--sync_offset > 0 without explorer ranks).
    None for a colocated run."""
    if link is not None:
        return trainer_link(config, link)
    if config.roles.sync_offset > 0:
        check_engine_roles(config)
        return start_ahead_explorer(config, strategy, build_explorer_parts(config, strategy.rank))
    return None
