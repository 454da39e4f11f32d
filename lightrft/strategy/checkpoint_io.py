"""The file-system protocol that makes training checkpoints crash-consistent.

A checkpoint is the folder `save_dir/<tag>`. It counts only when it holds the completion marker
(`MARKER_NAME`, JSON: tag, sequence number, and the size of every file), and every listed file is
there with that size. A marker that lacks a field its format requires (`marker_problem`) counts
as no marker: the folder is damaged, and loading falls back to the previous complete checkpoint. Saving goes:

1. the writer (rank 0) makes an empty temporary folder `save_dir/.tmp-<tag>`;
2. every rank writes its shard into it and fsyncs the files;   -- all ranks agree it worked
3. the writer writes the marker (write to a temp name, fsync, rename), renames the folder to
   `save_dir/<tag>` and fsyncs `save_dir`, then points `save_dir/latest` at the tag
   (write `latest.tmp`, fsync, `os.replace`);                   -- all ranks agree it worked
4. the writer prunes complete checkpoints beyond `max_num`, oldest first (by sequence number),
   and removes leftovers of earlier crashes (`.tmp-*`, `.trash-*`, `.old-*` folders).

A crash at any point leaves either the previous state or the new complete checkpoint: the folder
is invisible until renamed, and the rename happens only after the marker, which is written only
after every rank's files are durable. Loading reads `latest` and falls back to the newest complete
checkpoint when the pointer is missing or names an incomplete folder.

Checksums: the marker also records a CRC-32 of every file (format 2). Loading verifies the files
of the checkpoint it picks and, when one no longer matches (bytes changed after the save: a bad
disk, a stray write), falls back to the previous intact checkpoint, naming the file; a checkpoint
whose marker predates checksums loads on its sizes alone, with a note in the log. CRC-32 because
it only has to catch accidents (whoever can write the folder can rewrite the marker too): it hashes
at 2-4 GB/s a core here against sha256's 0.8-1.6 and blake2b's 0.4-0.8, and files are hashed in
parallel threads. Only the writer (rank 0) hashes, at save and when a resume picks a checkpoint;
a verified file is remembered (path, size, mtime, inode) for the process, so picking a checkpoint
and then loading it hashes each file once.

Failed saves: when a save fails, the writer removes its temporary folder once every rank has
stopped writing to it, so a full disk is not kept full by the failure. A folder left by a killed
writer is removed at the next save (and when a run resumes) if it is stale: its writer record
(`WRITER_NAME`: host and pid) names this process or a process of this host that is gone, or this
process holds the run lock of a folder above `save_dir` (`lightrft.utils.run_lock`), so no other
run can be writing there. A folder of a live writer elsewhere is never removed.

Assumptions: `save_dir` is one file system that every rank sees (a shared disk on several nodes),
with POSIX rename semantics; one run writes to a given `save_dir` at a time.

Test hook: the environment variable `LIGHTRFT_CKPT_FAULT=<stage>[:exit|:raise]` makes a save fail at
a named stage (see `FAULT_STAGES`): `exit` (the default) ends the process at once with
`os._exit(137)`, as a kill would; `raise` raises an OSError there. At `mid-shard` the largest file
written so far is first truncated to half its size, as a torn write would leave it.

Client state is saved per rank with `torch.save` and loaded with `torch.load(weights_only=True)`
(`load_plain`), so it must be plain data: ints, floats, strings, lists, tuples, dicts and tensors.
A file holding anything else is refused before any of it is built: unpickling arbitrary objects
can run code.
"""

import errno
import fcntl
import json
import logging
import os
import pickle
import re
import shutil
import socket
import sys
import time
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

import torch

from lightrft.utils.run_lock import LOCK_NAME, read_record

logger = logging.getLogger(__name__)

