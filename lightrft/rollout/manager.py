"""The one owner of a rollout engine's lifecycle: wake, sync weights when stale, generate, sleep.

Experience making and evaluation both generate through a `RolloutManager`, so neither can sample
from a sleeping engine or from weights older than the trainer's. The trainer tells the manager
when its weights changed (`mark_stale`, after each optimizer phase) and when it needs the memory
back (`sleep`, before the training passes); the manager does the rest on the next `generate`:

    wake_up -> update_weights(bucket) for each bucket, if stale -> generate

Every rank must call `generate` (and so the sync) at the same points: under ZeRO-3 each bucket is a
collective gather. The stale flag changes only through these calls, so ranks stay in step.

Tensor parallel engines (`capabilities.tensor_parallel`, `engine.tensor_parallel_size` T > 1): T
consecutive ranks share one engine replica, and its ranks must generate together with identical
requests. The manager gathers the prompts and seeds of the replica's ranks, every rank generates
their union, and each keeps the rows of its own prompts. The trainer above is unchanged: a rank
gets back exactly the samples of the prompts it passed (as it would with T = 1, same seeds), so
each sample trains on one rank only.

LoRA actors: only the adapter travels (`VLLMEngine.load_adapter`, a new adapter id per sync); the
base weights of the engine are the pretrained ones, which LoRA training leaves untouched.

Delta sync (`weight_sync="delta"`, `--weight_sync delta`): the manager keeps a host copy of the
weights it last sent, in the engine's dtype (`lightrft.rollout.delta.SentWeights`), and sends only
the decoder layers (and other modules) in which some bit changed; vLLM reloads whole layers, so a
changed layer goes whole. A training step changes some element of nearly every layer, so this
saves bytes only where layers do not train (frozen layers, a skipped step); the default, `auto`,
syncs a colocated engine fully and keeps no copy. The first sync, the first after a failed one,
and the first after a sleep that drops the engine's weights are full. The manager must be the only
one that syncs the engine: weights loaded behind its back need `forget_sent_weights()`.

What the manager does with an engine follows its `EngineCapabilities`, never its type or name:
whether to sync it and how, whether to put it to sleep, whether to shut it down.
"""

import json
import time
from dataclasses import replace
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightrft.rollout.base import (EngineCapabilities, RolloutEngine, RolloutOutput, SamplingParams,
                                   request_seeds_for, validate_prompts)
from lightrft.rollout.delta import SentWeights
from lightrft.utils.distributed import get_rank, get_world_size

WEIGHT_SYNC_MODES = ("auto", "delta", "full")
WeightBuckets = Callable[[], Iterable[list[tuple[str, torch.Tensor]]]]


def replica_ranks(rank: int, world_size: int, tensor_parallel_size: int) -> list[int]:
    """The ranks of `rank`'s engine replica: blocks of `tensor_parallel_size` consecutive ranks, as
    vLLM groups them (world 4, T 2: [0, 1] and [2, 3])."""
    if tensor_parallel_size < 1 or world_size % tensor_parallel_size != 0:
        raise ValueError(f"--vllm_tensor_parallel_size {tensor_parallel_size} must be >= 1 and divide the number "
                         f"of ranks ({world_size}): each engine replica spans that many consecutive ranks")
    first = rank // tensor_parallel_size * tensor_parallel_size
    return list(range(first, first + tensor_parallel_size))


def engine_capabilities_of(engine: RolloutEngine) -> EngineCapabilities:
    """`engine.capabilities`, or a TypeError naming what an engine written without them must add."""
    capabilities = getattr(engine, "capabilities", None)
    if not isinstance(capabilities, EngineCapabilities):
        raise TypeError(f"{type(engine).__name__} declares no capabilities: give the class "
                        "`capabilities = EngineCapabilities(...)` (lightrft.rollout.base), which tells the trainer how "
                        "to drive it (weight syncs, sleep, tensor parallelism, ...)")
    return capabilities


