"""The critic: a transformer backbone with a scalar value head, giving one value per action token."""

import os

import torch
from torch import nn

from lightrft.models.compiled_layers import CompiledLayers
from lightrft.models.families import family_of
from lightrft.models.hf_utils import (
    enable_gradient_checkpointing,
    strip_prefix,
    value_model_from,
    zero_dropout,
)
from lightrft.models.packing import check_num_actions, packed_action_index
from lightrft.models.sequence_parallel import checked_group
from lightrft.models.shared_prompts import PackedPromptSharing, padded_as_shared


class Critic(nn.Module):
    """Value function V(s_t) for PPO's GAE, on a Hugging Face backbone (`AutoModel`, no LM head).

    Args:
        pretrain_or_model: a model folder (`--critic_pretrain`) or Hub id, or a module built by
            `hf_utils.value_model_class`. A causal-LM folder works (critics usually start from the
            policy or the reward model): the backbone loads and the head starts fresh.
        value_head_prefix: attribute and weight-name prefix of the head
            `nn.Linear(hidden_size, 1, bias=False)`; saved in config.json.
        bf16, attn_implementation, trust_remote_code, gradient_checkpointing, disable_dropout,
            packing_samples: as for ActorLanguage.
        share_prompts: samples of one prompt share its forward (`shared_prompts.PackedPromptSharing`),
            in packed rows given `prompt_groups` and in padded batches (which are packed for it);
            values equal the unshared forward's.
        torch_compile: None, or the torch.compile backend its decoder layers are compiled with
            (`lightrft.models.compiled_layers`), as for ActorLanguage.

    `.model` is the `PreTrainedModel` (backbone under its usual prefix, head under
    `value_head_prefix`); `.head_loaded` says whether the head came from the folder.
    """

    def __init__(
        self,
        pretrain_or_model: str | os.PathLike | nn.Module,
        value_head_prefix: str = "score",
        *,
        bf16: bool = False,
        attn_implementation: str | None = None,
        trust_remote_code: bool = False,
        gradient_checkpointing: bool = False,
        disable_dropout: bool = True,
        packing_samples: bool = False,
        share_prompts: bool = True,
        torch_compile: str | None = None,
    ) -> None:
        super().__init__()
        self.value_head_prefix = value_head_prefix
        self.model, self.head_loaded = value_model_from(
            pretrain_or_model,
            value_head_prefix=value_head_prefix,
            flag="--critic_pretrain",
            bf16=bf16,
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
            gradient_checkpointing=gradient_checkpointing,
        )
        if disable_dropout:
            zero_dropout(self.model)
        self.share_prompts = share_prompts
        self.family = family_of(self.model)
        self.family.check(self.model, "--critic_pretrain")   # values must not see later tokens
        self.prompt_sharing = PackedPromptSharing(self.model, "--critic_pretrain")
        # The decoder layers under torch.compile (`--torch_compile`), or None.
        self.compiled_layers = (CompiledLayers(self.model, torch_compile, "--critic_pretrain") if torch_compile
                                else None)
        self.sequence_parallel = None         # as ActorLanguage.sequence_parallel
        self.packing_checked = False
        if packing_samples:
            self.check_packing()

    def check_packing(self) -> None:
        """Raises if this architecture cannot be packed exactly with its attention; runs once."""
        if not self.packing_checked:
            self.family.check_packing(self.model, "--critic_pretrain")
            self.packing_checked = True

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **kwargs) -> "Critic":
        return cls(path, **kwargs)

    def forward(
        self,
        sequences: torch.Tensor,
        num_actions: int | list[int],
        attention_mask: torch.Tensor | None = None,
        packed_seq_lens: list[int] | None = None,
        prompt_groups: list[int] | None = None,
        media: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Values of the states from which each action token is generated, in float32.

        The state before action token t is the prefix ending at t - 1, so the value for action t
        is the head's output at position t - 1: `values[:, -A-1:-1]` of the per-position values.
        Padded: sequences (B, T), num_actions int A -> (B, A).
        Packed: sequences (1, P), packed_seq_lens N lengths, num_actions N ints -> (N, max A),
        actions left-aligned, right-padded with 0 (the actor's layout). With `prompt_groups` a
        packed row computes each distinct prompt once, as `ActorLanguage.forward` does; a padded
        batch whose rows repeat a prompt is packed that way too (its pad slots then hold 0).
        `media`: a vision-language backbone's images of the batch or row (as `ActorLanguage.forward`
        takes them); such a critic does not share prompts, and a batch without images still runs
        the vision tower (`ModelFamily.blank_media_inputs`).
        """
        takes_media = self.family.takes_media()
        check_num_actions(num_actions, sequences, packed_seq_lens)
        if packed_seq_lens is not None:
            self.check_packing()
        if packed_seq_lens is None:
            num_actions = int(num_actions)
            shared = None if takes_media else self._shared_padded(sequences, attention_mask, num_actions)
            if shared is not None:
                return shared
            kwargs = self.family.value_inputs(self.model, sequences, attention_mask, None, media)
            values = self.model(**kwargs)  # (B, T)
            return values[:, -num_actions - 1 : -1].float()  # (B, A)
        index = packed_action_index(packed_seq_lens, num_actions, sequences.device)
        if self.sequence_parallel is not None:
            shard = self.sequence_parallel.split_row(
                self.model, lambda ids, lens: self.family.value_inputs(self.model, ids, None, lens, media), sequences,
                packed_seq_lens, num_actions)
            values = self.model(**shard.local)  # (1, P/N)
            return index.to_rows(shard.gather(values[0, shard.local_positions(index.predict_positions)].float()))
        shared = None if takes_media else self._shared_values(sequences, packed_seq_lens, num_actions, prompt_groups)
        if shared is not None:
            return index.to_rows(shared)  # (N, A)
        values = self.model(**self.family.value_inputs(self.model, sequences, None, packed_seq_lens, media))  # (1, P)
        return index.to_rows(values[0, index.predict_positions].float())  # (N, A)

    def _shared_values(self, sequences, seq_lens, num_actions, groups) -> torch.Tensor | None:
        """The values predicting each action of a packed row, its prompts computed once. Shape: (K,)"""
        if not self.share_prompts or groups is None:
            return None
        values = self.prompt_sharing.forward(sequences, seq_lens, num_actions, groups,
                                             lambda kwargs, layout: self.model(**kwargs)[0, layout.predict_positions])
        return None if values is None else values.float()

    def _shared_padded(self, sequences, attention_mask, num_actions: int) -> torch.Tensor | None:
        """Padded rows that repeat a prompt, valued as a shared packed row. Shape: (B, A)"""
        if not self.share_prompts or self.prompt_sharing.reason is not None:
            return None
        found = padded_as_shared(sequences, attention_mask, sequences.size(1) - num_actions)
        if found is None:
            return None
        ids, seq_lens, actions, groups = found
        values = self._shared_values(ids, seq_lens, actions, groups)
        if values is None:
            return None
        rows = packed_action_index(seq_lens, actions, sequences.device).to_rows(values)  # (B, max response)
        return nn.functional.pad(rows, (0, num_actions - rows.size(1)))  # (B, A)

    def use_sequence_parallel(self, group) -> None:
        """As `ActorLanguage.use_sequence_parallel`, for the value model (--critic_pretrain)."""
        self.sequence_parallel = checked_group(group, self.model, "--critic_pretrain")

    def gradient_checkpointing_enable(self) -> None:
        enable_gradient_checkpointing(self.model)

    def save_pretrained(
        self, output_dir: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None, tokenizer=None
    ) -> None:
        """Writes a Hugging Face folder: config.json (with `value_head_prefix`) and safetensors
        weights of backbone and head; loads back with `Critic(output_dir)`.
        `state_dict`, if given, is keyed like this wrapper's own `state_dict()` (entries under
        `model.`), as `DeepspeedStrategy.save_model` passes the weights gathered from ZeRO-3."""
        inner = None if state_dict is None else strip_prefix(state_dict, "model.")
        self.model.save_pretrained(output_dir, state_dict=inner)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
