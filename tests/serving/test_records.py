"""The record folder of `serve --record` under faults: a write that fails on a full disk leaves the
file as it was and recording resumes once there is space; a torn or incomplete line is skipped and
reported (file and line) instead of refusing the folder; one recorder per folder at a time."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from lightrft.serving import records
from lightrft.serving.records import ExperienceRecord, ExperienceRecorder, read_records, tokenizer_fingerprint
from lightrft.experience.recorded import RecordedExperienceDataset
from lightrft.utils.run_lock import LOCK_NAME, RunLockError, read_record
from lightrft.utils.tiny import build_char_tokenizer
from tests.conftest import REPO_ROOT, subprocess_env


def make_record(rid: str, fingerprint: str = "f" * 16, version: int = 0) -> ExperienceRecord:
    """A record as the server writes it (answer "c" + EOS to "ab")."""
    return ExperienceRecord(id=rid, index=0, prompt_token_ids=[10, 11], response_token_ids=[12, 2],
                            log_probs=[-0.5, -0.25], policy_version=version, tokenizer=fingerprint, prompt="ab",
                            response="c", messages=None, sampling={"seed": 1}, finish_reason="stop", time=0.0)


def run_child(script: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *map(str, args)], cwd=REPO_ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)


# A recorder whose disk fills up in the middle of a line: RLIMIT_FSIZE makes a write that crosses the
# limit write the bytes below it and the next one fail with EFBIG (Python ignores SIGXFSZ), which is
# what a full disk does with ENOSPC. The limit then goes back up: space is back.
FULL_DISK = """
import json, resource, sys
from lightrft.serving.records import ExperienceRecord, ExperienceRecorder

def record(rid):
    return ExperienceRecord(id=rid, index=0, prompt_token_ids=list(range(40)), response_token_ids=list(range(40)),
                            log_probs=[-0.5] * 40, policy_version=0, tokenizer="f" * 16, prompt="p" * 40,
                            response="r" * 40, messages=None, sampling={"seed": 1}, finish_reason="stop", time=0.0)

def fill_disk(path, room):
    resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + room, hard))

_, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
recorder = ExperienceRecorder(sys.argv[1])
recorder.record(record("a"))
recorder.add_feedback("a", 1.0)
out = {"sizes": [recorder.experiences_path.stat().st_size, recorder.feedback_path.stat().st_size]}
errors = []
fill_disk(recorder.experiences_path, 100)          # 100 bytes of the next line fit
try:
    recorder.record(record("b"))
except OSError as e:
    errors.append(str(e))
fill_disk(recorder.feedback_path, 10)
try:
    recorder.add_feedback("a", 5.0)
except OSError as e:
    errors.append(str(e))
