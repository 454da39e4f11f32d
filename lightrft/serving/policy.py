"""The policy behind `lightrft.cli.serve`: a Hugging Face model, its tokenizer, a rollout engine
that reports the log-probs of what it samples, and a policy version that moves when new weights
are loaded (`WeightWatcher` loads the exports a training run writes)."""

import logging
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightrft.models.vocabulary import check_vocabulary
from lightrft.rollout.base import SamplingParams
from lightrft.rollout.hf_engine import hf_engine_for
from lightrft.serving.records import tokenizer_fingerprint

logger = logging.getLogger("lightrft.serve")
_STEP_EXPORT = re.compile(r"^global_step(\d+)_hf$")


@dataclass
class Sample:
    """One generated response."""

    token_ids: list[int]        # (A,) up to and including the EOS token when it stopped on one
    log_probs: list[float]      # (A,) log-probs of those tokens under the sampling distribution
    truncated: bool             # hit max_new_tokens without an EOS token
    policy_version: int


def export_step(path: str | Path) -> int | None:
    """N for a `global_stepN_hf` folder written by train_ppo --save_hf_ckpt, else None."""
    match = _STEP_EXPORT.match(Path(path).name)
    return int(match.group(1)) if match else None


@dataclass
class _Request:
    """One prompt waiting in `ServedPolicy.generate`."""

    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    done: threading.Event = field(default_factory=threading.Event)
    samples: list[Sample] | None = None
    error: BaseException | None = None


class ServedPolicy:
    """Generates with the weights of one Hugging Face folder at a time; `load` swaps them.

    Generation and loading hold one lock, so a request is answered by one set of weights and its
    `policy_version` says which: the training step of the export (`global_stepN_hf` is version N;
    a folder with no step in its name is version 0, or one more than the previous weights).

    Requests that arrive while a generation runs wait in a queue, and the next generation takes
    the oldest one together with the others that ask for the same sampling options (up to
    `max_batch_prompts` prompts): one engine call for them all. Each prompt keeps its own seed, so
    its samples do not depend on the company it was generated in. A lone request is never held
    back to wait for company."""

    def __init__(self, path: str | Path, tokenizer: Any, eos_token_ids: list[int], *, bf16: bool = False,
                 device: str | torch.device = "cpu", attn_implementation: str | None = None,
                 trust_remote_code: bool = False, max_batch_prompts: int = 16):
        if max_batch_prompts < 1:
            raise ValueError(f"--max_batch_prompts must be at least 1, got {max_batch_prompts}")
        self.max_batch_prompts = max_batch_prompts
        self._queue: list[_Request] = []
        self._queue_lock = threading.Lock()
        self.batches = 0            # engine calls made for requests, for logs and tests
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        self.dtype = torch.bfloat16 if bf16 else torch.float32
        self.device = torch.device(device)
        self.attn_implementation = attn_implementation
        self.trust_remote_code = trust_remote_code
        self._lock = threading.Lock()
        self.version = -1
        self.path = None
        self.load(path)

    def load(self, path: str | Path, version: int | None = None) -> None:
        """Loads the weights of `path` and makes them the served policy at `version` (default: the
        step in the folder name, else the previous version + 1). A folder whose tokenizer differs
        from the served one is refused: recorded token ids would mean other text."""
        from lightrft.models.families import family_of, load_model
        from lightrft.models.tokenizer import build_tokenizer

        path = Path(path)
        if (path / "tokenizer_config.json").exists():
            other = build_tokenizer(str(path), trust_remote_code=self.trust_remote_code)
            if tokenizer_fingerprint(other) != self.fingerprint:
                raise ValueError(f"{path} has a different tokenizer from the served model; serve it with its own "
                                 "server (--pretrain) instead of loading it as new weights")
        kwargs = {"attn_implementation": self.attn_implementation} if self.attn_implementation else {}
        model = load_model(path, dtype=self.dtype, trust_remote_code=self.trust_remote_code, **kwargs).to(self.device).eval()
        check_finite_weights(model, path)
        # Requests are checked against the rows as they come (OpenAIServer.check_prompt_ids).
        rows = check_vocabulary(model, self.tokenizer, str(path), chat_template=True)
        if version is None:
            step = export_step(path)
            version = step if step is not None else self.version + 1
        family = family_of(model)
        engine = hf_engine_for(model, self.tokenizer, self.eos_token_ids,   # a request's samples at once
                               family=family)
        with self._lock:
            self.model, self.engine, self.path, self.version = model, engine, path, version
            self.vocab_rows = rows
            self.context_len = family.context_length(model.config)
        logger.info("serving %s as policy version %d", path, version)

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, seed: int) -> list[Sample]:
        """`params.n` responses to one prompt; sample j draws from `sample_seed(seed, j)`. Thread
        safe: concurrent callers are generated in shared engine calls (class docstring)."""
        request = _Request(list(prompt_token_ids), params, seed)
        with self._queue_lock:
            self._queue.append(request)
        while not request.done.is_set():
            with self._lock:          # one batch at a time, never across a weight swap
                if not request.done.is_set():
                    self._run(self._take_batch())
        if request.error is not None:
            raise request.error
        return request.samples

    def _take_batch(self) -> list[_Request]:
        """The oldest waiting request and the later ones with the same sampling options."""
        with self._queue_lock:
            first = self._queue[0]
            batch = [r for r in self._queue if r.params == first.params][:self.max_batch_prompts]
            taken = {id(r) for r in batch}
            self._queue = [r for r in self._queue if id(r) not in taken]
        return batch

    @torch.no_grad()
    def _run(self, batch: list[_Request]) -> None:
        """One engine call for `batch` (the lock held); every request gets its samples or the error."""
        try:
            params = batch[0].params
            rollout = self.engine.generate([r.prompt_token_ids for r in batch], params, seeds=[r.seed for r in batch])
            self.batches += 1
            for i, request in enumerate(batch):
                request.samples = []
                for j in range(i * params.n, (i + 1) * params.n):        # rows: prompt-major, n per prompt
                    mask = rollout.action_mask[j]
                    request.samples.append(Sample(token_ids=rollout.responses[j][mask].tolist(),
                                                  log_probs=rollout.rollout_log_probs[j][mask].tolist(),
                                                  truncated=bool(rollout.truncated[j]), policy_version=self.version))
        except Exception as err:      # each caller answers its client; the server stays up
            for request in batch:
                request.error = err
        finally:
            for request in batch:
                request.done.set()


