"""A causal LM split into its decoder and its LM head, for the fused log-prob head.

`ActorLanguage(fused_head_chunk=...)` runs the decoder alone (the model without its head: it
returns the last hidden states and computes no logits), keeps the hidden states of the positions
that predict action tokens, and turns them into log-probs and entropies with
`lightrft.algorithms.fused_head.log_probs_from_hidden`, which never holds (tokens x vocabulary)
logits.

The split must give the logits the model's own forward gives, and a causal LM's head may do more
than `hidden @ W.T + b` (a logit scale, a vocabulary cut, code shipped with the checkpoint), which
no attribute reveals for certain. So the split is made only for the architectures whose forward
tests/models/test_fused_head_actor.py checks against the fused head (`FUSED_HEAD_MODEL_TYPES`,
the tiny architectures of the compatibility matrix); any other model keeps the plain forward,
with the reason logged.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lightrft.algorithms.fused_head import log_probs_from_hidden
from lightrft.models.families import ModelFamily

# The `config.model_type`s whose causal-LM forward is `head(decoder(...))`, followed at most by
# Gemma's final-logit soft-cap: each is checked equal to the plain forward in
# tests/models/test_fused_head_actor.py (values and gradients).
FUSED_HEAD_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "olmoe", "deepseek_v3",
                                    "mistral", "gemma2", "gemma3_text", "phi3", "gpt_neox", "gpt2"})


class FusedHeadUnsupported(ValueError):
    """The model cannot be split into decoder and head; the message says why."""


@dataclass(frozen=True)
class LMHead:
    """The decoder and LM head of a causal LM (modules of the model itself, not copies)."""

    decoder: nn.Module  # the model without its head: forward(**inputs).last_hidden_state (B, T, H)
    head: nn.Linear  # weight (V, H), bias (V,) or None; the input embedding when tied
    softcap: float | None  # `config.final_logit_softcapping` (Gemma 2): logits = cap * tanh(logits / cap)

    def hidden_states(self, inputs: dict) -> torch.Tensor:
        """The decoder's last hidden states for the forward keyword arguments `inputs` (those the
        causal LM takes, from its `ModelFamily`). Shape: (B, T, H)"""
        return self.decoder(**inputs).last_hidden_state

    def log_probs(self, hidden: torch.Tensor, labels: torch.Tensor, temperature: float,
                  banned_ids: torch.Tensor | None, return_entropy: bool,
                  chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probs, entropy or None) of `labels` under the head on `hidden` (`log_probs_from_hidden`).
        Shape: hidden (N, H), labels (N,) -> (N,), (N,)"""
        def fused(rows: torch.Tensor):
            return log_probs_from_hidden(rows, self.head.weight, labels, self.head.bias, temperature=temperature,
                                         softcap=self.softcap, banned_ids=banned_ids, return_entropy=return_entropy,
                                         chunk_tokens=chunk_tokens)

        return _as_forward_of(self.head, fused, hidden)


def _as_forward_of(module: nn.Module, function: Callable, *args):
    """`function(*args)` run as `module`'s forward, so the hooks registered on the module fire
    around it as around its own forward. Under DeepSpeed ZeRO-3 they gather the head's
    partitioned weight for this call and again for its backward, and release it after each, as
    in the plain forward. Read outside them, the weight would be gathered as an "external
    parameter" of the module then running (the actor), and kept whole through that module's
    whole forward and backward: one more full (V, H) matrix during every layer's work."""
    own = module.__dict__.get("forward")  # a forward already set on the instance (accelerate's hooks)
    module.forward = function
    try:
        return module(*args)
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def find_lm_head(model: nn.Module, family: ModelFamily) -> LMHead:
    """The decoder and head of `model` (a causal LM of `family`, or a peft model wrapping one);
    raises `FusedHeadUnsupported` naming why when the fused head cannot stand in for its logits."""
    if family.takes_media():
        raise FusedHeadUnsupported(f"{family.name} models take media, and their decoder is fed by the model's own "
                                   "forward")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: the wrapped model
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if model_type not in FUSED_HEAD_MODEL_TYPES:
        raise FusedHeadUnsupported(f"model_type {model_type!r} is not among the architectures whose head is checked "
                                   f"against the fused head ({', '.join(sorted(FUSED_HEAD_MODEL_TYPES))})")
    head = base.get_output_embeddings()
    if not isinstance(head, nn.Linear) or not head.weight.is_floating_point():
        raise FusedHeadUnsupported(f"its LM head is a {type(head).__name__}, not a plain linear layer (a LoRA "
                                   "adapter or a quantised layer on the head)")
    decoder = base.get_decoder()
    if decoder is base:
        raise FusedHeadUnsupported(f"{type(base).__name__} has no decoder module apart from its head")
    softcap = getattr(base.config, "final_logit_softcapping", None)
    return LMHead(decoder, head, float(softcap) if softcap else None)
