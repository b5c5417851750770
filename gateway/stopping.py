"""The app learns that its server has begun to stop, when the signal arrives.

uvicorn tells the app nothing until its lifespan shutdown, and that runs only after the
requests still in flight have finished or been cancelled by `timeout_graceful_shutdown`;
a cancelled request logs an `Exception in ASGI application` traceback and the server an
ERROR line. Requests that only wait (a session start waiting on the staleness gate) should
instead be answered at once. So the exit handlers uvicorn installs (SIGINT, SIGTERM) are
wrapped while the app runs: the wrapper sets an event, then calls uvicorn's handler.
Nothing is added to any request's path: waiters look at the event they already poll.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

_EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def watch_exit_signals(stopping: asyncio.Event) -> Callable[[], None]:
    """Set `stopping` (on the running loop) when SIGINT or SIGTERM arrives, then run the
    handler that was in place (uvicorn's). Returns the function that puts those handlers
    back. A no-op off the main thread (an app served by a test's thread), where Python
    allows no signal handlers, and where the handler in place is not Python's own."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    previous: dict[int, Any] = {}
    for sig in _EXIT_SIGNALS:
        handler = signal.getsignal(sig)
        if not callable(handler):
            continue

        def on_exit(signum: int, frame: FrameType | None, _then: Any = handler) -> None:
            loop.call_soon_threadsafe(stopping.set)
            _then(signum, frame)

        previous[sig] = handler
        signal.signal(sig, on_exit)

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore
