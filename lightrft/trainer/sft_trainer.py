"""SFTTrainer: supervised fine-tuning with the loss on response tokens only.

One optimizer step takes `accumulated_gradient` micro-batches on every rank. Its loss is the
token-mean negative log-likelihood over all response tokens of the step, on all ranks:

    L = -(1 / N) sum_{ranks, micro-batches, i, t} m_it log p(y_it | y_<it),   N = sum m_it

Each micro-batch contributes its NLL sum divided by the global N (all-reduced before the first
backward), scaled by world_size * GAS because DeepSpeed averages gradients over ranks and divides
by the accumulation steps (see `lightrft.algorithms.aggregation`). So the update does not depend on
how the step is split over ranks and micro-batches, or on packing versus padding.
"""

import itertools
import math
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch
from tqdm import tqdm

from lightrft.algorithms.aggregation import aggregate_loss, dp_loss_scale
from lightrft.config.options import section_from_namespace
from lightrft.config.run import RMRunConfig, RunConfig, SFTRunConfig
from lightrft.config.sections import CheckpointConfig, EvalConfig, LoggingConfig, SupervisedOptimConfig
from lightrft.datasets.sft_dataset import SFTBatch
from lightrft.datasets.sharding import eval_shard_batches
from lightrft.trainer.guards import nonfinite_grad_norms
from lightrft.trainer.run_services import CheckpointPart, RunServices

# Options that define an SFT experiment: resuming with a different value is an error.
SFT_PINNED_OPTIONS = ("pretrain", "dataset", "input_key", "output_key", "apply_chat_template", "max_len",
                      "packing_samples", "train_batch_size", "micro_train_batch_size", "max_epochs", "seed",
                      "lora_rank", "learning_rate", "eval_split")


def supervised_total_steps(samples: int, train_batch_size: int, max_epochs: int, max_steps: int = -1) -> int:
    """Optimizer steps of a supervised run: `max_epochs` passes of `samples // train_batch_size`
    steps, capped by `max_steps` when it is positive. The LR schedule spans exactly these steps."""
    steps = samples // train_batch_size * max_epochs
    return min(steps, max_steps) if max_steps > 0 else steps


@dataclass(frozen=True)
class SupervisedConfig:
    """What the supervised loop reads of a run's options: four of its sections, and the values of
    the options a resume must not change (flag name -> value, tuples as lists). Taken once, by
    `of`, from the run config `fit` and `load_checkpoint` are given."""

    optim: SupervisedOptimConfig
    eval: EvalConfig
    logging: LoggingConfig
    checkpoint: CheckpointConfig
    pinned: dict[str, Any]

    @classmethod
    def of(cls, config, pinned_names: Sequence[str]) -> "SupervisedConfig":
        """From an `SFTRunConfig` / `RMRunConfig`, or from an argparse namespace of the same flag
        names (research code): then each section is built from the namespace's flags, with the
        defaults for flags it lacks, and only the pinned options it has are pinned."""
        if isinstance(config, RunConfig):
            if not isinstance(config, (SFTRunConfig, RMRunConfig)):
                raise TypeError(f"the supervised trainers take an SFTRunConfig or RMRunConfig (or an argparse "
                                f"namespace of their flags), got a {type(config).__name__}")
            sections = (config.optim, config.eval, config.logging, config.checkpoint)
            options = config.to_dict()
        else:
            sections = tuple(section_from_namespace(section, config)
                             for section in (SupervisedOptimConfig, EvalConfig, LoggingConfig, CheckpointConfig))
            options = vars(config)
        pinned = {name: list(options[name]) if isinstance(options[name], tuple) else options[name]
                  for name in pinned_names if name in options}
        return cls(*sections, pinned)


