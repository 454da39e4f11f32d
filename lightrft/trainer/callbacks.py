"""Callbacks let research code observe or change a run without copying `fit`.

Subclass `TrainerCallback`, override the hooks you need, and pass instances as
`PPOTrainer(..., callbacks=[...])`. Every hook gets the trainer, so it can read `trainer.global_step`,
inspect `trainer.replay_buffer`, and so on (what a step samples with: override
`PPOTrainer.sampling_params(step)`). Hooks run on every
rank; guard side effects with `trainer.strategy.is_rank_0()`.
"""


class TrainerCallback:
    def on_train_begin(self, trainer) -> None:
        """Before the first rollout (after any resume)."""

    def on_rollout_end(self, trainer, experiences: list) -> None:
        """After a rollout's experiences are made, before they enter the replay buffer."""

    def on_step_end(self, trainer, metrics: dict) -> None:
        """After each optimizer step; `metrics` holds that step's train/* values averaged over its
        micro-batches and the ranks. The steps of a pass are reduced together, in one all-reduce,
        so the hook runs for each of them, in order, when the pass's last optimizer step is done."""

    def on_save(self, trainer, path: str) -> None:
        """After a checkpoint is complete on disk at `path`."""

    def on_health(self, trainer, event: dict) -> None:
        """After a health monitor's action (`lightrft.trainer.ppo_health`): `event` names the
        monitor, the metric, its value and threshold, the onset and step, the action, and for a
        rollback the restored checkpoint's step (`restored_step`)."""

    def on_train_end(self, trainer) -> None:
        """After the last step, before the final export."""


class CallbackList:
    """Calls a hook on every callback in order."""

    def __init__(self, callbacks=()):
        self.callbacks = list(callbacks)

    def __getattr__(self, hook):
        if not hook.startswith("on_"):
            raise AttributeError(hook)

        def call(*args, **kwargs):
            for callback in self.callbacks:
                getattr(callback, hook)(*args, **kwargs)

        return call
