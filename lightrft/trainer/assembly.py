"""The one place a PPO run's parts are built: `build_ppo_parts`.

    strategy, PPOModels, PPOTrainerConfig (+ tokenizer, engine, reward sources, ...)  ->  PPOParts

Every way of making a `PPOTrainer` ends here: the classic constructor (its arguments turned into
config sections by `classic_trainer_config`), `PPOTrainer.from_config` and `build_ppo_run` (the
command line). The trainer receives the parts and only assigns them; nothing is set on a part
from outside once it is built: what a part needs (the processor of a vision-language run, the
on-policy choice) is an argument here.
"""

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from lightrft.algorithms.advantages import get_advantage_estimator
from lightrft.algorithms.kl import make_kl_controller
from lightrft.experience.generation import rollout_generate_kwargs
from lightrft.experience.replay_buffer import NaiveReplayBuffer
from lightrft.experience.services import RolloutServices, build_rollout_services
from lightrft.models.families import family_of
from lightrft.models.loss import GPTLMLoss, PolicyLoss, ValueLoss
from lightrft.rollout.checks import EngineGapCheck, engine_gap_tolerance
from lightrft.rollout.hf_engine import hf_engine_for
from lightrft.rollout.manager import RolloutManager, WeightStream, engine_capabilities_of
from lightrft.trainer.callbacks import CallbackList
from lightrft.trainer.ppo_config import PPOModels, PPOTrainerConfig
from lightrft.trainer.run_services import RunServices


@dataclass(frozen=True)
class PPOParts:
    """Everything a `PPOTrainer` is made of (see `build_ppo_parts`)."""

    strategy: Any
    models: PPOModels                  # prepared: DeepSpeed engines for the trained models
    config: PPOTrainerConfig           # the sections the parts were built from
    tokenizer: Any
    processor: Any                     # a vision-language run's processor (exports carry its files), else None
    rollout_engine: Any                # what generates: the run's engine, or HF decoding with the live actor
    weight_stream: WeightStream        # the actor's weights, bucketed: engine syncs and explorers' weights
    rollout: RolloutManager            # the one owner of the engine's lifecycle (wake, sync, generate, sleep)
    services: RolloutServices          # generation, scoring, experience building
    replay_buffer: NaiveReplayBuffer
    kl_ctl: Any                        # fixed or adaptive KL coefficient
    actor_loss_fn: PolicyLoss
    critic_loss_fn: ValueLoss
    ptx_loss_fn: GPTLMLoss
    normalize_advantages_globally: bool   # the estimator whitens over the global batch (buffer-side)
    engine_gap: EngineGapCheck         # every step: does the engine sample from the trained weights?
    run_services: RunServices          # checkpoints, preemption, non-finite guard
    callbacks: CallbackList
    tracker: Any                       # W&B / TensorBoard, or None
    experience_source: Any             # where each step's experience comes from; None: colocated at `fit`
    generate_kwargs: dict              # the rollout sampling parameters (`PPOTrainer.sampling_kwargs`)
    eval_generate_kwargs: dict         # evaluation's overrides of them
    dataloader_pin_memory: bool