class ReplicaGroup:
    """The ranks that share one tensor-parallel engine replica: blocks of `tensor_parallel_size`
    consecutive ranks, as vLLM groups them (world 4, T 2: [0, 1] and [2, 3]). Building one is
    collective (every rank creates every block's process group, in the same order). The group
    uses gloo: it carries a few lists of token ids per rollout, host-side."""

    def __init__(self, tensor_parallel_size: int):
        world_size, rank = get_world_size(), get_rank()
        self.ranks = replica_ranks(rank, world_size, tensor_parallel_size)
        self.index = rank - self.ranks[0]  # this rank's place in its replica
        self.group = None
        for start in range(0, world_size, tensor_parallel_size):
            group = dist.new_group(list(range(start, start + tensor_parallel_size)), backend="gloo")
            if start == self.ranks[0]:
                self.group = group

    def gather(self, value) -> list:
        """`value` from every rank of the replica, in rank order."""
        values = [None] * len(self.ranks)
        dist.all_gather_object(values, value, group=self.group)
        return values


class WeightStream:
    """The actor's weights, bucket by bucket, for whatever holds a copy of them: the rollout
    engine (`RolloutManager.for_actor`) and the explorer ranks' publisher alike. Each bucket is a
    list of `(Hugging Face name, tensor)` of whole decoder layers, about `bucket_mb` MB
    (`DeepspeedStrategy.iter_parameter_buckets`; under ZeRO-3 each is a gather every rank joins).

    - `buckets()`: the module's own names under `prefix` (what the explorers load);
    - `checkpoint_buckets()`: the names of the model's checkpoint files (what vLLM loads);
    - `adapter_buckets()`: a LoRA actor's adapter only, under peft's file names."""

    def __init__(self, strategy, actor, bucket_mb: float, prefix: str = "model."):
        self.strategy, self.actor, self.bucket_mb, self.prefix = strategy, actor, bucket_mb, prefix

    def buckets(self, include=None) -> Iterable[list[tuple[str, torch.Tensor]]]:
        kwargs = {"include": include} if include is not None else {}
        return self.strategy.iter_parameter_buckets(self.actor, self.bucket_mb, prefix=self.prefix, **kwargs)

    def checkpoint_buckets(self) -> Iterable[list[tuple[str, torch.Tensor]]]:
        module = self.strategy.unwrap_model(self.actor)
        hf_model = getattr(module, "model", module)
        for bucket in self.buckets():
            yield checkpoint_format(hf_model, bucket)

    def _adapter(self):
        peft_model = self.strategy.unwrap_model(self.actor).model
        return peft_model, peft_model.active_adapter

    def adapter_buckets(self) -> Iterable[list[tuple[str, torch.Tensor]]]:
        adapter = self._adapter()[1]
        # peft's saved names drop the adapter's name: `...q_proj.lora_A.default.weight` -> `...q_proj.lora_A.weight`.
        for bucket in self.buckets(include=_is_lora_name):
            yield [(name.replace(f".{adapter}.", "."), tensor) for name, tensor in bucket]

    def adapter_config(self):
        peft_model, adapter = self._adapter()
        return peft_model.peft_config[adapter]

    def adapter_spec(self) -> Optional[dict]:
        """A LoRA actor's adapter as plain data for a copy elsewhere (an explorer's engine):
        {"name": the adapter's name in the module's parameter names, "config": its peft config
        as JSON (`adapter_from_spec` reads it back)}; None for an actor without LoRA."""
        if getattr(self.strategy.unwrap_model(self.actor), "lora_rank", 0) == 0:
            return None
        peft_model, adapter = self._adapter()
        config = peft_model.peft_config[adapter].to_dict()
        return {"name": adapter,
                "config": json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v))}


