"""The reference policy of a LoRA run, without a second copy of the model.

With LoRA only the adapter trains, so the initial policy is the actor's own base model with the
adapter switched off (peft's `disable_adapter()`): the KL reference costs no memory beyond the
actor, where a separate `ActorLanguage` would hold another full set of base weights (under ZeRO-3,
another shard of every layer on every rank).
"""

from contextlib import contextmanager

import torch
from torch import nn


class AdapterDisabledReference(nn.Module):
    """Log-probs of `actor` with its LoRA adapter disabled, with the actor's call signature:
    `reference(sequences, num_actions, attention_mask=...)` -> (B, A), as `ActorLanguage` returns.

    The actor is held outside this module's parameters on purpose: preparing the reference with
    the strategy (`strategy.prepare(reference)`) wraps none of its weights, and the forward runs
    the actor's own (possibly ZeRO-3-sharded) module, whose hooks gather its parameters as usual.
    The one parameter the reference owns, `anchor` (a single frozen zero), exists because
    DeepSpeed's ZeRO-3 wrapper reads the dtype of a module's first parameter and fails without one.
    """

    def __init__(self, actor: nn.Module):
        super().__init__()
        # An ActorLanguage with an adapter (checked by what it has: actor.py imports this module).
        if getattr(actor, "lora_rank", 0) == 0:
            raise ValueError("AdapterDisabledReference needs an ActorLanguage with a LoRA adapter (--lora_rank > 0); "
                             "without LoRA the reference is a separate ActorLanguage of --pretrain")
        self.__dict__["actor"] = actor  # not a submodule (see the class doc)
        dtype = next(actor.parameters()).dtype
        self.anchor = nn.Parameter(torch.zeros(1, dtype=dtype), requires_grad=False)

    @contextmanager
    def _base_model(self):
        with self.actor.model.disable_adapter():
            yield

    def forward(self, sequences: torch.Tensor, num_actions=None, attention_mask: torch.Tensor | None = None,
                **kwargs):
        with self._base_model():
            return self.actor(sequences, num_actions, attention_mask=attention_mask, **kwargs)