def build_ppo_parts(strategy, models: PPOModels, config: PPOTrainerConfig, *, tokenizer, processor=None,
                    rollout_engine=None, reward_sources: Sequence = (), reward_fn=None, callbacks: Sequence = (),
                    tracker=None, experience_source=None, workflow_runner=None,
                    eos_token_ids: Optional[Sequence[int]] = None, generate_kwargs: Optional[dict] = None,
                    eval_generate_kwargs: Optional[dict] = None, buffer_limit: int = 0, buffer_cpu_offload: bool = True,
                    dataloader_pin_memory: bool = True, reuse_old_log_probs: Optional[bool] = None) -> PPOParts:
    """Every part of a PPO run from the strategy, the prepared models and the config sections.

    What a config cannot hold comes as keywords: the tokenizer and a vision-language run's
    `processor`, a rollout engine (default: Hugging Face decoding with the live actor), reward
    sources beside the reward models (combined by `reward_fn`), callbacks, a tracker, the
    experience source (default: colocated, made by `fit`), the workflow runner of multi-turn
    runs, the stop tokens, the sampling parameters (default: the rollout section's) and
    evaluation's overrides, the replay buffer's limit and offload. `reuse_old_log_probs` is the
    trainer class's choice of the on-policy shortcut (`decide_on_policy`)."""
    algo, rollout_config = config.algorithm, config.rollout
    estimator = get_advantage_estimator(algo.advantage_estimator)
    if estimator.needs_critic and models.critic is None:
        raise ValueError(f"--advantage_estimator {algo.advantage_estimator} needs a critic: pass "
                         "--critic_pretrain, or pick a critic-free estimator such as group_norm or reinforce++")
    kl_ctl = make_kl_controller(algo.init_kl_coef, algo.kl_target or None, algo.kl_horizon)
    rollout_engine, weight_stream, rollout = build_rollout(strategy, models.actor, tokenizer, rollout_config,
                                                           rollout_engine, eos_token_ids)
    services = build_rollout_services(
        rollout, tokenizer, strategy, algo=algo, prompt_max_len=config.data.prompt_max_len,
        micro_rollout_batch_size=rollout_config.micro_rollout_batch_size,
        micro_rollout_max_tokens=rollout_config.micro_rollout_max_tokens,
        apply_chat_template=config.data.apply_chat_template, actor=models.actor, critic=models.critic,
        initial_model=models.initial_model, teacher=models.teacher_model, kl_controller=kl_ctl,
        reward_models=models.reward_models, reward_sources=reward_sources, reward_fn=reward_fn,
        eos_token_ids=eos_token_ids, workflow_runner=workflow_runner,
        reuse_policy_log_probs=decide_on_policy(reuse_old_log_probs, strategy, models.actor, config.optim.max_epochs))
    # Every step checks that the engine samples from the trained weights (`lightrft.rollout.checks`).
    threshold = rollout_config.engine_logprob_gap_threshold
    engine_gap = EngineGapCheck(engine_gap_tolerance(strategy.config.bf16)[0] if threshold is None else threshold,
                                rollout_config.engine_logprob_gap_action, lambda message: strategy.print(message))
    return PPOParts(
        strategy=strategy, models=models, config=config, tokenizer=tokenizer, processor=processor,
        rollout_engine=rollout_engine, weight_stream=weight_stream, rollout=rollout, services=services,
        replay_buffer=NaiveReplayBuffer(config.optim.micro_train_batch_size, buffer_limit, buffer_cpu_offload,
                                        packing_samples=config.model.packing_samples,
                                        pad_token_id=tokenizer.pad_token_id),
        kl_ctl=kl_ctl, actor_loss_fn=PolicyLoss.from_algorithm(algo), critic_loss_fn=ValueLoss.from_algorithm(algo),
        ptx_loss_fn=GPTLMLoss(), normalize_advantages_globally=estimator.normalize_globally, engine_gap=engine_gap,
        run_services=RunServices(strategy, preemption_grace=config.checkpoint.preemption_grace,
                                 max_nonfinite_steps=algo.max_nonfinite_steps,
                                 max_ckpt_num=config.checkpoint.max_ckpt_num),
        callbacks=CallbackList(callbacks), tracker=tracker, experience_source=experience_source,
        generate_kwargs=dict(rollout_generate_kwargs(rollout_config) if generate_kwargs is None else generate_kwargs),
        eval_generate_kwargs=dict(eval_generate_kwargs or {}), dataloader_pin_memory=dataloader_pin_memory)


def build_rollout(strategy, actor, tokenizer, rollout_config, rollout_engine=None,
                  eos_token_ids: Optional[Sequence[int]] = None) -> tuple[Any, WeightStream, RolloutManager]:
    """(the engine, the actor's weight stream, the rollout manager over both). Without an engine,
    Hugging Face decoding with the live actor (all ranks decode together under ZeRO-3). The
    stream's bucket size: that of an engine with its own weights (--vllm_sync_bucket_mb), else
    the rollout section's, else 512 MB."""
    if rollout_engine is None:
        policy = strategy.unwrap_model(actor).model
        rollout_engine = hf_engine_for(policy, tokenizer, eos_token_ids, rollout_config.micro_rollout_batch_size,
                                       synced_gpus=strategy.world_size > 1 and strategy.config.zero_stage == 3,
                                       family=family_of(policy), kv_cache=rollout_config.hf_kv_cache,
                                       compile_decode=rollout_config.hf_compile_decode)
    live = engine_capabilities_of(rollout_engine).shares_live_weights
    engine_bucket_mb = None if live else rollout_engine.sync_bucket_mb
    stream = WeightStream(strategy, actor, engine_bucket_mb or rollout_config.vllm_sync_bucket_mb or 512.0)
    return rollout_engine, stream, RolloutManager.for_actor(rollout_engine, strategy, actor, stream=stream)


def decide_on_policy(reuse_old_log_probs: Optional[bool], strategy, actor, max_epochs: int) -> bool:
    """Whether the first optimizer step of each rollout is exactly on-policy (one epoch, no active
    dropout), so its ratio is 1 and the old log-probs need no forward at rollout time: that step
    detaches its own, and `PPOUpdate.fill_old_log_probs` computes the later steps' before it
    updates. `reuse_old_log_probs` (the trainer class's attribute) decides when not None."""
    if reuse_old_log_probs is not None:
        return reuse_old_log_probs
    dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in strategy.unwrap_model(actor).modules())
    return max_epochs == 1 and not dropout


def classic_reward_sources(remote_rm_url) -> list:
    """The reward sources of the classic constructor's `remote_rm_url` (HTTP servers, reward
    files, builtin rules; comma-separated), none without one."""
    if not remote_rm_url:
        return []
    from lightrft.rewards import make_reward_sources

    return list(make_reward_sources(remote_rm_url))
