"""Overlapped batches (`--overlap_batches`, with `--partial_rollouts`; docs/async.md).

Without it an explorer decodes a batch until its longest response ends, the rows that ended
idling beside it, and starts the next batch after. With it the explorer keeps up to two of its
batches in flight and decodes them together in segments of `SEGMENT_TOKENS` tokens: one engine
call per segment over every response still going, each continued from its tokens so far (the
engine recomputes the prefix, as a weight switch does). A batch is sent as soon as all its
responses ended, in batch order. Between two segments the explorer loads the newest weights it
received, so a response may span versions: each token carries the version that sampled it and
that version's log-prob.

`OverlappedBatches` is the decoding side: batches admitted, segments decoded, finished batches
handed back. When to admit the next batch is the explorer's (`Explorer._may_admit`).
"""

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from lightrft.rollout.base import RolloutOutput, SamplingParams
from lightrft.rollout.seeds import mix_seed, sample_seed

SEGMENT_TOKENS = 8      # tokens per segment: a weight switch or a new batch waits at most this long
# The next batch may start one sync early once at most this share of the batch in flight is still
# decoding. Measured on benchmarks/async.py's long tail (docs/benchmarks.md): 0.5 left the trainer
# idle 17-18% of the time against 31% without overlap; 1.0 (always two batches) did no better and
# made more tokens one sync older.
EARLY_START_GOING_SHARE = 0.5


def may_admit(in_flight: list["InFlight"], newest: int, required: int, sync_interval: int) -> bool:
    """Whether the next batch starts now, given the batches in flight, the newest weights received
    and the version the batch calls for: with those weights; or early, when at most
    EARLY_START_GOING_SHARE of the batch in flight is still going and the weights received are at
    most one sync (`sync_interval` versions) older. Never a third batch."""
    if len(in_flight) >= 2:
        return False
    if newest >= required:
        return True
    return (bool(in_flight) and in_flight[0].going_share <= EARLY_START_GOING_SHARE
            and newest >= required - sync_interval)


@dataclass
class InFlight:
    """One batch being decoded: its samples (n per prompt, contiguous) and what the explorer
    sends with it (`payload`)."""

    batch: int
    prompts: list[list[int]]            # per sample, its prompt's token ids
    seeds: list[int]                    # per sample, its sampling stream
    version: int                        # the weights it started with: the oldest of its tokens'
    payload: Any
    responses: list[list[int]] = field(default_factory=list)
    log_probs: list[list[float]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    going: list[int] = field(default_factory=list)      # samples still decoding, in order
    started: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        self.responses = [[] for _ in self.prompts]
        self.log_probs = [[] for _ in self.prompts]
        self.versions = [[] for _ in self.prompts]
        self.going = list(range(len(self.prompts)))

    @property
    def going_share(self) -> float:
        return len(self.going) / max(1, len(self.prompts))


@dataclass
class Finished:
    """A batch whose responses all ended."""

    batch: int
    rollout: RolloutOutput
    version: int
    payload: Any
    seconds: float          # from its admission to its last token


class OverlappedBatches:
    """Batches decoded together in segments over `engine` (any rollout engine's `generate`),
    sampled with `params` (`n` samples per prompt; the engine's own weight switch unused)."""

    def __init__(self, engine, params: SamplingParams, pad_token_id: int, eos_token_ids, segment: int = SEGMENT_TOKENS):
        if params.min_new_tokens:
            raise ValueError("overlapped batches decode in segments and keep no per-response minimum length: "
                             f"min_new_tokens must be 0, got {params.min_new_tokens}")
        self.engine, self.params, self.segment = engine, params, segment
        self.pad_token_id, self.eos = pad_token_id, set(eos_token_ids)
        self.in_flight: list[InFlight] = []

    def admit(self, batch: int, prompts: list[list[int]], seeds: list[int], version: int, payload: Any = None) -> None:
        """Starts batch `batch`: `prompts` token ids and their request seeds (one per prompt), the
        weights loaded being `version`. Sample j of prompt i draws from `sample_seed(seeds[i], j)`
        (the engines' one-call stream), each segment from that mixed with its offset."""
        n = self.params.n
        self.in_flight.append(InFlight(batch, [list(p) for p in prompts for _ in range(n)],
                                       [sample_seed(s, j) for s in seeds for j in range(n)], version, payload))

    def decode_segment(self, version: int) -> int:
        """One engine call over every response still going, at most `segment` tokens each, with
        the weights loaded now (`version`); returns the tokens sampled."""
        rows = [(batch, row) for batch in self.in_flight for row in batch.going]
        if not rows:
            return 0
        limit = self.params.max_new_tokens
        prompts = [batch.prompts[row] + batch.responses[row] for batch, row in rows]
        # A response continues from its own offset in its stream (the engines seed sample 0 of a request by it).
        seeds = [mix_seed(batch.seeds[row], len(batch.responses[row])) for batch, row in rows]
        longest = max(limit - len(batch.responses[row]) for batch, row in rows)
        params = dataclasses.replace(self.params, n=1, max_new_tokens=min(self.segment, longest))
        out = self.engine.generate(prompts, params, seeds=seeds)
        lengths = out.action_mask.sum(dim=-1).tolist()
        sampled = 0
        for k, (batch, row) in enumerate(rows):
            room = limit - len(batch.responses[row])
            kept = min(int(lengths[k]), room)       # a response nearer its limit than the segment stops there
            tokens = out.sequences[k, out.prompt_len:out.prompt_len + kept].tolist()
            batch.responses[row] += tokens
            batch.log_probs[row] += out.rollout_log_probs[k, :kept].tolist()
            batch.versions[row] += [version] * kept
            sampled += kept
        for batch in self.in_flight:
            batch.going = [row for row in batch.going if not self._ended(batch.responses[row])]
        return sampled

    def _ended(self, response: list[int]) -> bool:
        return len(response) >= self.params.max_new_tokens or bool(response and response[-1] in self.eos)

    def finished(self) -> list[Finished]:
        """The batches at the front whose responses all ended, in batch order, taken out."""
        done = []
        while self.in_flight and not self.in_flight[0].going:
            batch = self.in_flight.pop(0)
            done.append(Finished(batch.batch, self._rollout(batch), batch.version, batch.payload,
                                 time.perf_counter() - batch.started))
        return done

    def _rollout(self, batch: InFlight) -> RolloutOutput:
        return RolloutOutput.from_token_lists(batch.prompts, batch.responses, batch.log_probs, self.pad_token_id,
                                              self.eos, batch.versions)
