"""The policy: a Hugging Face causal LM that returns log-probabilities of its action tokens."""

import copy
import logging
import os
import re

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from lightrft.algorithms.logprobs import entropy_from_logits, log_probs_from_logits
from lightrft.models.families import family_of, load_model
from lightrft.models.attention import default_attn_implementation
from lightrft.models.compiled_layers import CompiledLayers
from lightrft.models.lm_head import FusedHeadUnsupported, LMHead, find_lm_head
from lightrft.models.hf_utils import (
    check_packed_row,
    enable_gradient_checkpointing,
    explain_load_errors,
    model_dtype,
    resolve_pretrained,
    zero_dropout,
)
from lightrft.models.packing import check_num_actions, packed_action_index
from lightrft.models.reference import AdapterDisabledReference
from lightrft.utils.routing import NO_ROUTE, ROUTING_REPLAY_MODES, RoutingReplay, load_balancing_loss
from lightrft.models.sequence_parallel import checked_group
from lightrft.models.shared_prompts import (
    PackedPromptSharing,
    PromptSharingUnsupported,
    sharing_possible,
    shared_prompt_forward,
)

logger = logging.getLogger(__name__)


class ActorLanguage(nn.Module):
    """A causal LM (loaded from a folder, or a given module) returning action log-probabilities.

    Args:
        pretrain_or_model: a Hugging Face model folder (`--pretrain`), a Hub id, or an `nn.Module`
            (a causal LM with the Hugging Face forward signature) to wrap; its attention
            implementation is set as below.
        bf16: load weights in bfloat16 (else float32). Log-probs are float32 either way.
        attn_implementation: None picks `attention.default_attn_implementation()`
            (lightrft's packed attention, on flash-attn's varlen kernel where installed); any
            transformers name ("sdpa", "eager", "flex_attention", ...) overrides it.
        lora_rank: > 0 wraps the model in a peft LoRA adapter of this rank; only the adapter trains.
        lora_alpha, lora_dropout: LoRA scale numerator (scale = alpha / rank) and dropout.
        target_modules: module names that get adapters; None means every linear layer but the LM head
            (and, in a vision-language model, but the vision tower).
        freeze_vision_tower: a vision-language model's vision encoder and connector do not train.
        trust_remote_code: allow model code shipped in the folder.
        gradient_checkpointing: recompute activations in the backward pass (non-reentrant).
        temperature: logits are divided by it before log-softmax and entropy, matching sampling
            at that temperature.
        disable_dropout: set every dropout probability of the model to 0 (`hf_utils.zero_dropout`),
            so that training forwards compute the function the rollouts were scored with and the
            first on-policy update has an importance ratio of exactly 1. LoRA dropout is kept.
        packing_samples: the model will get packed rows; an architecture that cannot be packed
            exactly is refused here (`ModelFamily.check_packing`) rather than at its first
            packed forward.
        share_prompts: in padded forwards, rows with the same prompt columns share one prompt
            forward (`lightrft.models.shared_prompts`): the same log-probs and gradients, with a
            prompt's matrix work done once for its G samples. Off under gradient checkpointing
            (its layers drop the KV cache) and for mixture-of-experts load-balancing losses.
            Packed rows given `prompt_groups` share too, gradient checkpointing included.
        fused_head_chunk: None (the default) computes log-probs from the model's logits of the
            action-predicting positions. A number of tokens turns on the fused log-prob head: the
            decoder runs without the LM head and `lightrft.algorithms.fused_head` computes the
            log-probs and entropies from its hidden states and the head's weight, `fused_head_chunk`
            tokens' logits at a time, so no (tokens x vocabulary) logits or logit gradients are
            held (`lightrft.algorithms.fused_head.CHUNK_TOKENS` is a good size). The same values and
            gradients; where it does not apply, the plain forward runs (`forward` says where).
        routing_replay: "off" (the default); else a mixture-of-experts model's forwards take
            `routes=` and send each token through the recorded experts (`lightrft.utils.routing`):
            "rollout" also has the Hugging Face engine decoding with `.model` record the rollout's
            routes; "old" leaves recording to the caller (the old-policy forward's routes).
        torch_compile: None (the default) runs the model eagerly; "inductor" or "aot_eager" compiles
            every decoder layer with that torch.compile backend around lightrft's packed attention,
            with dynamic shapes (`lightrft.models.compiled_layers`; `.compiled_layers.graphs` counts
            the graphs compiled). The same log-probs and gradients, to floating-point rounding.

    Attribute `.model` is the Hugging Face model (a peft model with LoRA), usable for `generate`;
    `.family` its `lightrft.models.families.ModelFamily`, which loads it and builds its forward inputs.
    """

    def __init__(
        self,
        pretrain_or_model: str | os.PathLike | nn.Module,
        *,
        bf16: bool = False,
        attn_implementation: str | None = None,
        lora_rank: int = 0,
        lora_alpha: int = 16,
        lora_dropout: float = 0.0,
        target_modules: list[str] | str | None = None,
        trust_remote_code: bool = False,
        gradient_checkpointing: bool = False,
        temperature: float = 1.0,
        disable_dropout: bool = True,
        packing_samples: bool = False,
        share_prompts: bool = True,
        freeze_vision_tower: bool = False,
        fused_head_chunk: int | None = None,
        routing_replay: str = "off",
        torch_compile: str | None = None,
        flag: str = "--pretrain",
    ) -> None:
        super().__init__()
        self.flag = flag      # the option the model came from, named in errors (--teacher_pretrain for a teacher)
        if temperature <= 0:
            raise ValueError(f"--temperature must be > 0, got {temperature}")
        if lora_rank < 0:
            raise ValueError(f"--lora_rank must be >= 0, got {lora_rank}")
        if fused_head_chunk is not None and (type(fused_head_chunk) is not int or fused_head_chunk < 1):
            raise ValueError(f"fused_head_chunk must be None (off) or a number of tokens >= 1, "
                             f"got {fused_head_chunk!r}")
        self.temperature = float(temperature)
        self.share_prompts = share_prompts
        if isinstance(pretrain_or_model, nn.Module):
            model = pretrain_or_model
            if hasattr(model, "set_attn_implementation"):
                model.set_attn_implementation(attn_implementation or default_attn_implementation())
        else:
            path = resolve_pretrained(pretrain_or_model, flag)
            with explain_load_errors(path, flag):
                model = load_model(
                    path,
                    dtype=model_dtype(bf16),
                    attn_implementation=attn_implementation or default_attn_implementation(),
                    trust_remote_code=trust_remote_code,
                )
        # How this kind of model is loaded and fed (`lightrft.models.families`).
        self.family = family_of(model)
        self.family.check(model, flag)
        config = getattr(model, "config", None)
        banned = self.family.banned_token_ids(config) if isinstance(config, PretrainedConfig) else ()
        self.banned_ids = torch.tensor(banned, dtype=torch.long) if banned else None
        if disable_dropout:
            # Before LoRA wraps the model, so an explicit --lora_dropout stays in force.
            zero_dropout(model)
        if gradient_checkpointing:
            enable_gradient_checkpointing(model)
        vision = self.family.vision_modules(model)
        if freeze_vision_tower:
            if not vision:
                raise ValueError(f"--freeze_vision_tower: --pretrain is a {self.family.name} model, which has no "
                                 "vision tower; drop the flag")
            for name, param in model.named_parameters():
                if name.startswith(tuple(prefix + "." for prefix in vision)):
                    param.requires_grad_(False)
        self.lora_rank = lora_rank
        if lora_rank > 0:
            # peft is imported only when LoRA is asked for: it takes seconds to import.
            from peft import LoraConfig, TaskType, get_peft_model

            lora_config = LoraConfig(
                task_type=TaskType.CAUSAL_LM,
                r=lora_rank,
                lora_alpha=lora_alpha,
                lora_dropout=lora_dropout,
                target_modules=target_modules or "all-linear",
                # The vision encoder and connector get no adapters: LoRA tunes the decoder.
                exclude_modules=vision_module_pattern(vision) if vision else None,
                bias="none",
            )
            model = get_peft_model(model, lora_config)
        self.model = model
        if routing_replay not in ROUTING_REPLAY_MODES:
            raise ValueError(f"--routing_replay must be one of {', '.join(ROUTING_REPLAY_MODES)}, "
                             f"got {routing_replay!r}")
        # The expert choice of every MoE layer, recorded and replayed (`forward(routes=...)`), or None.
        self.routing = (None if routing_replay == "off" else
                        RoutingReplay(model, flag, record_rollouts=routing_replay == "rollout"))
        self.fused_head_chunk = fused_head_chunk
        # The decoder and head the fused log-prob head runs on, or None for the model's logits.
        self.lm_head = self._split_head(model) if fused_head_chunk is not None else None
        self.prompt_sharing = PackedPromptSharing(model, flag)
        # The decoder layers under torch.compile (`--torch_compile`), or None.
        self.compiled_layers = CompiledLayers(model, torch_compile, flag) if torch_compile else None
        # The sequence-parallel group packed rows are split over (`use_sequence_parallel`), or None.
        self.sequence_parallel = None
        self.packing_checked = False
        if packing_samples:
            self.check_packing()

    def _split_head(self, model: nn.Module) -> LMHead | None:
        """The decoder and head of `model` for the fused log-prob head, or None (with the reason
        logged) where it cannot stand in for the model's logits."""
        try:
            return find_lm_head(model, self.family)
        except FusedHeadUnsupported as reason:
            logger.warning("%s: the fused log-prob head is off: %s; log-probs come from the model's logits",
                           self.flag, reason)
            return None

    def check_packing(self) -> None:
        """Raises if this architecture cannot be packed exactly with its attention; runs once,
        at construction with `packing_samples=True`, else before the first packed forward."""
        if not self.packing_checked:
            self.family.check_packing(self.model, self.flag)
            self.packing_checked = True

    def use_sequence_parallel(self, group) -> None:
        """Splits every packed-row forward over `group` (a `lightrft.models.sequence_parallel.
        SequenceParallel` of size > 1; None or size 1 undoes it); raises naming --pretrain when
        this model cannot run split. Split rows do not share prompts."""
        self.sequence_parallel = checked_group(group, self.model, "--pretrain")

    @property
    def is_moe(self) -> bool:
        """Whether the model routes tokens to experts and can report router logits."""
        return hasattr(self.model.config, "output_router_logits")

    @property
    def attn_implementation(self) -> str:
        return self.model.config._attn_implementation

    def forward(
        self,
        sequences: torch.Tensor,
        num_actions: int | list[int] | None = None,
        attention_mask: torch.Tensor | None = None,
        return_output: bool = False,
        packed_seq_lens: list[int] | None = None,
        return_entropy: bool = False,
        return_aux_loss: bool = False,
        prompt_groups: list[int] | None = None,
        media: dict[str, torch.Tensor] | None = None,
        routes: torch.Tensor | None = None,
    ):
        """Log-probabilities of the action tokens (the last `num_actions` tokens of each sequence).

        Padded: sequences (B, T) with prompts left-padded and responses right-padded, num_actions
        an int A -> log-probs (B, A) of `sequences[:, -A:]`. Positions are counted over real tokens
        (from `attention_mask`), so padding does not shift them.
        Packed: sequences (1, P), `packed_seq_lens` N lengths, num_actions N ints -> (N, max A)
        with row i holding the log-probs of the last num_actions[i] tokens of sequence i,
        left-aligned and right-padded with 0. `attention_mask` is ignored.

        Only the logits that predict action tokens are computed (`logits_to_keep`), and the
        float32 log-softmax runs in chunks, so no float32 (B, T, V) copy is made.

        With `fused_head_chunk` set (and a model `lm_head.find_lm_head` can split), padded and
        packed forwards, shared prompts included, compute no logits at all: the decoder's hidden
        states of the action-predicting positions go through `fused_head.log_probs_from_hidden`
        (same values and gradients), and a `return_output` output has `logits=None` (and `entropy`
        when asked for). The plain forward still runs for `num_actions=None` (the caller wants
        logits), for mixture-of-experts router logits (`return_aux_loss`: transformers computes the
        loss in the causal LM's forward), for rows split over a sequence-parallel group, and for
        vision-language models and architectures outside `lm_head.FUSED_HEAD_MODEL_TYPES` (said
        once, at construction).

        With `return_output=True` returns `(log_probs, output)`: the model output whose `logits`
        cover only the action-predicting positions ((B, A, V) padded, (1, K, V) packed with
        K = sum(num_actions)), plus `output["entropy"]` (same layout as log_probs, float32) when
        `return_entropy=True`. With `num_actions=None` returns the full model output (logits over
        every position, e.g. for a pretraining/SFT loss).

        Packed rows share prompts given `prompt_groups` (N ids, equal ids for sequences whose
        prompts, their first L_i - num_actions[i] tokens, are equal, as `packing.prompt_group_ids`
        finds them): each distinct prompt is computed once and its responses attend to it
        (`packing.SharedPromptLayout`), the same log-probs and gradients as the unshared row.

        With `return_aux_loss=True` a mixture-of-experts model is asked for its router logits and
        `output["aux_loss"]` holds its load-balancing loss (Switch Transformer eq. 4, as transformers
        computes it: over the real tokens of the batch, pads excluded, unscaled by
        `router_aux_loss_coef`), a scalar tensor; None for a model without one. Packed and padded
        layouts give the same value, as both count exactly the real tokens.

        `media` carries the images (and the like) of a vision-language model's batch or packed row,
        in the order of their placeholder tokens (`lightrft.models.families.merge_media` joins the
        samples'); the model family computes their features apart from the decoder
        (`ModelFamily.media_inputs`); a batch without media still runs the vision tower, on a blank
        image with weight 0 (`ModelFamily.blank_media_inputs`: ZeRO-3 needs every rank to run the
        same modules). A vision-language model's forwards do not share prompts, and its image
        placeholder ids are out of the distribution (the rollout engines never sample them), so the
        log-probs and entropy are the engines'.

        `routes` (with `routing_replay` on): per token, the experts each MoE layer sends it through,
        laid out like `sequences` ((B, T, L, K) padded, (1, P, L, K) packed; -1 where the live
        router chooses), for this forward and its recomputation under gradient checkpointing; None:
        live routing. Packed rows share prompts with the first sample's prompt routes; padded rows
        of a model with routing replay do not share prompts (recorded routes follow the rows).
        """
        if routes is not None and self.routing is None:
            raise ValueError(f"{self.flag}: forward got routes but routing replay is off for this model "
                             "(ActorLanguage(routing_replay=...), --routing_replay)")
        if self.routing is not None:
            self.routing.replay(None if routes is None else routes.reshape(-1, *routes.shape[-2:]))
        if return_aux_loss and num_actions is not None and not return_output:
            raise ValueError("return_aux_loss=True puts the loss in the model output: pass return_output=True too")
        extra = {"output_router_logits": True} if return_aux_loss and self.is_moe else {}
        if packed_seq_lens is None:
            kwargs = {**self.family.padded_inputs(self.model, sequences, attention_mask, media), **extra}
            result = self._forward_padded(kwargs, sequences, num_actions, return_output, return_entropy)
        else:
            self.check_packing()
            result = self._forward_packed(extra, sequences, num_actions, packed_seq_lens, return_output, return_entropy,
                                          prompt_groups, media)
        if return_aux_loss:
            output = result[1] if isinstance(result, tuple) else result
            aux_loss = output.get("aux_loss") if extra else None
            output["aux_loss"] = aux_loss if isinstance(aux_loss, torch.Tensor) else None
        return result

    def _forward_padded(self, kwargs, sequences, num_actions, return_output, return_entropy):
        if num_actions is None:
            return self.model(**kwargs)
        check_num_actions(num_actions, sequences, None)
        num_actions = int(num_actions)
        if self.lm_head is not None and "output_router_logits" not in kwargs:
            return self._fused_padded(kwargs, sequences[:, -num_actions:], return_output, return_entropy)
        output = self._shared_prompt_forward(kwargs, num_actions)
        if output is None:
            # Logits at T-A-1 .. T-2 predict the action tokens at T-A .. T-1: keep A + 1, drop the last.
            output = self.model(**kwargs, logits_to_keep=num_actions + 1)
            output.logits = output.logits[:, :-1]  # (B, A, V)
        output.logits = self._without_banned(output.logits)
        log_probs = log_probs_from_logits(output.logits, sequences[:, -num_actions:], self.temperature)  # (B, A)
        if return_output and return_entropy:
            output["entropy"] = entropy_from_logits(output.logits, self.temperature)  # (B, A)
        return (log_probs, output) if return_output else log_probs

    def _without_banned(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with the family's banned ids (a vision-language model's image placeholders,
        which no rollout engine samples) pushed out of the distribution: the policy trained is the
        one the engines sample from, so on-policy ratios are 1 and the engine check compares like
        with like. A copy; the logits as they are when nothing is banned."""
        if self.banned_ids is None:
            return logits
        fill = -1e9 if torch.finfo(logits.dtype).max > 1e10 else torch.finfo(logits.dtype).min / 2
        return logits.index_fill(-1, self.banned_ids.to(logits.device), fill)

    def _fused_padded(self, kwargs, labels, return_output, return_entropy):
        """`_forward_padded` with the fused head: the decoder's hidden states at the positions that
        predict the action tokens `labels` (B, A), through `lightrft.algorithms.fused_head`."""
        num_actions = labels.size(1)
        output = self._shared_prompt_forward(kwargs, num_actions, self.lm_head.decoder, "last_hidden_state")
        if output is not None:
            hidden = output.last_hidden_state  # (B, A, H)
        else:
            # Hidden states at T-A-1 .. T-2 predict the action tokens at T-A .. T-1.
            hidden = self.lm_head.hidden_states(kwargs)[:, -num_actions - 1:-1]  # (B, A, H)
        return self._fused_result(hidden.reshape(-1, hidden.size(-1)), labels.reshape(-1),
                                  lambda flat: flat.view_as(labels), return_output, return_entropy)

    def _fused_result(self, hidden, labels, to_layout, return_output, return_entropy):
        """The log-probs (and entropies) of `labels` (K,) from the hidden states (K, H) that predict
        them, put in the caller's layout by `to_layout`; with `return_output`, an output without
        logits (the fused head computes none) holding `entropy` when asked for."""
        log_probs, entropy = self.lm_head.log_probs(hidden, labels, self.temperature, self.banned_ids,
                                                    return_output and return_entropy, self.fused_head_chunk)
        if not return_output:
            return to_layout(log_probs)
        output = CausalLMOutputWithPast()
        if entropy is not None:
            output["entropy"] = to_layout(entropy)
        return to_layout(log_probs), output

    def _shared_prompt_forward(self, kwargs, num_actions, model=None, field="logits"):
        """The padded output with one prompt forward per distinct prompt, or None for the plain forward;
        `model` and `field` as `shared_prompt_forward` takes them (default: this actor's model, logits)."""
        if (not self.share_prompts or "output_router_logits" in kwargs or "input_ids" not in kwargs
                or "mm_encoder_outputs" in kwargs or not sharing_possible(self.model) or self.routing is not None):
            return None
        try:
            return shared_prompt_forward(self.model if model is None else model, kwargs, num_actions, field)
        except PromptSharingUnsupported:
            self.share_prompts = False  # this model cannot; the plain forward from now on
            return None

    def _forward_packed(self, extra, sequences, num_actions, packed_seq_lens, return_output, return_entropy,
                        prompt_groups=None, media=None):
        """`extra`: keyword arguments beyond the packed row's (router logits); the row's own (with
        its media) are built only for the forward that runs (the shared row builds its own)."""
        check_packed_row(sequences, packed_seq_lens)
        if num_actions is None:
            return self.model(**self.family.packed_inputs(self.model, sequences, packed_seq_lens, media), **extra)
        check_num_actions(num_actions, sequences, packed_seq_lens)
        index = packed_action_index(packed_seq_lens, num_actions, sequences.device)
        if self.sequence_parallel is not None:
            return self._forward_split(sequences, packed_seq_lens, num_actions, index, return_output, return_entropy,
                                       router=bool(extra), media=media)
        if self.lm_head is not None and not extra:
            return self._fused_packed(sequences, packed_seq_lens, num_actions, index, prompt_groups, media,
                                      return_output, return_entropy)
        output = None
        if self.share_prompts and prompt_groups is not None and not self.family.takes_media():
            output = self.prompt_sharing.forward(
                sequences, packed_seq_lens, num_actions, prompt_groups,
                lambda shared, layout: self._replay_shared(layout) or self._shared_row_forward(shared, layout, extra))
        if output is None:
            self._replay_unshared()
            kwargs = self.family.packed_inputs(self.model, sequences, packed_seq_lens, media)
            output = self.model(**kwargs, **extra, logits_to_keep=index.predict_positions)  # logits (1, K, V)
        output.logits = self._without_banned(output.logits)
        labels = sequences[0, index.token_positions]  # (K,)
        log_probs = index.to_rows(log_probs_from_logits(output.logits[0], labels, self.temperature))  # (N, A)
        if return_output and return_entropy:
            output["entropy"] = index.to_rows(entropy_from_logits(output.logits[0], self.temperature))  # (N, A)
        return (log_probs, output) if return_output else log_probs

    def _shared_row_forward(self, shared: dict, layout, extra: dict):
        """The model over a shared-prompt row; with router logits asked for (`extra`), its
        load-balancing loss counts each shared prompt token once per sample sharing it
        (`layout.multiplicity`): the unshared row's value."""
        output = self.model(**shared, **extra, logits_to_keep=layout.predict_positions)
        if extra:
            output["aux_loss"] = load_balancing_loss(output.router_logits, *self._router_sizes(), layout.multiplicity)
        return output

    def _router_sizes(self) -> tuple[int, int]:
        """(experts, experts per token) of a mixture-of-experts model's config."""
        config = self.model.config
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        return int(experts), int(config.num_experts_per_tok)

    def _fused_packed(self, sequences, packed_seq_lens, num_actions, index, prompt_groups, media, return_output,
                      return_entropy):
        """`_forward_packed` with the fused head: the decoder's hidden states at `index.predict_positions`
        (of the shared row when the prompts are shared), through `lightrft.algorithms.fused_head`."""
        hidden = None
        if self.share_prompts and prompt_groups is not None:
            hidden = self.prompt_sharing.forward(
                sequences, packed_seq_lens, num_actions, prompt_groups,
                lambda shared, layout: self._replay_shared(layout) or self.lm_head.hidden_states(shared)[
                    0, layout.predict_positions])
        if hidden is None:
            self._replay_unshared()
            kwargs = self.family.packed_inputs(self.model, sequences, packed_seq_lens, media)
            hidden = self.lm_head.hidden_states(kwargs)[0, index.predict_positions]  # (K, H)
        labels = sequences[0, index.token_positions]  # (K,)
        return self._fused_result(hidden, labels, index.to_rows, return_output, return_entropy)

    def _forward_split(self, sequences, packed_seq_lens, num_actions, index, return_output, return_entropy,
                       router: bool = False, media=None):
        """The packed forward with the row split over the sequence-parallel group: this rank's
        slice runs through the model (`SequenceParallel.split_row`), and the log-probs (and
        entropies) of the row's action tokens are gathered from the ranks that predict them.
        `output.logits` then hold this rank's action-predicting positions only. With `router`
        (a mixture-of-experts model asked for its load-balancing loss) `output["aux_loss"]` is the
        whole row's, from router statistics summed over the group (`RowShard.load_balancing_loss`).
        A vision-language model's `media` enter the whole row on every rank before it is cut."""
        shard = self.sequence_parallel.split_row(
            self.model, lambda ids, lens: self.family.packed_inputs(self.model, ids, lens, media), sequences,
            packed_seq_lens, num_actions)
        if self._replaying:
            # This rank's slice of the row's routes; the filler the split appends routes live.
            routes = self._row_routes
            local = shard.local["position_ids"].size(-1)
            filler = shard.start + local - routes.size(0)
            if filler > 0:
                routes = torch.cat([routes, routes.new_full((filler, *routes.shape[1:]), NO_ROUTE)])
            self.routing.replay(routes[shard.start:shard.start + local])
        positions = shard.local_positions(index.predict_positions)
        extra = {"output_router_logits": True} if router else {}
        output = self.model(**shard.local, **extra, logits_to_keep=positions)   # logits (1, K_r, V)
        if router:
            output["aux_loss"] = shard.load_balancing_loss(output.router_logits, *self._router_sizes())
        output.logits = self._without_banned(output.logits)
        labels = sequences[0, positions + shard.start + 1]  # (K_r,)
        log_probs = index.to_rows(shard.gather(log_probs_from_logits(output.logits[0], labels, self.temperature)))
        if return_output and return_entropy:
            output["entropy"] = index.to_rows(shard.gather(entropy_from_logits(output.logits[0], self.temperature)))
        return (log_probs, output) if return_output else log_probs

    @property
    def _replaying(self) -> bool:
        """Whether this forward replays routes."""
        return self.routing is not None and self.routing.row_routes is not None

    @property
    def _row_routes(self) -> torch.Tensor:
        """The routes `forward` was given, one token after another. Shape: (P, L, K)"""
        return self.routing.row_routes

    def _replay_shared(self, layout) -> None:
        """Routes laid out like the shared row of `layout` (each token's from its place in the
        packed row: a shared prompt's from its group's first sample) for the forward that follows."""
        if self._replaying:
            self.routing.replay(self._row_routes[layout.source], keep_row=True)

    def _replay_unshared(self) -> None:
        """The packed row's own routes again, for a forward over the unshared row (the shared one may
        have been tried and given up on)."""
        if self._replaying:
            self.routing.replay(self._row_routes, keep_row=True)

    def gradient_checkpointing_enable(self) -> None:
        enable_gradient_checkpointing(self.model)

    def adapter_disabled(self) -> nn.Module:
        """This LoRA actor with its adapter switched off, as a reference policy with the actor's
        call signature (`lightrft.models.reference.AdapterDisabledReference`): the KL reference of
        a LoRA run without a second copy of the base weights."""
        return AdapterDisabledReference(self)

    def merged_model(self) -> PreTrainedModel:
        """The plain Hugging Face causal LM to export: without LoRA the model itself; with LoRA a
        copy with the adapters merged into the base weights (W + alpha/r * B A), which loads with
        `AutoModelForCausalLM` anywhere. The copy costs one extra set of weights in memory; with
        ZeRO-3 call it inside a parameter-gathering context. `DeepspeedStrategy.save_model`
        exports `.model` itself (gathering and merging), so the wrapper needs no save method."""
        if self.lora_rank == 0:
            return self.model
        return copy.deepcopy(self.model).merge_and_unload()


def vision_module_pattern(prefixes: tuple[str, ...]) -> str:
    """A peft `exclude_modules` regular expression for the modules under `prefixes`."""
    return r"^(" + "|".join(re.escape(prefix) for prefix in prefixes) + r")(\..*)?$"
