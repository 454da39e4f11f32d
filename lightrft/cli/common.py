"""Argument groups shared by every lightrft command line (train_ppo, train_sft, train_rm).

Each `add_*_args` adds one titled group so `--help` reads by topic, and every flag is defined
once. The names follow OpenRLHF where a flag exists there, so recipes port unchanged.
"""

import argparse
import json
import os
import sys


def add_strategy_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("strategy", "distributed training and DeepSpeed")
    group.add_argument("--seed", type=int, default=42, help="random seed shared by all ranks")
    group.add_argument("--local_rank", type=int, default=-1, help="set by the launcher; leave it")
    group.add_argument("--zero_stage", type=int, default=2, help="DeepSpeed ZeRO stage: 0, 1, 2 or 3")
    group.add_argument("--bf16", action="store_true", help="train in bfloat16 (fp32 master weights)")
    group.add_argument("--adam_offload", action="store_true", help="keep Adam states on the CPU")
    group.add_argument("--zero3_param_offload", action="store_true",
                       help="with --zero_stage 3, keep parameters on the CPU between uses")
    group.add_argument("--ref_reward_offload", action="store_true",
                       help="keep the frozen reference and reward models' parameters on the CPU (ZeRO-3 offload)")
    group.add_argument("--grad_accum_dtype", type=str, default=None, choices=["fp32", "bf16", "fp16"],
                       help="dtype gradients are accumulated in (default: DeepSpeed's choice for the run dtype)")
    group.add_argument("--gradient_checkpointing", action="store_true",
                       help="recompute activations in the backward pass to save memory")
    group.add_argument("--max_norm", type=float, default=1.0, help="gradient clipping norm")
    group.add_argument("--micro_train_batch_size", type=int, default=4,
                       help="samples per rank per forward/backward")
    group.add_argument("--train_batch_size", type=int, default=128,
                       help="samples per optimizer step over all ranks; gradient accumulation is derived")
    group.add_argument("--dist_timeout", type=int, default=30, help="collective timeout in minutes")
    return group


def add_model_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("models", "model paths and adapters")
    group.add_argument("--pretrain", type=str, required=True,
                       help="Hugging Face folder of the model to train")
    group.add_argument("--attn_implementation", type=str, default=None,
                       help="attention kernel: flash_attention_2, sdpa, eager or flex_attention "
                            "(default: flash_attention_2 when installed on CUDA, else lightrft_varlen: exact packing, "
                            "sliding windows and soft-caps per layer)")
    group.add_argument("--trust_remote_code", action="store_true",
                       help="allow model code shipped inside the model folder to run")
    group.add_argument("--lora_rank", type=int, default=0, help="LoRA rank; 0 trains all weights")
    group.add_argument("--lora_alpha", type=int, default=16, help="LoRA scaling numerator")
    group.add_argument("--lora_dropout", type=float, default=0.0, help="LoRA dropout")
    group.add_argument("--target_modules", type=str, nargs="*", default=None,
                       help="module names that get LoRA adapters (default: all linear layers)")
    group.add_argument("--packing_samples", action="store_true",
                       help="pack variable-length samples into one row instead of padding")
    return group


def add_data_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("data", "datasets and their fields")
    group.add_argument("--input_key", type=str, default="input", help="field holding the prompt")
    group.add_argument("--apply_chat_template", action="store_true",
                       help="wrap inputs with the tokenizer's chat template")
    group.add_argument("--max_samples", type=int, default=None, help="use at most this many rows")
    group.add_argument("--on_bad_row", choices=["error", "skip"], default="error",
                       help="a row with a missing, empty or non-string field stops the run (error) "
                            "or is skipped and counted (skip)")
    return group


def add_logging_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("logging", "progress and metrics")
    group.add_argument("--logging_steps", type=int, default=1, help="log metrics every N steps")
    group.add_argument("--use_wandb", type=str, default=None,
                       help="log to Weights & Biases: an API key, or 'offline' / 'online' to use the "
                            "environment's login (offline needs no network)")
    group.add_argument("--wandb_project", type=str, default="lightrft", help="W&B project")
    group.add_argument("--wandb_org", type=str, default=None, help="W&B entity (team or user)")
    group.add_argument("--wandb_run_name", type=str, default=None, help="W&B run name (default: generated)")
    group.add_argument("--use_tensorboard", type=str, default=None,
                       help="write TensorBoard scalars under this folder")
    return group


