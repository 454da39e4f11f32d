"""Rollouts with vLLM running in the trainer's own process, on the trainer's GPU.

This is the only lightrft module that imports vLLM, and it does so when a `VLLMEngine` is built,
so the module imports without vLLM installed.

Layout: one vLLM engine per torchrun rank, tensor_parallel_size=1. With several ranks vLLM is told
`distributed_executor_backend="external_launcher"`: it then reuses the process group torchrun set
up and treats each rank as an independent data-parallel replica, and it runs its engine in this
process, so `update_weights` hands tensors to the model by reference (nothing written to disk, no
copies between processes). Weight loading goes through `LLM.collective_rpc`, which runs a
function on the worker that holds the model and calls the model's own `load_weights` with
Hugging Face parameter names. These parts (external-launcher replicas, `logprobs_mode`,
`collective_rpc` with a function) need vLLM 0.10 or newer.

The trainer's side of a step: `wake_up()`, `update_weights(...)` with the new actor weights
(gathered from ZeRO-3 shards a few at a time, so the whole model never sits in memory twice),
`generate(...)`, then `sleep()` before the training passes.
"""

import os
from collections.abc import Iterable, Sequence

import torch

from lightrft.rollout.base import RolloutOutput, SamplingParams, validate_prompts
from lightrft.utils.distributed import get_world_size

VLLM_INSTALL_HINT = "pip install lightrft[vllm]"


def _import_vllm():
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            f"the vllm rollout engine needs vLLM, which is not installed: {VLLM_INSTALL_HINT} "
            "(on a machine without a CUDA GPU use the Hugging Face engine, --rollout_engine hf)"
        ) from err
    return vllm


def _load_weights_on_worker(worker, named_params: list) -> None:
    """Runs inside the vLLM worker: loads Hugging Face-named tensors into the served model."""
    worker.model_runner.model.load_weights(weights=named_params)


class VLLMEngine:
    """A colocated vLLM engine.

    Args:
        model_path: Hugging Face folder (or hub name) of the actor's initial weights.
        pad_token_id, eos_token_id: as for `HFEngine`; EOS ends a response (kept in it).
        seed: vLLM's seed. Pass a different one per rank (for example `base_seed + rank`) so ranks
            draw different samples; `SamplingParams.seed` additionally seeds each request.
        gpu_memory_utilization: share of the GPU vLLM may take for weights and KV cache; the rest
            stays for the trainer's ZeRO shards.
        enable_sleep_mode: lets `sleep()` free the GPU memory while the trainer runs.
        llm_kwargs: passed to `vllm.LLM` (for example `max_model_len`, `dtype`, `enforce_eager`).

    Log-probs: vLLM is asked for `logprobs_mode="processed_logprobs"`, the log-softmax of the
    logits after temperature. With top-k/top-p off this is log softmax(logits / T), the same
    quantity `HFEngine` reports; with them on, vLLM reports values renormalised over the kept
    tokens (HFEngine does not renormalise).
    """

    def __init__(self, model_path: str, pad_token_id: int, eos_token_id: int | Sequence[int], *, seed: int = 0,
                 gpu_memory_utilization: float = 0.5, enable_sleep_mode: bool = True, **llm_kwargs):
        vllm = _import_vllm()
        self._vllm = vllm
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]
        world_size = get_world_size()
        options = dict(
            model=model_path,
            tensor_parallel_size=1,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=enable_sleep_mode,
            logprobs_mode="processed_logprobs",
        )
        if world_size > 1:
            options["distributed_executor_backend"] = "external_launcher"
        else:
            # Keep the engine core in this process so weights pass by reference (see module doc).
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        options.update(llm_kwargs)
        self.llm = vllm.LLM(**options)
        self._asleep = False

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> RolloutOutput:
        validate_prompts(prompt_token_ids)
        vllm_params = self._vllm.SamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_new_tokens,
            min_tokens=params.min_new_tokens,
            seed=params.seed,
            logprobs=0,  # the sampled token's log-prob only
            stop_token_ids=self.eos_token_ids,
            detokenize=False,
        )
        requests = [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        outputs = self.llm.generate(requests, vllm_params, use_tqdm=False)
        prompts, responses, log_probs = [], [], []
        for prompt, request_output in zip(prompt_token_ids, outputs):
            for completion in request_output.outputs:  # the n samples of this prompt, in order
                tokens = list(completion.token_ids)
                prompts.append(list(prompt))
                responses.append(tokens)
                log_probs.append([step[token].logprob for token, step in zip(tokens, completion.logprobs)])
        return RolloutOutput.from_token_lists(prompts, responses, log_probs, self.pad_token_id, self.eos_token_ids)

    def update_weights(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads `(name, tensor)` pairs named as in the Hugging Face model; may be called with a
        part of the model at a time. Prefix-cache entries computed with the old weights are
        dropped. Call `wake_up()` first: a sleeping engine has no GPU weights to load into."""
        if self._asleep:
            raise RuntimeError("VLLMEngine.update_weights() called while the engine sleeps: call wake_up() first")
        self.llm.collective_rpc(_load_weights_on_worker, args=(list(named_params),))
        self.llm.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Level 1 moves the weights to CPU memory and drops the KV cache; level 2 drops both
        (use it when `update_weights` will load every weight before the next `generate`)."""
        if not self._asleep:
            self.llm.sleep(level=level)
            self._asleep = True

    def wake_up(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
