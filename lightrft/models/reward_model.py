"""The reward model: a transformer backbone with a scalar head read at the last real token."""

import math
import os

import torch
from torch import nn

from lightrft.models.families import family_of
from lightrft.models.hf_utils import (
    enable_gradient_checkpointing,
    strip_prefix,
    value_model_from,
    zero_dropout,
)
from lightrft.models.packing import check_seq_lens
from lightrft.models.shared_prompts import PackedPromptSharing, padded_as_shared


class RewardModel(nn.Module):
    """Sequence score r(x, y) from a Hugging Face backbone (`AutoModel`) and a value head.

    Args:
        pretrain_or_model: a reward-model folder (`--reward_pretrain`) or Hub id, or a module built
            by `hf_utils.value_model_class`.
        value_head_prefix: attribute and weight-name prefix of the head
            `nn.Linear(hidden_size, 1, bias=False)`; saved in config.json.
        normalize_reward: return (r - mean) / std with `config.mean`, `config.std` (set by
            `set_normalization`, saved in config.json); stored as `config.normalize_reward`.
        init_value_head: allow a folder without head weights (a causal LM or backbone) and start
            the head fresh, as reward-model training does. Without it such a folder is an error,
            since scoring with an untrained head would silently give noise.
        bf16, attn_implementation, trust_remote_code, gradient_checkpointing, disable_dropout,
            packing_samples: as for ActorLanguage.
        share_prompts: a padded batch scored with `prompt_len` computes each distinct prompt once
            (`shared_prompts.PackedPromptSharing`), with the unshared forward's scores.
    """

    def __init__(
        self,
        pretrain_or_model: str | os.PathLike | nn.Module,
        value_head_prefix: str = "score",
        *,
        normalize_reward: bool = False,
        init_value_head: bool = False,
        bf16: bool = False,
        attn_implementation: str | None = None,
        trust_remote_code: bool = False,
        gradient_checkpointing: bool = False,
        disable_dropout: bool = True,
        packing_samples: bool = False,
        share_prompts: bool = True,
    ) -> None:
        super().__init__()
        self.value_head_prefix = value_head_prefix
        self.model, self.head_loaded = value_model_from(
            pretrain_or_model,
            value_head_prefix=value_head_prefix,
            flag="--reward_pretrain",
            bf16=bf16,
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
            gradient_checkpointing=gradient_checkpointing,
        )
        if disable_dropout:
            zero_dropout(self.model)
        self.share_prompts = share_prompts
        self.family = family_of(self.model)
        self.prompt_sharing = PackedPromptSharing(self.model, "--reward_pretrain")
        self.packing_checked = False
        if packing_samples:
            self.check_packing()
        if not self.head_loaded and not init_value_head:
            raise ValueError(
                f"--reward_pretrain {os.fspath(pretrain_or_model)!r} has no value-head weights "
                f"'{value_head_prefix}.weight': it is not a trained reward model, or its head has another name "
                "(pass --value_head_prefix NAME). To train a reward model from this folder, use init_value_head=True."
            )
        hf_config = self.model.config
        hf_config.normalize_reward = bool(normalize_reward)
        hf_config.mean = float(getattr(hf_config, "mean", 0.0))
        hf_config.std = float(getattr(hf_config, "std", 1.0))

    def check_packing(self) -> None:
        """Raises if this architecture cannot be packed exactly with its attention; runs once."""
        if not self.packing_checked:
            self.family.check_packing(self.model, "--reward_pretrain")
            self.packing_checked = True

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **kwargs) -> "RewardModel":
        return cls(path, **kwargs)

    def set_normalization(self, mean: float, std: float) -> None:
        """Stores the reward statistics used when `config.normalize_reward` is on."""
        if not math.isfinite(mean) or not math.isfinite(std) or std <= 0:
            raise ValueError(f"reward normalisation needs a finite mean and a std > 0, got mean={mean}, std={std}")
        self.model.config.mean = float(mean)
        self.model.config.std = float(std)

    def forward(
        self,
        sequences: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        packed_seq_lens: list[int] | None = None,
        prompt_len: int | None = None,
        media: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Scores in float32, read from the head at the last real token of each sequence.

        Padded: sequences (B, T); the last real token is the last 1 of `attention_mask` (so left
        and right padding both work), or position T - 1 without a mask -> (B,).
        Packed: sequences (1, P), packed_seq_lens N lengths -> (N,).
        With `config.normalize_reward`: (r - config.mean) / config.std.
        `prompt_len` (padded): the first columns that are the left-padded prompts; rows that repeat
        a prompt then share its forward. `media`: a vision-language backbone's images of the batch
        or row (as `ActorLanguage.forward` takes them); such a reward model does not share prompts.
        """
        if packed_seq_lens is not None:
            self.check_packing()
        scores = (self._shared_scores(sequences, attention_mask, prompt_len)
                  if packed_seq_lens is None and not self.family.takes_media() else None)
        if scores is not None:
            return self._normalized(scores)
        kwargs = self.family.value_inputs(self.model, sequences, attention_mask, packed_seq_lens, media)
        values = self.model(**kwargs)  # (B, T) or (1, P)
        if packed_seq_lens is not None:
            ends = torch.tensor(check_seq_lens(packed_seq_lens, sequences.size(-1))).cumsum(0) - 1  # (N,)
            scores = values[0, ends.to(values.device)]  # (N,)
        elif attention_mask is not None:
            mask = attention_mask.long()
            last = mask.size(1) - 1 - mask.flip(dims=[1]).argmax(dim=1)  # (B,) index of the last 1
            scores = values.gather(1, last.unsqueeze(1)).squeeze(1)  # (B,)
        else:
            scores = values[:, -1]  # (B,)
        return self._normalized(scores.float())

    def _normalized(self, scores: torch.Tensor) -> torch.Tensor:
        hf_config = self.model.config
        if hf_config.normalize_reward:
            scores = (scores - hf_config.mean) / hf_config.std
        return scores

    def _shared_scores(self, sequences, attention_mask, prompt_len: int | None) -> torch.Tensor | None:
        """Scores of padded rows that repeat a prompt, from a shared packed row. Shape: (B,)"""
        if not self.share_prompts or prompt_len is None or self.prompt_sharing.reason is not None:
            return None
        found = padded_as_shared(sequences, attention_mask, prompt_len)
        if found is None:
            return None
        ids, seq_lens, actions, groups = found
        scores = self.prompt_sharing.forward(ids, seq_lens, actions, groups,
                                             lambda kwargs, layout: self.model(**kwargs)[0, layout.last_positions])
        return None if scores is None else scores.float()

    def gradient_checkpointing_enable(self) -> None:
        enable_gradient_checkpointing(self.model)

    def save_pretrained(
        self, output_dir: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None, tokenizer=None
    ) -> None:
        """Writes a Hugging Face folder: config.json (with `value_head_prefix`, `normalize_reward`,
        `mean`, `std`) and safetensors weights of backbone and head.
        `state_dict`, if given, is keyed like this wrapper's own `state_dict()` (entries under
        `model.`), as `DeepspeedStrategy.save_model` passes the weights gathered from ZeRO-3."""
        inner = None if state_dict is None else strip_prefix(state_dict, "model.")
        self.model.save_pretrained(output_dir, state_dict=inner)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
