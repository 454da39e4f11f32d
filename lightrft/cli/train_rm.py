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

from lightrft.cli.common import announce_config, parse_run_config, run_command
from lightrft.cli.train_sft import check_data_vocabulary, run_supervised
from lightrft.config import RMRunConfig
from lightrft.models.tokenizer import build_tokenizer
from lightrft.utils.program import run_program


def build_parser() -> argparse.ArgumentParser:
    """The flags, generated from `RMRunConfig` (lightrft/config)."""
    return RMRunConfig.build_parser("python -m lightrft.cli.train_rm", __doc__)


def parse_args(argv=None) -> RMRunConfig:
    """The typed run config of a command line; a bad option exits with a message naming it."""
    return parse_run_config(RMRunConfig, build_parser(), argv)


def build_datasets(args, tokenizer):
    """(train set, eval set or None) from --dataset and --eval_dataset / --eval_split."""
    from lightrft.datasets import PreferenceDataset, split_train_eval

    def pairs(path, flag, max_samples=None):
        return PreferenceDataset(path, tokenizer, prompt_key=args.prompt_key, chosen_key=args.chosen_key,
                                 rejected_key=args.rejected_key, apply_chat_template=args.apply_chat_template,
                                 max_len=args.max_len, on_bad_row=args.on_bad_row, margin_key=args.margin_key,
                                 max_samples=max_samples, flag=flag)

    train_set = pairs(args.dataset, "--dataset", args.max_samples)
    eval_set = None
    if args.eval_dataset:
        eval_set = pairs(args.eval_dataset, "--eval_dataset")
    elif args.eval_split:
        train_set, eval_set = split_train_eval(train_set, args.eval_split, seed=args.seed)
    return train_set, eval_set


def train(args: RMRunConfig) -> dict:
    """Builds everything from parsed flags, trains the reward model and exports it; returns the
    last logged metrics with the reward statistics."""
    from lightrft.models import RewardModel
    from lightrft.strategy import get_strategy
    from lightrft.trainer.rm_trainer import RewardModelTrainer

    strategy = get_strategy(args)
    strategy.setup_distributed()
    announce_config(build_parser(), args, strategy, args.ckpt_path)
    tokenizer = build_tokenizer(args.model.pretrain, args.model.trust_remote_code)
    with strategy.zero3_init_context():
        model = RewardModel(args.pretrain, value_head_prefix=args.value_head_prefix, init_value_head=True,
                            bf16=args.bf16, attn_implementation=args.attn_implementation,
                            trust_remote_code=args.trust_remote_code,
                            gradient_checkpointing=args.gradient_checkpointing)

    train_set, eval_set = build_datasets(args, tokenizer)
    check_data_vocabulary(args, model, tokenizer, train_set, eval_set,
                          lambda pair: [pair.chosen_ids.tolist(), pair.rejected_ids.tolist()])
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
    run_program(main, sys.argv[1:])
