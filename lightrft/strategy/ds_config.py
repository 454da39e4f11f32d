"""DeepSpeed configuration dictionaries, built by pure functions.

Nothing here imports deepspeed: the functions take numbers and flags and return the dict that
`deepspeed.initialize(config=...)` reads, so they are unit-tested without a process group.

Batch sizes follow the OpenRLHF convention: `train_batch_size` counts samples per optimizer step
over all ranks, `micro_train_batch_size` counts samples per rank per forward, and the gradient
accumulation steps are derived: GAS = train_batch_size / (micro_train_batch_size * world_size).
"""

ZERO_STAGES = (0, 1, 2, 3)
GRAD_ACCUM_DTYPES = ("fp32", "bf16", "fp16")

# Printing is the trainer's job; DeepSpeed's own per-step log line is switched off.
_NO_STEP_PRINT = 2**31 - 1


def check_zero_stage(zero_stage: int) -> int:
    """Returns `zero_stage` if DeepSpeed has it, else raises ValueError naming the flag."""
    if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES:
        raise ValueError(f"--zero_stage {zero_stage!r} is not a ZeRO stage; valid values are 0, 1, 2, 3")
    return zero_stage


def gradient_accumulation_steps(train_batch_size: int, micro_train_batch_size: int, world_size: int) -> int:
    """GAS = train_batch_size / (micro_train_batch_size * world_size), which must be a whole number >= 1.

    Raises ValueError naming `--train_batch_size`, `--micro_train_batch_size` and the world size
    when the division is not exact."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if micro_train_batch_size < 1 or train_batch_size < 1:
        raise ValueError(f"--train_batch_size ({train_batch_size}) and --micro_train_batch_size "
                         f"({micro_train_batch_size}) must both be >= 1")
    per_step = micro_train_batch_size * world_size
    if train_batch_size % per_step:
        raise ValueError(
            f"--train_batch_size {train_batch_size} is not divisible by --micro_train_batch_size "
            f"{micro_train_batch_size} x world size {world_size} = {per_step}; choose a --train_batch_size "
            f"that is a multiple of {per_step} (for example {max(per_step, train_batch_size // per_step * per_step)})")
    return train_batch_size // per_step


def _zero_section(zero_stage: int, *, offload_optimizer: bool, offload_param: bool, overlap_comm: str = "auto",
                  reduce_bucket_size: int | None = None, prefetch_bucket_size: int | None = None,
                  max_live_parameters: int | None = None, param_persistence_threshold: int | None = None) -> dict:
    section = {"stage": zero_stage}
    if overlap_comm != "auto" and zero_stage > 0:
        section["overlap_comm"] = overlap_comm == "on"
    if reduce_bucket_size is not None and zero_stage > 0:
        section["reduce_bucket_size"] = int(reduce_bucket_size)
    if zero_stage == 3:
        for key, value in (("stage3_prefetch_bucket_size", prefetch_bucket_size),
                           ("stage3_max_live_parameters", max_live_parameters),
                           ("stage3_param_persistence_threshold", param_persistence_threshold)):
            if value is not None:
                section[key] = int(value)
    if offload_optimizer:
        section["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_param:
        section["offload_param"] = {"device": "cpu", "pin_memory": True}
    if zero_stage == 3:
        # HF export gathers parameters itself (DeepspeedStrategy.save_model), so DeepSpeed need not
        # keep a consolidated 16-bit copy at save time.
        section["stage3_gather_16bit_weights_on_model_save"] = False
    return section


def get_train_ds_config(
    *,
    zero_stage: int,
    train_batch_size: int,
    micro_train_batch_size: int,
    world_size: int,
    bf16: bool = False,
    max_norm: float = 1.0,
    adam_offload: bool = False,
    zero3_param_offload: bool = False,
    grad_accum_dtype: str | None = None,
    overlap_comm: str = "auto",
    zero_reduce_bucket_size: int | None = None,
    zero3_prefetch_bucket_size: int | None = None,
    zero3_max_live_parameters: int | None = None,
    zero3_param_persistence_threshold: int | None = None,
) -> dict:
    """The DeepSpeed config for a trained model (actor, critic).

    - `zero_stage` 0-3 (ValueError naming `--zero_stage` otherwise);
    - `bf16` enables bf16 mixed precision (fp32 master weights in the optimizer), else fp32;
    - `adam_offload` keeps optimizer states on the CPU (ZeRO-Offload, needs stage >= 1 and
      DeepSpeedCPUAdam, which `DeepspeedStrategy.create_optimizer` picks);
    - `zero3_param_offload` keeps parameters on the CPU between uses (stage 3 only);
    - `max_norm` clips the global gradient norm (0 disables clipping);
    - `grad_accum_dtype` ("fp32", "bf16", "fp16") sets the dtype gradients accumulate in;
    - `overlap_comm` ("auto": DeepSpeed's default, "on", "off") and the bucket sizes in elements
      (None: DeepSpeed's defaults) tune how ZeRO overlaps its communication with computation
      (`--overlap_comm`, `--zero_reduce_bucket_size`, `--zero3_*`); they change when data moves,
      never what is computed.
    """
    check_zero_stage(zero_stage)
    gas = gradient_accumulation_steps(train_batch_size, micro_train_batch_size, world_size)
    if adam_offload and zero_stage == 0:
        raise ValueError("--adam_offload needs ZeRO: use --zero_stage 1, 2 or 3 (optimizer offload is part of ZeRO)")
    if zero3_param_offload and zero_stage != 3:
        raise ValueError(f"--zero3_param_offload needs --zero_stage 3 (got --zero_stage {zero_stage}); "
                         f"parameters are only partitioned, and so offloadable, in stage 3")
    if max_norm < 0:
        raise ValueError(f"--max_norm must be >= 0 (0 disables clipping), got {max_norm}")
    config = {
        "train_batch_size": train_batch_size,
        "train_micro_batch_size_per_gpu": micro_train_batch_size,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": float(max_norm),
        "zero_optimization": _zero_section(zero_stage, offload_optimizer=adam_offload,
                                           offload_param=zero3_param_offload, overlap_comm=overlap_comm,
                                           reduce_bucket_size=zero_reduce_bucket_size,
                                           prefetch_bucket_size=zero3_prefetch_bucket_size,
                                           max_live_parameters=zero3_max_live_parameters,
                                           param_persistence_threshold=zero3_param_persistence_threshold),
        "bf16": {"enabled": bool(bf16)},
        "fp16": {"enabled": False},
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "steps_per_print": _NO_STEP_PRINT,
        # Our optimizers are torch AdamW or DeepSpeedCPUAdam; ZeRO treats torch's as "untested".
        "zero_allow_untested_optimizer": True,
    }
    if grad_accum_dtype is not None:
        if grad_accum_dtype not in GRAD_ACCUM_DTYPES:
            raise ValueError(f"--grad_accum_dtype {grad_accum_dtype!r} is not one of {', '.join(GRAD_ACCUM_DTYPES)}")
        config["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
    return config


def get_eval_ds_config(
    *,
    zero_stage: int,
    micro_batch_size: int,
    world_size: int,
    bf16: bool = False,
    offload: bool = False,
) -> dict:
    """The DeepSpeed config for a frozen model (reference, reward model, EMA copy).

    A frozen model has no optimizer or gradients, so ZeRO stages 1 and 2 (which shard those) bring
    nothing: it is sharded with stage 3 when training uses stage 3, else kept whole (stage 0).
    `offload=True` keeps its parameters on the CPU between uses, which needs stage 3, so it selects
    stage 3 with parameter offload whatever the training stage is.
    """
    check_zero_stage(zero_stage)
    if micro_batch_size < 1 or world_size < 1:
        raise ValueError(f"micro batch size ({micro_batch_size}) and world size ({world_size}) must be >= 1")
    stage = 3 if zero_stage == 3 or offload else 0
    return {
        "train_batch_size": micro_batch_size * world_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": _zero_section(stage, offload_optimizer=False, offload_param=offload),
        "bf16": {"enabled": bool(bf16)},
        "fp16": {"enabled": False},
        "wall_clock_breakdown": False,
        "steps_per_print": _NO_STEP_PRINT,
    }
