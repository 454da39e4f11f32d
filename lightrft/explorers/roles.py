"""Explorer and trainer roles inside one torchrun job (`--explorer_ranks N`).

The job's W ranks split in two: ranks 0 ... W-N-1 train (DeepSpeed data parallel among
themselves, rank 0 logs and saves), ranks W-N ... W-1 explore (generate and score). Each role
gets its own default process group, so everything written for "the ranks" (the strategy,
DeepSpeed, the samplers, the run services) works unchanged among the trainers, and torchrun's
`RANK`/`WORLD_SIZE` are rewritten to the role's own. The roles talk over two extra gloo groups
built on the job's rendezvous store:

- the experience channel (all W ranks): explorers send scored rollouts to the trainers,
  point to point;
- the control channel (trainer rank 0 and the explorers): weights, retries and the stop signal,
  broadcast from trainer rank 0.

Both carry host tensors, so they work the same on CPU and on GPUs (weights are copied to the host
once per sync; see docs/async.md for what that costs). On GPUs the weights' bytes may instead
travel over a third group of the control channel's members on the devices
(`--explorer_weight_transport device`: an NCCL broadcast from trainer rank 0's GPU into each
explorer's), the control messages staying on gloo. `LocalChannel` stands in for both when the
explorer is a thread of the trainer's own process (the colocated one-step-ahead mode).

What arrives on a channel is decoded as tensors and plain data only (`torch.load(weights_only=True)`):
a message holding any other object is refused, so a peer (or anything that reaches the job's
rendezvous port) cannot make a rank run code. Dataclasses registered with `wire_type` (the rollout
batches) travel as plain dicts tagged with their class name and are rebuilt on arrival.
"""

import dataclasses
import io
import os
import queue
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lightrft.strategy.checkpoint_io import load_plain

JOB_RANK_ENV, JOB_WORLD_ENV = "LIGHTRFT_JOB_RANK", "LIGHTRFT_JOB_WORLD_SIZE"
HEADER_TAG, PAYLOAD_TAG = 1, 2


@dataclass(frozen=True)
class RoleLayout:
    """Which ranks of a job of `world_size` explore (the last `explorers`) and which train."""

    world_size: int
    rank: int
    explorers: int

    def __post_init__(self):
        if self.explorers < 1 or self.explorers >= self.world_size:
            raise ValueError(f"--explorer_ranks {self.explorers} needs at least one trainer rank besides the "
                             f"explorers, but the job has {self.world_size} rank(s): launch with torchrun "
                             f"--nproc_per_node (or --nnodes) giving more than {self.explorers} ranks")

    @property
    def trainers(self) -> int:
        return self.world_size - self.explorers

    @property
    def is_explorer(self) -> bool:
        return self.rank >= self.trainers

    @property
    def role(self) -> str:
        return "explorer" if self.is_explorer else "trainer"

    @property
    def role_rank(self) -> int:
        """Rank within the role: a trainer's DeepSpeed rank, an explorer's index."""
        return self.rank - self.trainers if self.is_explorer else self.rank

    @property
    def role_size(self) -> int:
        return self.explorers if self.is_explorer else self.trainers

    def explorer_job_rank(self, index: int) -> int:
        return self.trainers + index

    def explorer_of_batch(self, batch: int) -> int:
        """Explorers take rollout batches in turn: batch b is explorer b % N's."""
        return batch % self.explorers


class ExperienceChannel:
    """Explorers -> trainers over a gloo group: `send(obj, trainer_rank)` blocks until the trainer
    receives it (gloo's sends wait for the matching receive), `recv()` returns (obj, source)."""

    def __init__(self, group):
        self.group = group

    def send(self, obj, dst: int) -> None:
        send_object(self.group, obj, dst)

    def recv(self):
        return recv_object(self.group)


class ControlChannel:
    """Trainer rank 0 -> explorers over a gloo group: a message (a dict) and, with weights, their
    bytes, broadcast from member 0. `weights_group` (the same members, e.g. an NCCL group) and
    `device` (this member's GPU) move the weights' bytes over the devices instead: the publisher's
    host bytes are copied to its device once and broadcast, and an explorer receives them into its
    device's memory, where its engine loads them from. Messages stay on `group`, in order; the
    bytes of a message follow it on `weights_group`, so the two groups see the same order."""

    def __init__(self, group, weights_group=None, device: torch.device | str | None = None):
        self.group = group
        self.weights_group = group if weights_group is None else weights_group
        self.device = torch.device("cpu" if device is None else device)

    def publish(self, message: dict, data: torch.Tensor | None = None) -> None:
        broadcast_object(self.group, message)
        if data is not None:
            broadcast_tensor(self.weights_group, data.to(self.device))

    def receive(self) -> tuple[dict, torch.Tensor | None]:
        message = broadcast_object(self.group)
        data = None
        if message["kind"] == "weights" and "path" not in message:
            data = broadcast_tensor(self.weights_group, torch.empty(flat_size(message["spec"]), dtype=torch.uint8,
                                                                    device=self.device))
        return message, data