def check_finite_weights(model: torch.nn.Module, path: Path) -> None:
    """Refuses weights holding NaN or infinity (a run that diverged, a torn write): served, they
    would answer with NaN log-probs, and recorded, train on them."""
    bad = [name for name, param in model.named_parameters() if not bool(torch.isfinite(param).all())]
    if bad:
        raise ValueError(f"{path}: {len(bad)} weight tensors hold NaN or infinite values ({', '.join(bad[:3])}"
                         f"{', ...' if len(bad) > 3 else ''}); not served")


def export_candidates(folder: Path) -> list[tuple[Path, int | None]]:
    """The exports in `folder`, newest first: its `global_stepN_hf` folders holding a config.json
    (train_ppo --save_hf_ckpt under --ckpt_path) by decreasing N; else `folder` itself when it is a
    Hugging Face folder (train_ppo's final export at --save_path). Empty when there is none yet."""
    if not folder.is_dir():
        return []
    steps = [(export_step(p), p) for p in folder.iterdir() if p.is_dir() and export_step(p) is not None]
    steps = sorted(((n, p) for n, p in steps if (p / "config.json").exists()), reverse=True)
    if steps:
        return [(path, n) for n, path in steps]
    return [(folder, None)] if (folder / "config.json").exists() else []


def newest_weights(folder: Path) -> tuple[Path, int | None] | None:
    """The newest export in `folder` (`export_candidates`), or None."""
    candidates = export_candidates(folder)
    return candidates[0] if candidates else None


def _stamp(path: Path) -> tuple:
    """What an export folder holds: its identity and every file's name, size and modification time.
    It changes when the folder is replaced (a new inode) and while a copy into it goes on."""
    files = sorted((p.name, stat.st_size, stat.st_mtime_ns) for p in path.iterdir() if p.is_file()
                   for stat in [p.stat()])
    return path.resolve(), path.stat().st_ino, tuple(files)


class WeightWatcher:
    """Polls `folder` every `interval` seconds and loads the newest export newer than the served
    policy (`export_candidates`). An export that fails to load (a different tokenizer, a folder
    still being copied, NaN weights) is logged once and skipped while its files stay as they are:
    the next older new export is tried, the old weights keep serving, and the failed one is tried
    again when its files change (a copy that finished)."""

    def __init__(self, policy: ServedPolicy, folder: str | Path, interval: float = 10.0):
        if interval <= 0:
            raise ValueError(f"--watch_interval must be positive, got {interval}")
        self.policy = policy
        self.folder = Path(folder)
        self.interval = interval
        self._seen = None
        self._failed: dict[Path, tuple] = {}     # export -> its stamp when it failed to load
        found = newest_weights(self.folder)
        # What is already there when the server starts counts as seen unless it is newer.
        if found is not None and (found[1] is None or found[1] <= policy.version):
            self._seen = _stamp(found[0])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="lightrft-weight-watcher")

    def start(self) -> "WeightWatcher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def poll(self) -> bool:
        """Loads the newest new export that loads; True when the served weights changed."""
        for path, step in export_candidates(self.folder):
            if step is not None and step <= self.policy.version:
                return False                     # this one and the rest are not newer
            try:
                stamp = _stamp(path)
            except FileNotFoundError:            # removed while we looked
                continue
            if stamp == self._seen or self._failed.get(path) == stamp:
                continue
            try:
                self.policy.load(path, version=step if step is not None else self.policy.version + 1)
            except Exception:  # keep serving the old weights; retried once the folder's files change
                logger.exception("loading new weights from %s failed; still serving version %d", path,
                                 self.policy.version)
                self._failed[path] = stamp
                continue
            self._failed.pop(path, None)
            self._seen = stamp
            return True
        return False

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()
