"""How the policy-shaped models of a run are built."""

from lightrft.config.sections import DistributedConfig, PPOModelConfig


def model_kwargs(model: PPOModelConfig, distributed: DistributedConfig) -> dict:
    """Keyword arguments of every model of a run (policies, critic, reward models) besides its
    path: precision, attention, remote code, dropout, packing and whether the samples of one
    prompt share its forward."""
    # Dropout off by default: with it on, even the first on-policy update has ratios != 1.
    return dict(bf16=distributed.bf16, attn_implementation=model.attn_implementation,
                trust_remote_code=model.trust_remote_code, disable_dropout=not model.keep_dropout,
                packing_samples=model.packing_samples, share_prompts=not model.no_prompt_sharing)


def policy_model_kwargs(model: PPOModelConfig, distributed: DistributedConfig) -> dict:
    """Keyword arguments of every policy-shaped model of a run (actor, reference, EMA, explorer
    copies) besides its path: `model_kwargs` (critic and reward models share prompts too), the
    fused log-prob head (`--fused_logprob_head`) and routing replay (`--routing_replay`), which only
    policies have, and compiled decoder layers (`--torch_compile`, which the critic takes too)."""
    return {**model_kwargs(model, distributed), "fused_head_chunk": model.fused_logprob_head,
            "routing_replay": model.routing_replay, "torch_compile": model.torch_compile}


def build_scoring_policy(path: str, model: PPOModelConfig, distributed: DistributedConfig, temperature: float,
                         flag: str = "--pretrain"):
    """A frozen policy that scores the actor's sampled tokens with its own log-probs: the KL
    reference (`--pretrain`) and the distillation teacher (`--teacher_pretrain`) alike. It takes
    the actor's precision, attention, packing and sampling temperature, so its log-probs compare
    with the actor's; built inside `strategy.zero3_init_context()` it is partitioned under ZeRO-3,
    and `strategy.prepare` serves it as a frozen module (`--ref_reward_offload` keeps it on the CPU).
    `flag` is the option `path` came from, named in its errors. The reference replays the actor's
    routes (`--routing_replay`, same architecture); a teacher routes live.
    """
    from lightrft.models import ActorLanguage

    kwargs = policy_model_kwargs(model, distributed)
    if flag != "--pretrain":
        kwargs["routing_replay"] = "off"
    elif kwargs["routing_replay"] != "off":
        kwargs["routing_replay"] = "old"      # replays what it is given; the actor's engine records
    return ActorLanguage(path, temperature=temperature, flag=flag, **kwargs)


def reward_model_paths(config) -> list[str]:
    """The comma-separated `--reward_pretrain` folders of a run (`config`, the `PPORunConfig`)."""
    return [path.strip() for path in (config.model.reward_pretrain or "").split(",") if path.strip()]


def check_scorers_take_images(config) -> None:
    """A run with images (--image_key) scores its samples with models that see them: a teacher,
    critic or reward model folder of a text model would read the image placeholders as text, and
    is refused naming its flag before any weight loads."""
    if not config.data.image_key:
        return
    from transformers import AutoConfig

    from lightrft.models.families import family_for

    model = config.model
    folders = [(flag, folder) for flag, folder in (("--teacher_pretrain", model.teacher_pretrain),
                                                   ("--critic_pretrain", model.critic_pretrain)) if folder]
    folders += [("--reward_pretrain", path) for path in reward_model_paths(config)]
    for flag, folder in folders:
        try:
            hf_config = AutoConfig.from_pretrained(folder, trust_remote_code=model.trust_remote_code)
        except (OSError, ValueError):
            continue              # the model load names what is wrong with the folder
        if not family_for(hf_config).takes_media():
            raise ValueError(f"{flag} {folder} is a text model ({hf_config.model_type}) and the prompts carry images "
                             f"(--image_key {config.data.image_key}): it would read the image placeholders as text. "
                             "Pass a vision-language model of the policy's family (a critic or reward model gets a "
                             "value head on its backbone), or score with --remote_rm_url sources")
