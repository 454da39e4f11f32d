"""RoBERTa trained as a causal decoder (`RobertaForCausalLM` with `is_decoder=True`).

Its position embeddings count from `pad_token_id + 1`, not from 0: the first real token of a
sequence sits at position 2 when the pad id is 1, as RoBERTa computes positions itself from the
padding mask. lightrft passes position ids explicitly (left-padded and packed rows need them), so
without this family every token would read the embedding of a position two steps earlier, and the
trainer's log-probs would not be the model's.
"""

import torch
from torch import nn
from transformers import PretrainedConfig

from lightrft.models.families.base import ModelFamily, register_family


class RobertaDecoder(ModelFamily):
    name = "RoBERTa decoder"
    model_types = ("roberta",)
    rollout_engines = frozenset({"hf"})     # vLLM has no RobertaForCausalLM

    def check(self, model: nn.Module, flag: str) -> None:
        if not getattr(model.config, "is_decoder", False):
            raise ValueError(f"{flag}: this RoBERTa attends in both directions (is_decoder is false), so it is not a "
                             "causal LM; train a decoder checkpoint (\"is_decoder\": true in its config.json)")

    def packing_problem(self, model: nn.Module) -> tuple[str, bool] | None:
        if not getattr(model.config, "is_decoder", False):   # a reward model may be an encoder: padded only
            return "a RoBERTa encoder (is_decoder false) attends in both directions", True
        return super().packing_problem(model)

    def position_ids(self, config: PretrainedConfig, positions: torch.Tensor) -> torch.Tensor:
        return positions + (config.pad_token_id + 1)

    def context_length(self, config: PretrainedConfig) -> int | None:
        return config.max_position_embeddings - (config.pad_token_id + 1)


register_family(RobertaDecoder())
