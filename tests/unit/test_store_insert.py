"""Driver-level completion inserts (`completion_insert.py`): rows are column for column
what the ORM writes, errors are SQLAlchemy's and leave nothing behind, the kept
connection is reused, replaced when it dies while idle, and shared safely by threads;
on SQLite and (when configured) PostgreSQL."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import event, select, text
from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.orm import Session

from areal_service.packing import pack_float32, pack_int32
from areal_service.store import TrajectoryStore
from areal_service.store.inserts import _json
from areal_service.store.linking import token_digest
from areal_service.store.schema import CompletionRow, SessionRow
from areal_service.types import CompletionRecord, SessionRecord


def full_record(cid: str, **kw) -> CompletionRecord:
    """Every field set away from its default; JSON with unicode, nesting and escapes."""
    fields = dict(
        id=cid,
        model="areal-policy",
        prompt_ids=(0, 1, 2**31 - 1, -(2**31), 151_643),
        output_ids=(7, 8, 9),
        output_logprobs=(-0.5, 0.0, float("-inf")),
        output_versions=(4, 3, 5),
        finish_reason="tool_calls",
        session_id="s1",
        api_key_id="key-1",
        parent_id="chatcmpl-parent",
        request_json={"messages": [{"role": "user", "content": 'héllo "world"\n✓'}], "n": 1},
        response_json={"choices": [{"message": {"content": None, "tool_calls": []}}], "x": 1.5},
        temperature=0.7,
        top_p=0.95,
        top_k=40,
        backend="http://127.0.0.1:30000",
        latency_ms=12.25,
        prompt_tokens=5,
        completion_tokens=3,
        created_at=1_700_000_000.125,
    )
    fields.update(kw)
    return CompletionRecord(**fields)


def orm_row(record: CompletionRecord) -> CompletionRow:
    """The row as SQLAlchemy's ORM would write it (the reference for the driver path)."""
    versions = record.output_versions
    return CompletionRow(
        id=record.id,
        session_id=record.session_id,
        api_key_id=record.api_key_id,
        parent_id=record.parent_id,
        model=record.model,
        request_json=record.request_json,
        response_json=record.response_json,
        prompt_ids=pack_int32(record.prompt_ids),
        output_ids=pack_int32(record.output_ids),
        output_logprobs=pack_float32(record.output_logprobs),
        output_versions=pack_int32(versions),
        min_version=min(versions) if versions else None,
        finish_reason=record.finish_reason,
        temperature=record.temperature,
        top_p=record.top_p,
        top_k=record.top_k,
        backend=record.backend,
        latency_ms=record.latency_ms,
        prompt_tokens=record.prompt_tokens,
        completion_tokens=record.completion_tokens,
        created_at=record.created_at,
        full_len=len(record.prompt_ids) + len(record.output_ids),
        full_hash=token_digest(record.prompt_ids + record.output_ids),
    )


def stored(store: TrajectoryStore, cid: str) -> dict:
    table = CompletionRow.__table__
    with store.engine.connect() as connection:
        row = connection.execute(select(table).where(table.c.id == cid)).mappings().one()
    return {key: value for key, value in row.items() if key != "id"}


def test_driver_rows_equal_orm_rows(store: TrajectoryStore):
    store.add_session(SessionRecord(id="s1"))
    for suffix, kw in [
        ("", {}),
        (
            "-empty",
            dict(
                output_ids=(),
                output_logprobs=(),
                output_versions=(),
                session_id=None,
                request_json={},
                parent_id=None,
            ),
        ),
    ]:
        driver, orm = full_record("driver" + suffix, **kw), full_record("orm" + suffix, **kw)
        store.add_completions([driver])
        with Session(store.engine) as session, session.begin():
            session.add(orm_row(orm))
        assert stored(store, driver.id) == stored(store, orm.id)
        assert store.get_completion(driver.id) == driver
    assert stored(store, "driver-empty")["min_version"] is None
    if store.engine.dialect.name == "sqlite":  # storage classes, not just Python values
        columns = ", ".join(f"typeof({c})" for c in CompletionRow.__table__.columns.keys())
        with store.engine.connect() as connection:
            types = [
                connection.execute(
                    text(f"SELECT {columns} FROM completions WHERE id = :i"), {"i": cid}
                ).one()
                for cid in ("driver", "orm")
            ]
        assert types[0] == types[1]


