"""One asyncio event loop per process, on a daemon thread, for synchronous code that calls async
libraries (the httpx clients of reward and judge servers).

Why a loop of its own: an `httpx.AsyncClient` belongs to the loop it was first used on, so a client
that pools connections across the trainer's calls needs a loop that outlives each call; and a
coroutine on it can be cancelled at a deadline (`asyncio.wait_for`), which a blocking socket read
cannot. The thread is a daemon: nothing joins it at exit, and a forked child makes its own.
"""

import asyncio
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_owner_pid: int | None = None


def background_loop() -> asyncio.AbstractEventLoop:
    """This process's background event loop, started on first use."""
    global _loop, _owner_pid
    with _lock:
        if _loop is None or _owner_pid != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="lightrft-event-loop", daemon=True).start()
            _loop, _owner_pid = loop, os.getpid()
        return _loop


def run_blocking(coroutine: Coroutine[Any, Any, T]) -> T:
    """Runs `coroutine` on the background loop and waits for its result (or its exception). Never
    call it from the background loop itself (the loop would wait on itself)."""
    loop = background_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        coroutine.close()
        raise RuntimeError("run_blocking was called on the background loop it would wait for")
    return asyncio.run_coroutine_threadsafe(coroutine, loop).result()
