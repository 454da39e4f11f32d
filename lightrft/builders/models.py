"""How the policy-shaped models of a run are built."""

from lightrft.config.sections import DistributedConfig, PPOModelConfig


def policy_model_kwargs(model: PPOModelConfig, distributed: DistributedConfig) -> dict:
    """Keyword arguments of every policy-shaped model of a run (actor, reference, EMA, explorer
    copies) besides its path: precision, attention, remote code, dropout and packing."""
    # Dropout off by default: with it on, even the first on-policy update has ratios != 1.
    return dict(bf16=distributed.bf16, attn_implementation=model.attn_implementation,
                trust_remote_code=model.trust_remote_code, disable_dropout=not model.keep_dropout,
                packing_samples=model.packing_samples)
