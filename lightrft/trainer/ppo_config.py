"""What a `PPOTrainer` is built from: its models (`PPOModels`) and the typed sections of a run
config it reads (`PPOTrainerConfig`; a `lightrft.config.PPORunConfig` has them all), and how the
classic constructor's arguments map onto those sections (`classic_trainer_config`)."""

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from lightrft.experience.generation import rollout_generate_kwargs  # noqa: F401  (re-exported)
from lightrft.config.sections import (AlgorithmConfig, CheckpointConfig, PPODataConfig, PPODistributedConfig,
                                      PPOModelConfig, PPOOptimConfig, RolloutConfig)


@dataclass
class PPOModels:
    """The models of a PPO run, and once prepared their optimizers and schedulers: DeepSpeed
    engines for the trained ones (actor, critic), prepared frozen modules for the others. Only
    the actor is required: no critic is a critic-free method, no reference model no KL term."""

    actor: object
    critic: object = None
    reward_models: list = field(default_factory=list)
    initial_model: object = None      # the reference policy of the KL term
    ema_model: object = None
    teacher_model: object = None      # the teacher of on-policy distillation (--teacher_pretrain)
    actor_optim: object = None
    critic_optim: object = None
    actor_scheduler: object = None
    critic_scheduler: object = None

    @property
    def classic_reward_model(self):
        """The reward models as the classic signature takes them: one model, a list of several, or None."""
        return self.reward_models[0] if len(self.reward_models) == 1 else list(self.reward_models) or None


@dataclass(frozen=True)
class PPOTrainerConfig:
    """The sections of a run config that a `PPOTrainer` reads when it is built; a
    `lightrft.config.PPORunConfig` has them all. The classic constructor builds one from its
    arguments (`classic_trainer_config`)."""

    model: PPOModelConfig             # ema_beta, packing_samples
    rollout: RolloutConfig            # sampling, micro-batch, engine log-prob gap, weight-sync buckets
    algorithm: AlgorithmConfig
    optim: PPOOptimConfig             # micro_train_batch_size, max_epochs, max_norm
    data: PPODataConfig               # prompt_max_len, apply_chat_template
    checkpoint: CheckpointConfig      # save_hf_ckpt, disable_ds_ckpt, max_ckpt_num, preemption_grace
    distributed: PPODistributedConfig    # gradient_checkpointing


def classic_trainer_config(*, algo: Optional[AlgorithmConfig], classic: dict, ema_beta: float,
                           micro_train_batch_size: int, micro_rollout_batch_size: int, gradient_checkpointing: bool,
                           max_epochs: int, max_norm: float, prompt_max_len: int, save_hf_ckpt: bool,
                           disable_ds_ckpt: bool, packing_samples: bool, preemption_grace: float,
                           apply_chat_template: bool, max_ckpt_num: int,
                           engine_logprob_gap_threshold: Optional[float], engine_logprob_gap_action: str,
                           sync_bucket_mb: Optional[float]) -> PPOTrainerConfig:
    """The sections the classic constructor's arguments stand for. A classic PPO argument
    (`classic`: init_kl_coef ... value_clip) given explicitly overrides `algo`; None takes
    `algo`'s value; without `algo` the classic signature's documented values apply
    (init_kl_coef 0.001, not the command line's 0.01)."""
    algorithm = dataclasses.replace(algo if algo is not None else AlgorithmConfig(init_kl_coef=0.001),
                                    **{k: v for k, v in classic.items() if v is not None})
    rollout = RolloutConfig(micro_rollout_batch_size=micro_rollout_batch_size,
                            engine_logprob_gap_threshold=engine_logprob_gap_threshold,
                            engine_logprob_gap_action=engine_logprob_gap_action, vllm_sync_bucket_mb=sync_bucket_mb)
    return PPOTrainerConfig(
        model=PPOModelConfig(ema_beta=ema_beta, packing_samples=packing_samples), rollout=rollout,
        algorithm=algorithm,
        optim=PPOOptimConfig(micro_train_batch_size=micro_train_batch_size, max_epochs=max_epochs, max_norm=max_norm),
        # The prompts themselves come with `fit`; the section holds how they are encoded.
        data=PPODataConfig(prompt_data="(the prompts given to PPOTrainer.fit)", prompt_max_len=prompt_max_len,
                           apply_chat_template=apply_chat_template),
        checkpoint=CheckpointConfig(save_hf_ckpt=save_hf_ckpt, disable_ds_ckpt=disable_ds_ckpt,
                                    max_ckpt_num=max_ckpt_num, preemption_grace=preemption_grace),
        distributed=PPODistributedConfig(gradient_checkpointing=gradient_checkpointing))


#: The classic constructor's option arguments that `classic_trainer_config` turns into sections.
CLASSIC_OPTIONS = ("ema_beta", "micro_train_batch_size", "micro_rollout_batch_size", "gradient_checkpointing",
                   "max_epochs", "max_norm", "prompt_max_len", "save_hf_ckpt", "disable_ds_ckpt", "packing_samples",
                   "preemption_grace", "apply_chat_template", "max_ckpt_num", "engine_logprob_gap_threshold",
                   "engine_logprob_gap_action", "sync_bucket_mb")
#: Its PPO arguments, which default to None: `algo`'s value, or the classic one without `algo`.
CLASSIC_ALGORITHM_OPTIONS = ("init_kl_coef", "kl_target", "kl_horizon", "ptx_coef", "eps_clip", "value_clip")


def classic_options_config(algo: Optional[AlgorithmConfig], arguments: dict) -> PPOTrainerConfig:
    """`classic_trainer_config` of the classic constructor's `arguments` (its locals, by name)."""
    return classic_trainer_config(algo=algo, classic={name: arguments[name] for name in CLASSIC_ALGORITHM_OPTIONS},
                                  **{name: arguments[name] for name in CLASSIC_OPTIONS})


def legacy_models(actor, critic=None, reward_model=None, initial_model=None, ema_model=None, actor_optim=None,
                  critic_optim=None, actor_scheduler=None, critic_scheduler=None, *, teacher_model=None) -> PPOModels:
    """`PPOModels` from the positional models of the classic signatures."""
    reward_models = [] if reward_model is None else (
        list(reward_model) if isinstance(reward_model, (list, tuple)) else [reward_model])
    return PPOModels(actor, critic, reward_models, initial_model, ema_model, teacher_model, actor_optim,
                     critic_optim, actor_scheduler, critic_scheduler)


def legacy_positionals(models: PPOModels) -> tuple:
    """The classic signature's nine positional models after the strategy (actor ... critic_scheduler)."""
    return (models.actor, models.critic, models.classic_reward_model, models.initial_model, models.ema_model,
            models.actor_optim, models.critic_optim, models.actor_scheduler, models.critic_scheduler)