class LocalChannel:
    """Both channels inside one process (an explorer thread next to its trainer): a queue of
    (obj, source 0) holding at most `maxsize` items, so a full queue makes the sender wait."""

    def __init__(self, maxsize: int = 0):
        self.queue = queue.Queue(maxsize=maxsize)

    def send(self, obj, dst: int = 0) -> None:
        self.queue.put((obj, 0))

    def recv(self):
        return self.queue.get()

    def publish(self, message: dict, data: torch.Tensor | None = None) -> None:
        self.queue.put((message, data))

    def receive(self) -> tuple[dict, torch.Tensor | None]:
        return self.queue.get()


@dataclass
class JobLink:
    """This rank's place in a split job and the two channels between the roles."""

    layout: RoleLayout
    experience: ExperienceChannel       # all ranks
    control: ControlChannel | None      # trainer rank 0 and the explorers (None on other trainers)


def join_roles(explorers: int, timeout_minutes: float, backend: str | None = None,
               weight_transport: str = "host") -> JobLink:
    """Splits the torchrun job: the role's default process group, the environment rewritten to
    the role's rank and size, and the channels between the roles. Call it on every rank before
    anything else joins a process group. `weight_transport`: "host" (the weights' bytes over the
    control channel's gloo group) or "device" (over an NCCL group of the same members, each on its
    LOCAL_RANK GPU)."""
    if dist.is_initialized():
        raise RuntimeError("--explorer_ranks: the job must be split into roles before a process group starts")
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(f"--explorer_ranks needs a torchrun launch (missing {', '.join(missing)}): run "
                         f"torchrun --nproc_per_node <explorers + trainers> -m lightrft.cli.train_ppo ...")
    on_device = weight_transport == "device"
    if on_device and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ValueError("--explorer_weight_transport device needs CUDA and NCCL on every rank; this rank has "
                         f"{'no CUDA device' if not torch.cuda.is_available() else 'no NCCL'}: use host")
    layout = RoleLayout(int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]), explorers)
    timeout = timedelta(minutes=timeout_minutes)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    assert (rank, world_size) == (layout.rank, layout.world_size)
    backend = backend or ("nccl" if torch.cuda.is_available() and not layout.is_explorer else "gloo")
    dist.init_process_group(backend, store=dist.PrefixStore(f"lightrft/{layout.role}", store),
                            rank=layout.role_rank, world_size=layout.role_size, timeout=timeout)
    os.environ.update({JOB_RANK_ENV: str(layout.rank), JOB_WORLD_ENV: str(layout.world_size),
                       "RANK": str(layout.role_rank), "WORLD_SIZE": str(layout.role_size)})
    experience = dist.ProcessGroupGloo(dist.PrefixStore("lightrft/experience", store), layout.rank,
                                       layout.world_size, timeout)
    control = None
    if layout.is_explorer or layout.rank == 0:
        member, members = 1 + layout.role_rank if layout.is_explorer else 0, layout.explorers + 1
        group = dist.ProcessGroupGloo(dist.PrefixStore("lightrft/control", store), member, members, timeout)
        if on_device:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            control = ControlChannel(group, nccl_group(dist.PrefixStore("lightrft/weights", store), member, members,
                                                       timeout), device)
        else:
            control = ControlChannel(group)
    return JobLink(layout, ExperienceChannel(experience), control)


