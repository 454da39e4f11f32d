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
the ones every PPO step computes (`ExperienceBuilder.build`).

Multi-turn chats are one episode. A chat client sends the whole conversation with each new
message, so the server records every turn as a request whose prompt holds the turns before it.
Record B continues record A when B's prompt token ids start with exactly A's prompt and response
ids (the server re-rendered A's answer into B's prompt as the same ids; a choice of an n > 1
request is continued when its own ids match). A chain A -> B -> C is one sample, as an agent
episode is (`lightrft.agents`): A's prompt, then A's response, the tokens B's prompt added after it
(the template's end of A's turn, the next user message, the assistant header), B's response, ...,
C's response. The loss mask is True on the recorded response tokens and False between them (log-
probs 0 there). C's feedback is the episode's reward (0 when C got none); feedback on A or B is a
per-turn reward on that turn's last token (`RewardBatch.token_rewards`). A chain without any
feedback is unrewarded; a record that a later one continues is not trained alone; a turn continued
twice (a conversation forked) is in the episode of each branch. When the round trip through text
did not keep the ids (a special token the decoded text dropped, a template that does not write the
end-of-turn token the model sampled, a client that edited the answer), B's prompt starts with A's
prompt and answer as text but not as tokens: B stays a single-turn sample, counted in
`unjoined_turns` and reported in one warning.