MARKER_NAME = "lightrft_checkpoint_complete.json"
WRITER_NAME = ".lightrft_writer.json"    # in a temporary folder: who is writing it (host, pid)
POINTER_NAME = "latest"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
TRASH_PREFIX = ".trash-"
# A checkpoint's universal form (`DeepspeedStrategy` converts one to resume on another rank count),
# kept beside it as `.universal-<tag>` while the checkpoint is the same, removed with it.
UNIVERSAL_PREFIX = ".universal-"
UNIVERSAL_SOURCE = "lightrft_universal_source.json"
CLIENT_STATE_DIR = "client_state"
FAULT_ENV = "LIGHTRFT_CKPT_FAULT"
FAULT_STAGES = ("mid-shard", "before-marker", "before-rename", "before-pointer", "during-cleanup")
MARKER_FORMAT = 2                  # 1: sizes only; 2: sizes and CRC-32 checksums
CHECKSUM = "crc32"
HASH_CHUNK = 1 << 20               # bytes read at a time while hashing


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the previous checkpoints are untouched."""


class CheckpointCorruptError(FileNotFoundError):
    """No intact copy of a checkpoint: a file does not match the checksum recorded when it was
    saved. A FileNotFoundError, as a missing checkpoint is, so every caller that handles one (the
    ranks' agreement on what to load, the command-line error report) handles this too."""


class UnsafePickleError(pickle.UnpicklingError, ValueError):
    """A file or message that holds objects other than tensors and plain data, refused unread:
    unpickling it could run code. The message names the file and the object."""


# ---------------------------------------------------------------------------------------------
# Plain-data loading


def load_plain(source, what: str, *, allow: Iterable[type] = (), **kwargs):
    """`torch.load(source, weights_only=True)` on the CPU: tensors and plain data (numbers,
    strings, lists, tuples, dicts, dtypes) only, plus the classes in `allow`. Anything else
    raises UnsafePickleError naming `what` (the file or message) and the object, before any of it
    is built. `kwargs` go to torch.load (e.g. `mmap=True`)."""
    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(source, map_location="cpu", weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        # torch's message advises weights_only=False, exactly what must not be done with such a file.
        found = re.search(r"WeightsUnpickler error: (.*?)(?: was not an allowed global|\.?\n|$)", str(err))
        reason = found.group(1) if found else str(err).splitlines()[0]
        raise UnsafePickleError(f"{what}: refused to load: it holds more than tensors and plain data ({reason}), "
                                "and unpickling it could run code; only what lightrft (or DeepSpeed) writes is "
                                "accepted") from None


# ---------------------------------------------------------------------------------------------
# Test hook


def fault_spec() -> tuple[str, str] | None:
    """The (stage, mode) named by `LIGHTRFT_CKPT_FAULT`, None when unset; ValueError when malformed."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return None
    name, _, mode = spec.partition(":")
    if name not in FAULT_STAGES or mode not in ("", "exit", "raise"):
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected <stage>[:exit|:raise] with stage one of "
                         f"{', '.join(FAULT_STAGES)}")
    return name, mode or "exit"


def fault_point(stage: str, directory: Path | None = None) -> None:
    """Fails here when `LIGHTRFT_CKPT_FAULT` names `stage` (a test hook; see the module docstring)."""
    spec = fault_spec()
    if spec is None or spec[0] != stage:
        return
    if stage == "mid-shard" and directory is not None:
        _tear_largest_file(directory)
    if spec[1] == "raise":
        raise OSError(errno.EIO, f"{FAULT_ENV}: injected failure at stage {stage}", str(directory))
    sys.stdout.write(f"{FAULT_ENV}: exiting at stage {stage}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(137)


def _tear_largest_file(directory: Path) -> None:
    files = [p for p in Path(directory).rglob("*") if p.is_file()]
    if files:
        largest = max(files, key=lambda p: p.stat().st_size)
        os.truncate(largest, largest.stat().st_size // 2)


# ---------------------------------------------------------------------------------------------
# Durable file operations


def fsync_file(path: Path) -> None:
    """Flushes one file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flushes a directory's entries (creations, renames) to disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flushes every file and folder under `root`, then `root` itself."""
    root = Path(root)
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_file(Path(dirpath) / name)
        fsync_dir(Path(dirpath))


def atomic_write_text(path: Path, text: str) -> None:
    """Writes `path` so a reader sees the old content or the new, never a mix: write `<path>.tmp`,
    fsync it, `os.replace` it over `path`, fsync the folder."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


# ---------------------------------------------------------------------------------------------
# Markers, pointer, discovery


def validate_tag(tag: str) -> str:
    """A tag names one folder directly under the save folder."""
    if (not isinstance(tag, str) or not tag or tag.startswith(".") or tag == POINTER_NAME
            or any(c in tag for c in "/\\\n\r\t ")):
        raise ValueError(f"checkpoint tag {tag!r} must be a plain folder name: not empty, not starting with '.', "
                         f"not {POINTER_NAME!r}, without slashes or whitespace (e.g. 'global_step100')")
    return tag


def list_files(root: Path) -> dict[str, int]:
    """Relative path -> size in bytes of every file under `root` (the marker excluded)."""
    root = Path(root)
    sizes = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.name not in (MARKER_NAME, WRITER_NAME):
            sizes[path.relative_to(root).as_posix()] = path.stat().st_size
    return sizes


# ---------------------------------------------------------------------------------------------
# Checksums


def file_checksum(path: Path) -> str:
    """CRC-32 of a file's bytes (read in 1 MiB chunks), as 8 hex digits."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def checksum_files(root: Path, names: Iterable[str]) -> dict[str, str]:
    """Relative path -> checksum of each named file under `root`, hashed in parallel threads
    (zlib releases the GIL while it hashes)."""
    names = list(names)
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(names)))) as pool:
        return dict(zip(names, pool.map(lambda rel: file_checksum(Path(root) / rel), names)))


