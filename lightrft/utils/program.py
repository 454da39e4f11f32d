"""How lightrft's commands end their process: `run_program(main, argv)` under `__main__`.

A finished run's rank could abort at the very end, after its work was done and saved ("terminate
called without an active exception", exit -6, so torchrun reports the run as failed): about one
two-rank launch in 300 on a loaded 2-core machine. The cause is gloo's worker threads. Each process
group keeps two of them, and `destroy_process_group` does not stop them while anything still holds
the group (ZeRO-3 parameters and optimizer keep theirs, and `torch.distributed.nn`, imported by
transformers after the group started, holds the default group in its functions' default
arguments). After a collective completes, its worker thread still drops its reference to the
collective's tensors a moment later; when the caller already dropped its own, the last release
frees the tensor's Python object, which needs the GIL. If the interpreter has begun finalising by
then, CPython ends the thread (pthread_exit), and the unwinding through a C++ destructor calls
std::terminate.

`run_program` ends the process the way the interpreter would, minus the finalising that races: it
tells thread pools to stop and waits for non-daemon threads, runs the `atexit` handlers (logging,
W&B, multiprocessing's child clean-up, weakref finalizers), flushes stdout and stderr, and then
leaves with `os._exit`, so no thread ever meets a finalising interpreter. Everything lightrft
writes is closed before that (trackers, checkpoints, exports, the run lock), and a command called
as a function (tests, research code) is unaffected: only the `__main__` block uses this.
"""

import atexit
import os
import sys
import threading
from collections.abc import Callable


# Clean-up the interpreter's teardown would have done (C++ destructors of extensions), run by
# `finish_process` instead; each registered once.
_WITHOUT_TEARDOWN: list[Callable[[], None]] = []


def on_exit_without_teardown(release: Callable[[], None]) -> None:
    """Registers `release` to run when `finish_process` ends the process, which skips the
    interpreter's teardown: for what an extension releases only in its C++ destructors (vLLM's
    CPU shared memory, `lightrft.rollout.vllm_engine.release_shared_memory`). A process that ends
    normally runs those destructors instead, and never calls `release`."""
    if release not in _WITHOUT_TEARDOWN:
        _WITHOUT_TEARDOWN.append(release)


def exit_code(code) -> int:
    """The process exit status `SystemExit(code)` stands for: None is 0, an int itself, anything
    else (a message) is printed to stderr and gives 1, as the interpreter does."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def finish_process(code: int) -> None:
    """Ends the process with `code` after what a normal exit does before finalising (see the module
    doc); never returns."""
    try:
        threading._shutdown()           # the interpreter's own calls at exit, before it finalises:
        atexit._run_exitfuncs()         # thread pools told to stop, non-daemon threads joined, atexit
        for release in _WITHOUT_TEARDOWN:
            try:
                release()
            except Exception as err:   # one failed clean-up must not keep the process alive
                print(f"lightrft: clean-up {getattr(release, '__name__', release)} failed at exit: {err}",
                      file=sys.stderr)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):    # closed or broken pipe: nothing more can be written
                pass
        os._exit(code)


def run_program(main: Callable, *args, **kwargs) -> None:
    """Runs a command's `main(*args, **kwargs)` as the whole program and ends the process with its exit status
    (0, or what SystemExit carries). An exception other than SystemExit propagates as usual, with
    its traceback and the normal interpreter exit: the run failed anyway."""
    try:
        main(*args, **kwargs)
    except SystemExit as done:
        finish_process(exit_code(done.code))
    finish_process(0)