out["sizes_after_failures"] = [recorder.experiences_path.stat().st_size, recorder.feedback_path.stat().st_size]
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
recorder.record(record("c"))
recorder.add_feedback("c", 2.0)
out["errors"] = errors
print(json.dumps(out))
"""


def test_a_full_disk_leaves_no_torn_line_and_recording_resumes_when_space_is_back(tmp_path, caplog):
    child = run_child(FULL_DISK, tmp_path)
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout)
    assert out["sizes_after_failures"] == out["sizes"]  # each failed write was cut back to the byte
    experiences, feedback = tmp_path / "experiences.jsonl", tmp_path / "feedback.jsonl"
    assert len(out["errors"]) == 2
    for error, path in zip(out["errors"], [experiences, feedback]):
        assert f"could not record in {path}: File too large" in error
        assert "left as it was before this write" in error
    # Every line is whole: the failed ones are gone, the ones after them are intact.
    lines = experiences.read_bytes().split(b"\n")
    assert lines[-1] == b"" and [json.loads(line)["id"] for line in lines[:-1]] == ["a", "c"]
    assert [json.loads(line)["reward"] for line in feedback.read_bytes().splitlines()] == [1.0, 2.0]
    with caplog.at_level(logging.WARNING, logger="lightrft"):
        assert [(r.id, reward) for r, reward in read_records(tmp_path)[0]] == [("a", 1.0), ("c", 2.0)]
    assert caplog.records == []  # nothing to skip


def test_an_append_after_a_torn_tail_cuts_the_tail_first(tmp_path, caplog):
    recorder = ExperienceRecorder(tmp_path)
    recorder.record(make_record("a"))
    with open(recorder.experiences_path, "ab") as f:  # what a failed write leaves if cutting it back failed too
        f.write(b'{"id": "torn", "ind')
    with caplog.at_level(logging.WARNING, logger="lightrft"):
        recorder.record(make_record("b"))
    assert [json.loads(line)["id"] for line in recorder.experiences_path.read_bytes().splitlines()] == ["a", "b"]
    assert f"{recorder.experiences_path}: cut off line 2" in caplog.text
    recorder.close()


def test_torn_and_incomplete_lines_are_skipped_and_reported_with_their_line_numbers(tmp_path, caplog):
    tokenizer = build_char_tokenizer()
    fingerprint = tokenizer_fingerprint(tokenizer)
    experiences, feedback = tmp_path / "experiences.jsonl", tmp_path / "feedback.jsonl"
    # What a full disk left with the old writer: a torn line, the next record appended to its end.
    line = {rid: make_record(rid, fingerprint).to_json() for rid in "abcd"}
    experiences.write_text("\n".join([line["a"], '{"id": "torn", "ind' + line["b"], line["c"],
                                      json.dumps({"id": "x", "index": 0}),   # a line lacking fields
                                      line["d"], '{"id": "cut off at the e']))  # a last line without newline
    feedback.write_text("\n".join(['{"id": "a", "index": 0, "reward": 1.0}', '{"id": "c", "ind',
                                   '{"id": "c", "index": 0, "reward": 3.0}', '{"id": "d", "index": 0}', ""]))

    with caplog.at_level(logging.WARNING, logger="lightrft"):
        loaded, path = read_records(tmp_path)
    assert path == experiences
    assert [(r.id, reward) for r, reward in loaded] == [("a", 1.0), ("c", 3.0), ("d", None)]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert warnings[0].startswith(f"{experiences}: skipped 3 of 6 lines: line 2 (not JSON")
    assert "line 4 (lacks " in warnings[0] and "line 6 (no newline at the end" in warnings[0]
    assert warnings[1].startswith(f"{feedback}: skipped 2 of 4 lines: line 2 (not JSON")
    assert "line 4 (lacks reward)" in warnings[1]
    folder = records.read_record_folder(tmp_path)  # the counts, for code that reports them
    assert [(s.path, [number for number, _ in s.lines], s.total) for s in folder.skipped] == \
        [(experiences, [2, 4, 6], 6), (feedback, [2, 4], 4)]

    # train_ppo --recorded_data trains on what is readable.
    dataset = RecordedExperienceDataset(tmp_path, tokenizer)
    assert [s.id for s in dataset.samples] == ["a", "c"] and dataset.unrewarded == 1

    # serve --record starts on the folder (cutting the unterminated last line) and takes feedback.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightrft"):
        recorder = ExperienceRecorder(tmp_path)
    assert f"{experiences}: cut off line 6" in caplog.text and f"{experiences}: skipped 2 of 5 lines" in caplog.text
    recorder.add_feedback("d", 4.0)
    with pytest.raises(KeyError, match="'x'"):  # a skipped line is not a recorded response
        recorder.add_feedback("x", 1.0)
    recorder.record(make_record("e", fingerprint))
    recorder.close()
    assert [(r.id, reward) for r, reward in read_records(tmp_path)[0]] == \
        [("a", 1.0), ("c", 3.0), ("d", 4.0), ("e", None)]


# A server's recorder that holds the folder until it is killed.
HOLDER = """
import sys, time
from lightrft.serving.records import ExperienceRecorder
recorder = ExperienceRecorder(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_recorder_on_the_folder_is_refused_and_a_dead_ones_lock_taken_over(tmp_path, capfd):
    folder = tmp_path / "served"
    first = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), str(folder), "--tag", "serve-one"],
                             cwd=REPO_ROOT, env=subprocess_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "held"
        with pytest.raises(RunLockError) as info:
            ExperienceRecorder(folder)
        message = str(info.value)
        assert f"the record folder {folder} (--record) is in use by another run: pid {first.pid}" in message
        assert "serve-one" in message and "pass a different --record" in message
        assert first.poll() is None  # the first server is untouched
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()

    recorder = ExperienceRecorder(folder)  # the dead server's lock is taken over
    assert f"taking over the lock left by a run that is no longer running (pid {first.pid}" in capfd.readouterr().err
    recorder.record(make_record("a"))
    recorder.close()
    assert read_record(folder / LOCK_NAME) is None  # released at close
    with pytest.raises(RuntimeError, match="closed"):
        recorder.record(make_record("b"))
    again = ExperienceRecorder(folder)
    assert capfd.readouterr().err == ""  # a clean release: nothing to take over
    again.close()
    assert [r.id for r, _ in read_records(folder)[0]] == ["a"]
