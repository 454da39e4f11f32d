"""Weights from trainers to explorers over the control channel.

`WeightPublisher` (trainer rank 0) and `WeightSubscriber` (explorers): new weights, retries and
the stop signal; the weights themselves go inline (`broadcast`) or through a folder
(`checkpoint`, `latest_published` reads the newest). The subscriber always receives at once, so
publishing never waits on generation. What is published is the trainer's `WeightStream`.

Delta publishing (`--weight_sync delta` or the default `auto`, with `broadcast`): after the first version,
each tensor travels as its change since the previous version (`lightrft.rollout.delta`): nothing
when no bit changed, the changed elements (int32 flat indices and values) when few changed, else
whole. Every subscriber receives every message in order, so it rebuilds each version from the
previous one, bit for bit what a full publish would have sent. The publisher's thread computes
the deltas, off the training path, against a host copy of the last published weights (the
weights once more in host memory on trainer rank 0). A `checkpoint` folder is read from its
newest file alone by explorers that may start at any time, so its files are always full.
"""


import os
import queue
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from lightrft.strategy.checkpoint_io import load_plain
from lightrft.explorers.roles import flatten_tensors, unflatten_tensors
from lightrft.rollout.delta import SentWeights, TensorDelta

class WeightPublisher:
    """Trainer rank 0's side of the control channel: publishes (version, weights) and control
    messages in order from a thread, holding at most one unsent set of weights. With `delta`
    (and `broadcast`) a version after the first carries only what changed (module doc).
    `sent_bytes` and `sent_seconds` list the weight bytes of each published version and the
    seconds its encoding and sending took."""

    def __init__(self, channel, method: str = "broadcast", sync_dir: Optional[str] = None, keep: int = 2,
                 delta: bool = True):
        self.channel, self.method, self.keep = channel, method, keep
        self.sync_dir = Path(sync_dir) if sync_dir else None
        if method == "checkpoint":
            self.sync_dir.mkdir(parents=True, exist_ok=True)
        self.sent = SentWeights() if delta and method == "broadcast" else None
        self.outbox: queue.Queue = queue.Queue(maxsize=1)
        self.error: Optional[BaseException] = None
        self.published = 0
        self.sent_bytes: list[int] = []
        self.sent_seconds: list[float] = []
        self.thread = threading.Thread(target=self._run, name="lightrft-weight-publisher", daemon=True)
        self.thread.start()

    def publish(self, version: int, named: list[tuple[str, torch.Tensor]], start_batch: int,
                adapter: Optional[dict] = None, offset: Optional[int] = None) -> None:
        """Queues the weights of `version` (copied to host memory here, so training may go on).
        `adapter`: a LoRA actor's adapter name and config (`WeightStream.adapter_spec`), for
        explorers whose engine serves the adapter apart from the base weights. `offset`: the
        explorers' offset from this version on, under --auto_sync_offset."""
        self._check()
        spec = [(name, tuple(t.shape), t.dtype) for name, t in named]
        message = {"kind": "weights", "version": version, "start_batch": start_batch, "spec": spec}
        if adapter is not None:
            message["adapter"] = adapter
        if offset is not None:      # --auto_sync_offset: the offset the explorers schedule by from now on
            message["offset"] = offset
        self.outbox.put((message, flatten_tensors([t for _, t in named])))

    def send(self, message: dict) -> None:
        self._check()
        self.outbox.put((message, None))

    def close(self, timeout: float) -> None:
        self.outbox.put(({"kind": "stop"}, None))
        self.thread.join(timeout)

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"sending weights to the explorers failed: {self.error}") from self.error

    def _run(self) -> None:
        try:
            while True:
                message, data = self.outbox.get()
                started = time.perf_counter()
                if data is not None and self.sent is not None:
                    message, data = self._encode(message, data)
                if data is not None:
                    self.sent_bytes.append(int(data.numel()))
                if data is not None and self.method == "checkpoint":
                    message = {**message, "path": str(self._write(message, data))}
                    data = None
                self.channel.publish(message, data)
                if message["kind"] == "weights":
                    self.published += 1
                    self.sent_seconds.append(time.perf_counter() - started)
                if message["kind"] == "stop":
                    return
        except BaseException as err:
            self.error = err

    def _encode(self, message: dict, data: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """The weights message as deltas against the previous version: `spec` then describes the
        pieces sent (a whole tensor, or a sparse one's indices then values) and `delta` lists per
        tensor its (name, shape, dtype, form), form "same", "whole" or "sparse"."""
        forms, pieces, spec = [], [], []
        for name, tensor in unflatten_tensors(data, message["spec"]):
            delta = self.sent.delta(name, tensor)
            form = "same" if delta is None else "sparse" if delta.sparse else "whole"
            forms.append((name, tuple(tensor.shape), tensor.dtype, form))
            if delta is not None:
                parts = [delta.values] if not delta.sparse else [delta.indices, delta.values]
                pieces += parts
                spec += [(name, tuple(part.shape), part.dtype) for part in parts]
        return {**message, "spec": spec, "delta": forms}, flatten_tensors(pieces)

    def _write(self, message: dict, data: torch.Tensor) -> Path:
        """`<sync_dir>/policy_v<version>.pt`, written whole or not at all; older ones pruned."""
        path = self.sync_dir / f"policy_v{message['version']:08d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save({"version": message["version"], "spec": message["spec"], "data": data}, tmp)
        os.replace(tmp, path)
        for old in sorted(self.sync_dir.glob("policy_v*.pt"))[:-self.keep]:
            old.unlink(missing_ok=True)
        return path


def latest_published(sync_dir: str | os.PathLike) -> Optional[tuple[int, list[tuple[str, torch.Tensor]]]]:
    """The newest (version, named weights) in a `--sync_method checkpoint` folder, or None: what an
    explorer running as a separate job polls."""
    files = sorted(Path(sync_dir).glob("policy_v*.pt"))
    return read_published(files[-1]) if files else None


def read_published(path: str | os.PathLike) -> tuple[int, list[tuple[str, torch.Tensor]]]:
    """(version, named weights) of one file `WeightPublisher` wrote: a dict of an int, the spec
    (names, shapes, dtypes) and one uint8 tensor, so it is read as plain data (`load_plain`): a file
    holding any other object is refused unread."""
    state = load_plain(path, f"published weights {path} (--sync_method checkpoint)")
    return state["version"], unflatten_tensors(state["data"], state["spec"])


class WeightSubscriber:
    """An explorer's side of the control channel: a thread that receives every message at once
    and keeps the published weights the explorer may still need (by version), the retry
    requests addressed to this explorer and the stop signal."""

    def __init__(self, channel, explorer_index: int):
        self.channel, self.explorer_index = channel, explorer_index
        self.versions: dict[int, list] = {}     # version -> named weights, oldest first
        self.latest: Optional[list] = None      # the newest weights received, what a delta applies to
        self.start_batch: Optional[int] = None  # the first message's: where the trainers stand
        # (batch, oldest version it may be generated with or None, whether a copy already sent is asked again)
        self.retries: list[tuple[int, Optional[int], bool]] = []
        self.adapter: Optional[dict] = None     # a LoRA actor's adapter name and config, when published
        self.offset: Optional[int] = None       # --auto_sync_offset: the offset last published with weights
        self.stopped = False
        self.error: Optional[BaseException] = None
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="lightrft-weight-subscriber", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                message, data = self.channel.receive()
                if message["kind"] == "weights":
                    named = (read_published(message["path"])[1] if "path" in message
                             else unflatten_tensors(data, message["spec"]))
                    if "delta" in message:
                        named = apply_published_delta(self.latest, message["delta"], named)
                    self.latest = named
                    with self.cond:
                        self.adapter = message.get("adapter", self.adapter)
                        self.offset = message.get("offset", self.offset)
                        self.versions[message["version"]] = named
                        if self.start_batch is None:
                            self.start_batch = message["start_batch"]
                        self.cond.notify_all()
                elif message["kind"] == "retry":
                    if message["explorer"] == self.explorer_index:
                        with self.cond:
                            self.retries.append((message["batch"], message.get("version"),
                                                 message.get("again", True)))
                            self.cond.notify_all()
                elif message["kind"] == "stop":
                    break
        except BaseException as err:
            self.error = err
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def wait(self, predicate) -> None:
        """Blocks until `predicate()` holds or the trainers said stop; raises if the channel failed."""
        with self.cond:
            self.cond.wait_for(lambda: self.stopped or predicate())
        if self.error is not None:
            raise RuntimeError(f"the control channel from the trainers failed: {self.error}") from self.error

    def wake(self) -> None:
        """Makes a waiting `wait` re-check its predicate (something else changed)."""
        with self.cond:
            self.cond.notify_all()

    def newest(self) -> int:
        """The newest version received; -1 before the first."""
        with self.cond:
            return max(self.versions, default=-1)

    def take(self, needed: int, newest: bool = False) -> tuple[int, list]:
        """The oldest received version >= `needed` (or the newest one), forgetting older ones:
        an explorer generates with exactly the version its batch calls for, so a run is
        reproducible whatever the timing."""
        with self.cond:
            candidates = [v for v in self.versions if v >= needed]
            version = max(self.versions) if newest or not candidates else min(candidates)
            for old in [v for v in self.versions if v < version]:
                del self.versions[old]
            return version, self.versions[version]


def apply_published_delta(previous: Optional[list], forms: list, pieces: list) -> list[tuple[str, torch.Tensor]]:
    """The named weights of a delta message (`WeightPublisher._encode`): `previous` (the version
    before, never modified: versions may still be in use) with each tensor replaced per its form.
    Unchanged tensors are shared with `previous`; nothing holds them mutably."""
    before, parts = dict(previous or []), iter(pieces)
    named = []
    for name, shape, dtype, form in forms:
        if form != "whole" and name not in before:
            raise RuntimeError(f"received a weight delta for {name} without its previous version: the explorer "
                               "missed a message of the control channel; restart the job")
        if form == "same":
            tensor = before[name]
        elif form == "whole":
            tensor = next(parts)[1]
        else:
            indices, values = next(parts)[1], next(parts)[1]
            tensor = before[name].clone()
            TensorDelta(name, values, indices).apply_to(tensor)
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise RuntimeError(f"weight delta for {name}: expected {tuple(shape)} {dtype}, rebuilt "
                               f"{tuple(tensor.shape)} {tensor.dtype}; the channel lost a message")
        named.append((name, tensor))
    return named
