"""An explorer's loop: wait for the weights a batch calls for, generate, score, send (docs/async.md).

Batch b is the same prompts a colocated run would draw at that step (one shuffled order per
episode, seeded by --seed), generated with the same per-prompt seeds, by explorer b % N, with
policy version >= `RolesConfig.required_version(b)`. `run_explorer` is an explorer rank of
`train_ppo --explorer_ranks N`; the one-step-ahead mode runs the same `Explorer` on a thread
(`lightrft.explorers.link.start_ahead_explorer`). Either way the explorer receives its parts
built (`lightrft.builders.explorers`): this package sits below the builders.
"""


import itertools
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightrft.config.run import planned_steps
from lightrft.datasets.prompt_record import Prompt
from lightrft.experience.generation import Generation, rollout_generate_kwargs, sampling_params
from lightrft.experience.placement import arrive
from lightrft.experience.services import RolloutServices
from lightrft.explorers.batches import DONE, FAILED, RolloutBatch
from lightrft.explorers.overlap import Finished, OverlappedBatches, may_admit
from lightrft.explorers.weights import WeightSubscriber
from lightrft.rollout.manager import adapter_from_spec
from lightrft.utils.distributed_sampler import DistributedSampler


def load_named_weights(module: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> None:
    """Copies Hugging Face named weights into `module` in place (every name must exist)."""
    params = dict(module.named_parameters())
    unknown = [name for name, _ in named if name not in params]
    if unknown:
        raise ValueError(f"weights from the trainers do not fit the explorer's model: unknown {unknown[:3]}")
    with torch.no_grad():
        for name, tensor in named:
            params[name].copy_(tensor)


@dataclass
class ExplorerParts:
    """What an explorer generates and scores with, built from the run config by
    `lightrft.builders.explorers.build_explorer_parts`."""

    engine: Any                           # a rollout engine of the policy: HFEngine over `module`, or vLLM
    module: Optional[torch.nn.Module]     # the policy copy HFEngine decodes with; None under vLLM
    services: RolloutServices             # generation (over `engine`, with the workflow runner) and scoring:
    #                                       the trainer's services, with no experience builder
    prompts: Any                          # the PromptDataset of --prompt_data


class Explorer:
    """An explorer's loop: wait for the weights a batch calls for, generate, score, send.

    `parts` are the explorer's engine, policy copy, generation and scoring services and prompts
    (`ExplorerParts`): it generates and scores exactly as a colocated trainer does
    (`lightrft.experience.services`), with the seeds of the trainer ranks it serves. Scoring and
    sending batch b run on a thread of their own while batch b + 1 generates, so a slow reward
    source (an HTTP server's latency) stays off the generation's path; with --overlap_batches
    two batches decode together (`lightrft.explorers.overlap`). Explorer `index` of `explorers`
    takes batches index, index + explorers, ...; of each batch it generates global positions
    `first_position`, `first_position + stride`, ... (all of them on an explorer rank; one rank's
    share in the one-step-ahead mode) and sends trainer t of `trainers` every t-th of them: the
    prompts a colocated rank t would get."""

    def __init__(self, args, experience, control, parts: ExplorerParts, *, index: int = 0, explorers: int = 1,
                 trainers: int = 1, first_position: int = 0, stride: int = 1):
        self.args, self.experience, self.control = args, experience, control
        self.engine, self.module, self.prompts = parts.engine, parts.module, parts.prompts
        # The global positions of its prompts are those of the trainer ranks it serves: the seeds too.
        self.generator = parts.services.generator.at(first_position, stride)
        self.scorer = parts.services.scorer
        self.params = sampling_params(args.algorithm.n_samples_per_prompt, **rollout_generate_kwargs(args.rollout))
        self._scored: Optional[BackgroundCall] = None     # the batch being scored and sent
        self.roles = args.roles
        self.index, self.explorers, self.trainers = index, explorers, trainers
        self.first_position, self.stride = first_position, stride
        self.loaded_version = -1
        self.per_episode = len(self.prompts) // args.rollout.rollout_batch_size
        self.total_steps = planned_steps(args, len(self.prompts))
        # Dynamic sampling's steps take a varying number of batches: the stream goes on until stopped.
        self.endless = args.algorithm.dynamic_sampling
        self.sent_batches: set[int] = set()
        self.sampler = DistributedSampler(self.prompts, num_replicas=1, rank=0, shuffle=True,
                                          seed=args.distributed.seed, drop_last=True)
        self._orders: dict[int, list[int]] = {}
        self.sent = 0
        self._blocked = 0.0           # seconds waited for weights since the last batch started (`_wait_for_weights`)
        # --overlap_batches: its batches decoded two at a time, in segments (lightrft.explorers.overlap).
        self.overlap = (OverlappedBatches(self.generator.engine, self.params, self.engine.pad_token_id,
                                          self.engine.eos_token_ids) if args.roles.overlap_batches else None)

    def run(self) -> int:
        """Explores until the trainers say stop; returns the batches sent. An error is reported
        to the trainers (who raise it) before it propagates here."""
        subscriber = WeightSubscriber(self.control, self.index)
        try:
            subscriber.wait(lambda: subscriber.start_batch is not None)
            if subscriber.start_batch is not None and self.overlap is not None:
                self._explore_overlapped(subscriber, start=subscriber.start_batch)
            elif subscriber.start_batch is not None:
                self._explore(subscriber, start=subscriber.start_batch)
            self._settle()
        except BaseException:
            for trainer_rank in range(self.trainers):
                self.experience.send((FAILED, traceback.format_exc()), trainer_rank)
            raise
        for trainer_rank in range(self.trainers):
            self.experience.send(DONE, trainer_rank)
        return self.sent

    def _explore(self, subscriber: WeightSubscriber, start: int) -> None:
        planned = itertools.count(start) if self.endless else range(start, self.total_steps)
        for batch in planned:
            self._serve_retries(subscriber)
            if batch % self.explorers != self.index:
                continue
            while self.roles.staleness_policy == "wait" and batch not in self.sent_batches:
                # Woken by the trainers' requests too: a dynamic-sampling step asks for its refills.
                # The version needed is re-read on each wake: --auto_sync_offset moves it.
                self._wait_for_weights(subscriber, lambda: subscriber.newest() >= self._required(batch, subscriber)
                                       or bool(subscriber.retries) or self._scoring_failed())
                self._raise_scoring_error()
                if not subscriber.retries or subscriber.stopped:
                    break
                self._serve_retries(subscriber)
            if subscriber.stopped:
                return
            if batch not in self.sent_batches:      # a refill asked for earlier was this batch
                self._generate_and_send(batch, subscriber)
        while not subscriber.stopped:      # the trainers may still ask for a batch again
            subscriber.wait(lambda: bool(subscriber.retries) or self._scoring_failed())
            self._raise_scoring_error()
            self._serve_retries(subscriber)

    def _explore_overlapped(self, subscriber: WeightSubscriber, start: int) -> None:
        """--overlap_batches: this explorer's batches, up to two in flight, decoded together in
        segments; the newest weights received are loaded between segments, and each batch is
        scored and sent as soon as its responses all ended, in order."""
        planned = itertools.count(start) if self.endless else range(start, self.total_steps)
        mine = (batch for batch in planned if batch % self.explorers == self.index)
        upcoming = next(mine, None)
        while not subscriber.stopped:
            self._raise_scoring_error()
            if subscriber.retries:
                raise RuntimeError(f"an explorer with --overlap_batches was asked for rollout batch "
                                   f"{subscriber.retries[0][0]} again, which only --staleness_policy drop or "
                                   "--dynamic_sampling ask for (both refused with it); this is a bug")
            if upcoming is not None and self._may_admit(upcoming, subscriber):
                self._admit(upcoming, subscriber)
                upcoming = next(mine, None)
                continue
            if not self.overlap.in_flight:
                if upcoming is None:
                    break
                self._wait_for_weights(subscriber, lambda: subscriber.newest() >= self._required(upcoming, subscriber)
                                       or self._scoring_failed())
                self._raise_scoring_error()
                continue
            self._take_newer(subscriber)
            self.overlap.decode_segment(self.loaded_version)
            for done in self.overlap.finished():
                self._send_finished(done, subscriber)
        while not subscriber.stopped:      # the trainers are still training what was sent
            subscriber.wait(lambda: self._scoring_failed())
            self._raise_scoring_error()

    def _may_admit(self, batch: int, subscriber: WeightSubscriber) -> bool:
        """Whether batch `batch` starts now: with the weights it calls for received; or early, when
        at most half of the batch in flight is still going and the weights received are at most
        one sync (--sync_interval versions) older than those it calls for (`may_admit`)."""
        return may_admit(self.overlap.in_flight, subscriber.newest(), self._required(batch, subscriber),
                         self.roles.sync_interval)

    def _admit(self, batch: int, subscriber: WeightSubscriber) -> None:
        """Starts decoding batch `batch` with the newest weights received."""
        self._load(*subscriber.take(subscriber.newest(), newest=True), subscriber)
        self.sent_batches.add(batch)
        episode, ids, prompts, labels = self._batch_prompts(batch)
        # The seeds a colocated run draws at this step: rollout count batch + 1, global positions.
        seeds = self.generator.seeds(len(prompts), batch + 1)
        self.overlap.admit(batch, self.generator.tokenize(prompts), seeds, self.loaded_version,
                           payload=(episode, ids, prompts, labels))

    def _send_finished(self, done: Finished, subscriber: WeightSubscriber) -> None:
        """Scores and sends a batch whose responses all ended, on a thread of its own that first
        waits for the batch before it: decoding goes on meanwhile, batches leave in order."""
        episode, ids, prompts, labels = done.payload
        self._scored = BackgroundCall(self._score_and_send, done.batch, episode, ids, prompts, labels,
                                      Generation(done.rollout), done.version,
                                      {"generate": done.seconds, "blocked": self._take_blocked()}, subscriber,
                                      self._scored, on_error=subscriber.wake)

    def _serve_retries(self, subscriber: WeightSubscriber) -> None:
        """Generates what the trainers asked for: a batch again (it arrived too stale), or a
        batch they need before this explorer's schedule reached it (a refill), unless sent."""
        while subscriber.retries and not subscriber.stopped:
            batch, version, again = subscriber.retries.pop(0)
            if again or batch not in self.sent_batches:
                self._generate_and_send(batch, subscriber, version)

    def _refresh(self, batch: int, subscriber: WeightSubscriber, needed: Optional[int] = None) -> None:
        """Loads the weights batch `batch` is generated with: exactly the version it calls for
        (`needed` when the trainers named it, else its place in the schedule) when waiting, for
        which it waits; the newest received under --staleness_policy drop."""
        needed = self._required(batch, subscriber) if needed is None else needed
        if self.roles.staleness_policy == "wait":
            self._wait_for_weights(subscriber, lambda: subscriber.newest() >= needed)
            if subscriber.stopped:
                return
        newest = self.roles.staleness_policy == "drop" or self.roles.partial_rollouts
        version, named = subscriber.take(needed, newest=newest)
        self._load(version, named, subscriber)

    def _wait_for_weights(self, subscriber: WeightSubscriber, ready) -> None:
        """`subscriber.wait(ready)`, its seconds counted as blocked by the staleness bound: sent
        with the next batch (`seconds["blocked"]`), they tell --auto_sync_offset whether running
        further ahead would give this explorer work to do (lightrft.explorers.staleness)."""
        started = time.perf_counter()
        subscriber.wait(ready)
        self._blocked += time.perf_counter() - started

    def _take_blocked(self) -> float:
        blocked, self._blocked = self._blocked, 0.0
        return blocked

    def _load(self, version: int, named: list, subscriber: WeightSubscriber) -> None:
        """Loads published weights `version` into the engine (the policy copy, or vLLM)."""
        if version == self.loaded_version:
            return
        if self.module is not None:
            load_named_weights(self.module, named)
        elif getattr(self.engine, "lora_rank", 0) > 0:     # vLLM serving the run's LoRA adapter
            if subscriber.adapter is None:
                raise RuntimeError("the explorer's engine serves a LoRA adapter (--lora_rank) but the trainers "
                                   "published weights without one: trainers and explorers were started with "
                                   "different --lora_rank")
            self.engine.load_adapter(*adapter_from_spec(subscriber.adapter, named))
        else:
            self.engine.update_weights(named)
        self.loaded_version = version
        if self.roles.partial_rollouts:
            self.engine.version = version

    def _take_newer(self, subscriber: WeightSubscriber) -> Optional[int]:
        """Partial rollouts: loads the newest weights received when newer than those decoding,
        between two decoding steps (`HFEngine.weight_switch`); their version, else None."""
        if subscriber.stopped or subscriber.newest() <= self.loaded_version:
            return None
        self._load(*subscriber.take(subscriber.newest(), newest=True), subscriber)
        return self.loaded_version

    def _required(self, batch: int, subscriber: WeightSubscriber) -> int:
        """The oldest version batch `batch` may be generated with: by --sync_offset, or by the
        offset the trainers last published with their weights (--auto_sync_offset)."""
        return self.roles.required_version(batch, subscriber.offset)

    def _order(self, episode: int) -> list[int]:
        if episode not in self._orders:
            self.sampler.set_epoch(episode)
            self._orders = {episode: self.sampler.epoch_order()}
        return self._orders[episode]

    def _batch_prompts(self, batch: int) -> tuple[int, list[int], list[Prompt], list]:
        """Batch `batch`'s episode, the dataset rows of the whole batch, and this explorer's
        prompts and labels among them."""
        size = self.args.rollout.rollout_batch_size
        episode, position = divmod(batch, self.per_episode)
        ids = self._order(episode)[position * size:(position + 1) * size]
        mine = list(range(self.first_position, size, self.stride))
        prompts, labels = self.prompts.collate_fn([self.prompts[ids[p]] for p in mine])
        return episode, ids, prompts, labels

    def _generate_and_send(self, batch: int, subscriber: WeightSubscriber, needed: Optional[int] = None) -> None:
        self._refresh(batch, subscriber, needed)
        if subscriber.stopped:
            return
        self.sent_batches.add(batch)
        episode, ids, prompts, labels = self._batch_prompts(batch)
        started = time.perf_counter()
        version = self.loaded_version      # the batch's version: the oldest of its tokens'
        if self.roles.partial_rollouts:
            self.engine.weight_switch = lambda: self._take_newer(subscriber)
        with torch.no_grad():
            # The seeds a colocated run draws at this step: rollout count batch + 1, global positions.
            generation = self.generator.generate(prompts, labels, self.params, batch + 1)
        seconds = {"generate": time.perf_counter() - started, "blocked": self._take_blocked()}
        self._settle()                # the previous batch is scored and sent (in order), or its error raised
        self._scored = BackgroundCall(self._score_and_send, batch, episode, ids, prompts, labels, generation,
                                      version, seconds, subscriber, on_error=subscriber.wake)

    def _scoring_failed(self) -> bool:
        return self._scored is not None and self._scored.error is not None

    def _raise_scoring_error(self) -> None:
        """Raises the error of the batch being scored, if it failed (waits never outlast one)."""
        if self._scoring_failed():
            self._settle()

    def _settle(self) -> None:
        if self._scored is not None:
            scored, self._scored = self._scored, None
            scored.result()

    def _score_and_send(self, batch: int, episode: int, ids: list[int], prompts: list[Prompt], labels: list,
                        generation: Generation, version: int, seconds: dict, subscriber: WeightSubscriber,
                        before: Optional["BackgroundCall"] = None) -> None:
        """Scores batch `batch` and sends each trainer its share, once `before` (the batch before
        it, on a thread of its own) was scored and sent: one batch scores at a time, in order; its
        error is raised here."""
        if before is not None:
            before.result()
        n = self.params.n
        started = time.perf_counter()
        rollout = arrive(generation.rollout)       # from the engine's device to where experience is made
        rewards = self.scorer.score_generation(generation, prompts, labels, self.params)
        seconds = {**seconds, "reward": time.perf_counter() - started}
        if subscriber.stopped:       # the trainers are done: nobody will take it
            return
        for trainer_rank in range(self.trainers):
            local = list(range(trainer_rank, len(prompts), self.trainers))     # this explorer's prompts
            rows = [i * n + k for i in local for k in range(n)]
            share = RolloutBatch(batch=batch, episode=episode, version=version, prompt_ids=list(ids),
                                 rollout=rollout.select(rows), scores=rewards.scores[rows],
                                 valid=rewards.valid[rows], seconds=seconds,
                                 token_rewards=None if rewards.token_rewards is None else rewards.token_rewards[rows],
                                 info={k: v[rows] for k, v in rewards.info.items()})
            self.experience.send(share, trainer_rank)
        self.sent += 1


class BackgroundCall:
    """`fn(*args)` on a daemon thread (it must never keep a finished process alive); `result()`
    waits for it and raises its error."""

    def __init__(self, fn, *args, on_error=lambda: None):
        self.error: Optional[BaseException] = None
        self.on_error = on_error
        name = f"lightrft-{fn.__name__.strip('_')}"      # lightrft-score_and_send, lightrft-run
        self.thread = threading.Thread(target=self._run, args=(fn, *args), name=name, daemon=True)
        self.thread.start()

    def _run(self, fn, *args) -> None:
        try:
            fn(*args)
        except BaseException as err:  # re-raised by result() in the explorer's thread
            self.error = err
            self.on_error()

    def result(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def run_explorer(explorer: Explorer) -> dict:
    """An explorer rank of `train_ppo --explorer_ranks N` once built
    (`lightrft.builders.explorers.build_explorer`): explores until the trainers stop, then shuts
    its engine down and leaves the process group."""
    import torch.distributed as dist

    sent = explorer.run()
    # A vLLM engine's teardown needs this role's process group (VLLMEngine.shutdown), and destroys it.
    if explorer.engine.capabilities.needs_shutdown:
        explorer.engine.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
    return {"role": "explorer", "batches_sent": sent}
