"""Sequence parallelism (Ulysses): N ranks share the forward and backward of one packed row.

Each rank of a sequence-parallel group holds the same packed row and computes the hidden states of
its contiguous slice of it (1/N of the tokens), so activations per rank shrink N-fold. Everything
but attention is per token; attention is DeepSpeed's Ulysses exchange
(`deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF`): an all-to-all turns
"my tokens, all heads" into "all tokens, my heads" (H/N query heads, H_kv/N key/value heads),
lightrft's varlen attention (`attention.varlen_attention`) runs over the whole row for those heads,
with the row's sequence borders, sliding windows and soft-caps, and a second all-to-all brings the
output back to "my tokens, all heads".

The row's log-probs (and entropies, values) are computed by each rank for the action tokens its
slice predicts and gathered over the group (`gather_shards`), so every rank holds those of the
whole row and computes the same loss. The gather's backward keeps the rank's own part of the
gradient: each rank's weight gradients are its slice's share, and their sum over the group (the
data-parallel reduction adds them up) is the gradient of the unsplit row.

Only the training forwards of a packed row are split (`SequenceParallel.split_row`): the rollout
engines generate whole sequences, and a padded batch (the rollout-time forwards) runs unsplit.

A vision-language model's row is split after its images enter it: every rank of the group runs
the vision tower over all the row's images (the same modules on every rank, as ZeRO-3 needs) and
builds the whole row's embeddings, then keeps its slice of them (or, for a family that hands the
decoder its image features, the features of the placeholders in its slice: `ModelFamily.
split_media_inputs`). Backward through the slice gives the vision tower this rank's share of its
gradient, which the group's reduction adds up as it does the decoder's. The tower's work is
repeated on each rank; its activations are the images', not the row's.

Requirements (`SequenceParallel.problem`): the model's attention is `VARLEN_ATTENTION`, its query
heads divide by N and its key/value heads divide by N or N by them (then each rank attends with a
copy of one key/value head, as DeepSpeed's exchange replicates it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightrft.models.attention import VARLEN_ATTENTION, VARLEN_SDPA_LEGACY, all_ones_mask, varlen_attention
from lightrft.models.families import family_of
from lightrft.models.packing import SPLIT_KEYWORD


class SequenceParallel:
    """A sequence-parallel group of this rank: `size` ranks, this one the `rank`-th.

    `group` is a `torch.distributed` process group (None with size 1, where nothing is split).
    Build one per run (`DeepspeedStrategy.sequence_parallel`) and give it to the models that train
    on packed rows (`ActorLanguage.sequence_parallel`, `Critic.sequence_parallel`)."""

    def __init__(self, group: Any, size: int, rank: int):
        self.group, self.size, self.rank = group, int(size), int(rank)
        self._attention: dict[int, Any] = {}

    def union(self, items: list) -> list:
        """The items of every rank of this group, in rank order (the same list on each of them):
        the group trains on its ranks' rollouts together. Tensors travel on the CPU."""
        gathered = [None] * self.size
        dist.all_gather_object(gathered, [item.to("cpu") if hasattr(item, "to") else item for item in items],
                               group=self.group)
        return [item for part in gathered for item in part]

    def problem(self, model: nn.Module) -> str | None:
        """Why `model` cannot run split over this group, or None."""
        config = getattr(model, "config", None)
        if config is None:
            return f"{type(model).__name__} has no Hugging Face config"
        implementation = getattr(config, "_attn_implementation", None)
        if implementation not in (VARLEN_ATTENTION, VARLEN_SDPA_LEGACY):
            return (f"its attention is {implementation!r}; sequence parallelism runs over lightrft's "
                    f"{VARLEN_ATTENTION!r} (flash attention's varlen kernel on CUDA, exact packing on the CPU): "
                    f"pass --attn_implementation {VARLEN_ATTENTION} or leave it unset without flash-attn")
        text = text_config(model)
        heads = getattr(text, "num_attention_heads", None)
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        if heads is None:
            return "its config names no num_attention_heads"
        if heads % self.size or (kv_heads % self.size and self.size % kv_heads):
            return (f"its {heads} query heads must divide by --sequence_parallel_size {self.size}, and its "
                    f"{kv_heads} key/value heads divide by it or it by them (each rank attends with 1/N of the "
                    "query heads)")
        return None

    def attention(self, model: nn.Module):
        """DeepSpeed's Ulysses exchange for `model`'s attention shapes, made once per model config."""
        key = id(model.config)
        if key not in self._attention:
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

            text = text_config(model)
            heads = text.num_attention_heads
            self._attention[key] = UlyssesSPAttentionHF(
                attn=varlen_attention, batch_size=1, attn_head_count=heads,
                attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // heads,
                kv_head_count=getattr(text, "num_key_value_heads", None) or heads,
                num_hidden_layers=text.num_hidden_layers, process_group=self.group, seq_length_is_variable=True)
        return self._attention[key]

    def split_row(self, model: nn.Module, build, input_ids: torch.Tensor, seq_lens: list[int],
                  num_actions: list[int]) -> "RowShard":
        """This rank's slice of a packed-row forward and where its action predictions fall.
        `build(ids, lens)` makes the forward keywords of a whole row (`ModelFamily.packed_inputs`,
        with the row's media for a vision-language model).

        The row is padded to a multiple of the group size with a filler sequence of its own (no
        action, attended by nothing else); input ids (or the embeddings that carry the images),
        position ids (each of their rows) and the padding mask are sliced, and what else carries
        the images is cut by the model's family (`ModelFamily.split_media_inputs`); the sequence
        lengths stay the whole row's, since the attention sees the whole row."""
        seq_lens = [int(n) for n in seq_lens]
        length = sum(seq_lens)
        filler = -length % self.size
        if filler:
            seq_lens = seq_lens + [filler]
            input_ids = torch.cat([input_ids, input_ids[:, -1:].expand(1, filler)], dim=1)
        step = (length + filler) // self.size
        start, stop = self.rank * step, (self.rank + 1) * step
        local = family_of(model).split_media_inputs(model, dict(build(input_ids, seq_lens)), input_ids, start, stop)
        if "inputs_embeds" in local:
            local["inputs_embeds"] = local["inputs_embeds"][:, start:stop]
        else:
            local["input_ids"] = input_ids[:, start:stop]
        positions = local["position_ids"] = local["position_ids"][..., start:stop]
        if "attention_mask" in local:
            local["attention_mask"] = all_ones_mask(input_ids[:, start:stop])
        # The exchange gathers the row's own count (a multimodal family's first row of positions).
        local[SPLIT_KEYWORD] = RowSplit(self.attention(model), positions[0] if positions.dim() == 3 else positions)
        # The action-predicting positions of each rank's slice, from the host-side lengths.
        counts, ends = [0] * self.size, 0
        for n, a in zip(seq_lens, list(num_actions) + [0] * (len(seq_lens) - len(num_actions))):
            ends += n
            for r in range(self.size):
                lo, hi = max(ends - a - 1, r * step), min(ends - 1, (r + 1) * step)
                counts[r] += max(0, hi - lo)
        return RowShard(local=local, start=start, counts=counts, offset=sum(counts[:self.rank]), group=self.group,
                        rank=self.rank, real=max(0, min(stop, length) - start))