def add_checkpoint_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("checkpoint", "saving, exporting and resuming")
    group.add_argument("--save_path", type=str, default="./ckpt/model",
                       help="folder for the final Hugging Face export")
    group.add_argument("--ckpt_path", type=str, default="./ckpt/checkpoints",
                       help="folder for resumable training checkpoints")
    group.add_argument("--save_steps", type=int, default=-1,
                       help="save a resumable checkpoint every N steps (-1: only at the end)")
    group.add_argument("--max_ckpt_num", type=int, default=3, help="keep at most N checkpoints")
    group.add_argument("--load_checkpoint", nargs="?", const="required", default=None,
                       choices=["required", "if_present"],
                       help="resume from the newest complete checkpoint in --ckpt_path; a bare "
                            "flag makes a missing checkpoint an error, 'if_present' starts fresh")
    group.add_argument("--save_hf_ckpt", action="store_true",
                       help="also export Hugging Face weights next to each checkpoint")
    group.add_argument("--disable_ds_ckpt", action="store_true",
                       help="skip DeepSpeed optimizer state in checkpoints (not resumable exactly)")
    group.add_argument("--preemption_grace", type=float, default=600.0,
                       help="seconds a SIGTERM/SIGUSR1 gives the run to write a checkpoint and exit")
    group.add_argument("--max_nonfinite_steps", type=int, default=3,
                       help="consecutive optimizer steps skipped for a non-finite loss or gradient before the "
                            "run saves and stops")
    return group


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=str, default=None, metavar="FILE.yaml",
                        help="read flag values from a YAML mapping of flag names (without --) to values; "
                             "flags given on the command line override it")


def parse_command_line(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parses `argv` on top of the `--config` file, if one is given: the file's values replace the
    defaults (so a required flag may come from the file), and flags on the command line win.
    Unknown keys and values of the wrong type are errors naming the file and the key."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=str, default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config:
        parser.set_defaults(**_config_defaults(parser, known.config))
    return parser.parse_args(argv)


def _config_defaults(parser: argparse.ArgumentParser, path: str) -> dict:
    import yaml

    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except OSError as err:
        parser.error(f"--config {path}: cannot read it ({err.strerror})")
    except yaml.YAMLError as err:
        parser.error(f"--config {path}: not valid YAML ({err})")
    if not isinstance(values, dict):
        parser.error(f"--config {path}: expected a mapping of flag names to values, got {type(values).__name__}")
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    defaults = {}
    for key, value in values.items():
        dest = str(key).lstrip("-").replace("-", "_")
        action = actions.get(dest)
        if action is None:
            close = [d for d in actions if d.split("_")[0] == dest.split("_")[0]][:3]
            hint = f" (did you mean {', '.join('--' + d for d in close)}?)" if close else ""
            parser.error(f"--config {path}: unknown key {key!r}{hint}; keys are flag names without the leading --")
        try:
            defaults[dest] = _config_value(action, value)
        except (TypeError, ValueError):
            parser.error(f"--config {path}: key {key!r} has the value {value!r}, which --{dest} does not take "
                         f"({action.help})")
        if action.choices is not None and defaults[dest] is not None and defaults[dest] not in action.choices:
            parser.error(f"--config {path}: key {key!r} must be one of {sorted(action.choices)}, got {value!r}")
        action.required = False       # the file provides it
    return defaults


def _config_value(action: argparse.Action, value):
    """A YAML value converted as the flag's parser would convert its command-line text."""
    if value is None:
        return None
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise TypeError(value)
        return value
    convert = action.type or (lambda v: v)
    if action.nargs in ("*", "+") or isinstance(action.nargs, int):
        items = value if isinstance(value, (list, tuple)) else [value]
        return [convert(v) for v in items]
    return convert(value)


def resolved_config(args: argparse.Namespace) -> dict:
    """Every option of the run as plain YAML-able values (tuples as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(vars(args).items())}


def announce_config(parser: argparse.ArgumentParser, args: argparse.Namespace, strategy, ckpt_path: str | None) -> None:
    """Prints the options that differ from the defaults on rank 0 and writes the whole resolved
    config to `<ckpt_path>/run_config.yaml`, which `--config` reads back to repeat the run."""
    import yaml

    if not strategy.is_rank_0():
        return
    config = resolved_config(args)
    changed = {k: v for k, v in config.items() if k != "config" and v != parser.get_default(k)}
    print("options: " + json.dumps(changed, default=str, sort_keys=True), flush=True)
    if ckpt_path:
        os.makedirs(ckpt_path, exist_ok=True)
        target = os.path.join(ckpt_path, "run_config.yaml")
        tmp = target + ".tmp"
        with open(tmp, "w") as f:
            yaml.safe_dump({k: v for k, v in config.items() if k != "config"}, f, sort_keys=True)
        os.replace(tmp, target)


def check_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """Rejects zero or negative values of the named integer flags with a parser error."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name} must be positive, got {value}")


