"""How a command's process ends (lightrft.utils.program): everything a normal exit does before the
interpreter finalises, then no finalising at all, where gloo's worker threads could abort a
finished run."""

import subprocess
import sys

import pytest

from tests.conftest import subprocess_env

PROGRAM = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from lightrft.utils.program import on_exit_without_teardown, run_program

out = Path(sys.argv[1])
how = sys.argv[2]


class Finalised:
    def __del__(self):
        (out / "finalised").write_text("yes")


keep = Finalised()                       # collected only when the interpreter finalises
atexit.register(lambda: (out / "atexit").write_text("yes"))
# what an extension's C++ destructor would release at teardown: only when teardown is skipped
on_exit_without_teardown(lambda: (out / "released").write_text("yes"))
pool = ThreadPoolExecutor(2)             # idle non-daemon workers, never shut down
pool.submit(time.sleep, 0.01).result()


def late_writer():
    time.sleep(0.3)
    (out / "thread").write_text("yes")


def main(code=None):
    threading.Thread(target=late_writer).start()
    sys.stdout.write("unflushed output")   # a pipe: block-buffered, written only if flushed
    if code == "message":
        raise SystemExit("stopped: a reason")
    if code == "crash":
        raise RuntimeError("a bug")
    if code is not None:
        raise SystemExit(int(code))


if how == "plain":
    main()
else:
    run_program(main, *sys.argv[3:])
"""


def run(tmp_path, how, *args):
    result = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path), how, *args], env=subprocess_env(),
                            capture_output=True, text=True, timeout=120)
    written = sorted(p.name for p in tmp_path.iterdir())
    return result, written


def test_a_plain_exit_finalises_which_is_what_the_race_needs(tmp_path):
    """The control: without run_program the interpreter finalises (the module's object is
    collected), so the check below would see it."""
    result, written = run(tmp_path, "plain")
    assert result.returncode == 0, result.stderr
    assert written == ["atexit", "finalised", "thread"]          # teardown ran: nothing else released


@pytest.mark.parametrize("code, status", [(None, 0), ("0", 0), ("3", 3)])
def test_run_program_does_the_exit_work_but_never_finalises(tmp_path, code, status):
    result, written = run(tmp_path, "program", *([code] if code is not None else []))
    assert result.returncode == status, result.stderr
    assert result.stdout == "unflushed output"
    # non-daemon threads joined, thread pools stopped, atexit handlers and the registered
    # releases run; no finalising
    assert written == ["atexit", "released", "thread"]


def test_a_message_exit_prints_it_and_gives_one(tmp_path):
    result, written = run(tmp_path, "program", "message")
    assert result.returncode == 1
    assert result.stderr.strip().endswith("stopped: a reason")
    assert written == ["atexit", "released", "thread"]


def test_an_error_keeps_its_traceback_and_the_normal_exit(tmp_path):
    result, written = run(tmp_path, "program", "crash")
    assert result.returncode == 1
    assert "RuntimeError: a bug" in result.stderr and "Traceback" in result.stderr
    assert "atexit" in written and "thread" in written