def test_json_text_is_compact_json_dumps():
    values = [
        {"a": [1, 2.5, None, True, -0.0, 1e300, 'h\u00e9 "q"\n\u2713\U0001f600'], "b": {}},
        {1: "int key", "nested": [[[]], {"x": {"y": [{}]}}]},
        [],
        "top-level string",
        None,
    ]
    for value in values:
        assert _json(value) == json.dumps(value, separators=(",", ":"))
    assert _json([math.inf, math.nan]) == "[Infinity,NaN]"  # as json.dumps (PG rejects it)
    with pytest.raises(TypeError, match="not JSON serializable"):
        _json({"x": object()})


def test_batch_errors_are_sqlalchemy_errors_and_leave_nothing(store: TrajectoryStore):
    store.add_session(SessionRecord(id="s1", last_activity_at=1.0))
    a, b = full_record("a", created_at=5.0), full_record("b", created_at=6.0)
    store.add_completions([a])
    with pytest.raises(IntegrityError) as caught:  # duplicate id after a good row
        store.add_completions([b, full_record("a")])
    assert caught.value.orig is not None
    with pytest.raises(IntegrityError):  # unknown session, batch of one
        store.add_completions([full_record("c", session_id="nope")])
    # A value the driver refuses while binding (SQLite: OverflowError, not a DB error;
    # PostgreSQL: out of range for INTEGER) rolls the batch back as well.
    with pytest.raises((OverflowError, DataError)):
        store.add_completions([b, full_record("d", top_k=2**70)])
    assert store.get_completion("b") is None and store.get_completion("d") is None
    assert store.get_session("s1").last_activity_at == 5.0  # the failed batches touched nothing
    store.add_completions([b])  # the kept connection is still usable
    assert store.get_completion("b") == b
    assert store.get_session("s1").last_activity_at == 6.0


def test_activity_only_moves_forward_within_and_across_batches(store: TrajectoryStore):
    store.add_session(SessionRecord(id="s1", last_activity_at=10.0))
    store.add_session(SessionRecord(id="s2", last_activity_at=10.0))
    store.add_completions(
        [
            full_record("x1", created_at=30.0),
            full_record("x2", created_at=20.0),
            full_record("y1", session_id="s2", created_at=5.0),  # older than the session
            full_record("z1", session_id=None, created_at=99.0),
        ]
    )
    assert store.get_session("s1").last_activity_at == 30.0
    assert store.get_session("s2").last_activity_at == 10.0


def test_batches_reuse_one_connection_outside_the_pool(store: TrajectoryStore):
    store.add_session(SessionRecord(id="s1"))
    store.add_completions([full_record("first")])  # opens the kept connection
    checkouts = []
    event.listen(store.engine.pool, "checkout", lambda *args: checkouts.append(args))
    for i in range(10):
        store.add_completions([full_record(f"r{i}-{j}") for j in range(i % 3 + 1)])
    assert checkouts == []  # no checkout, reset or pre-ping per batch
    store.close()  # closes the kept connection too; a later write opens a new one
    store.add_completions([full_record("after-close")])
    assert store.get_completion("after-close") is not None


def test_a_connection_lost_while_idle_is_replaced_once(store: TrajectoryStore):
    store.add_session(SessionRecord(id="s1"))
    store.add_completions([full_record("before")])
    if store.engine.dialect.name == "postgresql":
        with store.engine.connect() as connection:
            killed = connection.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            ).all()
        assert killed  # the kept connection was among them
    else:
        store._completions._connection.close()  # what a lost connection looks like here
    store.add_completions([full_record("after"), full_record("after-2")])
    assert store.get_completion("after") is not None
    with store.engine.connect() as connection:
        ids = connection.execute(select(CompletionRow.id).order_by(CompletionRow.id)).scalars()
        assert list(ids) == ["after", "after-2", "before"]


def test_threads_share_the_kept_connection(store: TrajectoryStore):
    store.add_session(SessionRecord(id="s1", last_activity_at=1.0))

    def batch(t: int) -> None:
        for i in range(10):
            store.add_completions(
                [full_record(f"t{t}-{i}-{j}", created_at=100.0 * t + i) for j in range(3)]
            )

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(batch, range(4)))
    with store.engine.connect() as connection:
        assert len(connection.execute(select(CompletionRow.id)).all()) == 4 * 10 * 3
        activity = connection.execute(select(SessionRow.last_activity_at)).scalar_one()
    assert activity == 309.0
