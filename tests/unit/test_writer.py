"""GroupCommitWriter: many concurrent writers share few transactions, each caller
returns only after its row is committed, one bad record fails only its own caller, and
stop() drains the queue."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError, OperationalError

from areal_service.config import StoreConfig
from areal_service.store import TrajectoryStore
from areal_service.store.schema import CompletionRow
from areal_service.store.writer import GroupCommitWriter
from areal_service.types import CompletionRecord, SessionRecord


def record(cid: str, *, session_id: str | None = None, n_out: int = 4) -> CompletionRecord:
    return CompletionRecord(
        id=cid,
        model="m",
        prompt_ids=tuple(range(8)),
        output_ids=tuple(range(100, 100 + n_out)),
        output_logprobs=tuple(-0.25 * (i + 1) for i in range(n_out)),
        output_versions=(3,) * n_out,
        finish_reason="stop",
        session_id=session_id,
    )


def count_rows(store: TrajectoryStore) -> int:
    with store.engine.connect() as connection:
        return connection.execute(select(func.count()).select_from(CompletionRow)).scalar_one()


async def test_200_concurrent_writes_share_few_transactions(store: TrajectoryStore):
    store.add_session(SessionRecord(id="s1", created_at=1.0, last_activity_at=1.0))
    writer = GroupCommitWriter(store, interval_ms=5, max_batch=512)
    writer.start()
    records = [record(f"c{i:03d}", session_id="s1" if i % 2 else None) for i in range(200)]
    await asyncio.gather(*(writer.write(r) for r in records))
    writer.stop()
    assert writer.records == 200 and writer.failed == 0
    assert writer.transactions <= 20, writer.transactions
    assert count_rows(store) == 200
    assert store.get_completion("c137") == records[137]
    assert store.get_session("s1").last_activity_at == max(r.created_at for r in records[1::2])


async def test_write_returns_after_commit_visible_to_another_connection(store_url):
    config = StoreConfig()
    store = TrajectoryStore.open(store_url, config)
    reader = TrajectoryStore.open(store_url, StoreConfig(auto_migrate=False))
    writer = GroupCommitWriter.from_config(store, config)
    writer.start()
    for i in range(5):
        r = record(f"seen-{i}")
        await writer.write(r)
        assert reader.get_completion(r.id) == r  # committed, not just queued
    writer.stop()
    reader.close()
    store.close()


def test_bad_records_fail_alone_and_neighbours_commit(store: TrajectoryStore):
    store.add_completion(record("dup"))
    writer = GroupCommitWriter(store, interval_ms=0, max_batch=512)
    mismatched = CompletionRecord(
        id="mismatched",
        model="m",
        prompt_ids=(1,),
        output_ids=(1, 2),
        output_logprobs=(-1.0,),
        output_versions=(0, 0),
        finish_reason="stop",
    )
    batch = [record(f"ok{i}") for i in range(20)]
    batch[5] = record("dup")
    batch[12] = mismatched
    futures = [writer.submit(r) for r in batch]  # queued before start: one batch
    writer.start()
    writer.flush()
    with pytest.raises(IntegrityError):
        futures[5].result()
    with pytest.raises(ValueError, match="one entry per output token"):
        futures[12].result()
    for i, future in enumerate(futures):
        if i not in (5, 12):
            assert future.result() is None
    writer.stop()
    # One failed batch transaction, then each record alone.
    assert writer.transactions == 1 + 20
    assert (writer.records, writer.failed) == (18, 2)
    assert count_rows(store) == 1 + 18
    assert store.get_completion("mismatched") is None


async def test_async_caller_gets_its_own_error(store: TrajectoryStore):
    store.add_completion(record("taken"))
    writer = GroupCommitWriter(store, interval_ms=20)
    writer.start()
    ids = ["a", "taken", "b", "c"]
    results = await asyncio.gather(*(writer.write(record(i)) for i in ids), return_exceptions=True)
    writer.stop()
    assert [type(r) for r in results] == [type(None), IntegrityError, type(None), type(None)]
    assert count_rows(store) == 4


def test_shared_errors_fail_the_batch_without_per_record_retries(tmp_path):
    store = TrajectoryStore.open(f"sqlite:///{tmp_path / 'gone.db'}", StoreConfig())
    with store.engine.begin() as connection:
        connection.execute(text("DROP TABLE rewards"))
        connection.execute(text("DROP TABLE completions"))  # every insert now fails alike
    writer = GroupCommitWriter(store, interval_ms=0)
    futures = [writer.submit(record(f"x{i}")) for i in range(5)]
    writer.start()
    writer.flush()
    writer.stop()
    for future in futures:
        with pytest.raises(OperationalError, match="no such table"):
            future.result()
    assert (writer.transactions, writer.failed) == (1, 5)
    store.close()


def test_max_batch_bounds_each_transaction(store: TrajectoryStore):
    writer = GroupCommitWriter(store, interval_ms=0, max_batch=3)
    futures = [writer.submit(record(f"m{i}")) for i in range(10)]
    writer.start()
    writer.stop()
    assert all(f.done() and f.exception() is None for f in futures)
    assert (writer.transactions, writer.records) == (4, 10)  # 3 + 3 + 3 + 1


async def test_cancelled_write_is_still_stored(store: TrajectoryStore):
    writer = GroupCommitWriter(store, interval_ms=500)  # a long gather window
    writer.start()
    task = asyncio.create_task(writer.write(record("cancelled")))
    await asyncio.sleep(0.01)  # queued; the writer is still gathering
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.to_thread(writer.flush)  # the barrier ends the gather early
    assert store.get_completion("cancelled") is not None
    writer.stop()


def test_stop_drains_and_then_refuses(store: TrajectoryStore):
    writer = GroupCommitWriter(store, interval_ms=1)
    writer.start()
    futures: list[Future[None]] = [writer.submit(record(f"d{i}")) for i in range(100)]
    writer.stop()
    assert all(f.done() and f.exception() is None for f in futures)
    assert count_rows(store) == 100
    with pytest.raises(RuntimeError, match="stopped"):
        writer.submit(record("late"))
    writer.stop()  # idempotent


def test_never_started_writer_drains_on_stop(store: TrajectoryStore):
    writer = GroupCommitWriter(store)
    futures = [writer.submit(record(f"n{i}")) for i in range(10)]
    with pytest.raises(RuntimeError, match="start"):
        writer.flush()
    writer.stop()
    assert all(f.result() is None for f in futures)
    assert count_rows(store) == 10
