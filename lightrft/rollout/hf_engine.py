"""Rollouts with the live Hugging Face model: works on any device, under any ZeRO stage.

The engine decodes with the model object it was given (the actor's `.model`), so it always
samples from the current policy and needs no weight transfer. The decoding loop is written here
rather than delegated to `model.generate` so that every sample draws from its own seeded stream
(`sample_seed(request_seed, j)`, one uniform per step, inverse-CDF sampling) and the log-probs of
the sampled tokens are computed one step at a time, without keeping (A, B, V) logits around.
Because each sample owns its stream, the result does not depend on `micro_batch_size` or on
which other prompts share a call.

Work a rollout does not need is left out, without changing what it computes (tests hold it equal
to the plain loop): the n samples of a prompt share one prompt forward (its KV cache and
next-token logits are copied to every sample), outputs and the attention mask are preallocated
and written column by column, and the sample streams come from one reseeded generator.

With `kv_cache="static"` the KV cache is a transformers `StaticCache` allocated once per chunk at
its final length, so every decoding step has the same shapes; `compile_decode` then runs the
one-token step through `torch.compile` (CUDA graphs on CUDA). The tokens and log-probs are the
dynamic cache's, to float32 rounding (tests/rollout/test_hf_static_cache.py).
"""

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from lightrft.utils.routing import NO_ROUTE, recorder_of
from lightrft.rollout.base import (EngineCapabilities, RolloutOutput, SamplingParams, request_seeds_for,
                                   switch_weights, validate_prompts)
from lightrft.rollout.registry import register_engine
from lightrft.rollout.sampling import sample_next_tokens
from lightrft.rollout.seeds import sample_seed
from lightrft.utils.distributed import get_world_size
from lightrft.utils.hf_api import (base_model, cache_argument, forward_parameters, recurrent_cache_layer,
                                   returned_cache)

# On CUDA, decoding reads "has every row ended?" back from the device once per this many steps.
STOP_CHECK_STEPS = 8
# KV caches the engine decodes with (`--hf_kv_cache`).
KV_CACHES = ("dynamic", "static")
# A static cache's length is rounded up to a multiple of this many tokens, so that chunks whose
# prompts differ a little in length share one compiled decoding step (fewer recompilations and
# CUDA-graph captures); the extra slots are masked out.
STATIC_CACHE_MULTIPLE = 64


