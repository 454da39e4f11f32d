"""The crash-consistent checkpoint protocol on real files, without DeepSpeed: kills (os._exit) and
injected errors at every stage leave the previous checkpoint loadable and the partial one ignored."""

import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from lightrft.strategy import checkpoint_io as cio
from lightrft.utils.run_lock import RunLock
from tests.conftest import REPO_ROOT, subprocess_env

CHILD = """
import sys
from pathlib import Path
from lightrft.strategy.checkpoint_io import save_checkpoint_dir
from tests.strategy.test_checkpoint_io import write_for
save_checkpoint_dir(sys.argv[1], sys.argv[2], write_for(sys.argv[2]), max_num=int(sys.argv[3]))
print("finished")
"""


def write_for(tag: str):
    """A shard writer whose files identify the tag: two files in two folders, and client state."""
    def write(tmp: Path) -> None:
        (tmp / "model").mkdir()
        (tmp / "model" / "shard_0.bin").write_bytes(tag.encode() * 4000)
        (tmp / "optim.bin").write_bytes(tag.encode() * 100)
        cio.save_client_state(tmp, 0, {"tag": tag, "step": len(tag), "rng": torch.arange(3)})
    return write


def saved_tag(ckpt_dir: Path) -> str:
    return cio.load_client_state(ckpt_dir, 0)["tag"]


def save(save_dir, tag, max_num=2):
    return cio.save_checkpoint_dir(save_dir, tag, write_for(tag), max_num=max_num)


def complete_tags(save_dir):
    return [p.name for _, p in cio.list_complete(save_dir)]


def test_save_writes_marker_pointer_and_no_leftovers(tmp_path):
    final = save(tmp_path, "step1")
    assert final == tmp_path / "step1"
    marker = cio.read_marker(final)
    assert marker["tag"] == "step1" and marker["seq"] == 1
    # the marker lists every file with its size: 5 bytes x 4000, 5 x 100, and the client state
    assert marker["files"]["model/shard_0.bin"] == 20000 and marker["files"]["optim.bin"] == 500
    assert "client_state/rank_0.pt" in marker["files"]
    assert (tmp_path / "latest").read_text().strip() == "step1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step1"]
    assert cio.resolve_checkpoint(tmp_path) == final
    state = cio.load_client_state(final, 0)
    assert state["step"] == 5 and torch.equal(state["rng"], torch.arange(3))


def test_max_num_keeps_newest_complete_and_sequence_orders(tmp_path):
    for i in range(1, 6):
        save(tmp_path, f"s{i}", max_num=3)
    assert complete_tags(tmp_path) == ["s3", "s4", "s5"]
    assert [seq for seq, _ in cio.list_complete(tmp_path)] == [3, 4, 5]
    assert cio.find_latest_complete(tmp_path) == tmp_path / "s5"
    # an incomplete folder that looks like a checkpoint is neither counted nor deleted
    (tmp_path / "s9").mkdir()
    save(tmp_path, "s6", max_num=3)
    assert complete_tags(tmp_path) == ["s4", "s5", "s6"]
    assert (tmp_path / "s9").is_dir()


def test_overwriting_a_tag_replaces_it_whole(tmp_path):
    save(tmp_path, "a")
    save(tmp_path, "a", max_num=1)
    assert complete_tags(tmp_path) == ["a"]
    assert cio.read_marker(tmp_path / "a")["seq"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "latest"]