def nccl_group(store, member: int, members: int, timeout: timedelta):
    """An NCCL process group of `members` on `store` (this process is `member`), built directly
    as the gloo channels are, outside the default group."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, member, members, options)


WIRE_TYPES: dict[str, type] = {}       # class name -> dataclass that may cross the channels
WIRE_TAG = "__lightrft_wire_type__"


def wire_type(cls: type) -> type:
    """Registers a dataclass (of tensors and plain data) as one that may cross the channels (a
    class decorator)."""
    WIRE_TYPES[cls.__name__] = cls
    return cls


def to_wire(obj):
    """`obj` with every registered dataclass in it turned into a tagged dict (module docstring)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        name = type(obj).__name__
        if WIRE_TYPES.get(name) is not type(obj):
            raise TypeError(f"{type(obj).__qualname__} cannot be sent between explorers and trainers: register it "
                            "with lightrft.explorers.roles.wire_type (its fields must be tensors and plain data)")
        return {WIRE_TAG: name, **{f.name: to_wire(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    if type(obj) is dict:
        return {k: to_wire(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(to_wire(v) for v in obj)
    return obj


def from_wire(obj):
    """Inverse of `to_wire`: tagged dicts back into their registered dataclasses."""
    if type(obj) is dict:
        if WIRE_TAG in obj:
            cls = WIRE_TYPES.get(obj[WIRE_TAG])
            if cls is None:
                raise ValueError(f"a message names the type {obj[WIRE_TAG]!r}, which no module registered with "
                                 "wire_type (explorer and trainer run different lightrft versions?)")
            return cls(**{k: from_wire(v) for k, v in obj.items() if k != WIRE_TAG})
        return {k: from_wire(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(from_wire(v) for v in obj)
    return obj


def encode(obj) -> torch.Tensor:
    """An object of tensors, plain data and registered dataclasses as a uint8 tensor."""
    buffer = io.BytesIO()
    torch.save(to_wire(obj), buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def decode(data: torch.Tensor, source: str = "a peer"):
    """Inverse of `encode`; UnsafePickleError for a message holding any other object."""
    return from_wire(load_plain(io.BytesIO(data.numpy().tobytes()), f"a message from {source}"))


def send_object(group, obj, dst: int) -> None:
    """Sends `obj` to rank `dst` of `group` (blocks until it is received)."""
    data = encode(obj)
    group.send([torch.tensor([data.numel()], dtype=torch.int64)], dst, HEADER_TAG).wait()
    group.send([data], dst, PAYLOAD_TAG).wait()


def recv_object(group, src: int | None = None):
    """The next object sent to this rank by `src` (any rank when None); returns (obj, src)."""
    size = torch.zeros(1, dtype=torch.int64)
    if src is None:
        work = group.recv_anysource([size], HEADER_TAG)
        work.wait()
        src = work._source_rank()
    else:
        group.recv([size], src, HEADER_TAG).wait()
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    group.recv([data], src, PAYLOAD_TAG).wait()
    return decode(data, f"rank {src} of the experience channel"), src


def broadcast_tensor(group, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
    """Fills `tensor` on every member of `group` with `root`'s (in place; returns it)."""
    options = dist.BroadcastOptions()
    options.rootRank = root
    group.broadcast([tensor], options).wait()
    return tensor


def broadcast_object(group, obj=None, root: int = 0):
    """`obj` from `root` of `group` on every member (pass None on the others)."""
    data = encode(obj) if group.rank() == root else None
    size = broadcast_tensor(group, torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64), root)
    if data is None:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    return decode(broadcast_tensor(group, data, root), f"member {root} of the control channel")


def tensor_nbytes(shape: tuple, dtype: torch.dtype) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel * torch.empty(0, dtype=dtype).element_size()


ALIGN = 16   # bytes: each tensor starts at a multiple, so it can be viewed in place as any dtype


def _padded(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def flat_size(spec: list[tuple[str, tuple, torch.dtype]]) -> int:
    """Bytes `flatten_tensors` takes for tensors of the given (name, shape, dtype)."""
    return sum(_padded(tensor_nbytes(shape, dtype)) for _, shape, dtype in spec)


def flatten_tensors(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The bytes of `tensors` back to back, each padded to a multiple of 16 bytes (host memory,
    one uint8 tensor)."""
    parts = []
    for t in tensors:
        data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        parts += [data, torch.zeros(_padded(data.numel()) - data.numel(), dtype=torch.uint8)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def unflatten_tensors(data: torch.Tensor, spec: list[tuple[str, tuple, torch.dtype]]) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `flatten_tensors` for tensors of the given (name, shape, dtype): views into
    `data`, no copy."""
    out, offset = [], 0
    for name, shape, dtype in spec:
        nbytes = tensor_nbytes(shape, dtype)
        out.append((name, data[offset:offset + nbytes].view(dtype).reshape(shape)))
        offset += _padded(nbytes)
    return out
