"""The replay buffer: rollout samples of this rank, served as padded or packed micro-batches."""

import torch

from lightrft.algorithms.whitening import WHITEN_EPS, whiten_with_moments, whitening_moments
from lightrft.experience.samples import Experience, Sample, collate_samples, split_experience


class NaiveReplayBuffer(torch.utils.data.Dataset):
    """Holds this rank's samples between rollout and training.

    `sample_batch_size` is the micro-batch size a DataLoader over the buffer uses; `limit` caps the
    number of samples kept (0: no cap, oldest dropped first); `cpu_offload` keeps samples on the CPU
    until a micro-batch is built; `packing_samples` makes `collate_fn` pack micro-batches."""

    def __init__(self, sample_batch_size: int, limit: int = 0, cpu_offload: bool = True,
                 packing_samples: bool = False, pad_token_id: int = 0):
        self.sample_batch_size = sample_batch_size
        self.limit = limit
        self.cpu_offload = cpu_offload
        self.packing_samples = packing_samples
        self.pad_token_id = pad_token_id
        self.items: list[Sample] = []

    def append(self, experience: Experience) -> None:
        if self.cpu_offload:
            experience = experience.to("cpu")
        self.items.extend(split_experience(experience))
        if self.limit > 0 and len(self.items) > self.limit:
            self.items = self.items[len(self.items) - self.limit:]

    def clear(self) -> None:
        self.items = []

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Sample:
        return self.items[index]

    def collate_fn(self, batch: list[Sample]) -> Experience:
        return collate_samples(batch, self.pad_token_id, self.packing_samples)

    def normalize(self, key: str, strategy, eps: float = WHITEN_EPS) -> None:
        """Whitens `key` (e.g. "advantages") over the trained tokens of every rank's buffer:
        x <- (x - mean) / sqrt(var + eps), mean and population var over the global batch
        (`lightrft.algorithms.whitening`; the moments take one all-reduce). Tokens outside a
        sample's loss mask and samples marked invalid (dropped, filler or masked out) neither enter
        the statistics nor get whitened: they stay at 0 and train on nothing."""
        trained = [item for item in self.items if self._trains(item)]
        rows = [item.per_action[key] for item in trained]
        values = torch.cat(rows or [torch.zeros(0)])
        mask = torch.cat([item.action_mask for item in trained] or [torch.zeros(0, dtype=torch.bool)])
        moments = strategy.all_reduce(whitening_moments(values, mask), op="sum")
        if not rows:      # nothing trains here (other ranks may still whiten theirs)
            return
        # Elementwise, so whitening all rows at once gives each row exactly its own result.
        whitened = whiten_with_moments(values, mask, moments, eps)
        for item, row in zip(trained, whitened.split([r.numel() for r in rows])):
            item.per_action[key] = row

    @staticmethod
    def _trains(item: Sample) -> bool:
        return "valid" not in item.info or bool(item.info["valid"] > 0)

    def info_sums(self) -> dict[str, torch.Tensor]:
        """This rank's sum of every info field over its samples, and the number of samples under
        "count" (0-d float64 tensors, no collective): summed over ranks, they give `info_means`."""
        if not self.items:
            return {}
        sums = {k: torch.stack([item.info[k] for item in self.items]).double().sum() for k in sorted(self.items[0].info)}
        return {**sums, "count": torch.tensor(float(len(self.items)), dtype=torch.float64)}

    @staticmethod
    def info_means(sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """Means of the info fields from `info_sums` (summed over ranks)."""
        count = float(sums.get("count", 0.0))
        return {k: float(v) / count for k, v in sums.items() if k != "count"} if count else {}

    def mean_info(self, strategy) -> dict[str, float]:
        """Mean of every info field over all ranks' samples (one all-reduce)."""
        return self.info_means(strategy.all_reduce_many(self.info_sums(), op="sum"))