class SupervisedTrainer:
    """The loop shared by the SFT and reward-model trainers: optimizer steps over groups of GAS
    micro-batches, epochs resumable mid-way, evaluation, logs, checkpoints and preemption.

    Subclasses implement `training_step(micro_batches) -> metrics` and `evaluate() -> metrics`.
    `train_dataloader` comes from `strategy.setup_dataloader`; `eval_dataset` (optional) is
    evaluated every `--eval_steps` steps and at the end, in micro-batches of the strategy's
    `micro_train_batch_size`. `tracker` is a `MetricsTracker` or None. The run's options arrive
    with `fit` / `load_checkpoint` and are kept as a `SupervisedConfig` in `self.config`."""

    progress_desc = "steps"

    def __init__(self, strategy, model, optim, scheduler, tokenizer, *, max_epochs: int = 1,
                 eval_dataset: Optional[Sequence] = None, eval_collate_fn=None, tracker=None,
                 save_hf_ckpt: bool = False, disable_ds_ckpt: bool = False,
                 pinned_options: Sequence[str] = SFT_PINNED_OPTIONS, preemption_grace: float = 600.0,
                 max_nonfinite_steps: int = 3, max_ckpt_num: int = 3):
        self.strategy = strategy
        self.model = model
        self.optim = optim
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.max_epochs = max_epochs
        self.eval_dataset = eval_dataset
        self.eval_collate_fn = eval_collate_fn
        self.tracker = tracker
        self.save_hf_ckpt = save_hf_ckpt
        self.disable_ds_ckpt = disable_ds_ckpt
        self.pinned_options = pinned_options
        self.config: Optional[SupervisedConfig] = None
        self.global_step = 0
        self.consumed_samples = 0  # samples trained on, over all ranks
        self.last_logs: dict[str, float] = {}
        self.services = RunServices(strategy, preemption_grace=preemption_grace,
                                    max_nonfinite_steps=max_nonfinite_steps, max_ckpt_num=max_ckpt_num)
        self.stop_reason: Optional[str] = None

    # ====================================================================================== fit
    def fit(self, args, train_dataloader) -> None:
        """Runs `max_epochs` passes over the data, or `--max_steps` optimizer steps when that is
        fewer, resuming after `self.consumed_samples`. A run cut short by `--max_steps` ends as a
        finished one does (evaluation, checkpoint) with `stop_reason` "max_steps". `args` is the
        run config (or an argparse namespace of its flags, see `SupervisedConfig.of`)."""
        self.config = SupervisedConfig.of(args, self.pinned_options)
        batch_size = self.config.optim.train_batch_size
        steps_per_epoch = len(train_dataloader.dataset) // batch_size
        if steps_per_epoch == 0:
            raise ValueError(f"the training set has {len(train_dataloader.dataset)} samples, fewer than "
                             f"--train_batch_size {batch_size}; lower --train_batch_size")
        total_steps = supervised_total_steps(len(train_dataloader.dataset), batch_size, self.max_epochs,
                                             self.config.optim.max_steps)
        self.services.start(self)
        bar = tqdm(total=total_steps, initial=min(self.global_step, total_steps), desc=self.progress_desc,
                   disable=not self.strategy.is_rank_0(), dynamic_ncols=True)
        remaining = max(0, total_steps - self.global_step)
        try:
            for step_batches in itertools.islice(self._step_groups(train_dataloader, steps_per_epoch), remaining):
                # 1. One optimizer step over GAS micro-batches.
                started = time.time()
                logs = self.training_step(step_batches)
                self.global_step += 1
                self.consumed_samples += batch_size
                logs["perf/step_time"] = time.time() - started
                logs["train/epoch"] = self.consumed_samples / (steps_per_epoch * batch_size)
                loss_ok = math.isfinite(logs["train/loss"])
                self.services.record_step(([] if loss_ok else ["loss"]) + nonfinite_grad_norms(self.strategy, model=self.model))
                logs["train/skipped_steps"] = float(self.services.guard.skipped)
                bar.update(1)
                bar.set_postfix(loss=f"{logs['train/loss']:.4f}")
                # 2. Logs, evaluation, checkpoints; stop early on preemption.
                self.save_logs_and_checkpoints(logs, is_last=self.global_step == total_steps)
                self.stop_reason = self.services.stop_reason(self.config.checkpoint.ckpt_path)
                if self.stop_reason is not None:
                    self.save_checkpoint()
                    break
            if self.stop_reason is None and total_steps < steps_per_epoch * self.max_epochs:
                self.stop_reason = "max_steps"
        finally:
            bar.close()
            self.services.stop()

    def _step_groups(self, dataloader, steps_per_epoch: int) -> Iterator[list]:
        """Lists of GAS micro-batches, one per optimizer step, from where `consumed_samples` left off."""
        batch_size = self.config.optim.train_batch_size
        per_epoch = steps_per_epoch * batch_size
        start_epoch, consumed_in_epoch = divmod(self.consumed_samples, per_epoch)
        grad_accum = self.strategy.accumulated_gradient
        for epoch in range(start_epoch, self.max_epochs):
            skipped = consumed_in_epoch if epoch == start_epoch else 0
            dataloader.sampler.set_epoch(epoch, consumed_samples=skipped)
            micro_batches = iter(dataloader)
            for _ in range(steps_per_epoch - skipped // batch_size):
                yield list(itertools.islice(micro_batches, grad_accum))

    def training_step(self, micro_batches: list) -> dict[str, float]:
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        raise NotImplementedError

    def eval_batches(self):
        """(batch, keep) pairs of the evaluation set for this rank, in micro-batches of the
        strategy's `micro_train_batch_size` (see `eval_shard_batches`)."""
        return eval_shard_batches(self.eval_dataset, self.eval_collate_fn, self.strategy.config.micro_train_batch_size,
                                  self.strategy.rank, self.strategy.world_size)

    # ======================================================================= logs and checkpoints
    def save_logs_and_checkpoints(self, logs: dict, is_last: bool = False) -> None:
        """Evaluates every `--eval_steps`, logs every `--logging_steps` and saves every
        `--save_steps` steps, and all three at the last step."""
        eval_steps = self.config.eval.eval_steps
        if self.eval_dataset is not None and ((eval_steps > 0 and self.global_step % eval_steps == 0) or is_last):
            logs.update(self.evaluate())
        if self.tracker is not None and (self.global_step % max(self.config.logging.logging_steps, 1) == 0 or is_last):
            self.tracker.log(logs, step=self.global_step)
        self.last_logs = logs
        save_steps = self.config.checkpoint.save_steps
        if (save_steps > 0 and self.global_step % save_steps == 0) or is_last:
            self.save_checkpoint()

    def client_state(self) -> dict:
        return RunServices.client_state({"global_step": self.global_step, "consumed_samples": self.consumed_samples},
                                        self.config.pinned)

    @property
    def failed_saves(self) -> int:
        return self.services.failed_saves

    def save_checkpoint(self) -> None:
        """A resumable checkpoint (weights, optimizer, scheduler, counters, RNG of every rank) under
        `--ckpt_path`, and a Hugging Face export next to it with `--save_hf_ckpt`."""
        tag = f"global_step{self.global_step}"
        ckpt_path = self.config.checkpoint.ckpt_path
        if not self.disable_ds_ckpt:
            if not self.services.save([CheckpointPart(ckpt_path, self.model, self.client_state())], tag, ckpt_path):
                return
        if self.save_hf_ckpt:
            self.export_hf(f"{ckpt_path}/{tag}_hf")

    def export_hf(self, output_dir: str) -> None:
        """Writes the model as a Hugging Face folder with the tokenizer (a causal LM with LoRA merged,
        or a reward model with its head and reward statistics), gathered from ZeRO-3 when sharded."""
        self.strategy.save_model(self.model, self.tokenizer, output_dir)

    def load_checkpoint(self, args, required: bool = True) -> int:
        """Restores the newest complete checkpoint under `--ckpt_path`; returns the consumed samples
        (0 when there is none and `required` is False). `args` as for `fit`."""
        self.config = SupervisedConfig.of(args, self.pinned_options)
        state = self.services.load(CheckpointPart(self.config.checkpoint.ckpt_path, self.model), required=required,
                                   options=self.config.pinned)
        if state is None:
            return 0
        self.global_step = state["global_step"]
        self.consumed_samples = state["consumed_samples"]
        return self.consumed_samples


class SFTTrainer(SupervisedTrainer):
    """Trains `model` (an `ActorLanguage` prepared by the strategy) on an `SFTDataset`: the loss is
    the global token-mean NLL of the response tokens (module docstring). Micro-batches are
    `SFTBatch`, padded or packed."""

    progress_desc = "SFT steps"

    def training_step(self, micro_batches: list[SFTBatch]) -> dict[str, float]:
        """Forward/backward of every micro-batch, then one optimizer step. Returns step metrics,
        reduced over ranks once."""
        self.model.train()
        device = self.strategy.device
        local_tokens = sum(batch.loss_mask.sum() for batch in micro_batches).float()
        global_tokens = self.strategy.all_reduce(local_tokens.to(device), op="sum")
        scale = dp_loss_scale(self.strategy.world_size, len(micro_batches))
        step_loss = torch.zeros((), device=device)
        for batch in micro_batches:
            loss = self.batch_loss(batch, global_tokens)
            self.strategy.backward(loss * scale, self.model, self.optim)
            self.strategy.optimizer_step(self.optim, self.model, self.scheduler)
            step_loss += loss.detach()
        # The parts sum to this rank's share of the global token-mean; the ranks' shares sum to it.
        total_loss = self.strategy.all_reduce(step_loss, op="sum")
        return {"train/loss": total_loss.item(), "train/tokens": global_tokens.item(),
                "train/lr": self.scheduler.get_last_lr()[0]}

    def response_log_probs(self, batch: SFTBatch) -> torch.Tensor:
        """Log-probs of tokens 1.. of every sample, in the layout of `batch.loss_mask`. Shape: (B, A)"""
        device = self.strategy.device
        return self.model(batch.input_ids.to(device), batch.num_actions,
                          attention_mask=batch.attention_mask.to(device), packed_seq_lens=batch.packed_seq_lens)

    def batch_loss(self, batch: SFTBatch, num_tokens) -> torch.Tensor:
        """The response-token NLL of `batch` summed and divided by `num_tokens`. Shape: scalar."""
        log_probs = self.response_log_probs(batch)  # (B, A)
        return aggregate_loss(-log_probs, batch.loss_mask.to(log_probs.device), "token-mean",
                              global_num_tokens=num_tokens)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Token-mean NLL of the response tokens over the whole evaluation set (each sample counted
        once over all ranks), and its exp, the perplexity."""
        self.model.eval()
        device = self.strategy.device
        nll, tokens = torch.zeros((), device=device), torch.zeros((), device=device)
        for batch, keep in self.eval_batches():
            mask = batch.loss_mask.to(device) & keep.to(device).unsqueeze(1)  # (B, A): fillers count nothing
            nll -= (self.response_log_probs(batch) * mask).sum()
            tokens += mask.sum()
        total = self.strategy.all_reduce(torch.stack([nll, tokens]), op="sum")
        self.model.train()
        loss = (total[0] / total[1].clamp(min=1)).item()
        return {"eval/loss": loss, "eval/ppl": math.exp(loss), "eval/tokens": total[1].item()}
