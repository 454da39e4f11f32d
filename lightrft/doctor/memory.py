"""Memory check: one PPO step of the user's configuration at the longest prompts and responses it
allows, with the peak memory of each phase (generate, forwards, train, weight sync) and the flags
to change when the peak does not fit.

Peaks: on CUDA the caching allocator's peak reserved bytes (what the device must hold, fragmentation
included), reset before each phase; on CPU the process's resident-set high-water mark (Linux
`VmHWM`), reset by writing "5" to `/proc/self/clear_refs`. The ranks of one CPU machine share its
RAM, so on CPU the peaks of all ranks are added; on GPUs each rank has its device and the largest
peak counts."""

import os
import resource

import torch

from lightrft.config.run import PPORunConfig
from lightrft.doctor.report import CheckResult
from lightrft.rollout import engine_capabilities
from lightrft.rollout.base import SamplingParams
from lightrft.experience.placement import arrive
from lightrft.rewards.batch import RewardBatch

GIB = 2.0**30
PHASES = ("generate", "forwards", "train", "weight sync")
HEADROOM = 0.9            # a peak above 90% of the budget is a warning: allocator growth and other processes


class MemoryProbe:
    """Peak memory of one phase of this process (see the module docstring)."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()
        self.resettable = self.cuda or reset_peak_rss()

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.resettable = reset_peak_rss()

    def peak_gib(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_reserved() / GIB
        hwm = _proc_status_kib("VmHWM")
        if hwm is None:  # not Linux: the peak since the process started (ru_maxrss is KiB on Linux, bytes on macOS)
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (GIB if os.uname().sysname == "Darwin" else 2**20)
        return hwm / 2**20


def reset_peak_rss() -> bool:
    """Resets this process's peak resident set (VmHWM) to its current size, where Linux allows it
    (`/proc/self/clear_refs`); False where it cannot, when the peak is the process's whole life's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _proc_status_kib(key: str, path: str = "/proc/self/status") -> float | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def memory_budget_gib(strategy, budget_gb: float | None) -> tuple[float, str]:
    """What the peak must fit in: `budget_gb` (--doctor_memory_budget_gb), else the GPU's memory,
    else the RAM this machine has available now plus what the ranks already hold."""
    if budget_gb is not None:
        return budget_gb, "--doctor_memory_budget_gb"
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(strategy.device).total_memory / GIB, "GPU memory"
    held = strategy.all_reduce(torch.tensor([(_proc_status_kib("VmRSS") or 0.0) / 2**20]), op="sum").item()
    available = (_proc_status_kib("MemAvailable", "/proc/meminfo") or 0.0) / 2**20
    return available + held, "available RAM"


def synthetic_prompts(tokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of exactly `length` token ids drawn from the non-special vocabulary."""
    special = set(tokenizer.all_special_ids)
    vocab = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    generator = torch.Generator().manual_seed(seed)
    return vocab[torch.randint(len(vocab), (count, length), generator=generator)].tolist()


def run_step_at_max_lengths(run, probe: MemoryProbe) -> dict:
    """One full PPO step of this rank's share of a rollout batch at --prompt_max_len prompt tokens
    and --generate_max_len response tokens (end-of-sequence banned until then). The optimizer step
    is real: the doctor's run is thrown away. Returns the per-phase peaks (GiB) and the lengths."""
    config, trainer, strategy = run.args, run.trainer, run.strategy
    sampling, seed, micro = config.rollout, config.distributed.seed, config.rollout.micro_rollout_batch_size
    services = trainer.experience_services
    prompts = synthetic_prompts(run.tokenizer, sampling.rollout_batch_size // strategy.world_size,
                                config.data.prompt_max_len, seed + strategy.rank)
    length = sampling.generate_max_len
    params = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                            max_new_tokens=length, min_new_tokens=length, n=config.algorithm.n_samples_per_prompt,
                            seed=seed + strategy.rank)
    peaks = {}
    probe.reset()
    for model in (trainer.actor, trainer.critic, trainer.initial_model, *services.scorer.reward_models):
        if model is not None:
            model.eval()
    rollout = arrive(trainer.rollout.generate(prompts, params))
    peaks["generate"] = probe.peak_gib()

    probe.reset()
    with torch.no_grad():
        for model in services.scorer.reward_models:   # scored for their memory; the scores are not used
            for i in range(0, rollout.sequences.size(0), micro):
                rows = slice(i, i + micro)
                model(rollout.sequences[rows].to(strategy.device),
                      attention_mask=rollout.attention_mask[rows].to(strategy.device))
    scores = torch.randn(rollout.sequences.size(0), generator=torch.Generator().manual_seed(seed))
    rewards = RewardBatch(scores=scores, valid=torch.ones_like(scores, dtype=torch.bool))
    experiences = services.builder.experience_from_rollout(rollout, rewards, params.n)
    trainer.rollout.sleep()
    peaks["forwards"] = probe.peak_gib()

    probe.reset()
    # The step training runs; a probe, so the run's step count and KL coefficient stay as they were.
    step, kl_state = trainer.global_step, trainer.kl_ctl.state_dict()
    trainer.step(experiences, check_engine=False)   # lengths forced by min_new_tokens: not the policy's samples
    trainer.global_step = step
    trainer.kl_ctl.load_state_dict(kl_state)
    peaks["train"] = probe.peak_gib()

    probe.reset()
    trainer.rollout.sync_weights()
    peaks["weight sync"] = probe.peak_gib()
    return {"peaks": peaks, "prompt_tokens": rollout.prompt_len,
            "response_tokens_min": int(rollout.response_lengths.min()),
            "response_tokens_max": int(rollout.response_lengths.max()), "samples": rollout.sequences.size(0)}


