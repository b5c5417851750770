"""GroupCommitWriter: the gateway's durable completion capture, many records per commit.

One thread takes what is queued (waiting up to `interval_ms` for more, at most
`max_batch`), writes it in ONE `TrajectoryStore.add_completions` transaction, then
resolves each caller. A failed batch is retried record by record, so a bad record fails
only its own caller. Completions only; other tables go through the store directly.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from sqlalchemy.exc import InterfaceError, OperationalError

from areal_service.config import StoreConfig
from areal_service.store.trajectory import TrajectoryStore
from areal_service.types import CompletionRecord

logger = logging.getLogger(__name__)

# Errors that say nothing about a record (database locked past busy_timeout, disk full,
# server gone): retrying each record alone would repeat them N times, so the whole
# batch gets the error.
_SHARED_ERRORS = (OperationalError, InterfaceError)


@dataclass(slots=True)
class _Pending:
    """A queued record and whoever waits for it: a concurrent Future (`submit`) or an
    asyncio future on `loop` (`write`)."""

    record: CompletionRecord
    future: Future[None] | None = None
    loop: asyncio.AbstractEventLoop | None = None
    waiter: asyncio.Future[None] | None = None


@dataclass(slots=True)
class _Barrier:
    """Ends the batch being gathered; resolved once everything queued before it is done."""

    future: Future[None]


_STOP = object()
_Item = _Pending | _Barrier | object  # object: the _STOP marker
_Outcome = tuple[_Pending, Exception | None]
_Wakeup = tuple[asyncio.Future[None], Exception | None, str]


def _wake(wakeups: list[_Wakeup]) -> None:
    """Runs on the caller's event loop: resolve a batch's asyncio futures in one go."""
    for waiter, error, record_id in wakeups:
        if waiter.cancelled():
            # The caller went away; its record was still written unless this error says
            # otherwise, and then nobody else will report it.
            if error is not None:
                logger.error("completion %s was not stored: %r", record_id, error)
        elif error is None:
            waiter.set_result(None)
        else:
            waiter.set_exception(error)


class GroupCommitWriter:
    """Batches `CompletionRecord` inserts from many callers into few transactions.

    Cost on the event loop: `write` is one non-blocking queue put, and each batch wakes
    each waiting loop once (`call_soon_threadsafe`), not once per record. Cancelling a
    `write` does not unqueue its record: a generated completion is always stored.
    Counters (`transactions`, `records`, `failed`) are written by the writer thread only.
    """

    def __init__(
        self,
        store: TrajectoryStore,
        *,
        interval_ms: float = 2.0,
        max_batch: int = 512,
        prepare: Callable[[list[CompletionRecord]], list[CompletionRecord]] | None = None,
    ) -> None:
        if max_batch < 1 or interval_ms < 0:
            raise ValueError(f"max_batch ({max_batch}) >= 1 and interval_ms ({interval_ms}) >= 0")
        self._store = store
        self.prepare = prepare
        """Applied to each batch on the writer thread right before its insert (parent
        linking when several processes share the store, `ParentLinker.link_batch`); an
        error fails the batch like an insert error."""
        self._interval_s = interval_ms / 1000.0
        self._max_batch = max_batch
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._cut = threading.Event()
        """Set by a marker or a full batch: ends the gather window early."""
        self._closed = False
        self._thread: threading.Thread | None = None
        self.transactions = 0
        """Transactions begun (batches plus single-record retries), committed or not."""
        self.records = 0
        """Records committed."""
        self.failed = 0
        """Records whose write raised (the error went to their caller)."""
        self.last_error: str | None = None
        """The last failed transaction's error (`Type: message`) while no transaction has
        succeeded since; None once one commits. Readiness reports it."""
        self.last_error_at: float | None = None
        """`time.time()` of that failure."""

    @classmethod
    def from_config(
        cls,
        store: TrajectoryStore,
        config: StoreConfig,
        prepare: Callable[[list[CompletionRecord]], list[CompletionRecord]] | None = None,
    ) -> GroupCommitWriter:
        """A writer with `store.commit_interval_ms` and `store.max_batch_records`."""
        return cls(
            store,
            interval_ms=config.commit_interval_ms,
            max_batch=config.max_batch_records,
            prepare=prepare,
        )

    @property
    def queued(self) -> int:
        """Records and markers waiting for the writer thread (approximate)."""
        return self._queue.qsize()

    @property
    def running(self) -> bool:
        """Whether the writer thread is alive (False before `start` and after it ended;
        the gateway's readiness reports a thread that died)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the writer thread. Records submitted before `start` wait in the queue."""
        if self._thread is not None:
            raise RuntimeError("GroupCommitWriter.start() called twice")
        # Daemon so a process that never calls stop() can exit; stop() is what drains.
        self._thread = threading.Thread(target=self._run, name="areal-store-writer", daemon=True)
        self._thread.start()

    def submit(self, record: CompletionRecord) -> Future[None]:
        """Queue `record`; the future resolves when its transaction committed, or holds
        the error that kept it out of the database. Cancelling the future before its
        batch starts drops the record (the caller asked for it)."""
        future: Future[None] = Future()
        self._put(_Pending(record, future=future))
        return future

    async def write(self, record: CompletionRecord) -> None:
        """Queue `record` and return once it is committed; raise its write error."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._put(_Pending(record, loop=loop, waiter=waiter))
        await waiter

    def flush(self, timeout: float | None = None) -> None:
        """Block until every record queued before this call is committed or failed.
        Blocking: from an event loop use `await asyncio.to_thread(writer.flush)`."""
        if self._thread is None:
            raise RuntimeError("flush() before start() would wait forever")
        barrier: Future[None] = Future()
        self._put(_Barrier(barrier))
        barrier.result(timeout)

    def stop(self) -> None:
        """Refuse new records, write everything queued, then end the thread (blocking).
        A writer that was never started drains its queue in the calling thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        if self._thread is None:
            self._run()
        else:
            self._thread.join()
        logger.info(
            "store writer stopped: %d records in %d transactions, %d failed",
            self.records,
            self.transactions,
            self.failed,
        )

    def _put(self, item: _Item) -> None:
        with self._lock:  # orders every put before the _STOP marker
            if self._closed:
                raise RuntimeError("the store writer is stopped")
            self._queue.put(item)
            if not isinstance(item, _Pending) or self._queue.qsize() >= self._max_batch:
                self._cut.set()

    # Writer thread.

    def _run(self) -> None:
        while True:
            batch, marker = self._gather(self._queue.get())
            if batch:
                self._commit(batch)
            if marker is _STOP:
                return
            if isinstance(marker, _Barrier):
                marker.future.set_result(None)

    def _gather(self, item: _Item) -> tuple[list[_Pending], _Item | None]:
        """Collect records starting with `item` until `max_batch`, the deadline, or a
        marker (returned so FIFO order holds: the batch is exactly what came before it).

        The window is a wait on `_cut`, not on the queue: a thread blocked in
        `SimpleQueue.get` is woken by every put, and each wake-up takes the GIL from the
        event loop (measured: ~3% of the gateway's GIL time while streaming). Records
        arriving in the window cost the loop one queue put; only a marker or a full
        batch wakes this thread early."""
        if isinstance(item, _Pending) and self._interval_s > 0:
            self._cut.wait(self._interval_s)
        self._cut.clear()
        batch: list[_Pending] = []
        while isinstance(item, _Pending):
            if item.future is None or item.future.set_running_or_notify_cancel():
                batch.append(item)
            if len(batch) >= self._max_batch:
                return batch, None
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return batch, None
        return batch, item

    def _write(self, records: list[CompletionRecord]) -> Exception | None:
        self.transactions += 1
        try:
            if self.prepare is not None:
                records = self.prepare(records)
            self._store.add_completions(records)
        except Exception as error:  # handed to the records' callers, never swallowed
            if isinstance(error, _SHARED_ERRORS):  # the write path, not one bad record
                self.last_error = f"{type(error).__name__}: {str(error).splitlines()[0]}"[:300]
                self.last_error_at = time.time()
            return error
        self.records += len(records)
        self.last_error = self.last_error_at = None
        return None

    def _commit(self, batch: list[_Pending]) -> None:
        error = self._write([pending.record for pending in batch])
        if error is None or len(batch) == 1 or isinstance(error, _SHARED_ERRORS):
            outcomes: list[_Outcome] = [(pending, error) for pending in batch]
        else:
            logger.warning("batch of %d failed (%s); writing each alone", len(batch), error)
            outcomes = [(pending, self._write([pending.record])) for pending in batch]
        self._resolve(outcomes)

    def _resolve(self, outcomes: list[_Outcome]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[_Wakeup]] = {}
        for pending, error in outcomes:
            if error is not None:
                self.failed += 1
            if pending.future is not None:
                if error is None:
                    pending.future.set_result(None)
                else:
                    pending.future.set_exception(error)
            else:
                assert pending.loop is not None and pending.waiter is not None
                wakeup = (pending.waiter, error, pending.record.id)
                by_loop.setdefault(pending.loop, []).append(wakeup)
        for loop, wakeups in by_loop.items():
            try:
                loop.call_soon_threadsafe(_wake, wakeups)
            except RuntimeError:  # the caller's loop is closed: nobody is waiting
                for _, error, record_id in wakeups:
                    if error is not None:
                        logger.error("completion %s was not stored: %r", record_id, error)