class RolloutManager:
    """Wraps a `RolloutEngine` and keeps its weights in step with the trainer.

    Args:
        engine: the rollout engine; its `capabilities` say how it is driven. One that shares live
            weights (`HFEngine`) decodes with the trainer's module and is never synced.
        weight_buckets: called once per sync; returns the actor's weights as an iterable of
            buckets, each a list of `(Hugging Face name, tensor)` holding whole decoder layers
            (`DeepspeedStrategy.iter_parameter_buckets`). Required unless the engine shares live
            weights.
        adapter_config: the actor's peft `LoraConfig` when only a LoRA adapter is synced: the
            buckets then hold the adapter's tensors under peft's file names and go to
            `engine.load_adapter` (`for_actor` sets this up for a LoRA actor).
        weight_sync: "delta" sends only the layers that changed since the last sync (a host copy
            of the synced weights in the engine's dtype, `engine.weight_dtype`, decides; see the
            module doc); "full" sends every layer every time and keeps no copy; "auto" (the
            default) is "full" here: a training step changes some element of every layer, so a
            colocated engine saves nothing for the copy's memory (delta pays off when layers are
            frozen). An adapter is always sent whole.

    A separate engine starts stale: it was built from the pretrained folder, while the actor may
    hold different weights (a resumed checkpoint), so the first `generate` syncs.
    """

    def __init__(self, engine: RolloutEngine, weight_buckets: WeightBuckets | None = None, adapter_config=None,
                 weight_sync: str = "auto"):
        self.engine = engine
        self.capabilities = capabilities = engine_capabilities_of(engine)
        self.shares_live_weights = capabilities.shares_live_weights
        if weight_buckets is None and not self.shares_live_weights:
            raise ValueError(f"{type(engine).__name__} holds its own copy of the weights: RolloutManager needs "
                             "weight_buckets to sync it (RolloutManager.for_actor builds them from the strategy)")
        if weight_sync not in WEIGHT_SYNC_MODES:
            raise ValueError(f"--weight_sync {weight_sync!r}: choose one of {', '.join(WEIGHT_SYNC_MODES)}")
        self.weight_buckets = weight_buckets
        self.adapter_config = adapter_config
        # What the engine holds, for delta syncs of full weights (an adapter is small and goes whole).
        kind = ("live" if self.shares_live_weights else "adapter" if adapter_config is not None
                else "delta" if weight_sync == "delta" else "full")
        if kind not in capabilities.weight_syncs:
            raise ValueError(f"{type(engine).__name__} takes weight syncs {sorted(capabilities.weight_syncs)}, not "
                             f"{kind!r}" + (": pass --weight_sync full" if kind == "delta" else ""))
        self.sent = SentWeights(engine.weight_dtype) if kind == "delta" else None
        tensor_parallel_size = engine.tensor_parallel_size if capabilities.tensor_parallel else 1
        self.replica = ReplicaGroup(tensor_parallel_size) if tensor_parallel_size > 1 else None
        self.stale = not self.shares_live_weights
        self.asleep = False
        self.syncs = 0                 # weight syncs done so far
        self.last_sync_seconds = 0.0   # duration of the latest sync
        self.last_sync_bytes = 0       # bytes of weights moved by the latest sync
        self.last_sync_skipped = 0     # layers (fused groups) the latest sync left out as unchanged
        self._logged_syncs = 0         # syncs already reported by `sync_logs`

    @classmethod
    def for_actor(cls, engine: RolloutEngine, strategy, actor, prefix: str = "model.",
                  bucket_mb: float | None = None, stream: "WeightStream | None" = None) -> "RolloutManager":
        """A manager syncing `engine` from `actor` (an `ActorLanguage`, its Hugging Face model under
        `prefix`) through its `WeightStream` (`stream`, or one over `strategy` in buckets of
        `bucket_mb` MB, default the engine's `sync_bucket_mb`, `--vllm_sync_bucket_mb`). A LoRA
        actor syncs its adapter only, to an engine built for LoRA (`lora_rank`, where the engine
        takes "adapter" syncs). The sync mode is the engine's `weight_sync` (`--weight_sync`)."""
        capabilities = engine_capabilities_of(engine)
        if capabilities.shares_live_weights:
            return cls(engine)
        if stream is None:
            stream = WeightStream(strategy, actor, bucket_mb if bucket_mb is not None else engine.sync_bucket_mb,
                                  prefix)
        module = strategy.unwrap_model(actor)
        actor_rank = getattr(module, "lora_rank", 0)
        engine_rank = engine.lora_rank if "adapter" in capabilities.weight_syncs else 0
        if actor_rank > 0 and not capabilities.lora:
            raise ValueError(f"the actor has --lora_rank {actor_rank} but {type(engine).__name__} cannot serve a LoRA "
                             "adapter: train all weights (--lora_rank 0) or pick an engine that serves LoRA")
        if (actor_rank > 0) != (engine_rank > 0):
            raise ValueError(f"the actor has --lora_rank {actor_rank} but the rollout engine was built with lora_rank "
                             f"{engine_rank}: build the engine with the actor's --lora_rank")
        if actor_rank == 0:
            return cls(engine, stream.checkpoint_buckets, weight_sync=engine.weight_sync)
        return cls(engine, stream.adapter_buckets, adapter_config=stream.adapter_config())

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None, media: list | None = None,
                 images: list | None = None) -> RolloutOutput:
        """Wakes the engine, brings its weights up to date if they are stale, and generates
        (`RolloutEngine.generate`: one call for the whole rollout, one seed per prompt). `media`
        and `images`: per prompt, its images as tensors and as `PromptImages` (or None), for an
        engine that declares `multimodal`."""
        if media is not None and not self.capabilities.multimodal:
            raise ValueError(f"{type(self.engine).__name__} takes token ids only, and these prompts carry images: "
                             "pick a rollout engine that takes images (--rollout_engine hf)")
        if media is not None and self.replica is not None:
            raise ValueError("a tensor-parallel replica cannot generate for prompts with images yet: "
                             "pass --vllm_tensor_parallel_size 1")
        self.wake_up()
        if self.stale:
            self.sync_weights()
        if self.replica is None:
            if media is None:
                return self.engine.generate(prompt_token_ids, params, seeds=seeds)
            return self.engine.generate(prompt_token_ids, params, seeds=seeds, media=media, images=images)
        return self._generate_in_replica(prompt_token_ids, params, seeds)

    def _generate_in_replica(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                             seeds: list[int] | None) -> RolloutOutput:
        """Generates the union of the replica's requests on every rank of it and returns this
        rank's rows. Bad input is reported on every rank of the replica (none is left waiting)."""
        problem = None
        try:
            validate_prompts(prompt_token_ids)
            seeds = request_seeds_for(prompt_token_ids, params, seeds)
        except ValueError as err:
            problem = str(err)
        params = replace(params, seed=None)  # resolved into per-request seeds above
        parts = self.replica.gather(([list(p) for p in prompt_token_ids], seeds, params, problem))
        for index, (_, _, other_params, other_problem) in enumerate(parts):
            rank = self.replica.ranks[index]
            if other_problem is not None:
                raise ValueError(f"rank {rank}: {other_problem}")
            if other_params != params:
                raise ValueError(f"the ranks of a tensor-parallel vLLM replica must sample alike: rank {rank} asked "
                                 f"for {other_params}, rank {get_rank()} for {params}")
        union = [prompt for prompts, _, _, _ in parts for prompt in prompts]
        union_seeds = [seed for _, part_seeds, _, _ in parts for seed in part_seeds]
        out = self.engine.generate(union, params, seeds=union_seeds)
        start = sum(len(prompts) for prompts, _, _, _ in parts[:self.replica.index])  # prompts of earlier ranks
        return out.rows(start * params.n, (start + len(prompt_token_ids)) * params.n)

    def mark_stale(self) -> None:
        """The trainer changed the weights (an optimizer phase ended): sync before the next
        generate. Free for an engine that shares live weights."""
        if not self.shares_live_weights:
            self.stale = True

    def sleep(self) -> None:
        """Frees the engine's memory for the training passes (where the platform can)."""
        if not self.asleep:
            if self.capabilities.sleep:
                self.engine.sleep()
                if not self.capabilities.keeps_weights_asleep:
                    self.forget_sent_weights()  # the engine may wake with other weights: sync in full
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            if self.capabilities.sleep:
                self.engine.wake_up()
            self.asleep = False

    def shutdown(self) -> None:
        """Releases an engine that `needs_shutdown` (`VLLMEngine.shutdown`: every rank together,
        before the strategy closes); nothing for others (`HFEngine`). Safe to call twice."""
        if self.capabilities.needs_shutdown:
            self.engine.shutdown()

    def forget_sent_weights(self) -> None:
        """The next sync sends every layer (call it after loading weights into the engine other
        than through this manager)."""
        if self.sent is not None:
            self.sent.forget()

    def sync_weights(self) -> None:
        """Pushes the trainer's weights to the engine now, bucket by bucket (all ranks together);
        with delta sync only the layers that changed. Every rank takes the same decisions: they
        compare the same gathered tensors with the same record of the last sync."""
        if self.shares_live_weights:
            self.stale = False
            return
        self.wake_up()
        started, moved, skipped = time.perf_counter(), 0, 0
        if self.adapter_config is not None:
            # Each bucket's tensors are copied while it is gathered; the adapter is one load.
            pairs = (pair for bucket in self.weight_buckets() for pair in bucket)
            moved = self.engine.load_adapter(pairs, self.adapter_config)
        else:
            try:
                for bucket in self.weight_buckets():
                    if self.sent is not None:
                        bucket, unchanged = self.sent.changed_groups(bucket)
                        skipped += unchanged
                    if bucket:
                        self.engine.update_weights(bucket)
                        moved += sum(t.numel() * t.element_size() for _, t in bucket)
            except BaseException:
                self.forget_sent_weights()  # what reached the engine is unknown
                raise
        self.last_sync_seconds = time.perf_counter() - started
        self.last_sync_bytes, self.last_sync_skipped = moved, skipped
        self.syncs += 1
        self.stale = False

    def sync_logs(self) -> dict[str, float]:
        """`sync/bytes`, `sync/seconds` and `sync/skipped_layers` of the latest weight sync, once
        per sync (empty when none happened since the last call)."""
        if self.syncs == self._logged_syncs:
            return {}
        self._logged_syncs = self.syncs
        return {"sync/bytes": float(self.last_sync_bytes), "sync/seconds": self.last_sync_seconds,
                "sync/skipped_layers": float(self.last_sync_skipped)}