@dataclass
class RowSplit:
    """What the attention of a split row needs besides its inputs: the Ulysses exchange and this
    rank's position ids (transformers does not pass every model's to the attention)."""

    ulysses: Any
    position_ids: torch.Tensor

    def attend(self, module, query, key, value, **kwargs):
        """The attention of the whole row for this rank's heads, back on this rank's tokens.
        Shape: query (1, H, P/N, D), key/value (1, H_kv, P/N, D) -> (1, P/N, H, D)"""
        kwargs.setdefault("position_ids", self.position_ids)
        return self.ulysses(module, query, key, value, None, **kwargs)


@dataclass
class RowShard:
    """One rank's part of a split packed row (`SequenceParallel.split_row`): `local` forward
    keywords; the row's action predictions from `offset` to `offset + counts[rank]` (in the order
    `packing.packed_action_index` lists them) fall in this rank's slice, which starts at `start`."""

    local: dict
    start: int
    counts: list[int]
    offset: int
    group: Any
    rank: int
    real: int = 0          # this slice's positions before the filler (the row's own tokens)

    def local_positions(self, predict_positions: torch.Tensor) -> torch.Tensor:
        """This slice's share of the row's action-predicting positions, relative to the slice. Shape: (K_r,)"""
        return predict_positions[self.offset:self.offset + self.counts[self.rank]] - self.start

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The row's values from every rank's part of them (`gather_shards`). Shape: (K_r, ...) -> (K, ...)"""
        return gather_shards(local, self.counts, self.rank, self.group)


    def load_balancing_loss(self, router_logits, num_experts: int, top_k: int) -> torch.Tensor:
        """The mixture-of-experts load-balancing loss of the whole row (Switch Transformer eq. 4 as
        transformers computes it over a packed row: E x sum_e f_e P_e, with f the fraction of the
        row's tokens routed to each expert, per top-k slot, and P the mean router probability,
        over every layer), from this rank's router logits (one (T_r, E) tensor per layer; the
        filler excluded). The routed counts and the token count are summed over the group, so f
        is the row's; P's sums are this rank's, so the returned value is the row's loss and its
        gradient this rank's part of the row's gradient (the parts add up over the group, as
        the split log-probs' do)."""
        logits = torch.cat([layer[:self.real] for layer in router_logits], dim=0)              # (L*T_r, E)
        probs = torch.softmax(logits, dim=-1)             # in the router's dtype, as transformers does
        chosen = torch.topk(probs, top_k, dim=-1).indices                                       # (L*T_r, k)
        routed = torch.nn.functional.one_hot(chosen, num_experts).float().sum(dim=0)            # (k, E)
        totals = torch.cat([routed.flatten(), torch.tensor([float(probs.size(0))], device=probs.device)]).detach()
        prob_sums = probs.float().sum(dim=0)                                                    # (E,)
        value = prob_sums.detach().clone()
        if self.group is not None:
            torch.distributed.all_reduce(totals, group=self.group)
            torch.distributed.all_reduce(value, group=self.group)
        tokens = totals[-1].clamp(min=1.0)
        fraction = totals[:-1].view(top_k, num_experts) / tokens                               # the row's f, (k, E)
        part = num_experts * (fraction * (prob_sums / tokens).unsqueeze(0)).sum()               # this rank's share
        whole = num_experts * (fraction * (value / tokens).unsqueeze(0)).sum()                  # the row's loss
        return part + (whole - part).detach()


class _GatherShards(torch.autograd.Function):
    """All-gather of unequal parts along dim 0; the backward returns this rank's part of the
    gradient, which is right when every rank computes the same function of the gathered tensor."""

    @staticmethod
    def forward(ctx, local, counts, rank, group):
        ctx.offset, ctx.count = sum(counts[:rank]), counts[rank]
        widest = max(counts)
        padded = local.new_zeros((widest, *local.shape[1:]))
        padded[:local.size(0)] = local
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([part[:count] for part, count in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.offset:ctx.offset + ctx.count], None, None, None


def gather_shards(local: torch.Tensor, counts: list[int], rank: int, group: Any) -> torch.Tensor:
    """`local` (this rank's `counts[rank]` rows) joined with the other ranks' parts, in rank order;
    differentiable (`_GatherShards`: each rank keeps the gradient of its own part)."""
    return _GatherShards.apply(local, list(counts), rank, group)


def text_config(model: nn.Module):
    """The config of `model`'s decoder: a vision-language model's text config, else its own."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def checked_group(group: SequenceParallel | None, model: nn.Module, flag: str) -> SequenceParallel | None:
    """`group` if `model` can run split over it, None for no group or a group of one; raises naming
    `flag` (the model's command-line flag) and the reason when it cannot."""
    if group is None or group.size == 1:
        return None
    reason = group.problem(model)
    if reason is not None:
        raise ValueError(f"--sequence_parallel_size {group.size}: {flag} cannot be split over ranks: {reason}")
    return group
