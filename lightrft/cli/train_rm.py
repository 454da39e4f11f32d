"""Reward-model training from preference pairs on the command line.

    torchrun --nproc_per_node 8 -m lightrft.cli.train_rm --pretrain MODEL --dataset FILE \
        --prompt_key prompt --chosen_key chosen --rejected_key rejected --apply_chat_template ...

A scalar head on the model's backbone is trained with the pairwise (Bradley-Terry) loss. The
export in `--save_path` is a `RewardModel` folder: `train_ppo --reward_pretrain` and
`serve_rm --reward_pretrain` load it, and its config holds the mean and std of the rewards over the
training set for `--normalize_reward`.
"""

import argparse
import sys

from lightrft.cli.common import (add_checkpoint_args, add_config_arg, add_data_args, add_logging_args,
                                 add_model_args, add_strategy_args, announce_config, check_positive,
                                 parse_command_line, run_command)
from lightrft.cli.train_sft import add_eval_args, add_optimizer_args, load_tokenizer, run_supervised


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightrft.cli.train_rm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_strategy_args(parser)
    models = add_model_args(parser)
    models.add_argument("--value_head_prefix", type=str, default="score", help="attribute name of the value head")
    data = add_data_args(parser)
    data.add_argument("--dataset", type=str, required=True,
                      help="preference rows: a .jsonl/.json/.parquet/.csv file or a saved datasets folder")
    data.add_argument("--prompt_key", type=str, default=None,
                      help="field holding the prompt; without it chosen/rejected are whole texts or conversations")
    data.add_argument("--chosen_key", type=str, default="chosen", help="field holding the preferred answer")
    data.add_argument("--rejected_key", type=str, default="rejected", help="field holding the other answer")
    data.add_argument("--margin_key", type=str, default=None,
                      help="optional field with a per-pair margin m: loss -log sigmoid(r_c - r_r - m)")
    data.add_argument("--max_len", type=int, default=2048, help="most tokens per sequence; longer pairs are bad rows")
    add_eval_args(parser)
    add_optimizer_args(parser).set_defaults(learning_rate=9e-6)
    add_logging_args(parser)
    add_checkpoint_args(parser)
    add_config_arg(parser)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parse_command_line(parser, argv)
    check_positive(parser, args, "max_epochs", "max_len", "train_batch_size", "micro_train_batch_size",
                   "learning_rate")
    if args.lora_rank > 0:
        parser.error("--lora_rank is not supported by train_rm: the reward model trains all weights; drop it")
    if args.packing_samples:
        parser.error("--packing_samples is not supported by train_rm (pairs are padded); drop it")
    if not 0.0 <= args.eval_split < 1.0:
        parser.error(f"--eval_split must be in [0, 1), got {args.eval_split}")
    if args.eval_split and args.eval_dataset:
        parser.error("pass either --eval_dataset or --eval_split, not both")
    return args


def build_datasets(args, tokenizer):
    """(train set, eval set or None) from --dataset and --eval_dataset / --eval_split."""
    from lightrft.datasets import PreferenceDataset, split_train_eval

    def pairs(path, max_samples=None):
        return PreferenceDataset(path, tokenizer, prompt_key=args.prompt_key, chosen_key=args.chosen_key,
                                 rejected_key=args.rejected_key, apply_chat_template=args.apply_chat_template,
                                 max_len=args.max_len, on_bad_row=args.on_bad_row, margin_key=args.margin_key,
                                 max_samples=max_samples)

    train_set = pairs(args.dataset, args.max_samples)
    eval_set = None
    if args.eval_dataset:
        eval_set = pairs(args.eval_dataset)
    elif args.eval_split:
        train_set, eval_set = split_train_eval(train_set, args.eval_split, seed=args.seed)
    return train_set, eval_set


def train(args: argparse.Namespace) -> dict:
    """Builds everything from parsed flags, trains the reward model and exports it; returns the
    last logged metrics with the reward statistics."""
    from lightrft.models import RewardModel
    from lightrft.strategy import get_strategy
    from lightrft.trainer.rm_trainer import RewardModelTrainer

    strategy = get_strategy(args)
    strategy.setup_distributed()
    announce_config(build_parser(), args, strategy, args.ckpt_path)
    tokenizer = load_tokenizer(args.pretrain, args.trust_remote_code)
    with strategy.zero3_init_context():
        model = RewardModel(args.pretrain, value_head_prefix=args.value_head_prefix, init_value_head=True,
                            bf16=args.bf16, attn_implementation=args.attn_implementation,
                            trust_remote_code=args.trust_remote_code,
                            gradient_checkpointing=args.gradient_checkpointing)

    train_set, eval_set = build_datasets(args, tokenizer)
    collate = (train_set.dataset if hasattr(train_set, "indices") else train_set).collate_fn

    def store_reward_statistics(trainer, engine, logs):
        # Reward statistics over the training set, stored in the exported config.
        mean, std = trainer.reward_statistics(train_set, collate)
        strategy.unwrap_model(engine).set_normalization(mean, std)
        logs.update({"reward/mean": mean, "reward/std": std})

    return run_supervised(args, strategy, model, tokenizer, RewardModelTrainer, train_set, eval_set, collate,
                          before_export=store_reward_statistics)


def main(argv=None) -> None:
    run_command("train_rm", train, parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
