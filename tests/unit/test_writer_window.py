"""GroupCommitWriter's gather window: records arriving in it do not end it, a full batch
or a marker (flush, stop) does, so a long `interval_ms` never delays either."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from areal_service.config import StoreConfig
from areal_service.store import TrajectoryStore
from areal_service.store.writer import GroupCommitWriter
from areal_service.types import CompletionRecord


def record(cid: str) -> CompletionRecord:
    return CompletionRecord(
        id=cid,
        model="m",
        prompt_ids=(1, 2, 3),
        output_ids=(7, 8),
        output_logprobs=(-0.5, -0.25),
        output_versions=(0, 0),
        finish_reason="stop",
    )


@pytest.fixture
def store(tmp_path: Path):
    opened = TrajectoryStore.open(f"sqlite:///{tmp_path / 'w.db'}", StoreConfig())
    yield opened
    opened.close()


def test_full_batch_ends_a_long_window(store: TrajectoryStore):
    writer = GroupCommitWriter(store, interval_ms=60_000, max_batch=4)
    writer.start()
    t0 = time.monotonic()
    futures = [writer.submit(record(f"r{i}")) for i in range(5)]  # 4 fill a batch
    futures[3].result(timeout=10)
    assert time.monotonic() - t0 < 10
    assert writer.transactions == 1 and writer.records == 4
    writer.flush(timeout=10)  # the barrier ends the fifth record's window
    assert futures[4].result(timeout=0) is None
    writer.stop()
    assert time.monotonic() - t0 < 10


def test_records_in_the_window_share_one_transaction(store: TrajectoryStore):
    writer = GroupCommitWriter(store, interval_ms=300, max_batch=512)
    writer.start()
    futures = []
    for i in range(20):
        futures.append(writer.submit(record(f"w{i}")))
        time.sleep(0.005)  # 100 ms of arrivals, all inside one 300 ms window
    for f in futures:
        f.result(timeout=10)
    assert writer.transactions == 1 and writer.records == 20
    writer.stop()