# path -> (size, mtime_ns, inode, checksum) of the files this process verified (module docstring)
_verified: dict[str, tuple] = {}
_noted_without_checksums: set[str] = set()     # checkpoints whose missing checksums were logged


def verify_checksums(ckpt_dir: Path, only: Callable[[str], bool] | None = None) -> bool:
    """Checks the files of checkpoint `ckpt_dir` (those for which `only(relative path)` holds,
    default all) against the checksums its marker recorded. Returns False when the marker has none
    (saved before lightrft recorded them: only the sizes were checked); raises
    CheckpointCorruptError naming the first file that differs."""
    ckpt_dir = Path(ckpt_dir)
    marker = read_marker(ckpt_dir)
    if marker is None:
        raise CheckpointCorruptError(f"checkpoint {ckpt_dir} has no valid {MARKER_NAME}")
    if marker["format"] < 2:
        return False            # saved before checksums (`marker_problem` refuses a format 2 without them)
    recorded = marker["checksums"]
    todo = {}
    for rel, expected in recorded["files"].items():
        if only is not None and not only(rel):
            continue
        path = ckpt_dir / rel
        try:
            st = path.stat()
        except OSError as err:
            raise CheckpointCorruptError(f"checkpoint {ckpt_dir}: {path} cannot be read ({err.strerror})") from None
        key = (st.st_size, st.st_mtime_ns, st.st_ino, expected)
        if _verified.get(str(path)) != key:
            todo[rel] = key
    actual = checksum_files(ckpt_dir, todo)
    for rel, key in todo.items():
        if actual[rel] != key[3]:
            raise CheckpointCorruptError(
                f"checkpoint {ckpt_dir} is corrupted: {ckpt_dir / rel} has {CHECKSUM} {actual[rel]}, not the "
                f"{key[3]} recorded when it was saved (its bytes changed after the save, with its size kept)")
        _verified[str(ckpt_dir / rel)] = key
    return True


_CRC_HEX = re.compile(r"[0-9a-f]{8}")
_noted_damaged_markers: set[str] = set()      # markers whose damage was logged


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def marker_problem(marker) -> str | None:
    """What makes a parsed marker invalid for its format, or None. Every marker lightrft wrote
    names its format. Format 1: `seq` (int >= 1) and `files` (relative path -> size in bytes).
    Format 2 adds `checksums`: {"algorithm": CHECKSUM, "files": path -> 8 hex digits} for exactly
    the files listed. A marker that lacks a field its format requires is damaged, never read as an
    older format: a format-2 marker without its checksums does not switch the check off."""
    if not isinstance(marker, dict):
        return f"it holds a JSON {type(marker).__name__}, not an object"
    version = marker.get("format")
    if not _is_int(version) or version not in (1, MARKER_FORMAT):
        return (f"its format is {version!r}; this lightrft reads formats 1 and {MARKER_FORMAT}"
                + (" (saved by a newer lightrft?)" if _is_int(version) and version > MARKER_FORMAT else ""))
    if not isinstance(marker.get("tag"), str):
        return f"its tag is {marker.get('tag')!r}, not a folder name"
    if not _is_int(marker.get("seq")) or marker["seq"] < 1:
        return f"its seq is {marker.get('seq')!r}, not an integer >= 1"
    files = marker.get("files")
    if not isinstance(files, dict) or not all(isinstance(k, str) and _is_int(v) and v >= 0 for k, v in files.items()):
        return "its files table is not a mapping of relative paths to sizes"
    if version >= 2:
        checksums = marker.get("checksums")
        if not isinstance(checksums, dict):
            return f"format {version} records checksums, and the marker has none"
        if checksums.get("algorithm") != CHECKSUM:
            return f"its checksums use {checksums.get('algorithm')!r}; format {version} records {CHECKSUM}"
        table = checksums.get("files")
        if not isinstance(table, dict) or not all(isinstance(v, str) and _CRC_HEX.fullmatch(v) for v in table.values()):
            return f"its checksum table is not a mapping of relative paths to {CHECKSUM} values"
        if set(table) != set(files):
            return "its checksum table does not list the same files as its size table"
    return None


