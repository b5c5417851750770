"""Completion inserts at the driver level: the store's hot write path (every batch of
the gateway's writer thread). Owns CompletionRecord -> driver-ready tuple and the one
DBAPI connection those inserts keep; `trajectory.py` owns the engine and calls
`CompletionInserter.write` from `add_completions`. Imports no gateway code.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Mapping
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, bindparam, insert, update
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError

from areal_service.packing import pack_float32, pack_int32
from areal_service.store.linking import packed_digest
from areal_service.store.pg_copy import BinaryCopy, copy_supported
from areal_service.store.schema import CompletionRow, SessionRow
from areal_service.types import CompletionRecord

if TYPE_CHECKING:
    from sqlalchemy.engine.interfaces import DBAPIModule

__all__ = ["CompletionInserter", "completion_row"]

logger = logging.getLogger(__name__)

_COMPLETION_COLUMNS = (
    "id", "session_id", "api_key_id", "parent_id", "model", "request_json", "response_json",
    "prompt_ids", "output_ids", "output_logprobs", "output_versions", "min_version",
    "finish_reason", "temperature", "top_p", "top_k", "backend", "latency_ms",
    "prompt_tokens", "completion_tokens", "created_at", "full_len", "full_hash",
    "requested_model", "continuity_key",
)  # fmt: skip
"""`completions` columns in table order: the order of `completion_row`'s tuple (checked
against the compiled INSERT when an inserter is made)."""


def _unserializable(value: object) -> object:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _json_encoder() -> Callable[[Any], str]:
    """`json.dumps(value, separators=(",", ":"))`: the JSON columns' text (what
    SQLAlchemy's JSON type writes, without its spaces). `dumps` builds a C encoder and a
    circular-reference memo per call, ~25% of encoding a short chat's request and
    response; this one is built once (a cycle raises RecursionError, not ValueError)."""
    if c_make_encoder is None:  # a Python without the _json accelerator
        return json.JSONEncoder(separators=(",", ":")).encode
    chunks = c_make_encoder(
        None, _unserializable, encode_basestring_ascii, None, ":", ",", False, False, True
    )
    return lambda value: "".join(chunks(value, 0))


_json = _json_encoder()


def completion_row(record: CompletionRecord) -> tuple[Any, ...]:
    """The record as driver-ready values in `_COMPLETION_COLUMNS` order: arrays packed,
    JSON serialized, derived columns filled. ValueError when the output arrays disagree
    in length; OverflowError for an id outside int32."""
    output_ids = record.output_ids
    logprobs, versions = record.output_logprobs, record.output_versions
    n = len(output_ids)
    if len(logprobs) != n or len(versions) != n:
        raise ValueError(
            f"completion {record.id}: output_ids ({n}), output_logprobs "
            f"({len(logprobs)}) and output_versions "
            f"({len(versions)}) must have one entry per output token"
        )
    prompt, output = pack_int32(record.prompt_ids), pack_int32(output_ids)
    # A completion is nearly always served by one version: tuple.count compares by
    # identity first (~1 µs per 1k tokens), where min() compares each pair (~8 µs).
    low = versions[0] if n and versions.count(versions[0]) == n else min(versions, default=None)
    return (
        record.id, record.session_id, record.api_key_id, record.parent_id, record.model,
        _json(record.request_json), _json(record.response_json), prompt, output,
        pack_float32(logprobs), pack_int32(versions), low,
        record.finish_reason, record.temperature, record.top_p, record.top_k, record.backend,
        record.latency_ms, record.prompt_tokens, record.completion_tokens, record.created_at,
        len(record.prompt_ids) + n, packed_digest(prompt, output), record.requested_model,
        record.continuity_key,
    )  # fmt: skip


_PYFORMAT = re.compile(r"%\((\w+)\)s")


def _driver_sql(statement: Any, dialect: Dialect) -> tuple[str, tuple[str, ...]]:
    """`statement` compiled for `dialect` (its casts included) with positional
    placeholders, and the bind names in placeholder order (a name may repeat)."""
    compiled = statement.compile(dialect=dialect)
    if compiled.positional:  # qmark (SQLite): already positional
        return compiled.string, tuple(compiled.positiontup)
    if dialect.paramstyle != "pyformat":
        raise NotImplementedError(f"completion inserts: paramstyle {dialect.paramstyle!r}")
    names: list[str] = []

    def positional(match: re.Match[str]) -> str:
        names.append(match.group(1))
        return "%s"  # psycopg takes %s with a tuple as well as %(name)s with a dict

    return _PYFORMAT.sub(positional, compiled.string), tuple(names)


class CompletionInserter:
    """`add_completions` at the driver level, for the gateway's writer thread.

    Statements are compiled once per engine, rows are tuples of driver-ready values, and
    one DBAPI connection of its own (opened through the engine, so the SQLite pragmas
    apply, then detached from the pool) serves every batch under a lock: no compile-cache
    lookup, bind processor per value, result setup, pool checkout and reset, or
    PostgreSQL pre-ping per batch. Measured on SQLite (py-spy --gil, gateway-shaped
    records): GIL held ~65 µs/record in batches of 1 and ~30 in batches of 64, against
    ~590 and ~120 through SQLAlchemy Core. A batch is the INSERT (`execute` for one row:
    psycopg's `executemany` runs a pipeline even for one), the sessions UPDATE when a
    record has a session, and COMMIT. On PostgreSQL through psycopg 3 a batch of two or
    more is one binary COPY instead (`pg_copy.py`): the same rows and errors, ~20% less
    server CPU and ~15% less client CPU per row at 64 (a COPY costs a round trip more,
    so one row stays an INSERT: ~90 against ~220 µs CPU). Driver errors are raised as
    SQLAlchemy's (`IntegrityError`, `OperationalError`, ...), like every other store
    method's."""

    def __init__(self, engine: Engine, *, copy: bool = True) -> None:
        dialect = engine.dialect
        self._engine = engine
        self._dbapi_error: type[DBAPIModule.Error] = dialect.loaded_dbapi.Error
        # An INSERT without values binds every column, in table order.
        self._insert, names = _driver_sql(insert(CompletionRow.__table__), dialect)
        if names != _COMPLETION_COLUMNS:
            raise RuntimeError(f"completion_row() does not match the table: {names}")
        self._copy = (
            BinaryCopy(CompletionRow.__table__, _COMPLETION_COLUMNS, dialect)
            if copy and copy_supported(dialect)
            else None
        )
        """PostgreSQL (psycopg 3): batches go in by binary COPY instead of the INSERT
        (`copy=False` keeps the INSERT: the reference the COPY is tested against)."""
        touch = (
            update(SessionRow.__table__)
            .where(SessionRow.id == bindparam("sid"), SessionRow.last_activity_at < bindparam("at"))
            .values(last_activity_at=bindparam("at"))
        )
        self._touch, names = _driver_sql(touch, dialect)
        self._touch_params = itemgetter(*(("sid", "at").index(name) for name in names))
        """(session id, time) -> the UPDATE's parameter tuple."""
        self._lock = threading.Lock()
        self._connection: Any = None
        self._cursor: Any = None

    def write(self, rows: list[tuple[Any, ...]], activity: Mapping[str, float]) -> None:
        """Insert `rows` and advance `activity`'s sessions in one transaction."""
        # Sessions are updated in id order: two writers (gateway replicas on one
        # PostgreSQL) touching the same sessions lock their rows in the same order, so
        # they wait for each other instead of deadlocking (which fails a whole batch).
        touches = [self._touch_params(item) for item in sorted(activity.items())]
        with self._lock:
            if not self._transaction(rows, touches, may_retry=self._connection is not None):
                # Like the pool's pre-ping: the kept connection died while idle (server
                # restart, idle timeout); nothing of this batch was committed.
                self._transaction(rows, touches, may_retry=False)

    def close(self) -> None:
        """Close the connection (a later write opens a new one)."""
        with self._lock:
            self._discard()

    def _transaction(
        self, rows: list[tuple[Any, ...]], touches: list[Any], *, may_retry: bool
    ) -> bool:
        """One attempt. False (rolled back, connection discarded) when `may_retry` and
        the connection turned out to be gone at the first statement."""
        cursor = self._open()
        statement, params, first = self._insert, rows, True
        ended = False
        try:
            if self._copy is not None and len(rows) > 1:
                statement = self._copy.statement
                self._copy.write(cursor, rows)
            else:
                self._execute(cursor, statement, params)
            first = False
            if touches:
                statement, params = self._touch, touches
                self._execute(cursor, statement, params)
            statement, params = "COMMIT", []
            self._connection.commit()
            ended = True
        except self._dbapi_error as error:
            ended = True
            gone = self._gone(error)
            self._abort(discard=gone)
            if gone and first and may_retry:
                logger.warning("completion writer: connection lost (%s), reconnecting", error)
                return False
            raise self._translate(error, statement, params) from error
        finally:
            if not ended:  # not a driver error (OverflowError binding an int, ...)
                self._abort(discard=False)
        return True

    @staticmethod
    def _execute(cursor: Any, statement: str, params: list[Any]) -> None:
        if len(params) == 1:
            cursor.execute(statement, params[0])
        else:
            cursor.executemany(statement, params)

    def _open(self) -> Any:
        if self._connection is None:
            pooled = self._engine.raw_connection()  # runs the engine's connect hooks
            pooled.detach()  # ours until close(): no pool slot, no reset on return
            self._connection = pooled.dbapi_connection
            self._cursor = self._connection.cursor()
        return self._cursor

    def _gone(self, error: DBAPIModule.Error) -> bool:
        return bool(self._engine.dialect.is_disconnect(error, self._connection, self._cursor))

    def _abort(self, *, discard: bool) -> None:
        """Roll back, or discard a connection that is gone or cannot roll back."""
        if not discard:
            try:
                self._connection.rollback()
                return
            except self._dbapi_error:
                logger.warning("completion writer: rollback failed, reconnecting", exc_info=True)
        self._discard()

    def _discard(self) -> None:
        connection, self._connection, self._cursor = self._connection, None, None
        if connection is not None:
            try:
                connection.close()
            except self._dbapi_error:  # already broken: nothing left to release
                logger.debug("completion writer: close failed", exc_info=True)

    def _translate(self, error: Exception, statement: str, params: list[Any]) -> BaseException:
        """The SQLAlchemy exception for a driver error (as Connection.execute raises it;
        parameters hidden: they are whole token arrays)."""
        return DBAPIError.instance(
            statement,
            params,
            error,
            self._dbapi_error,
            hide_parameters=True,
            connection_invalidated=self._connection is None,
            dialect=self._engine.dialect,
            ismulti=len(params) > 1,
        )
