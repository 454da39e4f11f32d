"""What a PPO checkpoint holds, and resuming from one: the trainer's engines (critic and EMA
first, the actor last, whose `latest` pointer makes the step resumable), the step counters, the
KL controller, the experience source's state and the resolved run config. Writing, verifying and
falling back are the run services' (`run_services.py`), shared with SFT and RM.

`PPOCheckpoints` is a base class of `PPOTrainer`, not used alone.
"""

from pathlib import Path
from typing import Any, Optional

from lightrft.config.run import PPORunConfig, plain_options
from lightrft.strategy import checkpoint_io
from lightrft.trainer.checkpoint import pinned_options
from lightrft.trainer.run_services import CheckpointPart, RunServices
from lightrft.utils.secrets import redact_options

# Options that define the experiment: resuming with a different value is an error.
PINNED_OPTIONS = ("pretrain", "advantage_estimator", "n_samples_per_prompt", "rollout_batch_size",
                  "train_batch_size", "micro_train_batch_size", "policy_loss", "loss_agg_mode",
                  "kl_estimator", "use_kl_loss", "seed", "prompt_data", "recorded_data", "max_epochs")


def as_ppo_config(args) -> PPORunConfig:
    """The typed run config of `args` (an argparse namespace of its flags is converted)."""
    return args if isinstance(args, PPORunConfig) else PPORunConfig.from_namespace(args)


class PPOCheckpoints:
    """Checkpoint and resume methods of `PPOTrainer` (see the module docstring).

    What it reads from the trainer it is part of is declared below (`PPOTrainer.assign` sets each;
    tests/trainer/test_trainer_options.py checks that nothing else is read)."""

    strategy: Any
    services: RunServices              # checkpoint writing, the failed-save count, the guard
    actor: Any
    critic: Any
    ema_model: Any
    tokenizer: Any
    processor: Any                     # a vision-language run's processor: exports carry its files
    kl_ctl: Any                        # its state is saved and restored
    counters: dict
    callbacks: Any
    nonfinite_counts: dict             # samples dropped for a non-finite value: saved and restored
    experience_source: Any             # its state travels in the checkpoint
    save_hf_ckpt: bool
    disable_ds_ckpt: bool
    args: Optional[PPORunConfig]       # the run config `fit` runs
    health: Any                        # the health monitors' state travels in the checkpoint

    @staticmethod
    def saved_at_step(args, global_step: int) -> bool:
        """Whether `save_logs_and_checkpoints` writes a checkpoint at this step (every --save_steps)."""
        save_steps = as_ppo_config(args).checkpoint.save_steps
        return save_steps > 0 and global_step % save_steps == 0

    def pinned_options(self, args) -> dict:
        return pinned_options(args, PINNED_OPTIONS)

    def client_state(self) -> dict:
        source_state = self.experience_source.state_dict() if self.experience_source is not None else {}
        counters = {"global_step": self.global_step, "consumed_samples": self.consumed_samples,
                    "kl_ctl": self.kl_ctl.state_dict(), **source_state,
                    "counters": dict(self.counters), "failed_saves": self.services.failed_saves,
                    "nonfinite_counts": dict(self.nonfinite_counts),
                    "health": self.health.state_dict() if getattr(self, "health", None) is not None else {},
                    # the resolved run config travels with every checkpoint, its secrets redacted
                    "config": redact_options(plain_options(self.args))}
        return RunServices.client_state(counters, self.pinned_options(self.args))

    def checkpoint_parts(self, args, client_state: Optional[dict] = None) -> list[CheckpointPart]:
        """The engines of a checkpoint in write order: critic and EMA first, the actor last (its
        `latest` pointer is what makes the step resumable)."""
        ckpt_path = as_ppo_config(args).checkpoint.ckpt_path
        parts = [CheckpointPart(f"{ckpt_path}/{name}", model, {"global_step": self.global_step},
                                load_optimizer_states=name == "_critic")
                 for name, model in (("_critic", self.critic), ("_ema", self.ema_model)) if model is not None]
        return parts + [CheckpointPart(f"{ckpt_path}/_actor", self.actor, client_state)]

    def save_checkpoint(self, args) -> None:
        """Writes a resumable checkpoint and, with `save_hf_ckpt`, a Hugging Face export of the actor."""
        tag, ckpt_path = f"global_step{self.global_step}", as_ppo_config(args).checkpoint.ckpt_path
        if not self.disable_ds_ckpt and not self.services.save(self.checkpoint_parts(args, self.client_state()),
                                                               tag, ckpt_path):
            return
        if self.save_hf_ckpt:
            self.strategy.save_model(self.ema_model or self.actor, self.processor or self.tokenizer,
                                     f"{ckpt_path}/{tag}_hf")
        self.callbacks.on_save(self, f"{ckpt_path}/_actor/{tag}")

    def load_checkpoint(self, args, required: bool = True) -> int:
        """Resumes weights, optimizer, scheduler, KL controller, counters and RNG from the newest
        complete checkpoint in `args.ckpt_path`; returns the consumed prompt count (0 if none)."""
        *others, actor = self.checkpoint_parts(args)
        state = self.services.load(actor, others, required=required, options=self.pinned_options(args),
                                   unit="prompts")
        if state is None:
            return 0
        self.global_step = state["global_step"]
        self.consumed_samples = state["consumed_samples"]
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.resumed_state = state       # the experience source resumes from it when the run starts
        self.counters.update(state.get("counters", {}))
        self.counters.pop("failed_saves", None)
        self.services.failed_saves = state.get("failed_saves", state.get("counters", {}).get("failed_saves", 0))
        self.services.guard.skipped = self.counters["skipped_steps"]
        self.nonfinite_counts.update(state.get("nonfinite_counts", {}))
        return self.consumed_samples

    def checkpoint_steps(self, args) -> list[tuple[int, str]]:
        """(step, folder) of every complete checkpoint of the actor in --ckpt_path, oldest first."""
        return [(int(checkpoint_io.load_client_state(path, 0)["global_step"]), str(path))
                for _, path in checkpoint_io.list_complete(Path(as_ppo_config(args).checkpoint.ckpt_path) / "_actor")]

    def restore_checkpoint(self, args, folder: str) -> dict:
        """Loads the checkpoint `folder` (one of `checkpoint_steps`) into the running engines, the
        weights and optimizer states of each (the learning-rate schedules keep their place), and
        returns this rank's client state; the counters are left as they are (a health rollback)."""
        tag = checkpoint_io.read_marker(Path(folder))["tag"]
        for part in self.checkpoint_parts(args):
            self.strategy.load_ckpt(part.model, part.folder, tag=tag, load_optimizer_states=part.load_optimizer_states,
                                    load_lr_scheduler_states=False)
        return checkpoint_io.load_client_state(Path(folder), self.strategy.rank)