def build_scheduler(optimizer, args, lr: float, total_steps: int):
    """The learning-rate schedule named by --lr_scheduler, warmed up over --lr_warmup_ratio of
    `total_steps`; cosine_with_min_lr decays to 10% of `lr`."""
    from transformers import get_scheduler

    # A rate, not an absolute floor: lr = 0 (a frozen policy, to measure it) stays valid.
    kwargs = {"min_lr_rate": 0.1} if args.lr_scheduler == "cosine_with_min_lr" else {}
    return get_scheduler(args.lr_scheduler, optimizer, num_warmup_steps=int(total_steps * args.lr_warmup_ratio),
                         num_training_steps=total_steps, scheduler_specific_kwargs=kwargs)


def make_tracker(args, strategy):
    """The W&B / TensorBoard tracker the logging flags ask for (writes on rank 0 only)."""
    from lightrft.utils.trackers import MetricsTracker

    return MetricsTracker(is_rank_0=strategy.is_rank_0(), config=vars(args), use_wandb=args.use_wandb,
                          wandb_project=args.wandb_project, wandb_org=args.wandb_org,
                          wandb_run_name=args.wandb_run_name, use_tensorboard=args.use_tensorboard)


def print_summary(strategy, stop_reason, step: int, save_path: str, logs: dict, digits: int = 6) -> None:
    """The one JSON line a training command ends with on rank 0: why it stopped, the step, where the
    model went, and the last logged metrics."""
    if strategy.is_rank_0():
        summary = {k: round(v, digits) for k, v in logs.items() if isinstance(v, float)}
        print(json.dumps({"stop_reason": stop_reason or "finished", "step": step,
                          "save_path": os.path.abspath(save_path), **summary}), flush=True)


def run_command(prog: str, train_fn, args) -> None:
    """Runs a training command and turns the errors a user can fix (bad flags, paths, rows, reward
    sources) into one message on stderr and exit code 1, without a traceback from deep inside.
    `LIGHTRFT_TRACEBACK=1` shows the traceback too.

    Two run services start here, for every command: under torchrun a lifeline stops the rank when
    the launcher dies (`lightrft.utils.lifeline`), and rank 0 holds the lock on `--ckpt_path` for the
    whole run, so a second run writing into the same folder is refused (`lightrft.utils.run_lock`)."""
    from lightrft.rewards.base import RewardSourceError
    from lightrft.utils.lifeline import lifeline_for_launcher
    from lightrft.utils.run_lock import RunLockError, checkpoint_folder_lock

    lifeline = lifeline_for_launcher(getattr(args, "preemption_grace", 600.0))
    try:
        with checkpoint_folder_lock(getattr(args, "ckpt_path", None), rank=int(os.environ.get("RANK", "0"))):
            train_fn(args)
    except (ValueError, FileNotFoundError, RewardSourceError, RunLockError) as err:
        if os.environ.get("LIGHTRFT_TRACEBACK"):
            raise
        rank = os.environ.get("RANK")
        where = f"[rank {rank}] " if rank not in (None, "0") else ""
        print(f"{where}{prog}: error: {err}\n(set LIGHTRFT_TRACEBACK=1 to see where it was raised)",
              file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        if lifeline is not None:
            lifeline.uninstall()
