"""DeepSpeed training strategy: process group, ZeRO engines, collectives, EMA, HF export and
crash-consistent checkpoints. The same code runs on CPU (gloo) and CUDA (NCCL).

Building models under ZeRO-3: build the model the same way on every rank after `setup_distributed`
(identical seeds give identical weights), then `prepare` partitions it inside
`deepspeed.initialize`; until then every rank holds a full copy. For models too large for that,
load them inside `strategy.zero3_init_context()`, which makes `from_pretrained` partition the
weights while loading (transformers' `HfDeepSpeedConfig` switched on for the duration).
"""

import contextlib
import functools
import importlib
import inspect
import os
import warnings
import resource
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightrft.config.run import RunConfig
from lightrft.strategy import checkpoint_io
from lightrft.strategy.config import StrategyConfig
from lightrft.strategy.ds_config import get_eval_ds_config, get_train_ds_config, gradient_accumulation_steps
from lightrft.strategy.hf_export import export_hf_folder
from lightrft.strategy.param_groups import weight_decay_groups
from lightrft.strategy.seeding import set_seed
from lightrft.utils.distributed import get_rank, get_world_size, is_dist_initialized
from lightrft.utils.distributed_sampler import DistributedSampler
from lightrft.utils.threads import configure_threads

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
REDUCE_OPS = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
              "min": dist.ReduceOp.MIN}
# Sub-folder of a checkpoint that holds DeepSpeed's own files (model and optimizer shards).
DS_SUBDIR = "deepspeed"
# A frozen engine under ZeRO-3 (prepared without an optimizer, such as the EMA copy) has no
# DeepSpeed checkpoint engine: its whole weights are written here instead (`save_ckpt`).
FROZEN_WEIGHTS = "frozen_weights.pt"
# A JIT build of DeepSpeed's CPU Adam takes about a minute; a build lock older than this was left
# by a killed build, and torch waits on it forever.
STALE_BUILD_LOCK_S = 300.0


# DeepSpeed calls torch collectives that torch now marks deprecated; the warning is not actionable
# for users and would repeat on every rank at every step.
warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor).* is deprecated",
                        category=FutureWarning)

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _is_zero3_param(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "ds_id")


def _without_checkpoint_engine(model) -> bool:
    """A DeepSpeed engine that cannot save itself: ZeRO-3 prepares a model without an optimizer
    as a parameter-offload engine with no checkpoint engine (its `save_checkpoint` fails on rank 0
    alone, before a barrier the other ranks then wait at)."""
    return hasattr(model, "save_checkpoint") and getattr(model, "checkpoint_engine", None) is None


def _fused_group_key(name: str) -> str:
    """The module a parameter must travel with: its decoder layer (`model.layers.3.mlp.up_proj.weight`
    -> `model.layers.3`), or its parent module when the name has no layer index."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1])


class PendingReduction:
    """A collective in flight (`DeepspeedStrategy.start_all_reduce`). `result()` waits for it the
    first time and returns the reduced value; `then(fn)` is the same collective with `fn` applied
    to its value."""

    def __init__(self, work, finish: Callable[[], object]):
        self._work, self._finish, self._done, self._value = work, finish, False, None

    def result(self):
        if not self._done:
            if self._work is not None:
                self._work.wait()
            self._value, self._done = self._finish(), True
        return self._value

    def then(self, fn: Callable) -> "PendingReduction":
        return PendingReduction(None, lambda: fn(self.result()))


def stale_build_lock(name: str) -> Path | None:
    """The lock file of torch's JIT build of the extension `name` (in $TORCH_EXTENSIONS_DIR or
    torch's default folder) when it is older than `STALE_BUILD_LOCK_S`, else None. A build killed
    with SIGKILL (or an unhandled SIGTERM) leaves the file, and every later build of that extension
    waits on it without a word."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    return lock if age > STALE_BUILD_LOCK_S else None


def warn_if_build_is_locked(name: str) -> None:
    """Says on stderr which file to delete when a stale build lock will make the build of `name` wait."""
    lock = stale_build_lock(name)
    if lock is not None:
        print(f"[rank {get_rank()}] waiting for the build lock {lock}, left {time.time() - lock.stat().st_mtime:.0f} s "
              f"ago: a build of the {name} extension that was killed leaves it behind and this build then waits "
              f"forever. If no other process on this machine is building {name}, delete {lock}",
              file=sys.stderr, flush=True)


DEEPSPEED_MUON_MODULE = "deepspeed.runtime.zero.muon.original_muon"


