"""Binary COPY of completion batches on PostgreSQL (`store/pg_copy.py`): the rows it
stores are column for column (JSON text included) what the INSERT path stores, parent
links and prefix hashes come out the same, its errors are the INSERT path's and leave
nothing behind, the writer still fails a bad record alone, and large values are
TOASTed with lz4. Needs AREAL_TEST_POSTGRES_URL (marker `postgres`)."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import DataError, IntegrityError
from test_store_insert import full_record, stored

from areal_service.config import StoreConfig
from areal_service.store import TrajectoryStore
from areal_service.store.inserts import CompletionInserter
from areal_service.store.linking import ParentLinker
from areal_service.store.schema import CompletionRow
from areal_service.store.writer import GroupCommitWriter
from areal_service.types import CompletionRecord, SessionRecord

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.parametrize("store_url", ["postgres"], indirect=True),
]


class _Paths:
    """The store's COPY inserter and an INSERT-only one on the same engine, with a
    count of COPY batches (so a test knows the fast path really ran)."""

    def __init__(self, store: TrajectoryStore) -> None:
        self.store = store
        self.copy = store._completions
        self.insert = CompletionInserter(store.engine, copy=False)
        self.copies = 0
        write = self.copy._copy.write

        def counted(cursor, rows):
            self.copies += 1
            write(cursor, rows)

        self.copy._copy.write = counted

    def add(self, path: str, records: list[CompletionRecord]) -> None:
        self.store._completions = self.copy if path == "copy" else self.insert
        try:
            self.store.add_completions(records)
        finally:
            self.store._completions = self.copy

    def close(self) -> None:
        self.insert.close()


@pytest.fixture
def paths(store: TrajectoryStore) -> Iterator[_Paths]:
    both = _Paths(store)
    yield both
    both.close()


def variants(prefix: str) -> list[CompletionRecord]:
    """Every column kind at its edges: int4 limits, empty arrays and NULLs, -inf and
    nan logprobs, unicode and escapes in JSON, a 1k+1k-token turn."""
    return [
        full_record(f"{prefix}-full"),
        full_record(
            f"{prefix}-empty",
            output_ids=(),
            output_logprobs=(),
            output_versions=(),
            session_id=None,
            parent_id=None,
            api_key_id=None,
            request_json={},
            response_json={"a": [None, True, -0.0, 1e300, '\u2028\\"\U0001f600']},
        ),
        full_record(
            f"{prefix}-edges",
            top_k=2**31 - 1,
            prompt_tokens=-(2**31),
            output_logprobs=(math.nan, -math.inf, -1e-45),
            requested_model="gpt-4o-mini",
            output_versions=(9, 9, 9),
            latency_ms=0,
            created_at=1_700_000_000.0000002,
        ),
        full_record(
            f"{prefix}-long",
            prompt_ids=tuple(range(1000)),
            output_ids=tuple(range(150_000, 151_000)),
            output_logprobs=tuple(-i / 7 for i in range(1000)),
            output_versions=(2,) * 999 + (1,),
        ),
    ]


def json_text(store: TrajectoryStore, cid: str) -> tuple[str, str]:
    with store.engine.connect() as connection:
        return connection.execute(
            text("SELECT request_json::text, response_json::text FROM completions WHERE id = :i"),
            {"i": cid},
        ).one()


def test_copy_rows_equal_insert_rows(paths: _Paths):
    store = paths.store
    store.add_session(SessionRecord(id="s1"))
    paths.add("copy", variants("copy"))
    paths.add("insert", variants("insert"))
    assert paths.copies == 1
    for copied, inserted in zip(variants("copy"), variants("insert"), strict=True):
        assert stored(store, copied.id) == stored(store, inserted.id)
        assert json_text(store, copied.id) == json_text(store, inserted.id)
        back = store.get_completion(copied.id)
        assert back is not None and back.prompt_ids == copied.prompt_ids
        assert back.output_ids == copied.output_ids
        assert back.request_json == copied.request_json
        assert back.response_json == copied.response_json
        versions = copied.output_versions
        assert stored(store, copied.id)["min_version"] == (min(versions) if versions else None)
    assert stored(store, "copy-empty")["min_version"] is None
    assert stored(store, "copy-long")["min_version"] == 1


def test_parent_links_and_prefix_hashes_match_the_insert_path(paths: _Paths):
    store = paths.store
    entries = {}
    for path in ("copy", "insert"):
        sid = f"episode-{path}"
        store.add_session(SessionRecord(id=sid, last_activity_at=1.0))
        linker = ParentLinker(store)
        prompt, turns = tuple(range(50)), []
        for turn in range(4):
            output = tuple(range(1000 + 10 * turn, 1010 + 10 * turn))
            turns.append(
                linker.link_parent(
                    full_record(
                        f"{sid}-{turn}",
                        session_id=sid,
                        parent_id=None,
                        prompt_ids=prompt,
                        output_ids=output,
                        output_logprobs=(-0.5,) * 10,
                        output_versions=(turn,) * 10,
                        created_at=100.0 + turn,
                    )
                )
            )
            prompt = prompt + output + (7, 7)
        paths.add(path, turns)  # one batch: the whole episode
        got = [store.get_completion(f"{sid}-{turn}") for turn in range(4)]
        assert [c.parent_id for c in got] == [None] + [f"{sid}-{t}" for t in range(3)]
        entries[path] = sorted(
            (e.length, e.digest, e.created_at) for e in store.prefix_entries(sid)
        )
        assert store.get_session(sid).last_activity_at == 103.0
    assert paths.copies == 1
    assert entries["copy"] == entries["insert"]


def test_copy_errors_match_the_insert_path_and_leave_nothing(paths: _Paths):
    store = paths.store
    store.add_session(SessionRecord(id="s1", last_activity_at=1.0))
    store.add_completions([full_record("taken", created_at=5.0)])
    cases = [
        (IntegrityError, lambda p: [full_record(f"{p}-a"), full_record("taken")]),  # duplicate
        (IntegrityError, lambda p: [full_record(f"{p}-b"), full_record(f"{p}-b")]),  # in batch
        (IntegrityError, lambda p: [full_record(f"{p}-c"), full_record(f"{p}-d", session_id="x")]),
        (IntegrityError, lambda p: [full_record(f"{p}-e"), full_record(f"{p}-f", model=None)]),
        (
            DataError,
            lambda p: [full_record(f"{p}-g"), full_record(f"{p}-h", finish_reason="x" * 33)],
        ),
        (
            DataError,
            lambda p: [full_record(f"{p}-i"), full_record(f"{p}-j", request_json=[math.inf])],
        ),
    ]
    for expected, batch in cases:
        for path in ("copy", "insert"):
            with pytest.raises(expected):
                paths.add(path, batch(path))
    # Binary COPY has no server-side range check for int4 (psycopg would send 2**31 as
    # -2**31): pg_copy refuses it before it is sent, with the INSERT's error.
    for value in (2**31, -(2**31) - 1):
        for path in ("copy", "insert"):
            with pytest.raises(DataError, match="integer out of range"):
                paths.add(path, [full_record(f"{path}-k"), full_record(f"{path}-l", top_k=value)])
    assert paths.copies == len(cases) + 2
    with store.engine.connect() as connection:
        assert list(connection.execute(select(CompletionRow.id)).scalars()) == ["taken"]
    assert store.get_session("s1").last_activity_at == 5.0
    paths.add(
        "copy", [full_record("after-1", created_at=9.0), full_record("after-2", created_at=8.0)]
    )
    assert store.get_completion("after-1") is not None  # the kept connection still works
    assert store.get_session("s1").last_activity_at == 9.0


def test_writer_fails_a_bad_record_alone_on_the_copy_path(paths: _Paths):
    store = paths.store
    store.add_session(SessionRecord(id="s1"))
    store.add_completions([full_record("dup")])
    batch = [full_record(f"ok{i}") for i in range(10)]
    batch[3] = full_record("dup")
    batch[7] = full_record("wraps", top_k=2**31)
    writer = GroupCommitWriter(store, interval_ms=0)
    futures = [writer.submit(r) for r in batch]  # queued before start: one batch
    writer.start()
    writer.stop()
    with pytest.raises(IntegrityError):
        futures[3].result()
    with pytest.raises(DataError, match="integer out of range"):
        futures[7].result()
    assert [f.exception() is None for f in futures].count(True) == 8
    assert paths.copies == 1  # the batch; the retries are single-row INSERTs
    assert (writer.records, writer.failed) == (8, 2)


def test_large_values_are_toasted_with_lz4(store: TrajectoryStore):
    with store.engine.connect() as connection:
        lz4 = connection.execute(
            text(
                "SELECT count(*) FROM pg_settings WHERE name = 'default_toast_compression'"
                " AND 'lz4' = ANY(enumvals)"
            )
        ).scalar_one()
    if not lz4:
        pytest.skip("this PostgreSQL has no lz4 TOAST compression")
    store.add_session(SessionRecord(id="s1"))
    store.add_completions(variants("v"))
    with store.engine.connect() as connection:
        method = connection.execute(
            text(
                "SELECT pg_column_compression(output_versions) FROM completions WHERE id = 'v-long'"
            )
        ).scalar_one()
    assert method == "lz4"


def test_two_writers_touching_the_same_sessions_do_not_deadlock(store_url: str):
    """Two gateway replicas on one PostgreSQL: batches that touch the same sessions in
    opposite orders wait for each other (sessions are updated in id order) instead of
    deadlocking, which would fail a whole batch."""
    replicas = [TrajectoryStore.open(store_url, StoreConfig()) for _ in range(2)]
    sessions = [f"s{i:02d}" for i in range(64)]
    for sid in sessions:
        replicas[0].add_session(SessionRecord(id=sid, last_activity_at=0.0))

    together = threading.Barrier(2)

    def replica(index: int) -> None:
        order = sessions if index == 0 else sessions[::-1]
        try:
            for turn in range(20):
                together.wait(timeout=30)  # both batches of a turn in flight at once
                replicas[index].add_completions(
                    [
                        full_record(f"r{index}-{turn}-{sid}", session_id=sid, created_at=1.0 + turn)
                        for sid in order
                    ]
                )
        except Exception:
            together.abort()  # the other replica stops waiting for this one
            raise

    with ThreadPoolExecutor(max_workers=2) as pool:
        for done in [pool.submit(replica, i) for i in range(2)]:
            done.result()
    assert replicas[0].get_session("s00").last_activity_at == 20.0
    with replicas[1].engine.connect() as connection:
        assert len(connection.execute(select(CompletionRow.id)).all()) == 2 * 20 * 64
    for opened in replicas:
        opened.close()
