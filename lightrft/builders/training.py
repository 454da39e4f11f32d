"""The learning-rate schedule and the metrics tracker of a training run (PPO, SFT and RM alike)."""

from lightrft.config.run import plain_options


def build_scheduler(optimizer, optim, lr: float, total_steps: int):
    """The learning-rate schedule named by `optim.lr_scheduler`, warmed up over
    `optim.lr_warmup_ratio` of `total_steps`; cosine_with_min_lr decays to 10% of `lr`. `optim` is
    the run's optimisation section (or the run config)."""
    from transformers import get_scheduler

    # A rate, not an absolute floor: lr = 0 (a frozen policy, to measure it) stays valid.
    kwargs = {"min_lr_rate": 0.1} if optim.lr_scheduler == "cosine_with_min_lr" else {}
    return get_scheduler(optim.lr_scheduler, optimizer, num_warmup_steps=int(total_steps * optim.lr_warmup_ratio),
                         num_training_steps=total_steps, scheduler_specific_kwargs=kwargs)


def build_tracker(config, strategy):
    """The W&B / TensorBoard tracker the logging section asks for (writes on rank 0 only); it
    records the whole resolved run `config`."""
    from lightrft.utils.trackers import MetricsTracker

    logging = config.logging
    return MetricsTracker(is_rank_0=strategy.is_rank_0(), config=plain_options(config), use_wandb=logging.use_wandb,
                          wandb_project=logging.wandb_project, wandb_org=logging.wandb_org,
                          wandb_run_name=logging.wandb_run_name, use_tensorboard=logging.use_tensorboard)