def recommendations(phase: str, config: PPORunConfig) -> list[str]:
    """Flags that lower the peak of `phase`, given the current settings."""
    rollout, distributed = config.rollout, config.distributed
    flags = []
    if phase == "generate":
        # The engine's own memory levers: its KV cache (vLLM), or the samples decoded at once (HF).
        options = engine_capabilities(rollout.rollout_engine).memory_options
        flags.append(" or ".join(f"--{name} (now {getattr(rollout, name)})" for name in options))
        flags.append(f"--generate_max_len (now {rollout.generate_max_len})")
    elif phase == "forwards":
        flags.append(f"--micro_rollout_batch_size (now {rollout.micro_rollout_batch_size})")
        if not distributed.ref_reward_offload and (config.algorithm.init_kl_coef > 0 or config.model.reward_pretrain):
            flags.append("--ref_reward_offload")
    elif phase == "train":
        flags.append(f"--micro_train_batch_size (now {config.optim.micro_train_batch_size})")
        if not distributed.gradient_checkpointing:
            flags.append("--gradient_checkpointing")
        if not config.model.packing_samples:
            flags.append("--packing_samples")
        if not distributed.adam_offload:
            flags.append("--adam_offload")
        flags.append(f"--sequence_parallel_size (now {distributed.sequence_parallel_size}; ranks sharing each packed "
                     "row, each holding 1/N of its activations)")
    elif phase == "weight sync":
        flags.append(f"--vllm_sync_bucket_mb (now {rollout.vllm_sync_bucket_mb})")
    if phase in ("forwards", "train") and distributed.zero_stage < 3:
        flags.append(f"--zero_stage 3 (now {distributed.zero_stage})")
    if phase in ("forwards", "train") and distributed.zero_stage == 3 and not distributed.zero3_param_offload:
        flags.append("--zero3_param_offload")
    return flags


def check_memory(run, budget_gb: float | None = None, probe: MemoryProbe | None = None) -> CheckResult:
    config, strategy = run.args, run.strategy
    prompt_max_len, generate_max_len = config.data.prompt_max_len, config.rollout.generate_max_len
    split = config.distributed.sequence_parallel_size
    result = CheckResult("memory", f"one step at {prompt_max_len} prompt + {generate_max_len} response "
                                   "tokens, peak memory per phase"
                                   + (f", training rows split over {split} ranks" if split > 1 else ""))
    probe = probe or MemoryProbe()
    budget, budget_source = memory_budget_gib(strategy, budget_gb)
    step = run_step_at_max_lengths(run, probe)
    local = torch.tensor([step["peaks"][p] for p in PHASES], dtype=torch.float64)
    # CPU ranks share the machine's RAM (add them); GPU ranks each have a device (take the largest).
    peaks = strategy.all_reduce(local, op="max" if probe.cuda else "sum").tolist()
    result.figures.update(step, peaks_all_ranks=dict(zip(PHASES, peaks)), budget_gib=budget,
                          sequence_parallel_size=split,
                          budget_source=budget_source, resettable=probe.resettable)
    what = "peak reserved per rank" if probe.cuda else "peak RSS, all ranks"
    result.rows.append(("phase", f"{what} (GiB)", "share of budget"))
    for phase, peak in zip(PHASES, peaks):
        result.rows.append((phase, f"{peak:.2f}", f"{peak / budget:.0%}"))
    result.rows.append(("budget", f"{budget:.2f}", budget_source))
    if not probe.resettable:
        result.add("WARN", "this platform cannot reset the memory high-water mark: each phase shows the peak so far")
    if (step["response_tokens_min"], step["prompt_tokens"]) != (generate_max_len, prompt_max_len):
        result.add("FAIL", f"the engine did not produce full-length samples: responses of {step['response_tokens_min']}"
                           f"-{step['response_tokens_max']} tokens for --generate_max_len {generate_max_len}")
    for phase, peak in zip(PHASES, peaks):
        if peak > HEADROOM * budget:
            level = "FAIL" if peak > budget else "WARN"
            verb = "does not fit" if peak > budget else f"is over {HEADROOM:.0%} of"
            result.add(level, f"{phase}: peak {peak:.2f} GiB {verb} the {budget:.2f} GiB {budget_source}; lower it "
                              f"with: {', '.join(recommendations(phase, config))}")
    if not result.findings:
        result.add("PASS", f"the largest peak ({max(peaks):.2f} GiB, {PHASES[peaks.index(max(peaks))]}) fits the "
                           f"{budget:.2f} GiB {budget_source}")
    return result