def deferred_compile(compile_fn: Callable) -> Callable:
    """`torch.compile` as a decorator that compiles a function on its first call instead of when
    it decorates it; the result of that call, and of every later one, is the compiled function's.
    Modules and anything but plain functions go to `compile_fn` at once."""

    def decorate(fn=None, **options):
        if fn is None:                                  # @torch.compile(mode=...) form
            return lambda inner: decorate(inner, **options)
        if not inspect.isfunction(fn):
            return compile_fn(fn, **options)
        compiled = None

        @functools.wraps(fn)
        def first_call_compiles(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(fn, **options)
            return compiled(*args, **kwargs)

        return first_call_compiles

    return decorate


def import_deepspeed_muon() -> None:
    """Imports DeepSpeed's Muon module with its `torch.compile` decorations deferred to each
    function's first call. DeepSpeed's ZeRO and bf16 optimizers import that module when they are
    built and on every gradient reduction, whatever the optimizer, and its decorations then load
    inductor's compiler: about 1.5 s of CPU per rank at every start (measured on 2 CPU cores), for
    an optimizer lightrft does not build. A Muon built by other code still compiles, on first use."""
    if DEEPSPEED_MUON_MODULE in sys.modules:
        return
    eager_compile = torch.compile
    torch.compile = deferred_compile(eager_compile)
    try:
        importlib.import_module(DEEPSPEED_MUON_MODULE)
    except ImportError:          # a DeepSpeed without Muon: nothing to defer
        pass
    finally:
        torch.compile = eager_compile


def release_deepspeed_groups() -> None:
    """Drops DeepSpeed's cached process groups (deepspeed.utils.groups) after the world group was
    destroyed by someone else (vLLM's teardown calls torch.distributed.destroy_process_group).
    Otherwise the next deepspeed.initialize in this process, under ZeRO-3, partitions over the
    dead group's clone and fails with "Group ... is not registered"."""
    from deepspeed.utils import groups

    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:
        release(group=None)
    else:                           # DeepSpeed versions before the helper kept only the clone
        groups._WORLD_GROUP = None


def skip_shared_memory_comm_op() -> None:
    """Keeps DeepSpeed from building its shared-memory all-reduce op when it joins the group.

    DeepSpeed's communication backend builds `deepspeed_shm_comm_op` at start-up on CPU machines:
    a C++ JIT compile on each machine's first run (40-85 s on a 2-core VM, the quickstart's first
    minute) and a load after it. Only DeepSpeed's inference all-reduce uses the op, which lightrft
    never calls; marked incompatible, that path would fall back to `torch.distributed`."""
    compatible = deepspeed.ops.__compatible_ops__    # DeepSpeed's per-launch probe, meant to be edited
    if "deepspeed_shm_comm" in compatible:
        compatible["deepspeed_shm_comm"] = False


class DeepspeedStrategy:
    """Owns the process group and turns models into DeepSpeed engines (see the module docstring).

    Typical use::

        strategy = get_strategy(run_config)    # or DeepspeedStrategy(StrategyConfig(...))
        strategy.setup_distributed()
        optim = strategy.create_optimizer(actor, lr=1e-6)
        (actor, optim, sched), ref = strategy.prepare((actor, optim, sched), ref)
        loss = ...; strategy.backward(loss, actor, optim); strategy.optimizer_step(optim, actor, sched)
        strategy.save_ckpt(actor, "ckpt/_actor", tag="global_step10", client_state={...})
        strategy.close()
    """

    def __init__(self, config: StrategyConfig):
        self.config = config
        self._ema_global_step: dict[int, int] = {}
        self._grad_norms: dict[int, torch.Tensor] = {}     # id(engine) -> norm, where `optimizer_step` clips
        self._hf_zero3_config = None
        # Why a checkpoint must be resumed on the number of ranks that saved it (None: any number,
        # through DeepSpeed's universal checkpoint; `load_ckpt`).
        self.same_ranks_reason: str | None = None
        self._sequence_parallel = None

    # ------------------------------------------------------------------------------------------
    # Process group

    def setup_distributed(self) -> None:
        """Joins the process group described by torchrun's environment (RANK, WORLD_SIZE,
        LOCAL_RANK, MASTER_ADDR, MASTER_PORT; several nodes work the same way). Without any of
        them the process becomes rank 0 of a world of 1 (a plain `python script.py`); the variables
        are then set in `os.environ`, because DeepSpeed's engine reads LOCAL_RANK from there.

        Backend: `config.backend`, else NCCL on CUDA and gloo on CPU; timeout
        `config.dist_timeout_minutes`. Seeds every generator with `config.seed`, the same on all
        ranks (see `lightrft.strategy.seeding`). Calling it again only re-seeds. CPU threads are
        split over the node's ranks (`lightrft.utils.threads.configure_threads`)."""
        present = [k for k in LAUNCH_ENV if k in os.environ]
        if not present:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(_free_port()))
        elif len(present) < len(LAUNCH_ENV):
            missing = [k for k in LAUNCH_ENV if k not in os.environ]
            raise RuntimeError(f"incomplete launcher environment: {', '.join(missing)} not set (found "
                               f"{', '.join(present)}); launch with torchrun, or set none of them to run "
                               f"as a single process")
        configure_threads()
        cuda = torch.cuda.is_available()
        backend = self.config.backend or ("nccl" if cuda else "gloo")
        if cuda:
            torch.cuda.set_device(self.local_rank)
        set_seed(self.config.seed)
        # Also when the group exists already (explorer roles start it): deepspeed.initialize then
        # starts DeepSpeed's communication backend itself, which would build the op.
        skip_shared_memory_comm_op()
        timeout = timedelta(minutes=self.config.dist_timeout_minutes)
        if not is_dist_initialized():
            if not present:
                # A world of one meets nobody: its group lives in an in-process store, with no port
                # to bind (a port picked free can be taken by another process before the bind).
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False, timeout=timeout)

    def close(self) -> None:
        """Leaves the process group cleanly; call it (or use `with strategy:`) at the end of
        every script.

        Why: ZeRO-3 gathers parameters with asynchronous collectives (prefetching included), which
        gloo runs on its own worker threads. If such a collective is still finishing when the
        interpreter shuts down, the worker thread releases the last reference to its output
        tensor, which needs the GIL; a thread taking the GIL during finalisation is ended with
        pthread_exit, whose unwinding through a C++ destructor calls std::terminate ("terminate
        called without an active exception", SIGABRT) after all the work is done. The barrier
        here (gloo's barrier waits for every earlier collective) lets that happen while Python is
        alive; the group is then destroyed. The groups' worker threads live on while anything
        holds a group (ZeRO-3 parameters do), and one can still be letting go of a finished
        collective's tensors as the process ends: lightrft's commands therefore end without
        finalising the interpreter (`lightrft.utils.program`).

        A vLLM rollout engine is shut down before this (`VLLMEngine.shutdown`, which waits at the
        same barrier): its teardown needs the group and destroys it, so here the group may be gone.
        DeepSpeed's own references to the groups (the world clone ZeRO-3 partitions over) are
        released either way, so a later run in the same process gets new ones."""
        if is_dist_initialized():
            dist.barrier()
            deepspeed.comm.destroy_process_group()     # releases DeepSpeed's references too
        else:
            release_deepspeed_groups()

    def __enter__(self) -> "DeepspeedStrategy":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        # After an error on this rank a barrier could wait forever for peers that carry on; the
        # launcher ends them instead.
        if exc_type is None:
            self.close()

    @property
    def rank(self) -> int:
        return get_rank()

    @property
    def world_size(self) -> int:
        return get_world_size()

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks sharing each packed training row (1: none)."""
        return self.config.sequence_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """Model replicas that train on different samples: the ranks over the sequence-parallel size."""
        return self.world_size // self.sequence_parallel_size

    @property
    def accumulated_gradient(self) -> int:
        """Micro-batches per optimizer step on each rank (DeepSpeed's gradient_accumulation_steps).
        The ranks of a sequence-parallel group train on the same micro-batches, so the step's
        samples are divided over the data-parallel replicas only."""
        return gradient_accumulation_steps(self.config.train_batch_size, self.config.micro_train_batch_size,
                                           self.data_parallel_size)

    @property
    def sequence_parallel(self):
        """This rank's sequence-parallel group (`lightrft.models.sequence_parallel.SequenceParallel`):
        consecutive ranks, `sequence_parallel_size` of them (on one node when that size divides the ranks
        per node);
        None with size 1. Made once; every rank builds every group, as torch requires."""
        size = self.sequence_parallel_size
        if size == 1:
            return None
        if self._sequence_parallel is None:
            from lightrft.models.sequence_parallel import SequenceParallel

            if self.world_size % size:
                raise ValueError(f"--sequence_parallel_size {size} must divide the number of ranks "
                                 f"({self.world_size}): each group of {size} ranks shares its rows")
            mine = None
            for first in range(0, self.world_size, size):
                group = dist.new_group(list(range(first, first + size)))
                if first <= self.rank < first + size:
                    mine = SequenceParallel(group, size, self.rank - first)
            self._sequence_parallel = mine
        return self._sequence_parallel

    def rank_generator(self, offset: int = 0, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator seeded with `seed + rank + offset`, for randomness that must differ per rank."""
        generator = torch.Generator(device=device)
        generator.manual_seed(self.config.seed + self.rank + offset)
        return generator

    def is_rank_0(self) -> bool:
        return self.rank == 0

    def print(self, *args, **kwargs) -> None:
        """`print` on rank 0 only."""
        if self.is_rank_0():
            print(*args, **kwargs, flush=True)

    def barrier(self) -> None:
        if is_dist_initialized():
            dist.barrier()

    # ------------------------------------------------------------------------------------------
    # Engines

    @property
    def clips_gradients(self) -> bool:
        """Whether `optimizer_step` clips the gradient norm itself instead of DeepSpeed: under ZeRO-0
        in fp32 every rank holds the same averaged gradients after the all-reduce, and DeepSpeed's
        clipping there averages the (equal) norms over the ranks with one more all-reduce per
        optimizer step. The formula is the same: g <- g * min(1, max_norm / (||g||_2 + 1e-6))."""
        return self.checks_gradients and self.config.max_norm > 0

    @property
    def checks_gradients(self) -> bool:
        """Whether `optimizer_step` measures the gradient norm itself and skips a step whose norm is
        not finite: under ZeRO-0 in fp32 DeepSpeed steps the plain torch optimizer, which would
        write a NaN gradient into the weights, while its ZeRO and bf16 optimizers skip such a step.
        Here it is skipped the same way: no update, no scheduler step, counted as skipped."""
        return self.config.zero_stage == 0 and not self.config.bf16

    def get_ds_train_config(self) -> dict:
        c = self.config
        # DeepSpeed counts every rank as a data-parallel one: its batch spans the repeated rows too.
        return get_train_ds_config(zero_stage=c.zero_stage,
                                   train_batch_size=c.train_batch_size * c.sequence_parallel_size,
                                   micro_train_batch_size=c.micro_train_batch_size, world_size=self.world_size,
                                   bf16=c.bf16, max_norm=0.0 if self.clips_gradients else c.max_norm,
                                   adam_offload=c.adam_offload,
                                   zero3_param_offload=c.zero3_param_offload, grad_accum_dtype=c.grad_accum_dtype,
                                   overlap_comm=c.overlap_comm, zero_reduce_bucket_size=c.zero_reduce_bucket_size,
                                   zero3_prefetch_bucket_size=c.zero3_prefetch_bucket_size,
                                   zero3_max_live_parameters=c.zero3_max_live_parameters,
                                   zero3_param_persistence_threshold=c.zero3_param_persistence_threshold)

    def get_ds_eval_config(self, offload: bool | None = None) -> dict:
        c = self.config
        return get_eval_ds_config(zero_stage=c.zero_stage, micro_batch_size=c.micro_train_batch_size,
                                  world_size=self.world_size, bf16=c.bf16,
                                  offload=c.ref_reward_offload if offload is None else offload)

    @contextlib.contextmanager
    def zero3_init_context(self):
        """While open, `transformers` `from_pretrained` builds models already partitioned for
        ZeRO-3 (nothing changes under other stages)."""
        if self.config.zero_stage != 3:
            yield
            return
        from transformers.integrations.deepspeed import HfDeepSpeedConfig

        # transformers keeps only a weak reference to this object; holding it keeps zero.Init on.
        self._hf_zero3_config = HfDeepSpeedConfig(self.get_ds_train_config())
        try:
            yield
        finally:
            self._hf_zero3_config = None

    def create_optimizer(self, model: nn.Module, lr: float, betas=(0.9, 0.95), weight_decay: float = 0.0):
        """AdamW over the trainable parameters, no decay on biases and norm weights: DeepSpeed's
        CPU Adam when `adam_offload` (optimizer states on the CPU), else torch's AdamW: fused on
        CUDA; on CPU the multi-tensor (foreach) form, which makes exactly the per-tensor loop's
        update at ~3/4 of its cost. (The fused CPU kernel is ~4x faster still, but its rounding
        differs and sends a run down another sampling trajectory.)"""
        groups = weight_decay_groups(self.unwrap_model(model), weight_decay)
        if self.config.adam_offload:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            warn_if_build_is_locked("cpu_adam")      # DeepSpeedCPUAdam builds it on first use

            return DeepSpeedCPUAdam(groups, lr=lr, betas=betas, weight_decay=weight_decay, adamw_mode=True)
        cuda = self.device.type == "cuda"
        return torch.optim.AdamW(groups, lr=lr, betas=betas, weight_decay=weight_decay, fused=cuda or None,
                                 foreach=None if cuda else True)

    def prepare(self, *models_or_triples):
        """Turns each argument into a DeepSpeed engine and returns them in the same structure:
        `(model, optimizer, scheduler)` -> `(engine, optimizer, scheduler)` trained with the train
        config; a model alone -> a frozen engine with the eval config (sharded under ZeRO-3,
        whole otherwise); None stays None. One argument returns one result, several a list."""
        if not is_dist_initialized():
            raise RuntimeError("DeepspeedStrategy.prepare needs the process group: call strategy.setup_distributed() "
                               "first (before building the models, so they are seeded alike on every rank)")
        import_deepspeed_muon()     # before DeepSpeed's optimizers import it themselves
        results = []
        for item in models_or_triples:
            if item is None:
                results.append(None)
            elif isinstance(item, (tuple, list)):
                if len(item) != 3:
                    raise ValueError("prepare takes a model, or a (model, optimizer, scheduler) triple "
                                     f"(scheduler may be None); got a sequence of {len(item)}")
                results.append(self._prepare_train(*item))
            else:
                results.append(self._prepare_eval(item))
        return results[0] if len(results) == 1 else results

    def _prepare_train(self, model, optimizer, scheduler):
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.get_ds_train_config(),
            dist_init_required=False)
        return engine, optimizer, scheduler

    def _prepare_eval(self, model):
        engine, *_ = deepspeed.initialize(model=model, config=self.get_ds_eval_config(), dist_init_required=False)
        engine.eval()
        return engine

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        """The module inside a DeepSpeed engine (the argument itself when it is not one)."""
        while isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        return model

    def backward(self, loss: torch.Tensor, model, optimizer=None) -> None:
        """Back-propagates `loss`. DeepSpeed divides it by the gradient accumulation steps and the
        gradients are averaged over ranks, so pass the mean loss of this rank's micro-batch."""
        model.backward(loss)

    def set_accumulation_boundary(self, boundary: bool, *models) -> None:
        """Whether the next micro-batch of `models` (None skipped) ends its optimizer step, for
        steps of a varying number of micro-batches (--micro_train_max_tokens): DeepSpeed otherwise
        counts `accumulated_gradient` of them. Its loss division by that count stays as it is
        (`PPOUpdate.loss_scale` undoes it), and ZeRO reduces the gradients at the boundary."""
        for model in models:
            if model is not None:
                model.set_gradient_accumulation_boundary(boundary)

    def optimizer_step(self, optimizer, model, scheduler=None, name: str = "model") -> None:
        """Counts a micro-batch; at the end of each accumulation window the gradients are clipped
        to `max_norm` (by DeepSpeed, or here when `clips_gradients`), and DeepSpeed steps the
        optimizer and the scheduler and zeroes the gradients. A window whose gradient norm is not
        finite makes no update (see `checks_gradients`)."""
        if self.checks_gradients and model.is_gradient_accumulation_boundary():
            params = [p for p in model.module.parameters() if p.grad is not None]
            max_norm = self.config.max_norm
            norm = (torch.nn.utils.clip_grad_norm_(params, max_norm) if max_norm > 0
                    else torch.nn.utils.get_total_norm([p.grad for p in params]))
            self._grad_norms[id(model)] = norm
            if not torch.isfinite(norm):
                self._skip_step(model, params)
                return
        model.step()

    @staticmethod
    def _skip_step(model, params: list[torch.Tensor]) -> None:
        """Ends an accumulation window without an update, as DeepSpeed's own optimizers skip an
        overflowing step: the gradients are dropped (torch's optimizers leave a parameter without
        one untouched), and the `overflow` flag DeepSpeed reads after `optimizer.step()` makes it
        count the step as skipped and leave the learning-rate scheduler where it was."""
        for p in params:
            p.grad = None
        model.optimizer.overflow = True      # the plain torch optimizer of ZeRO-0 fp32 has no flag of its own
        try:
            model.step()
        finally:
            model.optimizer.overflow = False

    def grad_norm(self, model) -> float | None:
        """The global gradient norm of `model`'s last optimizer step, before clipping (None when
        neither DeepSpeed nor `optimizer_step` measured one)."""
        norm = self._grad_norms.get(id(model))
        if norm is None:
            norm = model.get_global_grad_norm() if hasattr(model, "get_global_grad_norm") else None
        return None if norm is None else float(norm)

    def check_shared_folder(self, folder: str | os.PathLike | None, flag: str = "--ckpt_path") -> None:
        """Refuses, on every rank, a checkpoint folder that is not one folder for all ranks: a
        checkpoint holds every rank's shards in one place (rank 0 lists and checks them, and any
        rank may read another's), so the same path on node-local disks would save checkpoints
        that no node can load. Each rank writes a probe file; a rank that does not see every
        probe names what it misses (`lightrft.strategy.checkpoint_io.missing_probes`). All ranks
        call it; nothing happens on one rank or without a folder."""
        if not folder or not is_dist_initialized() or self.world_size == 1:
            return
        token = [os.urandom(8).hex() if self.is_rank_0() else None]
        dist.broadcast_object_list(token, src=0)
        path = Path(folder).expanduser()
        error = None
        try:
            probe = checkpoint_io.write_probe(path, token[0], self.rank)
        except OSError as err:
            probe, error = None, f"rank {self.rank} on {socket.gethostname()} cannot write to {path}: {err}"
        dist.barrier()
        if error is None:
            missing = checkpoint_io.missing_probes(path, token[0], self.world_size)
            if missing:
                error = (f"rank {self.rank} on {socket.gethostname()} does not see the files of rank(s) "
                         f"{', '.join(map(str, missing))} in {path}")
        reports = [None] * self.world_size
        dist.all_gather_object(reports, error)
        if probe is not None:
            probe.unlink(missing_ok=True)
        problems = [r for r in reports if r]
        if problems:
            raise ValueError(f"{flag} {folder} is not one folder for every rank: {'; '.join(problems)}. A checkpoint "
                             "holds every rank's files in one folder, so saves there could never be resumed: put "
                             f"{flag} on a filesystem every node mounts at the same path (NFS, Lustre, a shared "
                             "volume)")

    # ------------------------------------------------------------------------------------------
    # Collectives

    def _all_ok(self, ok: bool) -> bool:
        if not is_dist_initialized():
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def all_reduce(self, data, op: str = "mean"):
        """Reduces a tensor, or a dict of floats (or 0-d tensors), over all ranks with op `mean`,
        `sum`, `max` or `min`. A tensor comes back on its own device (floating point for `mean`);
        a dict comes back as a dict of Python floats (one collective for the whole dict)."""
        if isinstance(data, dict):
            keys = list(data)
            values = torch.tensor([float(data[k]) for k in keys], dtype=torch.float64)
            return dict(zip(keys, self.all_reduce(values, op).tolist()))
        return self._reduce(data, op, wait=True).result()

    def start_all_reduce(self, data: torch.Tensor, op: str = "mean") -> "PendingReduction":
        """`all_reduce` of a tensor without waiting for it: the collective runs while this rank
        goes on (a rank that arrives first does not sit idle, and the wake-up after the last
        arrival overlaps with work); `.result()` waits and returns what `all_reduce` would. Every
        rank must start its collectives in the same order."""
        return self._reduce(data, op, wait=False)

    def _reduce(self, data: torch.Tensor, op: str, wait: bool) -> "PendingReduction":
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce op {op!r} is not one of {', '.join(REDUCE_OPS)}")
        if not torch.is_tensor(data):
            raise TypeError(f"all_reduce takes a tensor or a dict of floats, got {type(data).__name__}")
        out = data.detach().to(self.device, copy=True)
        if op == "mean" and not out.is_floating_point():
            out = out.double()
        work = None
        if is_dist_initialized():
            work = dist.all_reduce(out, op=REDUCE_OPS[op], async_op=not wait)

        def finish() -> torch.Tensor:
            if op == "mean":
                out.div_(self.world_size)
            return out.to(data.device)
        return PendingReduction(work, finish)

    def all_reduce_many(self, parts: dict[str, torch.Tensor], op: str = "sum") -> dict[str, torch.Tensor]:
        """Reduces several tensors of any shapes over all ranks in one collective (each collective is
        a wait for the slowest rank): they travel as one float64 vector. Returns float64 tensors of
        the same shapes, on the CPU, under the same keys."""
        return self._reduce_many(parts, op, wait=True).result()

    def start_all_reduce_many(self, parts: dict[str, torch.Tensor], op: str = "sum") -> "PendingReduction":
        """`all_reduce_many` without waiting (see `start_all_reduce`)."""
        return self._reduce_many(parts, op, wait=False)

    def _reduce_many(self, parts: dict[str, torch.Tensor], op: str, wait: bool) -> "PendingReduction":
        keys = list(parts)
        flat = [parts[k].detach().reshape(-1).to("cpu", torch.float64) for k in keys]
        pending = self._reduce(torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64), op, wait)

        def split(reduced: torch.Tensor) -> dict[str, torch.Tensor]:
            pieces = reduced.cpu().split([f.numel() for f in flat])
            return {k: piece.reshape(parts[k].shape) for k, piece in zip(keys, pieces)}
        return pending.then(split)

    def all_gather(self, data):
        """Gathers from all ranks, in rank order. A tensor is concatenated along dim 0 (a 0-d
        tensor counts as one row; ranks may hold different numbers of rows): Shape: (sum of rows, ...).
        A dict of floats becomes a dict of lists, one value per rank."""
        if isinstance(data, dict):
            keys = list(data)
            values = torch.tensor([[float(data[k]) for k in keys]], dtype=torch.float64)
            gathered = self.all_gather(values)  # (world, len(keys))
            return {k: gathered[:, i].tolist() for i, k in enumerate(keys)}
        if not torch.is_tensor(data):
            raise TypeError(f"all_gather takes a tensor or a dict of floats, got {type(data).__name__}")
        local = data.detach().reshape(1) if data.dim() == 0 else data.detach()
        if not is_dist_initialized() or self.world_size == 1:
            return local.clone()
        local = local.to(self.device)
        rows = torch.tensor([local.shape[0]], dtype=torch.int64, device=self.device)
        all_rows = [torch.zeros_like(rows) for _ in range(self.world_size)]
        dist.all_gather(all_rows, rows)
        counts = [int(r.item()) for r in all_rows]
        padded = local.new_zeros((max(counts),) + tuple(local.shape[1:]))
        padded[: local.shape[0]] = local
        pieces = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(pieces, padded)
        return torch.cat([piece[:n] for piece, n in zip(pieces, counts)]).to(data.device)

    # ------------------------------------------------------------------------------------------
    # EMA

    @torch.no_grad()
    def moving_average(self, model, ema_model, beta: float = 0.992) -> bool:
        """ema = beta * ema + (1 - beta) * param for every parameter (an exponential moving average
        of the weights), gathered from ZeRO-3 shards where needed.

        The average moves once per optimizer update: with a DeepSpeed engine as `model`, a call
        while its `global_steps` has not advanced since the previous update (inside a gradient
        accumulation window) does nothing. Returns whether the average moved."""
        step = getattr(model, "global_steps", None)
        if step is not None:
            if self._ema_global_step.get(id(ema_model)) == step:
                return False
            self._ema_global_step[id(ema_model)] = step
        params = dict(self.unwrap_model(model).named_parameters())
        for name, ema_param in self.unwrap_model(ema_model).named_parameters():
            if name not in params:
                raise ValueError(f"moving_average: the EMA model has parameter {name!r} that the trained model lacks; "
                                 f"the EMA model must be a copy of the trained model")
            param = params[name]
            sharded = [p for p in (param, ema_param) if _is_zero3_param(p)]
            with deepspeed.zero.GatheredParameters(sharded, modifier_rank=0, enabled=bool(sharded)):
                # A sharded EMA weight is written on rank 0 and re-partitioned from there; a
                # replicated one is updated on every rank.
                if self.is_rank_0() or not _is_zero3_param(ema_param):
                    source = param.data.to(device=ema_param.device, dtype=ema_param.dtype)
                    ema_param.data.mul_(beta).add_(source, alpha=1 - beta)
        return True

    # ------------------------------------------------------------------------------------------
    # Data

    def setup_dataloader(self, dataset: Dataset, batch_size: int, pin_memory: bool = False, shuffle: bool = True,
                         collate_fn=None, drop_last: bool = True, consumed_samples: int = 0) -> DataLoader:
        """A DataLoader over this rank's slice of `dataset` (`batch_size` per rank), shuffled with
        `config.seed` and resumable: `consumed_samples` (over all ranks, this epoch) are skipped."""
        sampler = DistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle,
                                     seed=self.config.seed, drop_last=drop_last, consumed_samples=consumed_samples)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                          collate_fn=collate_fn, pin_memory=pin_memory)

    # ------------------------------------------------------------------------------------------
    # Saving

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The complete state dict of the (unwrapped) model as CPU tensors on rank 0, gathered
        from ZeRO-3 shards one parameter at a time; None on the other ranks, which must call it
        too. Tied parameters stay one tensor under both names."""
        module = self.unwrap_model(model)
        state = {}
        copies: dict[int, torch.Tensor] = {}
        for key, tensor in module.state_dict(keep_vars=True).items():
            if id(tensor) not in copies:
                with deepspeed.zero.GatheredParameters([tensor], enabled=_is_zero3_param(tensor)):
                    copies[id(tensor)] = tensor.data.detach().to("cpu", copy=True) if self.is_rank_0() else None
            state[key] = copies[id(tensor)]
        return state if self.is_rank_0() else None

    def iter_full_parameters(self, model: nn.Module, prefix: str = ""):
        """Yields `(name, tensor)` for every parameter of the (unwrapped) model whose name starts
        with `prefix` (stripped), whole on every rank: under ZeRO-3 each one is gathered just for
        the time the caller holds it, so peak memory grows by one parameter. For pushing weights to a
        colocated rollout engine without writing them to disk."""
        module = self.unwrap_model(model)
        for name, param in module.named_parameters():
            if not name.startswith(prefix):
                continue
            with deepspeed.zero.GatheredParameters([param], enabled=_is_zero3_param(param)):
                yield name[len(prefix):], param.data

    def iter_parameter_buckets(self, model: nn.Module, bucket_mb: float, prefix: str = "",
                               include: Callable[[str], bool] | None = None):
        """Yields lists of `(name, tensor)` covering every parameter of the (unwrapped) model whose
        name starts with `prefix` (stripped), each list gathered whole from ZeRO-3 shards for the
        time the caller holds it: peak memory grows by one bucket, never by the whole model.

        A bucket holds whole fused groups: every parameter of one decoder layer (names up to the
        first numeric part, `model.layers.3.`) or of one other module (`model.embed_tokens.`)
        goes into the same bucket, because rollout engines fuse q/k/v and gate/up projections and
        load a layer correctly only from all of its weights at once. Groups are packed in order
        until the next would pass `bucket_mb` MB (2**20 bytes); a group larger than that is a
        bucket of its own. All ranks must iterate together (each bucket is a collective gather)."""
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0 (--vllm_sync_bucket_mb), got {bucket_mb}")
        module = self.unwrap_model(model)
        groups: dict[str, list[tuple[str, nn.Parameter]]] = {}
        for name, param in module.named_parameters():
            if name.startswith(prefix) and (include is None or include(name[len(prefix):])):
                groups.setdefault(_fused_group_key(name[len(prefix):]), []).append((name[len(prefix):], param))
        limit = bucket_mb * 2**20
        bucket, size = [], 0
        for group in groups.values():
            group_bytes = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for _, p in group)
            if bucket and size + group_bytes > limit:
                yield from self._gathered_bucket(bucket)
                bucket, size = [], 0
            bucket, size = bucket + group, size + group_bytes
        if bucket:
            yield from self._gathered_bucket(bucket)

    @staticmethod
    def _gathered_bucket(bucket: list[tuple[str, nn.Parameter]]):
        sharded = [p for _, p in bucket if _is_zero3_param(p)]
        with deepspeed.zero.GatheredParameters(sharded, enabled=bool(sharded)):
            yield [(name, param.data) for name, param in bucket]

    def save_model(self, model: nn.Module, tokenizer, output_dir: str | os.PathLike, **_) -> None:
        """Writes a Hugging Face folder (config, safetensors weights, tokenizer) that
        `AutoModelForCausalLM.from_pretrained` loads; see `lightrft.strategy.hf_export` for how
        wrappers, value-head models and PEFT models are written. All ranks must call it; rank 0
        writes through a temporary folder, so a failure never leaves a half-written `output_dir`."""
        state = self.full_state_dict(model)
        error = None
        if self.is_rank_0():
            try:
                export_hf_folder(self.unwrap_model(model), state, tokenizer, output_dir)
            except Exception as err:  # reported on every rank below, so none waits forever
                error = err
        if not self._all_ok(error is None):
            raise RuntimeError(f"saving the Hugging Face model to {output_dir} failed"
                               + (f": {error}" if error else " on rank 0")) from error

    def save_ckpt(self, model, save_dir: str | os.PathLike, tag: str, max_num: int = 3,
                  client_state: dict | None = None, **_) -> Path:
        """Saves everything needed to continue training (weights, optimizer, scheduler shards and
        each rank's `client_state`) to `save_dir/<tag>`, crash-consistently, keeping the newest
        `max_num` checkpoints (protocol in `lightrft.strategy.checkpoint_io`). All ranks call it
        with the same tag; `client_state` may differ per rank (RNG states) and must be plain data
        and tensors. Raises CheckpointSaveError naming the path when writing fails; the previous
        checkpoints are then intact. Returns the checkpoint folder."""
        client_state = {} if client_state is None else client_state

        def write_shard(tmp_dir: Path) -> None:
            if _without_checkpoint_engine(model):      # a frozen ZeRO-3 engine (the EMA): its whole weights
                state = self.full_state_dict(model)     # every rank gathers; rank 0 writes
                if state is not None:
                    (tmp_dir / DS_SUBDIR).mkdir(parents=True, exist_ok=True)
                    torch.save(state, tmp_dir / DS_SUBDIR / FROZEN_WEIGHTS)
            else:
                model.save_checkpoint(str(tmp_dir), tag=DS_SUBDIR, client_state={}, save_latest=False)
            checkpoint_io.save_client_state(tmp_dir, self.rank, client_state)

        return checkpoint_io.save_checkpoint_dir(save_dir, tag, write_shard, is_writer=self.is_rank_0(),
                                                 all_ok=self._all_ok, max_num=max_num, ranks=self.world_size)

    def load_ckpt(self, model, load_dir: str | os.PathLike, tag: str | None = None, load_optimizer_states: bool = True,
                  load_lr_scheduler_states: bool = True, load_module_strict: bool = True, load_module_only: bool = False):
        """Loads a checkpoint written by `save_ckpt` into the engine `model` and returns
        `(checkpoint folder, this rank's client state)`.

        Without `tag`: the checkpoint `load_dir/latest` names, or the newest complete one when the
        pointer is missing or stale; incomplete folders (crashed saves) are never loaded. Returns
        `(None, None)` when `load_dir` holds no complete checkpoint: the caller decides whether
        that is an error (a run asked to resume, `--load_checkpoint`, should raise naming
        `--ckpt_path`). With `tag`: that checkpoint, FileNotFoundError when it is not complete.
        Rank 0 picks the folder and tells the others, so all ranks load the same one."""
        choice = [None]
        if self.is_rank_0():
            try:
                path = checkpoint_io.resolve_checkpoint(Path(load_dir), tag)
                choice = [("ok", None if path is None else str(path))]
            except FileNotFoundError as err:
                choice = [("error", str(err))]
        if is_dist_initialized():
            dist.broadcast_object_list(choice, src=0)
        status, value = choice[0]
        if status == "error":
            raise FileNotFoundError(value)
        if value is None:
            return None, None
        saved = [checkpoint_io.saved_ranks(Path(value)) if self.is_rank_0() else None]
        if is_dist_initialized():
            dist.broadcast_object_list(saved, src=0)
        options = dict(load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
                       load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only)
        frozen = Path(value) / DS_SUBDIR / FROZEN_WEIGHTS
        if frozen.is_file() or _without_checkpoint_engine(model):     # whole weights: any rank count
            self._load_whole_weights(model, frozen)
            return value, checkpoint_io.load_client_state(Path(value), self.rank)
        # Without ZeRO (stage 0) the checkpoint holds the whole optimizer state beside the weights
        # (mp_rank_00_model_states.pt), which any number of ranks loads as it is.
        sharded = any((Path(value) / DS_SUBDIR).glob("*_optim_states.pt"))
        if saved[0] and saved[0] != self.world_size and sharded:
            if self.same_ranks_reason:
                raise ValueError(f"cannot resume {value}, saved by {saved[0]} rank(s), on {self.world_size}: "
                                 f"{self.same_ranks_reason}; resume on {saved[0]} rank(s)")
            load_path = self._load_elsewhere(model, Path(value), saved[0], options)
        else:
            load_path, _ = model.load_checkpoint(value, tag=DS_SUBDIR, **options)
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {value}/{DS_SUBDIR} (see its log "
                               f"above); the folder is complete, so it was probably saved with a different "
                               f"world size or ZeRO stage")
        return value, checkpoint_io.load_client_state(Path(value), self.rank)

    def _load_whole_weights(self, model, path: Path) -> None:
        """Loads the whole weights `save_ckpt` wrote for an engine without a checkpoint engine into
        `model` (rank 0 reads them and every ZeRO-3 parameter is re-partitioned from it)."""
        module = self.unwrap_model(model)
        state, error = None, None
        if self.is_rank_0():
            try:
                state = checkpoint_io.load_plain(path, f"checkpoint weights {path}")
                missing = [key for key in module.state_dict() if key not in state]
                if missing:
                    raise ValueError(f"it has no weight {missing[0]!r} ({len(missing)} missing): it was saved from "
                                     "another model")
            except (OSError, ValueError, RuntimeError) as err:
                error = err
        if not self._all_ok(error is None):
            raise RuntimeError(f"cannot resume the weights in {path}" + (f": {error}" if error else " (see rank 0's "
                               "log)") + "; the checkpoint was saved by another engine setup or is damaged")
        for key, tensor in module.state_dict(keep_vars=True).items():
            with deepspeed.zero.GatheredParameters([tensor], modifier_rank=0, enabled=_is_zero3_param(tensor)):
                if self.is_rank_0():
                    tensor.data.copy_(state[key])
        if not _is_zero3_param(next(module.parameters())) and is_dist_initialized():
            for tensor in module.state_dict(keep_vars=True).values():   # replicated weights: rank 0's everywhere
                dist.broadcast(tensor.data, src=0)

    def _load_elsewhere(self, model, ckpt_dir: Path, saved: int, options: dict):
        """Loads a checkpoint saved by `saved` ranks into this job of another size through
        DeepSpeed's universal checkpoint: rank 0 converts the ZeRO shards (`ds_to_universal`, in
        a process of its own) into a folder beside the checkpoint, `.universal-<tag>`, which stays
        there while the checkpoint does (a later resume of it on any other rank count loads it
        without converting again; pruning removes it with the checkpoint), and every rank loads
        its new partition from it. The checkpoint itself is not touched. The other ranks wait on a
        group of their own whose timeout grows with the checkpoint's size (`conversion_wait`),
        so a large model does not trip --dist_timeout; a conversion that cannot fit on the disk
        stops before it starts."""
        out = checkpoint_io.universal_cache(ckpt_dir)
        group = wait = None
        if is_dist_initialized():
            wait = conversion_wait(ckpt_dir / DS_SUBDIR, self.config.dist_timeout_minutes)
            group = dist.new_group(backend="gloo", timeout=wait)
        error = None
        if self.is_rank_0():
            if checkpoint_io.universal_cache_valid(ckpt_dir):
                self.print(f"{ckpt_dir} was saved by {saved} rank(s) and this job has {self.world_size}: loading "
                           f"its universal checkpoint converted before ({out})")
            else:
                self.print(f"{ckpt_dir} was saved by {saved} rank(s) and this job has {self.world_size}: converting it "
                           f"to DeepSpeed's universal checkpoint ({out}, kept for later resumes) to load the shards "
                           "on the new ranks")
                error = self._convert_to_universal(ckpt_dir, out)
        verdict = [error]
        if group is not None:
            try:
                dist.broadcast_object_list(verdict, src=0, group=group)
            except RuntimeError as err:          # the wait timed out, or rank 0 is gone
                raise RuntimeError(
                    f"rank {self.rank} waited {wait} for rank 0 to convert {ckpt_dir} (saved by {saved} rank(s)) to "
                    f"DeepSpeed's universal checkpoint and stopped ({type(err).__name__}: {str(err)[:200]}); see rank "
                    f"0's log, resume on {saved} rank(s), or convert it first with `python -m "
                    f"deepspeed.checkpoint.ds_to_universal --input_folder {ckpt_dir / DS_SUBDIR} --output_folder "
                    f"<folder>` on one machine") from None
            finally:
                dist.destroy_process_group(group)
        error = verdict[0]
        if error is not None:
            raise RuntimeError(f"cannot resume {ckpt_dir} (saved by {saved} rank(s)) on {self.world_size}: converting "
                               f"it to DeepSpeed's universal checkpoint failed: {error}; resume on {saved} rank(s)")
        config = model._config
        try:
            config.load_universal_checkpoint = True
            load_path, _ = model.load_checkpoint(str(out), tag=DS_SUBDIR, **options)
            # ZeRO-3's universal load gives every parameter group one shared `step` tensor, which
            # torch's Adam then advances once per group and step (Adam's step 4 where 3 was due, a
            # bias correction off): each group gets its own.
            inner = getattr(getattr(model, "optimizer", None), "optimizer", None)
            for state in getattr(inner, "state", {}).values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()
        finally:
            config.load_universal_checkpoint = False
        return load_path

    def _convert_to_universal(self, ckpt_dir: Path, out: Path) -> str | None:
        """Rank 0's conversion of `ckpt_dir` into its universal cache `out` (through a temporary
        folder, published whole); None when it worked, else what went wrong."""
        source = ckpt_dir / DS_SUBDIR
        problem = disk_space_problem(source, out.parent)
        if problem:
            return problem
        tmp = out.parent / f"{checkpoint_io.TMP_PREFIX}universal-{ckpt_dir.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        error = convert_to_universal(source, tmp / DS_SUBDIR)
        if error is None:
            try:
                checkpoint_io.publish_universal(ckpt_dir, tmp)
            except OSError as err:
                error = f"publishing {tmp} as {out}: {err}"
        if error is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            if "iostream error" in error or "No space left" in error:
                error += f" (the disk holding {out.parent} is probably full: free space there)"
        return error

    # ------------------------------------------------------------------------------------------
    # Memory

    def report_memory(self, tag: str = "") -> dict[str, float]:
        """Prints (rank 0) and returns this rank's memory use in GiB: CUDA allocated / peak /
        reserved on GPUs, the process's peak resident set size on CPU."""
        gib = 2.0**30
        if torch.cuda.is_available():
            stats = {"allocated_gib": torch.cuda.memory_allocated() / gib,
                     "max_allocated_gib": torch.cuda.max_memory_allocated() / gib,
                     "reserved_gib": torch.cuda.memory_reserved() / gib}
        else:
            # ru_maxrss is in KiB on Linux.
            stats = {"max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / gib}
        self.print(f"[memory] {tag} " + ", ".join(f"{k}={v:.3f}" for k, v in stats.items()))
        return stats


def _shard_bytes(source: Path) -> int:
    return sum(path.stat().st_size for path in Path(source).glob("*.pt") if path.is_file())


def conversion_wait(source: Path, dist_timeout_minutes: float) -> timedelta:
    """How long the other ranks wait for rank 0 to convert the DeepSpeed folder `source` to the
    universal format: 10 minutes plus a second per 20 MB of its shards (the converter reads them
    and writes as much again, one worker each; about 70 minutes for a 7B model's 84 GB of
    weights and Adam states), and never less than --dist_timeout."""
    seconds = 600 + _shard_bytes(source) / 20e6
    return timedelta(seconds=max(seconds, dist_timeout_minutes * 60))


def disk_space_problem(source: Path, folder: Path) -> str | None:
    """Why the universal form of the DeepSpeed folder `source` cannot be written in `folder`
    (its disk has less room than the shards take, which the conversion writes again), or None."""
    need = _shard_bytes(source)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    if free >= need:
        return None
    def size(n: int) -> str:
        return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
    return (f"the disk holding {folder} has {size(free)} free and the universal form of {source} needs about "
            f"{size(need)}: free space there")


def convert_to_universal(source: Path, target: Path) -> str | None:
    """Converts the DeepSpeed checkpoint folder `source` (ZeRO shards of one tag) into the universal
    format at `target` with DeepSpeed's own converter, in a child process; None when it worked,
    else what went wrong (the converter's last lines)."""
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(source),
               "--output_folder", str(target), "--inject_missing_state", "--num_extract_workers", "1",
               "--num_merge_workers", "1"]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    if proc.returncode != 0:
        return "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
    return None


def get_strategy(config) -> DeepspeedStrategy:
    """A DeepspeedStrategy configured from a run config's `distributed` and `optim` sections, or
    from an argparse namespace of the same flags (research code; see `StrategyConfig.from_args`).
    Call `setup_distributed` on it before building models."""
    if isinstance(config, RunConfig):
        return DeepspeedStrategy(StrategyConfig.from_sections(config.distributed, config.optim))
    return DeepspeedStrategy(StrategyConfig.from_args(config))
