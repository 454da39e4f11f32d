"""RewardModelTrainer: a Bradley-Terry reward model from preference pairs.

For each pair the model scores the chosen and the rejected sequence (at their last token, EOS),
and the loss is -log sigmoid(r_chosen - r_rejected - margin) (Ouyang et al. 2022, eq. 1; the margin
is Llama 2's, Touvron et al. 2023, eq. 2), averaged over the pairs. Every micro-batch holds the same
number of pairs, so DeepSpeed's mean over ranks and accumulation steps is the mean over the step.

After training, the mean and std of the scores of every chosen and rejected training sequence go
into the model config, so `RewardModel(..., normalize_reward=True)` (`train_ppo
--normalize_reward`, `serve_rm --normalize_reward`) returns standardised rewards.
"""

import math

import torch

from lightrft.datasets.preference_dataset import PreferenceBatch
from lightrft.datasets.sharding import eval_shard_batches
from lightrft.models.loss import PairWiseLoss
from lightrft.trainer.sft_trainer import SupervisedTrainer

RM_PINNED_OPTIONS = ("pretrain", "dataset", "prompt_key", "chosen_key", "rejected_key", "margin_key",
                     "apply_chat_template", "max_len", "train_batch_size", "micro_train_batch_size", "max_epochs",
                     "seed", "lora_rank", "learning_rate", "eval_split", "value_head_prefix")


class RewardModelTrainer(SupervisedTrainer):
    """Trains `model` (a `RewardModel` prepared by the strategy) on `PreferenceBatch` micro-batches.

    Metrics: train/loss, train/acc (fraction of pairs with r_chosen > r_rejected), the mean chosen
    and rejected rewards; eval/loss and eval/acc over the evaluation set."""

    progress_desc = "RM steps"

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("pinned_options", RM_PINNED_OPTIONS)
        super().__init__(*args, **kwargs)
        self.loss_fn = PairWiseLoss()

    def pair_scores(self, batch: PreferenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores of the chosen and the rejected sequences, from one forward over both.
        Shape: (B,), (B,)"""
        device = self.strategy.device
        ids = torch.cat([batch.chosen_ids, batch.rejected_ids]).to(device)  # (2B, T)
        mask = torch.cat([batch.chosen_mask, batch.rejected_mask]).to(device)  # (2B, T)
        scores = self.model(ids, attention_mask=mask)  # (2B,)
        return scores.chunk(2)

    def _margins(self, batch: PreferenceBatch):
        return None if batch.margins is None else batch.margins.to(self.strategy.device)

    def training_step(self, micro_batches: list[PreferenceBatch]) -> dict[str, float]:
        self.model.train()
        sums = torch.zeros(4, device=self.strategy.device)  # loss, correct pairs, chosen sum, rejected sum
        for batch in micro_batches:
            chosen, rejected = self.pair_scores(batch)
            loss = self.loss_fn(chosen, rejected, self._margins(batch))
            self.strategy.backward(loss, self.model, self.optim)
            self.strategy.optimizer_step(self.optim, self.model, self.scheduler)
            sums += torch.stack([loss.detach() * len(chosen), (chosen > rejected).sum().float(),
                                 chosen.detach().sum(), rejected.detach().sum()])
        pairs = sum(len(batch.chosen_ids) for batch in micro_batches) * self.strategy.world_size
        loss, correct, chosen_sum, rejected_sum = (self.strategy.all_reduce(sums, op="sum") / pairs).tolist()
        return {"train/loss": loss, "train/acc": correct, "train/reward_chosen": chosen_sum,
                "train/reward_rejected": rejected_sum, "train/lr": self.scheduler.get_last_lr()[0]}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Pairwise loss and accuracy over the whole evaluation set (each pair counted once)."""
        self.model.eval()
        sums = torch.zeros(3, device=self.strategy.device)  # loss sum, correct pairs, pairs
        for batch, keep in self.eval_batches():
            keep = keep.to(self.strategy.device)
            chosen, rejected = self.pair_scores(batch)
            difference = chosen - rejected
            if batch.margins is not None:
                difference = difference - self._margins(batch)
            # Per-pair terms of the pairwise loss, so fillers can be left out of the sums.
            losses = -torch.nn.functional.logsigmoid(difference)  # (B,)
            sums += torch.stack([(losses * keep).sum(), ((chosen > rejected) & keep).sum().float(),
                                 keep.sum().float()])
        loss, correct, pairs = self.strategy.all_reduce(sums, op="sum").tolist()
        self.model.train()
        return {"eval/loss": loss / max(pairs, 1), "eval/acc": correct / max(pairs, 1), "eval/pairs": pairs}

    @torch.no_grad()
    def reward_statistics(self, dataset, collate_fn) -> tuple[float, float]:
        """Mean and (population) standard deviation of the scores of every chosen and rejected
        sequence of `dataset`, over all ranks: mu = S1 / n, sigma = sqrt(S2 / n - mu^2)."""
        self.model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.strategy.device)  # n, sum r, sum r^2
        batches = eval_shard_batches(dataset, collate_fn, self.strategy.config.micro_train_batch_size,
                                     self.strategy.rank, self.strategy.world_size)
        for batch, keep in batches:
            keep = keep.to(self.strategy.device).double().repeat(2)  # (2B,) chosen then rejected
            scores = torch.cat(self.pair_scores(batch)).double()  # (2B,)
            sums += torch.stack([keep.sum(), (scores * keep).sum(), (scores.square() * keep).sum()])
        n, s1, s2 = self.strategy.all_reduce(sums, op="sum").tolist()
        self.model.train()
        mean = s1 / n
        return mean, math.sqrt(max(s2 / n - mean * mean, 0.0))