def checkpoint_format(hf_model, bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """`bucket`'s tensors under the names and layout of the model's saved checkpoint, which is what
    rollout engines load. transformers 5 keeps some weights fused in memory that checkpoints store
    apart: a mixture-of-experts layer holds its experts as one `mlp.experts.gate_up_proj` tensor,
    saved as `mlp.experts.{e}.gate_proj.weight` / `up_proj.weight` per expert (Mixtral:
    `w1` / `w3`). Sent as they are, vLLM loaded them into the wrong places without a word (log-probs
    off by 1.3 nats after syncing unchanged weights). transformers' own save-time conversion
    (`revert_weight_conversion`) does the renaming; a bucket holds whole layers, which is all it
    needs. Models without conversions pass through unchanged."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:      # transformers 4 keeps checkpoint names in memory
        return bucket
    return list(revert_weight_conversion(hf_model, dict(bucket)).items())


def adapter_from_spec(spec: dict, named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list, Any]:
    """(the adapter's tensors under peft's file names, its peft `LoraConfig`) from the module's
    named weights and a `WeightStream.adapter_spec`: what `load_adapter` of an engine takes."""
    from peft import LoraConfig

    infix = f".{spec['name']}."
    tensors = [(name.replace(infix, "."), tensor) for name, tensor in named if _is_lora_name(name)]
    return tensors, LoraConfig.from_peft_type(**json.loads(spec["config"]))


def _is_lora_name(name: str) -> bool:
    """A LoRA adapter's parameter (peft names them `...lora_A.<adapter>.weight`, `lora_B`, and
    `lora_embedding_A`/`_B` for embeddings)."""
    return ".lora_" in name
