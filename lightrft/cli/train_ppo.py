"""PPO / GRPO / REINFORCE++ / RLOO training from the command line.

    torchrun --nproc_per_node 8 -m lightrft.cli.train_ppo --pretrain MODEL --prompt_data FILE \
        --advantage_estimator group_norm --n_samples_per_prompt 8 --remote_rm_url math ...

This module parses flags once (the typed `PPORunConfig`, which checks that they fit together) and
calls the builders of `lightrft.builders`; `--help` lists every flag by group.
"""

import argparse
import sys

from lightrft.builders.explorers import build_explorer, build_explorer_source
from lightrft.builders.ppo_run import PPORun, build_ppo_run, build_strategy, check_world_size  # noqa: F401
from lightrft.cli.common import announce_config, parse_run_config, print_summary, run_command
from lightrft.config import PPORunConfig
from lightrft.models.tokenizer import stop_token_ids  # noqa: F401  (the name research scripts import from here)
from lightrft.trainer.ppo_health import EXIT_STATUS as HEALTH_EXIT_STATUS
from lightrft.utils.program import run_program


def build_parser() -> argparse.ArgumentParser:
    """The flags, generated from `PPORunConfig` (lightrft/config): `--help` lists them by section."""
    return PPORunConfig.build_parser("python -m lightrft.cli.train_ppo", __doc__)


def parse_args(argv=None) -> PPORunConfig:
    """The typed run config of a command line (`--config FILE.yaml` first, flags over it); a bad
    option or combination exits with a message that names the flags."""
    return parse_run_config(PPORunConfig, build_parser(), argv)


def build_run(args: PPORunConfig, *, trainer_cls=None, callbacks=(), explorers: bool = False, link=None) -> PPORun:
    """The run `train` trains and `lightrft.cli.doctor` checks: the strategy joins the process
    group, the resolved config is announced (and saved next to the checkpoints), then
    `lightrft.builders.build_ppo_run` builds the rest. With `explorers`, the experience comes from
    explorer ranks (`link`) or the one-step-ahead explorer thread when the flags ask for them
    (the doctor checks the colocated path). `args` is the run config (an argparse namespace of the
    same flags is converted to one)."""
    if isinstance(args, argparse.Namespace):
        args = PPORunConfig.from_namespace(args)
    strategy = build_strategy(args)
    announce_config(build_parser(), args, strategy, args.checkpoint.ckpt_path)
    source = build_explorer_source(args, strategy, link) if explorers else None
    return build_ppo_run(args, strategy=strategy, trainer_cls=trainer_cls, callbacks=callbacks,
                         experience_source=source)


def train(args: PPORunConfig, *, trainer_cls=None, callbacks=()) -> dict:
    """Builds everything from parsed flags and runs PPO; returns the last logged metrics.

    Research code can reuse this wiring: `trainer_cls` replaces `PPOTrainer` (a subclass) and
    `callbacks` are `TrainerCallback` instances, e.g.

        args = parse_args([...])
        train(args, trainer_cls=MyTrainer, callbacks=[MyCallback()])
    """
    if isinstance(args, argparse.Namespace):
        args = PPORunConfig.from_namespace(args)
    link = None
    if args.explorer_ranks > 0:
        # Split the job into explorers and trainers before any process group starts.
        from lightrft.explorers.explorer import run_explorer
        from lightrft.explorers.roles import join_roles

        transport = args.explorer_weight_transport if args.sync_method == "broadcast" else "host"
        link = join_roles(args.explorer_ranks, args.dist_timeout, weight_transport=transport)
        if link.layout.is_explorer:
            return run_explorer(build_explorer(args, link))
    run = build_run(args, trainer_cls=trainer_cls, callbacks=callbacks, explorers=True, link=link)
    args, trainer = run.args, run.trainer
    consumed = 0
    run.strategy.check_shared_folder(args.ckpt_path)       # node-local disks: refused before the first step
    if args.load_checkpoint:
        consumed = trainer.load_checkpoint(args, required=args.load_checkpoint == "required")
    trainer.fit(args, run.dataloader, run.pretrain_dataloader, consumed, run.updates_per_step,
                eval_dataloader=run.eval_dataloader)
    if trainer.stop_reason != "preempted":
        run.strategy.save_model(trainer.ema_model or trainer.actor, trainer.processor or run.tokenizer,
                                args.save_path)
    logs = dict(getattr(trainer, "last_logs", {}))
    if run.eval_dataloader is not None:
        logs.update(trainer.evaluate(run.eval_dataloader))
    run.tracker.close()
    events = trainer.health.events if trainer.health is not None else []
    print_summary(run.strategy, trainer.stop_reason, trainer.global_step, args.save_path, logs, digits=4,
                  extra={"health": events} if events else None)
    trainer.rollout.shutdown()      # a vLLM engine's teardown needs the process group the strategy closes
    run.strategy.close()
    if trainer.stop_reason == "nonfinite":
        raise SystemExit(3)
    if (trainer.stop_reason or "").startswith("monitor:"):
        raise SystemExit(HEALTH_EXIT_STATUS)      # a health monitor stopped the run (its report in --ckpt_path)
    return logs


def main(argv=None) -> None:
    run_command("train_ppo", train, parse_args(argv))


if __name__ == "__main__":
    run_program(main, sys.argv[1:])