def read_marker(ckpt_dir: Path) -> dict | None:
    """The parsed completion marker of `ckpt_dir`, or None when it is missing, unreadable or
    damaged (`marker_problem`; logged once per folder): the folder then counts as incomplete, and a
    resume falls back to the previous complete checkpoint."""
    path = Path(ckpt_dir) / MARKER_NAME
    try:
        text = path.read_text()
    except (OSError, ValueError):
        return None
    try:
        marker = json.loads(text)
        problem = marker_problem(marker)
    except (ValueError, RecursionError) as err:        # RecursionError: JSON nested thousands deep
        problem = f"it is not valid JSON ({type(err).__name__})"
    if problem is None:
        return marker
    if str(path) not in _noted_damaged_markers:
        _noted_damaged_markers.add(str(path))
        logger.warning(f"checkpoint {ckpt_dir} is not used: its marker {path} is damaged ({problem})")
    return None


def is_complete(ckpt_dir: Path) -> bool:
    """True when `ckpt_dir` has a marker and every file it lists is present with the listed size."""
    marker = read_marker(ckpt_dir)
    if marker is None:
        return False
    for rel, size in marker["files"].items():
        path = Path(ckpt_dir) / rel
        try:
            if path.stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def list_complete(save_dir: Path) -> list[tuple[int, Path]]:
    """(sequence number, folder) of every complete checkpoint under `save_dir`, oldest first.

    A `.old-<tag>` folder (the previous copy of a tag being overwritten) counts only while
    `<tag>` itself is not complete: it is the copy a crash during the overwrite leaves."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    found = []
    for path in save_dir.iterdir():
        if not path.is_dir():
            continue
        if path.name.startswith(OLD_PREFIX):
            if is_complete(save_dir / path.name[len(OLD_PREFIX):]):
                continue
        elif path.name.startswith("."):
            continue
        if is_complete(path):
            found.append((int(read_marker(path)["seq"]), path))
    return sorted(found, key=lambda item: (item[0], item[1].name))


def find_latest_complete(save_dir: Path) -> Path | None:
    """The complete checkpoint with the highest sequence number, or None when there is none."""
    complete = list_complete(save_dir)
    return complete[-1][1] if complete else None


def read_pointer(save_dir: Path) -> str | None:
    """The tag `save_dir/latest` names, or None."""
    try:
        tag = (Path(save_dir) / POINTER_NAME).read_text().strip()
    except OSError:
        return None
    return tag or None


def resolve_checkpoint(save_dir: Path, tag: str | None = None, *, verify: bool = True) -> Path | None:
    """The folder to load from `save_dir`.

    With a `tag`: that checkpoint, which must be complete (else FileNotFoundError naming the path
    and the complete ones). Without: the one `latest` points to when complete, else the newest
    complete one, else None (nothing to resume from).

    With `verify` (the default), a candidate counts only when its files match their checksums:
    a corrupted one is skipped for the next older intact one, with a warning naming the file, and
    CheckpointCorruptError is raised when no complete checkpoint is intact (or `tag`'s is not)."""
    save_dir = Path(save_dir)
    complete = [path for _, path in list_complete(save_dir)]
    intact: dict[Path, bool] = {}
    problems: list[str] = []

    def is_intact(path: Path) -> bool:
        if path not in intact:
            try:
                if verify and not verify_checksums(path) and str(path) not in _noted_without_checksums:
                    _noted_without_checksums.add(str(path))
                    logger.warning(f"checkpoint {path} was saved without checksums (before lightrft recorded "
                                   "them): only its file sizes are checked")
                intact[path] = True
            except CheckpointCorruptError as err:
                problems.append(str(err))
                intact[path] = False
        return intact[path]

    def complete_copy_of(name: str) -> Path | None:
        for candidate in (save_dir / name, save_dir / (OLD_PREFIX + name)):
            if candidate in complete and is_intact(candidate):
                return candidate
        return None

    if tag is not None:
        found = complete_copy_of(tag)
        if found is None and problems:
            raise CheckpointCorruptError("; ".join(problems))
        if found is None:
            raise FileNotFoundError(
                f"checkpoint {save_dir / tag} is missing or incomplete (no valid {MARKER_NAME}); "
                f"complete checkpoints in {save_dir}: {[p.name for p in complete] or 'none'}")
    else:
        pointed = read_pointer(save_dir)
        found = complete_copy_of(pointed) if pointed and not pointed.startswith(".") else None
        found = found or next((path for path in reversed(complete) if is_intact(path)), None)
    if found is None and problems:
        raise CheckpointCorruptError(f"no intact checkpoint in {save_dir}: " + "; ".join(problems) +
                                     f". Move the corrupted folders out of {save_dir} to start afresh")
    for problem in problems:
        logger.warning(f"{problem}; loading {found} instead")
    return found


# ---------------------------------------------------------------------------------------------
# Client state


PROBE_PREFIX = ".shared-check-"


def write_probe(folder: Path, token: str, rank: int) -> Path:
    """Writes rank `rank`'s probe file for the shared-folder check (`token` is the same on every
    rank of one check) into `folder`, creating it, and returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{PROBE_PREFIX}{token}-rank{rank}"
    path.write_text(f"{rank}\n")
    fsync_file(path)
    return path


def missing_probes(folder: Path, token: str, world_size: int) -> list[int]:
    """The ranks whose probe file of check `token` this process does not see in `folder`."""
    return [rank for rank in range(world_size) if not (folder / f"{PROBE_PREFIX}{token}-rank{rank}").is_file()]


def saved_ranks(ckpt_dir: Path) -> int:
    """How many ranks saved the checkpoint `ckpt_dir` (every rank writes its client state); 0 when
    it holds none (a checkpoint written outside `DeepspeedStrategy.save_ckpt`)."""
    folder = Path(ckpt_dir) / CLIENT_STATE_DIR
    return len(list(folder.glob("rank_*.pt"))) if folder.is_dir() else 0


def client_state_path(ckpt_dir: Path, rank: int) -> Path:
    return Path(ckpt_dir) / CLIENT_STATE_DIR / f"rank_{rank}.pt"


def save_client_state(ckpt_dir: Path, rank: int, state: dict) -> None:
    """Writes this rank's client state (plain data and tensors) into the checkpoint folder."""
    path = client_state_path(ckpt_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)


def load_client_state(ckpt_dir: Path, rank: int) -> dict:
    """This rank's client state, or rank 0's when the checkpoint was saved by fewer ranks.

    Only plain data and tensors are accepted (`load_plain`: UnsafePickleError otherwise)."""
    path = client_state_path(ckpt_dir, rank)
    if not path.exists():
        path = client_state_path(ckpt_dir, 0)
    if not path.exists():
        return {}
    return load_plain(path, f"client state {path}")


# ---------------------------------------------------------------------------------------------
# The save protocol


def _agreed(all_ok: Callable[[bool], bool], error: BaseException | None, what: str, path: Path) -> None:
    """Collective check after a step: raises on every rank when the step failed on any."""
    if all_ok(error is None):
        return
    if error is not None:
        raise CheckpointSaveError(f"{what} failed for checkpoint {path}: {error}; the previous checkpoints "
                                  f"in {path.parent} are untouched") from error
    raise CheckpointSaveError(f"{what} failed on another rank for checkpoint {path}; the previous "
                              f"checkpoints in {path.parent} are untouched")


def _prepare_tmp(save_dir: Path, tmp: Path) -> None:
    save_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(save_dir)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    (tmp / WRITER_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    fsync_dir(save_dir)


def _commit(save_dir: Path, tmp: Path, tag: str) -> Path:
    """Writer only: marker, rename into place, pointer. Returns the final folder."""
    final = save_dir / tag
    fault_point("before-marker", tmp)
    previous = list_complete(save_dir)
    sizes = list_files(tmp)
    marker = {"format": MARKER_FORMAT, "tag": tag, "seq": (previous[-1][0] + 1) if previous else 1,
              "created": time.time(), "files": sizes,
              "checksums": {"algorithm": CHECKSUM, "files": checksum_files(tmp, sizes)}}
    atomic_write_text(tmp / MARKER_NAME, json.dumps(marker, indent=1))
    fault_point("before-rename", tmp)
    if final.exists():
        # Overwriting a tag: park the old copy under `.old-<tag>` (still loadable) until the new is in.
        old = save_dir / (OLD_PREFIX + tag)
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
        fsync_dir(save_dir)
    os.rename(tmp, final)
    fsync_dir(save_dir)
    fault_point("before-pointer", final)
    atomic_write_text(save_dir / POINTER_NAME, tag + "\n")
    return final


def prune_checkpoints(save_dir: Path, max_num: int) -> list[str]:
    """Removes complete checkpoints beyond the newest `max_num` (oldest first), and leftovers of
    earlier crashes. A removed folder is first renamed to `.trash-<tag>` so it disappears from
    discovery atomically. Returns the tags removed."""
    save_dir = Path(save_dir)
    removed = []
    complete = list_complete(save_dir)
    for _, path in complete[: max(0, len(complete) - max_num)]:
        trash = save_dir / (TRASH_PREFIX + path.name)
        if trash.exists():
            shutil.rmtree(trash)
        os.rename(path, trash)
        fsync_dir(save_dir)
        fault_point("during-cleanup", trash)
        shutil.rmtree(trash)
        removed.append(path.name)
    kept = {p.name for _, p in list_complete(save_dir)}
    for path in save_dir.iterdir():
        leftover = (path.name.startswith(TRASH_PREFIX) or (path.name.startswith(OLD_PREFIX) and path.name not in kept)
                    or (path.name.startswith(UNIVERSAL_PREFIX) and path.name[len(UNIVERSAL_PREFIX):] not in kept))
        if path.is_dir() and leftover:
            shutil.rmtree(path)
    remove_stale_temporaries(save_dir)
    fsync_dir(save_dir)
    return removed


def universal_source(ckpt_dir: Path) -> dict | None:
    """What identifies the checkpoint `ckpt_dir` for its cached universal form: its tag, sequence
    number and the checksum of its marker (a new save of the same tag changes it); None when it
    has no valid marker."""
    marker = read_marker(ckpt_dir)
    if marker is None:
        return None
    return {"tag": Path(ckpt_dir).name, "seq": marker["seq"],
            "marker": file_checksum(Path(ckpt_dir) / MARKER_NAME)}


def universal_cache(ckpt_dir: Path) -> Path:
    """The folder of the universal form of `ckpt_dir`, beside it."""
    return Path(ckpt_dir).parent / f"{UNIVERSAL_PREFIX}{Path(ckpt_dir).name}"


def universal_cache_valid(ckpt_dir: Path) -> bool:
    """Whether `universal_cache(ckpt_dir)` holds a finished conversion of this very checkpoint."""
    try:
        record = json.loads((universal_cache(ckpt_dir) / UNIVERSAL_SOURCE).read_text())
    except (OSError, ValueError):
        return False
    source = universal_source(ckpt_dir)
    return source is not None and record == source


def publish_universal(ckpt_dir: Path, converted: Path) -> Path:
    """Makes the finished conversion in `converted` (a temporary folder beside the checkpoint) the
    checkpoint's universal cache: its source record is written last and the folder renamed into
    place, so a crash leaves either no cache or a whole one."""
    source = universal_source(ckpt_dir)
    atomic_write_text(Path(converted) / UNIVERSAL_SOURCE, json.dumps(source))
    target = universal_cache(ckpt_dir)
    if target.exists():
        shutil.rmtree(target)
    os.rename(converted, target)
    fsync_dir(target.parent)
    return target


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:       # alive, another user's
        return False
    return False


def holds_run_lock(save_dir: Path) -> bool:
    """True when this process holds the run lock (`lightrft.utils.run_lock`) of `save_dir` or of a
    folder above it: then no other run may write there. The lock's holder record must name this
    process and the lock must be held (a fresh open of the file cannot take it)."""
    for folder in (Path(save_dir).resolve(), *Path(save_dir).resolve().parents):
        path = folder / LOCK_NAME
        if not path.is_file():
            continue
        record = read_record(path) or {}
        if record.get("pid") != os.getpid() or record.get("host") != socket.gethostname():
            return False
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True           # held, and the record says by this process
        finally:
            os.close(fd)          # closing releases the lock if this test took it
        return False
    return False


def is_stale_temporary(path: Path) -> bool:
    """Whether the temporary folder `path` (`.tmp-<tag>`) is a leftover no live writer will finish
    (module docstring): its writer record names this process or a process of this host that is
    gone, or this process holds the run lock above it."""
    try:
        record = json.loads((Path(path) / WRITER_NAME).read_text())
        host, pid = record["host"], int(record["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        host = pid = None
    if host == socket.gethostname() and (pid == os.getpid() or _process_gone(pid)):
        return True
    return holds_run_lock(Path(path).parent)


def remove_stale_temporaries(save_dir: Path) -> list[str]:
    """Removes the stale temporary folders of failed or killed saves in `save_dir` (never one a
    live writer may still be filling); returns their names."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    removed = []
    for path in sorted(save_dir.iterdir()):
        if path.name.startswith(TMP_PREFIX) and path.is_dir() and is_stale_temporary(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def save_checkpoint_dir(
    save_dir: str | os.PathLike,
    tag: str,
    write_shard: Callable[[Path], None],
    *,
    is_writer: bool = True,
    all_ok: Callable[[bool], bool] = lambda ok: ok,
    max_num: int = 3,
    ranks: int = 1,
) -> Path:
    """Runs the save protocol (module docstring) and returns the final folder `save_dir/<tag>`.

    `write_shard(tmp_dir)` writes this rank's files into the temporary folder. `all_ok(ok)` is a
    collective that returns True only when `ok` is True on every rank (it also synchronises them);
    a single process passes the default. `is_writer` is True on exactly one rank (rank 0).
    Raises CheckpointSaveError naming the path when any rank fails to write; the previous
    checkpoints are then untouched and the temporary folder is removed. A failed clean-up after
    the commit only warns: the new checkpoint is already complete. With `ranks` > 1 every rank
    writes its client state (`save_client_state`), and the writer refuses to commit a folder
    where it does not see all of them (ranks on node-local disks write elsewhere).
    """
    save_dir = Path(save_dir)
    validate_tag(tag)
    fault_spec()
    if max_num < 1:
        raise ValueError(f"--max_ckpt_num must be >= 1, got {max_num}")
    tmp = save_dir / (TMP_PREFIX + tag)
    try:
        _save_steps(save_dir, tag, tmp, write_shard, is_writer, all_ok, ranks)
    except CheckpointSaveError:
        # Every rank has stopped writing (the failure was agreed on), so the partial folder can go:
        # left behind, it would keep a full disk full and fail every later save.
        if is_writer:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = save_dir / tag
    if is_writer:
        try:
            prune_checkpoints(save_dir, max_num)
        except Exception as err:  # the new checkpoint is committed; a failed clean-up only warns
            warnings.warn(f"checkpoint {final} is complete, but removing old checkpoints in {save_dir} "
                          f"failed: {err}", RuntimeWarning)
    all_ok(True)
    return final


def _save_steps(save_dir: Path, tag: str, tmp: Path, write_shard: Callable[[Path], None], is_writer: bool,
                all_ok: Callable[[bool], bool], ranks: int = 1) -> None:
    """Steps 1-3 of the protocol; CheckpointSaveError on every rank when one fails on any."""
    final = save_dir / tag
    error = None
    if is_writer:
        try:
            _prepare_tmp(save_dir, tmp)
        except Exception as err:  # reported on every rank by _agreed
            error = err
    _agreed(all_ok, error, "creating the temporary folder", tmp)

    error = None
    try:
        write_shard(tmp)
        fault_point("mid-shard", tmp)
        fsync_tree(tmp)
    except Exception as err:  # any failure while writing must reach every rank, not hang them
        error = err
    _agreed(all_ok, error, "writing the shards", final)

    error = None
    if is_writer:
        try:
            missing = [rank for rank in range(ranks) if ranks > 1 and not client_state_path(tmp, rank).is_file()]
            if missing:
                raise RuntimeError(f"the files of rank(s) {', '.join(map(str, missing))} are not in {tmp} as rank 0 "
                                   "sees it: the ranks do not share this folder (node-local disks); put it on a "
                                   "filesystem every node mounts at the same path")
            _commit(save_dir, tmp, tag)
        except Exception as err:  # reported on every rank by _agreed
            error = err
    _agreed(all_ok, error, "committing", final)
