"""The gateway's background tasks under one supervisor.

A background task (the weight syncer, the policy and cache refreshers, the leader lease,
the session sweeper, the key-usage flusher) runs until shutdown. One that ends before
then, by raising or by returning, would otherwise stop its work silently until the
process is restarted (a raise outside the weight syncer's own `try` ended weight sync
for good). The supervisor logs such an end with its traceback and starts the task again
after a backoff (`BACKOFF_S`, doubling up to `MAX_BACKOFF_S`, back to the start once a
run lasted `HEALTHY_AFTER_S`); while a task waits to be started again, readiness is red
and names it (`problems`). The store writer is a thread (`GroupCommitWriter`): one that
died is reported the same way (it holds the queue of unwritten records, so it is not
replaced under them; the process must be restarted).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
HEALTHY_AFTER_S = 60.0
"""A run that lasted this long resets the backoff (its end was not a crash loop)."""

TaskFactory = Callable[[], Coroutine[Any, Any, None]]
"""Makes one run of a task (called again for each restart)."""


@dataclass
class TaskRecord:
    """One supervised task: what runs it, and what happened to it."""

    name: str
    factory: TaskFactory
    restarts: int = 0
    """How many times it ended unexpectedly and was started again."""
    last_error: str | None = None
    """`Type: message` of its last unexpected end (None: it never ended)."""
    down: bool = False
    """True while it waits (backoff) to be started again."""


@dataclass
class Supervisor:
    """Starts tasks, restarts the ones that end, cancels them all at `stop`."""

    backoff_s: float = BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S
    healthy_after_s: float = HEALTHY_AFTER_S
    tasks: dict[str, TaskRecord] = field(default_factory=dict)
    _running: list[asyncio.Task[None]] = field(default_factory=list)
    _watched: list[tuple[str, Callable[[], str | None]]] = field(default_factory=list)

    def start(self, name: str, factory: TaskFactory) -> None:
        """Run `factory()` in a task named `name`, restarted whenever it ends."""
        record = self.tasks[name] = TaskRecord(name, factory)
        self._running.append(asyncio.create_task(self._keep(record), name=f"supervised:{name}"))

    def watch(self, name: str, problem: Callable[[], str | None]) -> None:
        """Report `problem()` (None: fine) among `problems`: a part not restarted here."""
        self._watched.append((name, problem))

    def problems(self) -> dict[str, str]:
        """What is not running now, by name (empty: all is well). Readiness reports it."""
        found = {r.name: f"restarting after {r.last_error}" for r in self.tasks.values() if r.down}
        for name, problem in self._watched:
            text = problem()
            if text is not None:
                found[name] = text
        return found

    async def stop(self) -> None:
        """Cancel every task and wait for them to end."""
        for task in self._running:
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        self._running.clear()

    async def _keep(self, record: TaskRecord) -> None:
        delay = self.backoff_s
        while True:
            began = time.monotonic()
            try:
                await record.factory()
                log.error("background task %s returned; starting it again", record.name)
                record.last_error = "it returned"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # logged whole: the point of supervising it
                log.exception("background task %s failed; starting it again", record.name)
                record.last_error = f"{type(exc).__name__}: {exc}"
            if time.monotonic() - began >= self.healthy_after_s:
                delay = self.backoff_s
            record.restarts += 1
            record.down = True
            try:
                await asyncio.sleep(delay)
            finally:
                record.down = False
            delay = min(delay * 2, self.max_backoff_s)