Served traffic has one response per prompt, so there are no groups: the estimator must compare
nothing within a prompt (`reinforce`, `reinforce++`, or `gae` with a critic).
"""

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightrft.algorithms.advantages import get_advantage_estimator
from lightrft.rollout.base import RolloutOutput
from lightrft.serving.records import ExperienceRecord, read_records, tokenizer_fingerprint
from lightrft.rewards.batch import RewardBatch
from lightrft.experience.sources import SourceBatch, SourceContext

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecordedSample:
    """One rewarded served conversation, ready to train on: one response, or the turns of a chat
    joined into one episode (see the module docstring)."""

    prompt_token_ids: list[int]     # (T_prompt,) the first turn's prompt
    response_token_ids: list[int]   # (A,) every turn's response, the tokens between turns in between
    log_probs: list[float]          # (A,) sampling log-probs of the response tokens, 0 between turns
    reward: float                   # the last turn's feedback; 0.0 when only earlier turns got one
    policy_version: int             # the step of the (oldest) weights that generated it
    id: str                         # the last turn's response id
    loss_mask: list[bool]           # (A,) True on recorded response tokens, False between turns
    turn_rewards: list[tuple[int, float]]   # (response position of a turn's last token, its feedback), earlier turns
    turns: int = 1
    last_turn_start: int = 0        # the response position where the last turn starts


class PrefixIndex:
    """Which of a list of sequences (the keys) a query sequence starts with. Every prefix of the
    query is hashed at once (a polynomial hash, by prefix sums), and the keys whose hash and length
    match are compared exactly, so a query costs O(its length) however many keys there are."""

    MOD = 2**31 - 1
    BASE = 1_000_003

    def __init__(self, keys: Sequence[Sequence[int]]):
        self.keys = keys
        self._powers = torch.ones(1, dtype=torch.long)          # BASE^i mod MOD, grown on demand
        self._by_hash: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            if len(key):
                self._by_hash.setdefault(int(self._prefix_hashes(key)[-1]), []).append(i)

    def _prefix_hashes(self, seq: Sequence[int]) -> Tensor:
        """h[k] = sum_{i <= k} (seq[i] + 1) * BASE^i mod MOD: the hash of seq[:k + 1]. Shape: (L,).
        Values stay below 2^62: ids and code points are < 2^31, as is every power and term."""
        while len(self._powers) < len(seq):
            step = pow(self.BASE, len(self._powers), self.MOD)
            self._powers = torch.cat([self._powers, self._powers * step % self.MOD])
        terms = (torch.tensor(list(seq), dtype=torch.long) + 1) * self._powers[:len(seq)] % self.MOD
        return terms.cumsum(0) % self.MOD

    def prefixes_of(self, seq: Sequence[int], proper: bool = False) -> list[int]:
        """The indices of the keys `seq` starts with (`proper`: and is longer than), ascending."""
        if not len(seq) or not self._by_hash:
            return []
        found = []
        for position, value in enumerate(self._prefix_hashes(seq).tolist()):
            length = position + 1
            if value not in self._by_hash or (proper and length == len(seq)):
                continue
            found += [i for i in self._by_hash[value]
                      if len(self.keys[i]) == length and list(self.keys[i]) == list(seq[:length])]
        return sorted(found)


def _text_codes(text: str) -> list[int]:
    return list(text.encode("utf-8"))     # a prefix as bytes is a prefix as text (UTF-8 is prefix-free)


def find_continuations(records: Sequence[ExperienceRecord]) -> tuple[list[Optional[int]], int]:
    """For each record, the earlier record it continues (its prompt ids start with that record's
    prompt and response ids), or None; and how many records continue an earlier one as text (their
    prompt starts with its prompt and response text, and is longer) but not as ids: unjoined turns.

    Among several matches the longest wins (C continues B, not B's own predecessor A); among equal
    ones (identical choices or requests) the first not yet continued, else the last."""
    ends = PrefixIndex([r.prompt_token_ids + r.response_token_ids for r in records])
    texts = PrefixIndex([_text_codes(r.prompt + r.response) for r in records])
    parents: list[Optional[int]] = []
    continued = [False] * len(records)
    unjoined = 0
    for i, record in enumerate(records):
        found = [j for j in ends.prefixes_of(record.prompt_token_ids) if j < i]
        if found:
            longest = max(len(ends.keys[j]) for j in found)
            found = [j for j in found if len(ends.keys[j]) == longest]
            parent = next((j for j in found if not continued[j]), found[-1])
            continued[parent] = True
            parents.append(parent)
            continue
        parents.append(None)
        if any(j < i for j in texts.prefixes_of(_text_codes(record.prompt), proper=True)):
            unjoined += 1
    return parents, unjoined


def conversations(parents: Sequence[Optional[int]]) -> list[list[int]]:
    """The chains of records to train on: one per record no later record continues (in recording
    order), each its path from the conversation's first record."""
    continued = {p for p in parents if p is not None}
    chains = []
    for leaf in range(len(parents)):
        if leaf in continued:
            continue
        chain = [leaf]
        while parents[chain[-1]] is not None:
            chain.append(parents[chain[-1]])
        chains.append(chain[::-1])
    return chains


def episode_sample(turns: Sequence[tuple[ExperienceRecord, Optional[float]]]) -> RecordedSample:
    """The sample of a chain of records (each with its feedback or None): the first prompt, every
    response with the tokens each next prompt added in between (see the module docstring)."""
    first = turns[0][0]
    response: list[int] = []
    mask: list[bool] = []
    log_probs: list[float] = []
    turn_rewards: list[tuple[int, float]] = []
    start = 0
    for k, (record, reward) in enumerate(turns):
        # This prompt is the first prompt, the response so far, then what the client added.
        between = record.prompt_token_ids[len(first.prompt_token_ids) + len(response):]
        response += between
        mask += [False] * len(between)
        log_probs += [0.0] * len(between)
        start = len(response)
        response += record.response_token_ids
        mask += [True] * len(record.response_token_ids)
        log_probs += record.log_probs
        if reward is not None and k < len(turns) - 1:
            turn_rewards.append((len(response) - 1, float(reward)))
    last, reward = turns[-1]
    return RecordedSample(first.prompt_token_ids, response, log_probs, 0.0 if reward is None else float(reward),
                          min(int(r.policy_version) for r, _ in turns), last.id, mask, turn_rewards, len(turns),
                          start)


def check_record(record: ExperienceRecord, where: str, fingerprint: str, vocab: int) -> None:
    """Refuses a record another tokenizer made, or one that cannot train; `where` names it."""
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


class RecordedExperienceDataset(Dataset):
    """The rewarded conversations of a record folder, a chat's turns joined into one episode (see
    the module docstring), in the order their last turns were recorded (`max_samples`: the first
    ones). Items are `(RecordedSample, reward)`; `collate_fn` makes `(samples, rewards)` lists.
    `unrewarded` counts the conversations without any feedback, `unjoined_turns` the records that
    continue an earlier one as text but not as token ids (trained as single-turn samples).

    Every record must come from a tokenizer with the same vocabulary as `tokenizer` (their token
    ids are trained on as they are); a record from another one is an error naming the line."""

    def __init__(self, folder: str | Path, tokenizer: Any, max_samples: Optional[int] = None):
        records, path = read_records(folder)
        fingerprint = tokenizer_fingerprint(tokenizer)
        vocab = len(tokenizer)
        for number, (record, _) in enumerate(records, start=1):
            check_record(record, f"{path}: record {number} (id {record.id!r}, index {record.index})", fingerprint,
                         vocab)
        parents, self.unjoined_turns = find_continuations([record for record, _ in records])
        self.samples: list[RecordedSample] = []
        self.unrewarded = 0
        for chain in conversations(parents):
            turns = [records[i] for i in chain]
            if all(reward is None for _, reward in turns):
                self.unrewarded += 1
                continue
            if max_samples is not None and len(self.samples) >= max_samples:
                continue
            self.samples.append(episode_sample(turns))
        self.source = str(path)
        joined = [s.turns for s in self.samples if s.turns > 1]
        if joined:
            logger.info("%s: %d chats of %d turns in all train as one episode each", path, len(joined), sum(joined))
        if self.unjoined_turns:
            logger.warning(
                "%s: %d chat turn(s) continue an earlier response as text but not as token ids (the server "
                "re-rendered the answer differently: a special token the decoded text dropped, a chat template that "
                "does not write the end-of-turn token the model sampled, or a client that edited the answer); they "
                "train as separate single-turn samples", path, self.unjoined_turns)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx: int) -> tuple[RecordedSample, float]:
        sample = self.samples[idx]
        return sample, sample.reward

    @staticmethod
    def collate_fn(batch: list[tuple[RecordedSample, float]]) -> tuple[list[RecordedSample], list[float]]:
        samples, rewards = zip(*batch)
        return list(samples), list(rewards)


def recorded_rollout(samples: Sequence[RecordedSample], pad_token_id: int,
                     eos_token_ids: Sequence[int]) -> tuple[RolloutOutput, RewardBatch]:
    """The rollout and rewards of a batch of recorded samples: every sample an episode
    (`RolloutOutput.from_episodes`; a single-turn one has one turn and no holes), its last turn cut
    after its first EOS token and flagged truncated without one, as `RolloutOutput.from_token_lists`
    does with single responses; per-turn rewards as token rewards (None when the batch has none);
    `info["turns"]` the turns of each sample. Shape: token_rewards (B, A)."""
    eos = set(eos_token_ids)
    responses, masks, log_probs, truncated = [], [], [], []
    for s in samples:
        ids = s.response_token_ids
        end = next((j + 1 for j in range(s.last_turn_start, len(ids)) if ids[j] in eos), len(ids))
        responses.append(ids[:end])
        masks.append(s.loss_mask[:end])
        log_probs.append(s.log_probs[:end])
        truncated.append(ids[end - 1] not in eos)
    rollout = RolloutOutput.from_episodes([s.prompt_token_ids for s in samples], responses, masks, log_probs,
                                          truncated, pad_token_id)
    token_rewards = None
    if any(s.turn_rewards for s in samples):
        token_rewards = torch.zeros(rollout.action_mask.shape, dtype=torch.float32)    # (B, A)
        for row, s in enumerate(samples):
            for position, value in s.turn_rewards:
                token_rewards[row, position] += value
    rewards = RewardBatch(scores=torch.tensor([s.reward for s in samples], dtype=torch.float32),
                          valid=torch.ones(len(samples), dtype=torch.bool), token_rewards=token_rewards,
                          info={"turns": torch.tensor([float(s.turns) for s in samples])})
    return rollout, rewards


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
    """Each step's experience from a batch of recorded samples (served traffic: single responses
    and chats joined into episodes, `recorded_rollout`): their token ids and sampling log-probs as
    the server stored them, scored by their recorded rewards (a chat's earlier turns' as token
    rewards); the reference and critic forwards, the KL and the advantages are this trainer's.
    Each Experience's `info["policy_version"]` is the step of the weights that served it (a chat's
    oldest), `info["turns"]` its turns (rollout/turns). The samples come from whatever policy
    served them, so the engine-gap check does not apply."""

    checks_engine = False

    def start(self, context: SourceContext) -> None:
        self.context = context
        self._batches = context.prompts.batches(context.consumed_samples)

    def next(self, step: int, params=None) -> Optional[SourceBatch]:
        """The next batch of recorded samples, as served (`params` do not apply: nothing is sampled)."""
        batch = next(self._batches, None)
        if batch is None:
            return None
        samples, _ = batch
        services = self.context.services
        started = time.perf_counter()
        services.builder.eval_models()
        rollout, rewards = recorded_rollout(samples, services.generator.tokenizer.pad_token_id,
                                            services.builder.eos_token_ids)
        built = services.builder.build(rollout, rewards, 1)
        versions = torch.tensor([float(s.policy_version) for s in samples])
        for experience in built.experiences:
            experience.info["policy_version"] = versions[:experience.batch_size]
        return SourceBatch.of([built], self.context.rollout_batch_size,
                              timings={"generate": 0.0, "reward": 0.0, "experience": time.perf_counter() - started})

    def after_step(self, step: int, logs: Optional[dict[str, float]] = None) -> dict[str, float]:
        return {}

    def stop(self, preempted: bool = False) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
