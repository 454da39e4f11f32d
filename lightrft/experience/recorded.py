"""Training on served traffic: experiences recorded by `lightrft.cli.serve --record DIR`.

    python -m lightrft.cli.train_ppo --pretrain MODEL --recorded_data DIR \
        --advantage_estimator reinforce --n_samples_per_prompt 1 ...

`RecordedExperienceDataset` reads the rewarded records of DIR (records without feedback are
skipped, counted in `unrewarded`); `RecordedSource`, the trainer's experience source
(`PPOTrainer(..., experience_source=RecordedSource())`), turns each batch of them into
`Experience`s instead of generating: the recorded prompt and response tokens become a
`RolloutOutput`, the recorded rewards the scores, and the recorded log-probs the behaviour
policy's (`rollout_log_probs`, what `--tis_cap` corrects with when the served weights were older
than the trained ones). The actor, reference and critic forwards, the KL and the advantages are
the ones every PPO step computes (`NaiveExperienceMaker.experience_from_rollout`).

Served traffic has one response per prompt, so there are no groups: the estimator must compare
nothing within a prompt (`reinforce`, `reinforce++`, or `gae` with a critic).
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils.data import Dataset

from lightrft.algorithms.advantages import get_advantage_estimator
from lightrft.rollout.base import RolloutOutput
from lightrft.serving.records import read_records, tokenizer_fingerprint
from lightrft.experience.scorer import RewardBatch
from lightrft.experience.sources import SourceBatch, SourceContext


@dataclass(frozen=True)
class RecordedSample:
    """One rewarded served response, ready to train on."""

    prompt_token_ids: list[int]     # (T_prompt,)
    response_token_ids: list[int]   # (A,)
    log_probs: list[float]          # (A,) sampling log-probs of the response tokens
    reward: float
    policy_version: int             # the step of the weights that generated it
    id: str


class RecordedExperienceDataset(Dataset):
    """The rewarded experiences of a record folder, in recording order (`max_samples`: the first
    ones). Items are `(RecordedSample, reward)`; `collate_fn` makes `(samples, rewards)` lists.

    Every record must come from a tokenizer with the same vocabulary as `tokenizer` (their token
    ids are trained on as they are); a record from another one is an error naming the line."""

    def __init__(self, folder: str | Path, tokenizer: Any, max_samples: Optional[int] = None):
        records, path = read_records(folder)
        fingerprint = tokenizer_fingerprint(tokenizer)
        vocab = len(tokenizer)
        self.samples: list[RecordedSample] = []
        self.unrewarded = 0
        for number, (record, reward) in enumerate(records, start=1):
            where = f"{path}: record {number} (id {record.id!r}, index {record.index})"
            if record.tokenizer != fingerprint:
                raise ValueError(f"{where} was served with a different tokenizer (fingerprint {record.tokenizer}, "
                                 f"this model's is {fingerprint}); train the model that served it (--pretrain)")
            if len(record.response_token_ids) != len(record.log_probs):
                raise ValueError(f"{where} has {len(record.response_token_ids)} response tokens but "
                                 f"{len(record.log_probs)} log-probs")
            if any(not 0 <= t < vocab for t in record.prompt_token_ids + record.response_token_ids):
                raise ValueError(f"{where} holds token ids outside this tokenizer's vocabulary [0, {vocab})")
            if not record.prompt_token_ids or not record.response_token_ids:
                raise ValueError(f"{where} has an empty prompt or response; it cannot train")
            if reward is None:
                self.unrewarded += 1
                continue
            if max_samples is not None and len(self.samples) >= max_samples:
                continue
            self.samples.append(RecordedSample(record.prompt_token_ids, record.response_token_ids, record.log_probs,
                                               float(reward), int(record.policy_version), record.id))
        self.source = str(path)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx: int) -> tuple[RecordedSample, float]:
        sample = self.samples[idx]
        return sample, sample.reward

    @staticmethod
    def collate_fn(batch: list[tuple[RecordedSample, float]]) -> tuple[list[RecordedSample], list[float]]:
        samples, rewards = zip(*batch)
        return list(samples), list(rewards)


class RecordedRewardsOnly:
    """The reward source of a run on recorded data with no other: recorded experiences bring their
    rewards, so it is only called by evaluation, which has no recorded reward to read."""

    def __call__(self, queries, prompts, labels):
        raise ValueError("--recorded_data brings its own rewards, but evaluation (--eval_data) generates new "
                         "responses and needs a reward source: pass --remote_rm_url or --reward_pretrain too")


def check_recorded_algorithm(estimator_name: str, n_samples_per_prompt: int) -> None:
    """Recorded traffic has one response per prompt: refuse what needs groups."""
    if get_advantage_estimator(estimator_name).group:
        raise ValueError(f"--advantage_estimator {estimator_name} compares several responses to one prompt, but "
                         "served traffic (--recorded_data) has one response per prompt: use reinforce, reinforce++ "
                         "or gae (with --critic_pretrain)")
    if n_samples_per_prompt != 1:
        raise ValueError(f"--recorded_data trains on the recorded responses, one per prompt: drop "
                         f"--n_samples_per_prompt {n_samples_per_prompt} (use 1)")


class RecordedSource:
    """Each step's experience from a batch of recorded responses (served traffic): their token
    ids and sampling log-probs as the server stored them, scored by their recorded rewards; the
    reference and critic forwards, the KL and the advantages are this trainer's. Each
    Experience's `info["policy_version"]` is the step of the weights that served it. The samples
    come from whatever policy served them, so the engine-gap check does not apply."""

    checks_engine = False

    def start(self, context: SourceContext) -> None:
        self.context = context
        self._batches = context.prompts.batches(context.consumed_samples)

    def next(self, step: int) -> Optional[SourceBatch]:
        batch = next(self._batches, None)
        if batch is None:
            return None
        samples, rewards = batch
        maker = self.context.maker
        started = time.perf_counter()
        maker.eval_models()
        rollout = RolloutOutput.from_token_lists([s.prompt_token_ids for s in samples],
                                                 [s.response_token_ids for s in samples],
                                                 [s.log_probs for s in samples], maker.tokenizer.pad_token_id,
                                                 maker.eos_token_ids)
        scores = RewardBatch(scores=torch.tensor(rewards, dtype=torch.float32),
                             valid=torch.ones(len(samples), dtype=torch.bool))
        experiences = maker.experience_from_rollout(rollout, scores, 1)
        versions = torch.tensor([float(s.policy_version) for s in samples])
        for experience in experiences:
            experience.info["policy_version"] = versions[:experience.batch_size]
        return SourceBatch(experiences, self.context.rollout_batch_size,
                           timings={"generate": 0.0, "reward": 0.0, "experience": time.perf_counter() - started})

    def after_step(self, step: int) -> dict[str, float]:
        return {}

    def stop(self, preempted: bool = False) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