def run_child(save_dir, tag, fault, max_num=2):
    env = subprocess_env(**{cio.FAULT_ENV: fault})
    return subprocess.run([sys.executable, "-c", CHILD, str(save_dir), tag, str(max_num)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("stage", cio.FAULT_STAGES)
def test_kill_at_each_stage_keeps_a_loadable_checkpoint(tmp_path, stage):
    save(tmp_path, "a")
    save(tmp_path, "b")
    proc = run_child(tmp_path, "c", stage)
    assert proc.returncode == 137, proc.stderr
    assert f"exiting at stage {stage}" in proc.stdout and "finished" not in proc.stdout
    resolved = cio.resolve_checkpoint(tmp_path)
    if stage in ("mid-shard", "before-marker", "before-rename"):
        # the partial folder never became visible: the previous checkpoint is the one loaded
        assert (tmp_path / ".tmp-c").is_dir() and not (tmp_path / "c").exists()
        assert complete_tags(tmp_path) == ["a", "b"]
        assert resolved == tmp_path / "b"
    elif stage == "before-pointer":
        # c is complete, but `latest` still names b: the pointer decides
        assert complete_tags(tmp_path) == ["a", "b", "c"]
        assert resolved == tmp_path / "b"
    else:
        # during-cleanup: c is committed; "a" was being removed and is no longer a candidate
        assert (tmp_path / ".trash-a").is_dir()
        assert complete_tags(tmp_path) == ["b", "c"]
        assert resolved == tmp_path / "c"
    assert saved_tag(resolved) == resolved.name
    # the next save succeeds and clears what the crash left behind
    save(tmp_path, "d")
    assert complete_tags(tmp_path) == ["c", "d"] if stage in ("before-pointer", "during-cleanup") else ["b", "d"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert cio.resolve_checkpoint(tmp_path) == tmp_path / "d"


def test_torn_mid_shard_file_is_truncated_by_the_hook(tmp_path):
    save(tmp_path, "a")
    run_child(tmp_path, "b", "mid-shard")
    assert (tmp_path / ".tmp-b" / "model" / "shard_0.bin").stat().st_size == 4000 // 2


@pytest.mark.parametrize("stage", ["mid-shard", "before-marker", "before-rename", "before-pointer"])
def test_injected_error_raises_naming_the_path_and_keeps_previous(tmp_path, monkeypatch, stage):
    save(tmp_path, "a")
    monkeypatch.setenv(cio.FAULT_ENV, f"{stage}:raise")
    with pytest.raises(cio.CheckpointSaveError) as err:
        save(tmp_path, "b")
    assert str(tmp_path / "b") in str(err.value) and "injected failure" in str(err.value)
    assert cio.resolve_checkpoint(tmp_path) == tmp_path / "a"
    assert (tmp_path / "latest").read_text().strip() == "a"
    assert saved_tag(tmp_path / "a") == "a"
    # the failed save's temporary folder is gone (a full disk is not kept full by it)
    assert not (tmp_path / ".tmp-b").exists()


def test_failed_cleanup_only_warns(tmp_path, monkeypatch):
    save(tmp_path, "a", max_num=1)
    monkeypatch.setenv(cio.FAULT_ENV, "during-cleanup:raise")
    with pytest.warns(RuntimeWarning, match="is complete, but removing old checkpoints"):
        save(tmp_path, "b", max_num=1)
    assert cio.resolve_checkpoint(tmp_path) == tmp_path / "b"


def test_failing_writer_leaves_previous_intact(tmp_path):
    save(tmp_path, "a")

    def disk_full(tmp: Path) -> None:
        (tmp / "half.bin").write_bytes(b"x" * 10)
        raise OSError(28, "No space left on device", str(tmp / "half.bin"))

    with pytest.raises(cio.CheckpointSaveError) as err:
        cio.save_checkpoint_dir(tmp_path, "b", disk_full)
    assert str(tmp_path / "b") in str(err.value) and "No space left on device" in str(err.value)
    assert complete_tags(tmp_path) == ["a"] and cio.resolve_checkpoint(tmp_path) == tmp_path / "a"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "latest"]     # no .tmp-b left


def test_failure_on_another_rank_raises_here_too(tmp_path):
    # all_ok is the collective "did every rank succeed"; here another rank reports a failure.
    with pytest.raises(cio.CheckpointSaveError, match="failed on another rank"):
        cio.save_checkpoint_dir(tmp_path, "a", write_for("a"), all_ok=lambda ok: False)
    assert cio.resolve_checkpoint(tmp_path) is None


def test_unwritable_save_dir_names_the_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(cio.CheckpointSaveError, match=str(blocker / ".tmp-a")):
        save(blocker, "a")


def test_resolve_falls_back_when_pointer_is_missing_or_stale(tmp_path):
    assert cio.resolve_checkpoint(tmp_path) is None
    assert cio.resolve_checkpoint(tmp_path / "missing") is None
    save(tmp_path, "a", max_num=5)
    save(tmp_path, "b", max_num=5)
    (tmp_path / "latest").unlink()
    assert cio.resolve_checkpoint(tmp_path) == tmp_path / "b"
    (tmp_path / "latest").write_text("gone\n")
    assert cio.resolve_checkpoint(tmp_path) == tmp_path / "b"
    # a file that lost bytes after the marker was written makes the checkpoint incomplete
    os.truncate(tmp_path / "b" / "optim.bin", 10)
    (tmp_path / "latest").write_text("b\n")
    assert not cio.is_complete(tmp_path / "b")
    assert cio.resolve_checkpoint(tmp_path) == tmp_path / "a"
    # a marker that is not valid JSON counts as missing
    (tmp_path / "a" / cio.MARKER_NAME).write_text("{")
    assert cio.resolve_checkpoint(tmp_path) is None


def test_explicit_tag_must_be_complete(tmp_path):
    save(tmp_path, "a")
    (tmp_path / ".tmp-b").mkdir()
    assert cio.resolve_checkpoint(tmp_path, "a") == tmp_path / "a"
    with pytest.raises(FileNotFoundError) as err:
        cio.resolve_checkpoint(tmp_path, "b")
    assert str(tmp_path / "b") in str(err.value) and "['a']" in str(err.value)


def test_crash_during_tag_overwrite_keeps_the_old_copy(tmp_path):
    save(tmp_path, "a")
    # a crash between parking the old copy and renaming the new one in leaves only `.old-a`
    os.rename(tmp_path / "a", tmp_path / ".old-a")
    assert cio.resolve_checkpoint(tmp_path) == tmp_path / ".old-a"
    assert cio.resolve_checkpoint(tmp_path, "a") == tmp_path / ".old-a"
    save(tmp_path, "a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "latest"]


@pytest.mark.parametrize("tag", ["", ".hidden", "a/b", "latest", "two words", "x\n"])
def test_bad_tags_are_rejected(tmp_path, tag):
    with pytest.raises(ValueError, match="checkpoint tag"):
        save(tmp_path, tag)


def test_bad_max_num_and_fault_spec(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="--max_ckpt_num"):
        save(tmp_path, "a", max_num=0)
    monkeypatch.setenv(cio.FAULT_ENV, "halfway")
    with pytest.raises(ValueError, match="expected <stage>"):
        save(tmp_path, "a")


class Opaque:
    pass


class CreatesFile:
    """A pickle that creates `path` when it is loaded: stands for any code a file could run."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def __reduce__(self):
        return Path.touch, (self.path,)


def test_client_state_load_refuses_arbitrary_objects(tmp_path):
    cio.save_client_state(tmp_path, 0, {"obj": Opaque()})
    with pytest.raises(pickle.UnpicklingError):
        cio.load_client_state(tmp_path, 0)


def test_client_state_falls_back_to_rank_0(tmp_path):
    cio.save_client_state(tmp_path, 0, {"consumed": 12})
    assert cio.load_client_state(tmp_path, 3) == {"consumed": 12}
    assert cio.load_client_state(tmp_path / "none", 0) == {}


def test_client_state_holding_code_is_refused_unread(tmp_path):
    marker = tmp_path / "ran"
    cio.save_client_state(tmp_path, 0, {"step": 3, "obj": CreatesFile(marker)})
    with pytest.raises(cio.UnsafePickleError, match="client state .*rank_0.pt: refused to load"):
        cio.load_client_state(tmp_path, 0)
    assert not marker.exists()


# ------------------------------------------------------------------------------------ checksums
def overwrite_middle(path: Path, nbytes: int = 4096) -> None:
    """Overwrites `nbytes` in the middle of `path` with float32 3.4e38, keeping its size."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek((size - nbytes) // 2)
        f.write(bytes.fromhex("ffff7f7f") * (nbytes // 4))
    assert path.stat().st_size == size


def test_the_marker_records_a_crc32_of_every_file(tmp_path):
    marker = cio.read_marker(save(tmp_path, "a"))
    assert marker["format"] == 2 and marker["checksums"]["algorithm"] == "crc32"
    assert marker["checksums"]["files"]["optim.bin"] == f"{zlib.crc32(b'a' * 100):08x}"
    assert marker["checksums"]["files"]["model/shard_0.bin"] == f"{zlib.crc32(b'a' * 4000):08x}"
    assert set(marker["checksums"]["files"]) == set(marker["files"])


def test_a_corrupted_checkpoint_falls_back_to_the_previous_intact_one(tmp_path, caplog):
    save(tmp_path, "one", max_num=5)
    save(tmp_path, "two", max_num=5)
    shard = tmp_path / "two" / "model" / "shard_0.bin"           # 12000 bytes
    overwrite_middle(shard)
    assert cio.is_complete(tmp_path / "two")                    # sizes alone do not see it
    with caplog.at_level(logging.WARNING, logger="lightrft"):
        assert cio.resolve_checkpoint(tmp_path) == tmp_path / "one"
    assert f"checkpoint {tmp_path / 'two'} is corrupted: {shard} has crc32" in caplog.text
    assert f"loading {tmp_path / 'one'} instead" in caplog.text
    with pytest.raises(cio.CheckpointCorruptError, match=f"{shard} has crc32 .*, not the "):
        cio.resolve_checkpoint(tmp_path, "two")
    # nothing intact at all: an error naming every corrupted file, not a silent fresh start
    overwrite_middle(tmp_path / "one" / "optim.bin", 40)
    with pytest.raises(cio.CheckpointCorruptError, match="no intact checkpoint") as err:
        cio.resolve_checkpoint(tmp_path)
    assert str(shard) in str(err.value) and str(tmp_path / "one" / "optim.bin") in str(err.value)
    assert isinstance(err.value, FileNotFoundError)            # handled wherever a missing one is


def test_a_checkpoint_saved_before_checksums_still_loads_with_a_note(tmp_path, caplog):
    final = save(tmp_path, "one")
    marker = cio.read_marker(final)
    del marker["checksums"]
    (final / cio.MARKER_NAME).write_text(json.dumps({**marker, "format": 1}))
    overwrite_middle(final / "model" / "shard_0.bin")          # undetectable without checksums
    with caplog.at_level(logging.WARNING, logger="lightrft"):
        assert cio.resolve_checkpoint(tmp_path) == final
    assert f"checkpoint {final} was saved without checksums" in caplog.text


# ------------------------------------------------------------------------ stale temporary folders
def temporary(save_dir: Path, name: str, host: str | None = None, pid: int | None = None) -> Path:
    """A leftover `.tmp-<name>` with a shard, and a writer record when `host` is given."""
    path = save_dir / (cio.TMP_PREFIX + name)
    path.mkdir(parents=True)
    (path / "shard.bin").write_bytes(b"x" * 100)
    if host is not None:
        (path / cio.WRITER_NAME).write_text(json.dumps({"host": host, "pid": pid}))
    return path


def test_stale_temporaries_are_removed_and_a_live_writers_kept(tmp_path):
    host = socket.gethostname()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        temporary(tmp_path, "killed", host, int(gone.stdout))     # its writer is gone
        temporary(tmp_path, "mine", host, os.getpid())            # an earlier save of this process
        temporary(tmp_path, "live", host, live.pid)               # another run, writing right now
        temporary(tmp_path, "elsewhere", "another-host", 1)       # cannot tell: kept
        temporary(tmp_path, "unknown")                            # no record: kept
        save(tmp_path, "a")
        assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-elsewhere", ".tmp-live", ".tmp-unknown", "a",
                                                              "latest"]
        # Holding the run lock of the folder, this process knows no other run writes there.
        with RunLock(tmp_path):
            save(tmp_path, "b")
        assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "a", "b", "latest"]
    finally:
        live.kill()
        live.wait()


def damage(marker: dict, how: str):
    """A marker edited the way a careless or hostile hand might; returns the new JSON text."""
    if how == "deep":
        return "[" * 100_000 + "]" * 100_000
    marker = json.loads(json.dumps(marker))
    if how == "no checksums":
        del marker["checksums"]
    elif how == "other algorithm":
        marker["checksums"]["algorithm"] = "none"
    elif how == "seq null":
        marker["seq"] = None
    elif how == "seq true":
        marker["seq"] = True
    elif how == "checksum table a list":
        marker["checksums"]["files"] = list(marker["checksums"]["files"])
    elif how == "a file left out of the checksums":
        marker["checksums"]["files"].pop("optim.bin")
    elif how == "format from the future":
        marker["format"] = 3
    elif how == "no format":
        del marker["format"]
    elif how == "no tag":
        del marker["tag"]
    return json.dumps(marker)


@pytest.mark.parametrize("how", ["no checksums", "other algorithm", "seq null", "seq true", "checksum table a list",
                                 "a file left out of the checksums", "format from the future", "no format", "no tag",
                                 "deep"])
def test_a_damaged_marker_is_a_damaged_checkpoint(tmp_path, caplog, how):
    """Editing the marker cannot switch the checksum check off: the corrupted checkpoint (its
    weights overwritten with 3.4e38) is not loaded, and the resume falls back to the previous one,
    with a warning that names the marker and what is wrong with it; no traceback."""
    save(tmp_path, "one", max_num=5)
    two = save(tmp_path, "two", max_num=5)
    overwrite_middle(two / "model" / "shard_0.bin")
    marker_path = two / cio.MARKER_NAME
    marker_path.write_text(damage(json.loads(marker_path.read_text()), how))
    with caplog.at_level(logging.WARNING, logger="lightrft"):
        assert cio.resolve_checkpoint(tmp_path) == tmp_path / "one"
    assert f"checkpoint {two} is not used: its marker {marker_path} is damaged (" in caplog.text
    assert not cio.is_complete(two)
    with pytest.raises(FileNotFoundError, match=f"checkpoint {two} is missing or incomplete"):
        cio.resolve_checkpoint(tmp_path, "two")


def test_marker_problems_name_the_field(tmp_path):
    marker = cio.read_marker(save(tmp_path, "a"))
    assert cio.marker_problem(marker) is None
    assert "seq is None" in cio.marker_problem({**marker, "seq": None})
    assert "checksums use 'md5'" in cio.marker_problem({**marker, "checksums": {**marker["checksums"],
                                                                                 "algorithm": "md5"}})
    assert "saved by a newer lightrft" in cio.marker_problem({**marker, "format": 3})
    assert "JSON list" in cio.marker_problem([marker])
    legacy = {k: v for k, v in marker.items() if k != "checksums"} | {"format": 1}
    assert cio.marker_problem(legacy) is None                 # a pre-checksum marker stays readable


def converted(ckpt_dir: Path) -> Path:
    """A stand-in for a finished universal conversion of `ckpt_dir`, published as its cache."""
    tmp = ckpt_dir.parent / f"{cio.TMP_PREFIX}universal-{ckpt_dir.name}"
    (tmp / "deepspeed").mkdir(parents=True)
    (tmp / "deepspeed" / "zero").write_bytes(b"x" * 10)
    return cio.publish_universal(ckpt_dir, tmp)


def test_a_universal_form_is_reused_only_for_its_own_checkpoint_and_pruned_with_it(tmp_path):
    """The universal form of a checkpoint (resumed on another rank count) stays beside it: valid
    while the checkpoint is the one converted, invalid once the tag is saved again, not a
    checkpoint itself, and removed when pruning removes its checkpoint."""
    first = save(tmp_path, "s1", max_num=3)
    assert not cio.universal_cache_valid(first)
    cache = converted(first)
    assert cache == tmp_path / ".universal-s1" and cio.universal_cache_valid(first)
    assert complete_tags(tmp_path) == ["s1"]                          # not listed as a checkpoint
    save(tmp_path, "s2", max_num=3)
    assert cio.universal_cache_valid(first)                           # other saves leave it be
    save(tmp_path, "s1", max_num=3)                                   # the tag saved again: another checkpoint
    assert cache.is_dir() and not cio.universal_cache_valid(tmp_path / "s1")
    converted(tmp_path / "s2")
    save(tmp_path, "s3", max_num=1)                                   # s1 and s2 pruned: their forms go too
    assert complete_tags(tmp_path) == ["s3"]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(cio.UNIVERSAL_PREFIX)]


def test_a_conversion_that_cannot_fit_on_the_disk_says_so_before_it_starts(tmp_path, monkeypatch):
    """The disk's free space is the operating system's answer: shrunk here, as filling a real disk
    is not something a test may do."""
    import shutil
    from collections import namedtuple

    from lightrft.strategy.deepspeed_strategy import conversion_wait, disk_space_problem

    shards = tmp_path / "deepspeed"
    shards.mkdir()
    (shards / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x" * 3 * 2**20)
    (shards / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"x" * 2**20)
    assert disk_space_problem(shards, tmp_path) is None
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * 2**20, 9 * 2**20, 2**20))
    problem = disk_space_problem(shards, tmp_path)
    assert problem == (f"the disk holding {tmp_path} has 1.0 MiB free and the universal form of {shards} needs "
                       "about 4.0 MiB: free space there")
    # The wait for rank 0's conversion grows with the shards: 10 minutes + 1 s per 20 MB, never
    # under --dist_timeout.
    assert conversion_wait(shards, 1).total_seconds() == pytest.approx(600 + 4 * 2**20 / 20e6)
    assert conversion_wait(shards, 30).total_seconds() == 1800
