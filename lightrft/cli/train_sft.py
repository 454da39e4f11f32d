"""Supervised fine-tuning from the command line.

    torchrun --nproc_per_node 8 -m lightrft.cli.train_sft --pretrain MODEL --dataset FILE \
        --input_key question --output_key answer --apply_chat_template --max_len 2048 ...

The loss covers response tokens only (prompt tokens are labelled -100). Rows are prompt/response
pairs (`--input_key`, `--output_key`), or with `--multiturn` whole conversations in `--input_key`
whose assistant turns are all trained. Evaluation loss comes from `--eval_dataset` or a held-out
`--eval_split` fraction. `--max_steps N` stops after N optimizer steps (a quick try of a config).
The model is exported as a Hugging Face folder to `--save_path` at the end.
"""

import argparse
import sys

from lightrft.builders.training import build_scheduler, build_tracker
from lightrft.cli.common import (announce_config, parse_run_config, print_summary,
                                 run_command)
from lightrft.config import SFTRunConfig
from lightrft.models.tokenizer import build_tokenizer
from lightrft.utils.program import run_program


def build_parser() -> argparse.ArgumentParser:
    """The flags, generated from `SFTRunConfig` (lightrft/config)."""
    return SFTRunConfig.build_parser("python -m lightrft.cli.train_sft", __doc__)


def parse_args(argv=None) -> SFTRunConfig:
    """The typed run config of a command line; a bad option exits with a message naming it."""
    return parse_run_config(SFTRunConfig, build_parser(), argv)


def build_datasets(args, tokenizer):
    """(train set, eval set or None) from --dataset and --eval_dataset / --eval_split."""
    from lightrft.datasets import SFTDataset, split_train_eval

    def sft(path, flag, max_samples=None):
        return SFTDataset(path, tokenizer, input_key=args.input_key,
                          output_key=None if args.multiturn else args.output_key,
                          apply_chat_template=args.apply_chat_template, max_len=args.max_len,
                          on_bad_row=args.on_bad_row, input_template=args.input_template, max_samples=max_samples,
                          flag=flag)

    train_set = sft(args.dataset, "--dataset", args.max_samples)
    eval_set = None
    if args.eval_dataset:
        eval_set = sft(args.eval_dataset, "--eval_dataset")
    elif args.eval_split:
        train_set, eval_set = split_train_eval(train_set, args.eval_split, seed=args.seed)
    return train_set, eval_set


def check_data_vocabulary(args, model, tokenizer, train_set, eval_set, sample_ids) -> None:
    """`check_vocabulary` for the model of `train_sft` / `train_rm`: the tokens the run feeds it,
    and the ids of its data sets (`sample_ids(sample)` lists a sample's rows of ids) when the
    tokenizer is longer than the model's vocabulary."""
    from lightrft.models.vocabulary import check_vocabulary, ids_in_data, vocabulary_rows

    fed = None
    if len(tokenizer) > vocabulary_rows(model):
        fed = {}
        for flag, path, data in (("--eval_dataset", args.eval_dataset, eval_set), ("--dataset", args.dataset, train_set)):
            if data is not None:
                rows = [ids for sample in data for ids in sample_ids(sample)]
                fed.update(ids_in_data(rows, f"{flag} {path or args.dataset}"))
    check_vocabulary(model, tokenizer, f"--pretrain {args.pretrain}", chat_template=args.apply_chat_template, fed=fed)


def train(args: SFTRunConfig) -> dict:
    """Builds everything from parsed flags and runs SFT; returns the last logged metrics."""
    from lightrft.models import ActorLanguage
    from lightrft.strategy import get_strategy
    from lightrft.trainer.sft_trainer import SFTTrainer

    strategy = get_strategy(args)
    strategy.setup_distributed()
    announce_config(build_parser(), args, strategy, args.ckpt_path)
    tokenizer = build_tokenizer(args.model.pretrain, args.model.trust_remote_code)
    with strategy.zero3_init_context():
        model = ActorLanguage(args.pretrain, bf16=args.bf16, attn_implementation=args.attn_implementation,
                              lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                              target_modules=args.target_modules, trust_remote_code=args.trust_remote_code,
                              gradient_checkpointing=args.gradient_checkpointing,
                              packing_samples=args.packing_samples,
                              # SFT rows are whole sequences (num_actions = T - 1): no prompt columns to share.
                              share_prompts=False)

    train_set, eval_set = build_datasets(args, tokenizer)
    check_data_vocabulary(args, model, tokenizer, train_set, eval_set, lambda sample: [sample.input_ids.tolist()])
    base = train_set.dataset if hasattr(train_set, "indices") else train_set
    collate = base.packing_collate_fn if args.packing_samples else base.collate_fn
    return run_supervised(args, strategy, model, tokenizer, SFTTrainer, train_set, eval_set, collate)


def run_supervised(args, strategy, model, tokenizer, trainer_cls, train_set, eval_set, collate,
                   before_export=None) -> dict:
    """The part of `train_sft` and `train_rm` after the model and data exist: optimizer and
    schedule, DeepSpeed engines, tracker, resume, training, Hugging Face export, the summary line.
    `before_export(trainer, model, logs)` runs after a finished run (or one --max_steps ended),
    before the export."""
    from lightrft.trainer.sft_trainer import supervised_total_steps

    dataloader = strategy.setup_dataloader(train_set, args.micro_train_batch_size, shuffle=True, collate_fn=collate)
    # The schedule spans the optimizer steps the run will take (--max_steps ends it early).
    total_steps = max(1, supervised_total_steps(len(train_set), args.train_batch_size, args.max_epochs, args.max_steps))
    optim = strategy.create_optimizer(model, lr=args.learning_rate, betas=tuple(args.adam_betas),
                                      weight_decay=args.l2)
    scheduler = build_scheduler(optim, args.optim, args.learning_rate, total_steps)
    model, optim, scheduler = strategy.prepare((model, optim, scheduler))

    tracker = build_tracker(args, strategy)
    trainer = trainer_cls(strategy, model, optim, scheduler, tokenizer, max_epochs=args.max_epochs,
                          eval_dataset=eval_set, eval_collate_fn=collate, tracker=tracker,
                          save_hf_ckpt=args.save_hf_ckpt, disable_ds_ckpt=args.disable_ds_ckpt,
                          preemption_grace=args.preemption_grace, max_nonfinite_steps=args.max_nonfinite_steps,
                          max_ckpt_num=args.max_ckpt_num)
    if not args.disable_ds_ckpt:
        strategy.check_shared_folder(args.ckpt_path)       # node-local disks: refused before the first step
    if args.load_checkpoint:
        trainer.load_checkpoint(args, required=args.load_checkpoint == "required")
    trainer.fit(args, dataloader)
    logs = dict(trainer.last_logs)
    if trainer.stop_reason in (None, "max_steps"):
        if before_export is not None:
            before_export(trainer, model, logs)
        trainer.export_hf(args.save_path)
    tracker.close()
    print_summary(strategy, trainer.stop_reason, trainer.global_step, args.save_path, logs, digits=6)
    strategy.close()
    if trainer.stop_reason == "nonfinite":
        raise SystemExit(3)
    return logs


def main(argv=None) -> None:
    run_command("train_sft", train, parse_args(argv))


if __name__ == "__main__":
    run_program(main, sys.argv[1:])