class HFEngine:
    """Batched sampling with a live Hugging Face causal LM.

    Args:
        model: a Hugging Face causal LM (or a PEFT wrapper of one) taking `input_ids`,
            `attention_mask`, `position_ids`, `use_cache` and its KV cache as `cache` or, in
            transformers releases before that name, `past_key_values` (see `cache_argument`).
        pad_token_id: token written after a response ends.
        eos_token_id: one id or a list of ids that end a response (any of them stops it).
        synced_gpus: keep every rank running forward passes until all ranks have finished. Needed
            under DeepSpeed ZeRO-3 with more than one rank: each forward gathers parameter shards
            from all ranks, so a rank that stopped early would leave the others waiting forever.
        micro_batch_size: samples (prompts x n) decoded at once; `generate` takes any number of
            prompts and decodes them in chunks of this many samples. None decodes all at once.
        stop_check_steps: read "has every row ended?" back from the device once per this many
            decoding steps (a host sync each time). None: every STOP_CHECK_STEPS steps on CUDA, so
            the host queues steps ahead of the device, and every step on the CPU. The output is the
            same for any value; a larger one decodes up to that many steps of padding at the end.
        family: the model's `lightrft.models.families.ModelFamily` (None: a plain causal LM). It
            maps the positions below to the model's (`decoding_positions`, e.g. RoBERTa's count
            from pad_token_id + 1), turns the media of prompts into the prefill's arguments
            (`merge_media`, `encode_media`: a vision-language model's images) and names the tokens
            never to sample (`banned_token_ids`: image placeholders).

    Position ids follow the left padding: `cumsum(attention_mask) - 1`, as the actor computes
    them for its teacher-forced forward, so the rollout log-probs and the actor's agree; each new
    token takes the next position.

    A mixture-of-experts model with routing replay set to record rollouts (`lightrft.utils.routing.
    RoutingReplay(record_rollouts=True)`, which `--routing_replay rollout` installs) gets the experts
    each token went through recorded: `RolloutOutput.routes`, from the prefill for the prompt and
    from each decoding step for the token it fed.

    Partial rollouts (docs/async.md): with `weight_switch` set, a callable that loads newer weights
    into `model` when some have arrived and returns their version (None when nothing changed), the
    engine asks it before each decoding step. After a switch it recomputes the KV cache of every
    sequence so far (prompt and response) under the new weights and decodes on, so each token's
    log-prob is its own version's; `RolloutOutput.versions` tags each token with the version that
    sampled it (`version`, the weights' version before any switch). The sampling streams are the
    per-sample ones either way.
    """

    # It decodes with the module it was given, the trainer's own: no weights to push after a step,
    # nothing to free while the trainer runs, and a LoRA actor is served as it trains.
    capabilities = EngineCapabilities(weight_syncs=frozenset({"live"}), lora=True, multimodal=True,
                                      memory_options=("micro_rollout_batch_size",), routes=True, weight_switch=True)

    def __init__(self, model: torch.nn.Module, pad_token_id: int, eos_token_id: int | Sequence[int],
                 synced_gpus: bool = False, micro_batch_size: int | None = None, stop_check_steps: int | None = None,
                 family=None, kv_cache: str = "dynamic", compile_decode: bool = False):
        if eos_token_id is None:
            raise ValueError("HFEngine needs an eos_token_id: set tokenizer.eos_token_id or pass it explicitly")
        if pad_token_id is None:
            raise ValueError("HFEngine needs a pad_token_id: set tokenizer.pad_token_id (often to the EOS id)")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"HFEngine micro_batch_size must be >= 1 (--micro_rollout_batch_size), got {micro_batch_size}")
        if stop_check_steps is not None and stop_check_steps < 1:
            raise ValueError(f"HFEngine stop_check_steps must be >= 1, got {stop_check_steps}")
        check_cache_options(model, kv_cache, compile_decode)
        self.kv_cache = kv_cache
        self.stop_check_steps = stop_check_steps
        self.family = family
        self.positions = None if family is None else family.decoding_positions(model)
        banned = () if family is None else family.banned_token_ids(model.config)
        self._banned = torch.tensor(sorted(banned), dtype=torch.long)
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]
        self.synced_gpus = synced_gpus
        self.micro_batch_size = micro_batch_size
        parameters = forward_parameters(model)
        # Asking for the last position's logits only keeps the prefill from building (B, T, V) logits.
        self._keep_last_logits = "logits_to_keep" in parameters
        self._cache_name = cache_argument(parameters)
        # A recurrent (linear-attention) cache layer cannot copy its rows between samples: those
        # models prefill every sample's prompt (dynamic cache only; the static one refuses them).
        self._shares_prefill = not recurrent_cache_layers(model)
        # The one-token decoding step: the model itself, or its compiled forward (compiled lazily, at the first call).
        self._step = compiled_step(model) if compile_decode else model
        self.weight_switch = None        # partial rollouts: () -> the version of newer weights it loaded, or None
        self.version = 0                 # the version of the weights decoding with (partial rollouts)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None, media: list[dict | None] | None = None,
                 images: list | None = None) -> RolloutOutput:
        """Samples `params.n` responses for each prompt; sample j of prompt i draws from
        `sample_seed(seeds[i], j)`. `media`: per prompt, its images (and the like) as its model
        family takes them, or None; the prompt's placeholder tokens are in its ids (`images`, the
        raw images for engines that expand placeholders themselves, is not needed here). See
        `RolloutOutput` for the layout."""
        validate_prompts(prompt_token_ids)
        request_seeds = request_seeds_for(prompt_token_ids, params, seeds)
        if media is not None and (len(media) != len(prompt_token_ids) or (self.family is None and any(media))):
            raise ValueError(f"HFEngine.generate: {len(media)} media entries for {len(prompt_token_ids)} prompts"
                             if len(media) != len(prompt_token_ids) else
                             "HFEngine.generate got media for a model built without its family (hf_engine_for(..., "
                             "family=family_of(model)))")
        prompts = [list(p) for p in prompt_token_ids for _ in range(params.n)]  # B = prompts x n
        rows_media = [m for m in media or [None] * len(prompt_token_ids) for _ in range(params.n)]
        sample_seeds = [sample_seed(s, j) for s in request_seeds for j in range(params.n)]
        chunk = self.micro_batch_size or len(prompts)
        starts = list(range(0, len(prompts), chunk))
        # Under synced_gpus every rank must run the same number of decoding loops.
        rounds = self._max_over_ranks(len(starts))
        parts = []
        for k in range(rounds):
            if k < len(starts):
                rows = slice(starts[k], starts[k] + chunk)
                parts.append(self._generate_chunk(prompts[rows], sample_seeds[rows], params, rows_media[rows]))
            else:  # a rank with fewer chunks keeps the others company with a throwaway row
                self._generate_chunk(prompts[:1], sample_seeds[:1], params, rows_media[:1])
        return RolloutOutput.concat(parts, self.pad_token_id)

    def _generate_chunk(self, prompts: list[list[int]], sample_seeds: list[int], params: SamplingParams,
                        media: list[dict | None]) -> RolloutOutput:
        device = self.device
        uniforms = None if params.greedy else self._uniforms(sample_seeds, params.max_new_tokens).to(device)
        input_ids, prompt_mask = left_pad(prompts, self.pad_token_id)
        input_ids, prompt_mask = input_ids.to(device), prompt_mask.to(device)

        was_training = self.model.training
        self.model.eval()
        routing = recorder_of(self.model)
        rows = distinct_rows(prompts, media)
        try:
            if routing is not None:
                routing.start_recording()
            with torch.no_grad():
                tokens, log_probs, action_mask, unfinished, versions = self._decode(
                    input_ids, prompt_mask, rows, params, uniforms, media)
            routes = None if routing is None else self._routes(routing.take(), rows[1], prompt_mask, action_mask)
        finally:
            self.model.train(was_training)
            if routing is not None:
                routing.stop_recording()

        # Trim the columns no response of this rank reaches (synced ranks may decode further).
        num_actions = int(action_mask.sum(dim=-1).max().item())
        tokens, log_probs = tokens[:, :num_actions], log_probs[:, :num_actions]
        action_mask = action_mask[:, :num_actions]
        if versions is not None:
            versions = versions[:, :num_actions].cpu()
        return RolloutOutput(
            sequences=torch.cat([input_ids, tokens], dim=1),
            attention_mask=torch.cat([prompt_mask, action_mask.long()], dim=1),
            action_mask=action_mask,
            rollout_log_probs=log_probs,
            prompt_len=input_ids.shape[1],
            truncated=unfinished.cpu(),
            routes=None if routes is None else routes[:, :input_ids.shape[1] + num_actions].cpu(),
            versions=versions,
        )

    @staticmethod
    def _routes(recorded: list[torch.Tensor], expand: torch.Tensor, prompt_mask: torch.Tensor,
                action_mask: torch.Tensor) -> torch.Tensor:
        """The recorded expert choices laid out per token of the sequences: the prefill's (one per
        distinct prompt, `expand` to every sample) on the prompt's real tokens, decoding step s's
        on the token it fed (response token s - 1); -1 elsewhere (padding, the last token, which no
        forward saw). `recorded`: the prefill's (U*Tp, L, K), then one (B, L, K) per decoding step.
        Shape: (B, Tp + S, L, K), S the steps decoded."""
        batch, prompt_len = prompt_mask.shape
        prefill, steps = recorded[0], recorded[1:]
        layers, top_k = prefill.shape[1:]
        routes = prefill.new_full((batch, prompt_len + action_mask.size(1), layers, top_k), NO_ROUTE)
        prompt = prefill.view(-1, prompt_len, layers, top_k)[expand.to(prefill.device)]       # (B, Tp, L, K)
        routes[:, :prompt_len] = torch.where(prompt_mask.bool()[..., None, None], prompt, NO_ROUTE)
        for step, chosen in enumerate(steps, start=1):      # step s fed response token s - 1
            fed = action_mask[:, step - 1]
            routes[:, prompt_len + step - 1] = torch.where(fed[:, None, None], chosen, NO_ROUTE)
        return routes

    @staticmethod
    def _uniforms(sample_seeds: list[int], steps: int) -> torch.Tensor:
        """One stream per sample, one uniform per decoding step, drawn on the CPU so the draws are
        the same on every device; one generator reseeded per sample (as many fresh generators
        would draw the same numbers, at a higher cost). Shape: (B, steps) float64."""
        uniforms = torch.empty((len(sample_seeds), steps), dtype=torch.float64)
        generator = torch.Generator()
        for row, seed in enumerate(sample_seeds):
            torch.rand(steps, generator=generator.manual_seed(seed), dtype=torch.float64, out=uniforms[row])
        return uniforms

    def _decode(self, input_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor],
                params: SamplingParams, uniforms: torch.Tensor | None,
                media: list[dict | None]) -> tuple[torch.Tensor, ...]:
        """The cached decoding loop. `rows` is `distinct_rows(prompts)`: the prefill runs on the
        distinct prompts only and its KV cache and last logits are then copied to every sample.
        Returns tokens (B, S) long, log-probs (B, S) float32, the action mask (B, S) bool, where S
        is the number of steps decoded, (B,) bool: rows that never produced an EOS token (cut at
        the length limit), and with a `weight_switch` the (B, S) int32 version of each token (-1 on
        padding), else None."""
        batch, prompt_len = input_ids.shape
        device = input_ids.device
        steps = params.max_new_tokens
        eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=device)
        never = self._banned.to(device)            # (K,) placeholder ids: banned at every step
        early = torch.cat([eos, never])            # before min_new_tokens, EOS too
        position_ids = (prompt_mask.cumsum(dim=-1) - 1).clamp(min=0)  # (B, Tp)
        first, expand = rows
        # The distinct prompts' media, joined once for their positions and their prefill.
        merged = None if self.family is None else self.family.merge_media([media[row] for row in first.tolist()])
        if self.positions is not None:
            # The model's own, e.g. (4, B, Tp) multimodal rotary rows, computed for the distinct
            # prompts and copied to their samples; each row continues by one per step.
            first_d, expand_d = first.to(device), expand.to(device)
            position_ids = self.positions(input_ids[first_d], position_ids[first_d], merged)[..., expand_d, :]
        # Written in place, one column per step, and read as a prefix: no concatenation per step. A
        # static cache is read whole (its slots past the last token are masked out), so its steps keep
        # one shape: the mask is as long as the cache.
        static = self.kv_cache == "static"
        cache_len = static_cache_length(prompt_len + steps) if static else prompt_len + steps
        attention_mask = torch.zeros((batch, cache_len), dtype=prompt_mask.dtype, device=device)
        attention_mask[:, :prompt_len] = prompt_mask
        tokens = torch.full((batch, steps), self.pad_token_id, dtype=torch.long, device=device)
        log_probs = torch.zeros((batch, steps), dtype=torch.float32, device=device)
        is_action = torch.zeros((batch, steps), dtype=torch.bool, device=device)
        unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        extra = {"logits_to_keep": 1} if self._keep_last_logits else {}
        # Whether every row has ended is read back from the device (a host sync) every few steps on
        # CUDA, so the host queues the next steps while the device runs; the steps decoded past the
        # last EOS are padding, which the caller trims. On the CPU each step checks (no queue).
        check_every = self.stop_check_steps or (STOP_CHECK_STEPS if device.type == "cuda" else 1)

        versions = None
        if self.weight_switch is not None:
            switch_weights(self)
            versions = torch.full((batch, steps), -1, dtype=torch.int32, device=device)
        logits, cache = self._prefill(input_ids, prompt_mask, position_ids, rows, extra, merged,
                                      cache_len if static else None)
        decoded = 0
        for step in range(steps):
            if step > 0 and self.weight_switch is not None and switch_weights(self):
                # New weights: the cache and the next logits are recomputed from the whole sequences
                # (a static cache is emptied and refilled in place, keeping its tensors).
                positions = torch.cat([position_ids, position_ids[..., -1:] + torch.arange(
                    1, step + 1, device=device)], dim=-1)
                if static:
                    cache.reset()
                out = self.model(input_ids=torch.cat([input_ids, tokens[:, :step]], dim=1),
                                 attention_mask=attention_mask[:, :prompt_len + step], position_ids=positions,
                                 use_cache=True, **({self._cache_name: cache} if static else {}), **extra)
                logits, cache = out.logits[:, -1, :], returned_cache(out, self._cache_name)
            elif step > 0:
                out = self._step(input_ids=tokens[:, step - 1:step],
                                 attention_mask=attention_mask if static else attention_mask[:, :prompt_len + step],
                                 position_ids=position_ids[..., -1:] + step, use_cache=True,
                                 **{self._cache_name: cache}, **extra)
                logits, cache = out.logits[:, -1, :], returned_cache(out, self._cache_name)
            banned = early if step < params.min_new_tokens else never
            next_tokens, next_log_probs = sample_next_tokens(
                logits, params.temperature, params.top_k, params.top_p,
                None if uniforms is None else uniforms[:, step], banned)
            # Rows that already ended get padding: action mask 0 and log-prob 0.
            tokens[:, step] = torch.where(unfinished, next_tokens, self.pad_token_id)
            log_probs[:, step] = torch.where(unfinished, next_log_probs, 0.0)
            is_action[:, step] = unfinished
            if versions is not None:
                versions[:, step] = torch.where(unfinished, self.version, -1)
            attention_mask[:, prompt_len + step] = unfinished
            unfinished &= ~torch.isin(tokens[:, step], eos)
            decoded = step + 1
            if decoded == steps or (decoded % check_every == 0 and not self._any_rank_unfinished(unfinished)):
                break
        return (tokens[:, :decoded], log_probs[:, :decoded], is_action[:, :decoded], unfinished,
                None if versions is None else versions[:, :decoded])

    def _prefill(self, input_ids: torch.Tensor, prompt_mask: torch.Tensor, position_ids: torch.Tensor,
                 rows: tuple[torch.Tensor, torch.Tensor], extra: dict, merged: dict | None,
                 static_len: int | None) -> tuple[torch.Tensor, object]:
        """The prompt forward, once per distinct prompt: the n samples of a prompt share its KV
        cache and next-token logits, so a group of G samples costs one prompt forward instead of
        G. The prompts' media (images) enter here, through the model family; the decoding steps
        after it see tokens only (`merged`: the distinct prompts' media joined, or None).
        `static_len`: the slots of a static cache to prefill into (None: the model's dynamic
        cache). Returns the last position's logits (B, V) and the cache, both expanded to all B
        rows."""
        first, expand = rows  # (U,), (B,)
        dedupe = self._shares_prefill and first.numel() < input_ids.shape[0]
        if dedupe:
            first = first.to(input_ids.device)
            input_ids, prompt_mask, position_ids = input_ids[first], prompt_mask[first], position_ids[..., first, :]
        inputs = {"input_ids": input_ids}
        if self.family is not None:
            # Media, or a model that takes them running its vision tower on a blank (every rank
            # runs the same modules: ZeRO-3), may replace the ids by embeddings.
            inputs = self.family.with_media(self.model, inputs, input_ids, merged)
        if static_len is not None:
            inputs[self._cache_name] = new_static_cache(self.model, static_len)
        out = self.model(**inputs, attention_mask=prompt_mask, position_ids=position_ids, use_cache=True, **extra)
        logits, cache = out.logits[:, -1, :], returned_cache(out, self._cache_name)
        if dedupe:
            expand = expand.to(logits.device)
            if static_len is not None:
                expand_static_cache(cache, expand)
            elif hasattr(cache, "batch_select_indices"):
                cache.batch_select_indices(expand)  # (U, ...) -> (B, ...) on every layer
            else:
                raise TypeError(f"HFEngine needs a transformers Cache with batch_select_indices, got {type(cache)}")
            logits = logits[expand]  # (U, V) -> (B, V)
        return logits, cache

    def _any_rank_unfinished(self, unfinished: torch.Tensor) -> bool:
        """Whether decoding must go on: on this rank, or on any rank when `synced_gpus` is set."""
        return self._max_over_ranks(int(unfinished.any())) > 0

    def _max_over_ranks(self, value: int) -> int:
        """`value` on this rank, or its maximum over ranks when `synced_gpus` is set."""
        if not (self.synced_gpus and get_world_size() > 1):
            return value
        flag = torch.tensor(value, dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def update_weights(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to do: the engine decodes with the live module, which already holds the
        trainer's latest weights."""

    def sleep(self) -> None:
        """Nothing to free: the engine owns no memory besides the live module."""

    def wake_up(self) -> None:
        """Nothing to restore (see `sleep`)."""


def hf_engine_for(model: torch.nn.Module, tokenizer, eos_token_ids: Sequence[int] | None = None,
                  micro_batch_size: int | None = None, synced_gpus: bool = False, family=None,
                  kv_cache: str = "dynamic", compile_decode: bool = False) -> HFEngine:
    """The one place lightrft builds an `HFEngine`: over `model` (shared live, never synced),
    padding with the tokenizer's pad id and stopping at any of `eos_token_ids` (default: the
    tokenizer's end of sequence).

    `micro_batch_size` counts samples, prompts x n, decoded at once (None: every call at once);
    a caller whose batch counts prompts multiplies by its samples per prompt. It bounds memory
    only: the samples do not depend on it. `synced_gpus` keeps ranks decoding in step under ZeRO-3
    with several ranks, where every forward gathers parameters. `family`: the model's family
    (`lightrft.models.families.family_of(model)`, which callers above the models pass).
    `kv_cache` ("dynamic" or "static", `--hf_kv_cache`) and `compile_decode`
    (`--hf_compile_decode`): see `HFEngine`."""
    return HFEngine(model, pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=list(eos_token_ids or [tokenizer.eos_token_id]), synced_gpus=synced_gpus,
                    micro_batch_size=micro_batch_size, family=family, kv_cache=kv_cache,
                    compile_decode=compile_decode)


def check_cache_options(model: torch.nn.Module, kv_cache: str, compile_decode: bool) -> None:
    """Refuses a KV cache or compiled decoding `model` cannot decode with, naming the flag and
    the fix."""
    if kv_cache not in KV_CACHES:
        raise ValueError(f"HFEngine kv_cache (--hf_kv_cache) must be one of {', '.join(KV_CACHES)}, got {kv_cache!r}")
    if compile_decode and kv_cache != "static":
        raise ValueError("--hf_compile_decode compiles the decoding step over a static KV cache (fixed shapes); "
                         "add --hf_kv_cache static or drop --hf_compile_decode")
    if kv_cache == "static":
        from transformers.cache_utils import StaticLayer

        name = type(base_model(model)).__name__
        try:
            layers = new_static_cache(model, 1).layers
        except (KeyError, ValueError, TypeError, AttributeError) as err:
            raise ValueError(f"--hf_kv_cache static: transformers builds no StaticCache for {name} "
                             f"({type(err).__name__}: {err}); use --hf_kv_cache dynamic") from None
        # A recurrent (linear-attention) layer keeps a state per row rather than a slot per token.
        recurrent = sorted({type(layer).__name__ for layer in layers
                            if not isinstance(layer, StaticLayer) or recurrent_cache_layer(layer)})
        if recurrent:
            raise ValueError(f"--hf_kv_cache static: {name} has recurrent cache layers ({', '.join(recurrent)}), "
                             "which the engine's shared-prompt prefill cannot copy between rows; lightrft's Hugging "
                             "Face engine decodes attention-only models (use --rollout_engine vllm)")
    if compile_decode and recorder_of(model) is not None:
        raise ValueError("--hf_compile_decode cannot record routed experts (--routing_replay rollout): the recording "
                         "hooks append to a Python list at every step, which a compiled step does not run; drop "
                         "--hf_compile_decode or use --routing_replay old")


def recurrent_cache_layers(model: torch.nn.Module) -> list[str]:
    """The names of the recurrent (linear-attention) cache layers transformers' dynamic cache
    builds for `model`, which keep a state per row rather than a slot per token; [] for an
    attention-only model, or when transformers builds no cache from its config (such models
    build their own at the first forward)."""
    from transformers import DynamicCache  # transformers loads with the first engine, not with lightrft.rollout

    try:
        layers = DynamicCache(config=base_model(model).config).layers
    except (KeyError, ValueError, TypeError, AttributeError):
        return []
    return sorted({type(layer).__name__ for layer in layers if recurrent_cache_layer(layer)})


def static_cache_length(tokens: int) -> int:
    """Slots of a static cache for `tokens` prompt and response tokens: rounded up to a multiple
    of STATIC_CACHE_MULTIPLE."""
    return -(-tokens // STATIC_CACHE_MULTIPLE) * STATIC_CACHE_MULTIPLE


def new_static_cache(model: torch.nn.Module, length: int):
    """An empty transformers `StaticCache` of `length` slots for `model`'s layers (full, sliding
    window); its tensors are allocated at the first forward, with that forward's rows."""
    from transformers import StaticCache  # transformers loads with the first static cache, not with lightrft.rollout

    return StaticCache(config=base_model(model).config, max_cache_len=length)


def expand_static_cache(cache, expand: torch.Tensor) -> None:
    """Gathers a prefilled static cache's rows to every sample, in place: row b becomes row
    `expand[b]` on every layer (`reorder_cache`, transformers' row gather for beam search; the
    write position is shared by all rows). The gathered key and value tensors are marked as
    static addresses, as a freshly allocated static cache's are, so a compiled step may capture
    them in a CUDA graph. Shape: (U, H, L, D) -> (B, H, L, D) per layer, `expand` (B,)."""
    cache.reorder_cache(expand)
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is not None:
                torch._dynamo.mark_static_address(tensor)


def compiled_step(model: torch.nn.Module):
    """`model`'s forward under `torch.compile`: CUDA graphs (`mode="reduce-overhead"`) when the
    model is on CUDA, inductor's default elsewhere. Compiled at the first call, again for each new
    shape (a chunk of another size or cache length)."""
    on_cuda = next(model.parameters()).device.type == "cuda"
    return torch.compile(model, mode="reduce-overhead" if on_cuda else None)


def left_pad(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded to the longest: token ids and the 0/1 mask of real tokens.
    Shape: B prompts -> (B, Tp) long, (B, Tp) long."""
    lengths = torch.tensor([len(p) for p in prompts])
    prompt_len = int(lengths.max())
    mask = torch.arange(prompt_len) >= (prompt_len - lengths).unsqueeze(1)  # (B, Tp), True on real tokens
    input_ids = torch.full((len(prompts), prompt_len), pad_token_id, dtype=torch.long)
    input_ids[mask] = torch.tensor([t for p in prompts for t in p], dtype=torch.long)  # row-major = prompt order
    return input_ids, mask.long()


def distinct_rows(prompts: list[list[int]], media: list[dict | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first row of every run of equal consecutive prompts (equal ids and the same media
    object: the samples of one prompt), and for each row the index of its run: `first[expand]`
    maps every row to a row with the same prompt. Shape: (U,), (B,) long."""
    media = media or [None] * len(prompts)
    starts = [row for row in range(len(prompts))
              if row == 0 or prompts[row] != prompts[row - 1] or media[row] is not media[row - 1]]
    expand = torch.zeros(len(prompts), dtype=torch.long)
    expand[starts[1:]] = 1
    return torch.tensor(starts, dtype=torch.long), expand.cumsum(dim=0)


register_engine("hf", HFEngine, HFEngine.capabilities)
