"""TrajectoryStore: typed reads and writes of the frozen records of `types.py`.

Owns the engine and the single-table queries (keys, sessions, completions, rewards,
weight versions, train steps). Engine creation is `connect.py`'s, row <-> record
conversion `rows.py`'s, the driver-level completion insert `inserts.py`'s and its
batching `writer.py`'s; multi-table reads live in `episode_reads.py` (claims, export,
console detail), `session_queries.py` (export and console pages), `readiness.py` and
`claims.py` (claiming and reward settling).
Methods are synchronous, thread-safe, one transaction each (async callers: the writer or
a thread). Dialect-neutral SQL: a SQLite file (WAL) or PostgreSQL (`postgresql+psycopg://`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, TypeVar, cast

from sqlalchemy import Engine, bindparam, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import sessionmaker
from sqlalchemy.sql import Select

from areal_service.config import StoreConfig
from areal_service.store.admissions import (
    release_admission,
    reserve_admission,
    take_admitted_place,
)
from areal_service.store.auth_failures import exchange_auth_failures
from areal_service.store.connect import create_store_engine
from areal_service.store.inserts import CompletionInserter, completion_row
from areal_service.store.key_counters import exchange_key_counts, forget_key_counts
from areal_service.store.leases import acquire_lease, lease_holder, release_lease
from areal_service.store.linking import PrefixEntry
from areal_service.store.migrate import upgrade_engine
from areal_service.store.revocations import console_session_revoked, revoke_console_session
from areal_service.store.reward_admission import AcceptedReward, accept_reward
from areal_service.store.rows import completion_from_row, paged, row_values, to_record
from areal_service.store.schema import (
    ApiKeyRow,
    Base,
    CompletionRow,
    RewardRow,
    SessionRow,
    TrainStepRow,
    WeightVersionRow,
)
from areal_service.types import (
    ApiKeyRecord,
    AuthFailures,
    CompletionRecord,
    KeyCounts,
    RecentTurn,
    RewardRecord,
    SessionRecord,
    SessionStatus,
    TrainStepRecord,
    WeightVersionRecord,
    now,
)

logger = logging.getLogger(__name__)

_R = TypeVar("_R")


def _filter_sessions(
    statement: Select[Any],
    status: SessionStatus | None,
    group_id: str | None,
    task_id: str | None,
) -> Select[Any]:
    if status is not None:
        statement = statement.where(SessionRow.status == status)
    if group_id is not None:
        statement = statement.where(SessionRow.group_id == group_id)
    if task_id is not None:
        statement = statement.where(SessionRow.task_id == task_id)
    return statement


class TrajectoryStore:
    """Keys, sessions, completions, rewards, weight versions and train steps.

    List methods page with `limit`/`offset` and never load a whole table. Logprobs are
    stored as float32: a value comes back as the nearest float32 (exact for logprobs
    that a backend computed in float32 or lower precision)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self._completions = CompletionInserter(engine)

    @classmethod
    def open(cls, url: str, config: StoreConfig) -> TrajectoryStore:
        """Create the engine for `url` and, when `config.auto_migrate`, upgrade to head."""
        engine = create_store_engine(url, sqlite_synchronous=config.sqlite_synchronous,
                                     sqlite_max_size_mb=config.sqlite_max_size_mb)
        if config.auto_migrate:
            upgrade_engine(engine)
        logger.info("trajectory store at %s", engine.url)
        return cls(engine)

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine, for the store package's query modules (and tests); code
        outside `areal_service.store` calls named methods and functions instead."""
        return self._engine

    def ping(self) -> None:
        """One trivial query (readiness probes); raises when the database is unreachable."""
        with self._engine.connect() as connection:
            connection.execute(select(1))

    def close(self) -> None:
        """Close every connection (pooled, and the completion writer's own)."""
        self._completions.close()
        self._engine.dispose()

    def _add(self, row: Base) -> None:
        with self._sessions.begin() as session:
            session.add(row)

    def _get(self, cls: type[_R], row_type: type[Base], key: object) -> _R | None:
        with self._sessions() as session:
            row = session.get(row_type, key)
            return None if row is None else to_record(cls, row)

    def _list(self, cls: type[_R], statement: Select[Any]) -> list[_R]:
        with self._sessions() as session:
            return [to_record(cls, row) for row in session.scalars(statement)]

    def _update(self, statement: Any) -> int:
        with self._engine.begin() as connection:
            return int(connection.execute(statement).rowcount)

    # API keys.

    def add_api_key(self, record: ApiKeyRecord) -> ApiKeyRecord:
        """Insert a key (IntegrityError when the id or hash exists)."""
        self._add(ApiKeyRow(**row_values(record)))
        return record

    def get_api_key(self, key_id: str) -> ApiKeyRecord | None:
        """The key with id `key_id`, revoked or not."""
        return self._get(ApiKeyRecord, ApiKeyRow, key_id)

    def find_api_key_by_hash(self, key_hash: str) -> ApiKeyRecord | None:
        """The key whose SHA-256 hex is `key_hash` (revoked keys too: check `revoked_at`)."""
        found = self._list(ApiKeyRecord, select(ApiKeyRow).where(ApiKeyRow.key_hash == key_hash))
        return found[0] if found else None

    def list_api_keys(
        self, *, include_revoked: bool = True, limit: int = 100, offset: int = 0,
        kinds: Collection[str] | None = None,
    ) -> list[ApiKeyRecord]:
        """Keys, newest first; only those of `kinds` when given (the user's own keys
        are a handful among one session key per session ever started)."""
        statement = select(ApiKeyRow).order_by(ApiKeyRow.created_at.desc(), ApiKeyRow.id)
        if not include_revoked:
            statement = statement.where(ApiKeyRow.revoked_at.is_(None))
        if kinds is not None:
            statement = statement.where(ApiKeyRow.kind.in_(list(kinds)))
        return self._list(ApiKeyRecord, paged(statement, limit, offset))

    def count_api_keys(self, *, kinds: Collection[str] | None = None) -> int:
        """How many keys (of `kinds`, when given) exist, revoked ones included. A scan of
        the key table (no index on kind): for pages and commands, not per request."""
        statement = select(func.count()).select_from(ApiKeyRow)
        if kinds is not None:
            statement = statement.where(ApiKeyRow.kind.in_(list(kinds)))
        with self._engine.connect() as connection:
            return int(connection.execute(statement).scalar_one())

    def revoke_api_key(self, key_id: str, *, at: float | None = None) -> ApiKeyRecord | None:
        """Revoke a key (a second revoke keeps the first time). None if unknown."""
        self._update(
            update(ApiKeyRow)
            .where(ApiKeyRow.id == key_id, ApiKeyRow.revoked_at.is_(None))
            .values(revoked_at=now() if at is None else at)
        )
        return self.get_api_key(key_id)

    def touch_api_keys(self, used_at: Mapping[str, float]) -> None:
        """Set `last_used_at` of many keys in one transaction (key id → time); a row
        keeps a later time another replica already wrote."""
        if not used_at:
            return
        statement = (update(ApiKeyRow)
                     .where(ApiKeyRow.id == bindparam("key_id"),
                            or_(ApiKeyRow.last_used_at.is_(None),
                                ApiKeyRow.last_used_at < bindparam("at")))
                     .values(last_used_at=bindparam("at")))
        with self._engine.begin() as connection:
            connection.execute(statement, [{"key_id": k, "at": t} for k, t in used_at.items()])

    def add_api_key_tokens(self, tokens: Mapping[str, int]) -> None:
        """Add to `tokens_used` of many keys in one transaction (key id → tokens)."""
        if not tokens:
            return
        statement = (update(ApiKeyRow).where(ApiKeyRow.id == bindparam("key_id"))
                     .values(tokens_used=ApiKeyRow.tokens_used + bindparam("n")))
        with self._engine.begin() as connection:
            connection.execute(statement, [{"key_id": k, "n": n} for k, n in tokens.items()])

    def set_api_key_limits(self, key_id: str, limits: Mapping[str, int | None]
                           ) -> ApiKeyRecord | None:
        """Set some of a key's limits (`rpm_limit`, `tpm_limit`, `max_concurrent`,
        `token_budget`; None: unlimited). The key, or None if unknown."""
        allowed = {"rpm_limit", "tpm_limit", "max_concurrent", "token_budget"}
        if set(limits) - allowed:
            raise ValueError(f"unknown limits {sorted(set(limits) - allowed)}")
        if limits:
            self._update(update(ApiKeyRow).where(ApiKeyRow.id == key_id).values(**limits))
        return self.get_api_key(key_id)

    def bind_key_session(self, key_id: str, session_id: str | None) -> None:
        """Point a key at its current session (None unbinds)."""
        self._update(update(ApiKeyRow).where(ApiKeyRow.id == key_id).values(session_id=session_id))

    # Sessions (episodes).

    def add_session(self, record: SessionRecord, admission: str | None = None
                    ) -> SessionRecord:
        """Insert a session (IntegrityError when the id exists). `admission`: the
        staleness-window reservation it was admitted under, which gives the session its
        place in the same transaction (`admissions.py`)."""
        with self._sessions.begin() as session:
            session.add(SessionRow(**row_values(record)))
            if admission is not None:
                session.flush()
                take_admitted_place(session.connection(), admission)
        return record

    def get_session(self, session_id: str) -> SessionRecord | None:
        """The session `session_id`, or None."""
        return self._get(SessionRecord, SessionRow, session_id)

    def list_sessions(
        self,
        *,
        status: SessionStatus | None = None,
        group_id: str | None = None,
        task_id: str | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> list[SessionRecord]:
        """Sessions matching every given filter, newest first."""
        statement = select(SessionRow).order_by(SessionRow.created_at.desc(), SessionRow.id)
        statement = _filter_sessions(statement, status, group_id, task_id)
        return self._list(SessionRecord, paged(statement, limit, offset))

    def count_sessions(
        self,
        *,
        status: SessionStatus | None = None,
        group_id: str | None = None,
        task_id: str | None = None,
    ) -> int:
        """How many sessions match every given filter (one indexed COUNT)."""
        statement = _filter_sessions(
            select(func.count()).select_from(SessionRow), status, group_id, task_id
        )
        with self._engine.connect() as connection:
            return int(connection.execute(statement).scalar_one())

    def count_admitted_sessions(self) -> int:
        """Sessions that hold a place in the staleness window: accepted or running
        (open, ended, claimed, trained), not dropped (AReaL's accepted + running)."""
        statement = select(func.count()).select_from(SessionRow)
        statement = statement.where(SessionRow.status != "dropped")
        with self._engine.connect() as connection:
            return int(connection.execute(statement).scalar_one())

    def end_session(
        self, session_id: str, reason: str, *, at: float | None = None
    ) -> SessionRecord | None:
        """Move an `open` session to `ended`. Idempotent: a session that is not open is
        returned unchanged (the first reason wins). None if unknown."""
        at = now() if at is None else at
        self._update(
            update(SessionRow)
            .where(SessionRow.id == session_id, SessionRow.status == "open")
            .values(status="ended", ended_at=at, end_reason=reason, last_activity_at=at)
        )
        return self.get_session(session_id)

    def end_idle_sessions(self, idle_s: float, *, at: float | None = None) -> list[str]:
        """End every `open` session idle for more than `idle_s` seconds (reason
        `idle_timeout`, ended_at `at`); returns their ids. Conditional on status, so a
        session ended concurrently keeps its own reason."""
        at = now() if at is None else at
        with self._engine.begin() as connection:
            ended = connection.execute(
                update(SessionRow)
                .where(SessionRow.status == "open", SessionRow.last_activity_at < at - idle_s)
                .values(status="ended", ended_at=at, end_reason="idle_timeout")
                .returning(SessionRow.id)
            )
            return sorted(ended.scalars())

    # Completions.

    def add_completions(self, records: Sequence[CompletionRecord]) -> None:
        """Insert completions in ONE transaction (all or none), and in the same
        transaction advance `last_activity_at` of their sessions to the newest
        `created_at`. ValueError before any write if a record's output arrays disagree
        in length; IntegrityError for a duplicate id or an unknown session. Runs on one
        kept connection of its own (`CompletionInserter`): calls from several threads
        take turns."""
        if not records:
            return
        rows = [completion_row(record) for record in records]
        activity: dict[str, float] = {}
        for record in records:
            sid = record.session_id
            if sid is not None:
                last = activity.get(sid)
                if last is None or record.created_at > last:
                    activity[sid] = record.created_at
        self._completions.write(rows, activity)

    def add_completion(self, record: CompletionRecord) -> None:
        """Insert one completion in its own transaction (see `add_completions`)."""
        self.add_completions([record])

    def get_completion(self, completion_id: str) -> CompletionRecord | None:
        """The completion `completion_id` with its arrays unpacked, or None."""
        with self._sessions() as session:
            row = session.get(CompletionRow, completion_id)
            return None if row is None else completion_from_row(row)

    def list_completions(
        self, session_id: str, *, limit: int | None = None, offset: int = 0
    ) -> list[CompletionRecord]:
        """A session's completions, oldest first (bounded by the session, so no default
        limit)."""
        statement = (
            select(CompletionRow)
            .where(CompletionRow.session_id == session_id)
            .order_by(CompletionRow.created_at, CompletionRow.id)
        )
        if limit is not None:
            statement = paged(statement, limit, offset)
        elif offset:
            statement = statement.offset(offset)
        with self._sessions() as session:
            return [completion_from_row(row) for row in session.scalars(statement)]

    def prefix_entries(self, session_id: str) -> list[PrefixEntry]:
        """Length and hash of prompt+output of each completion of a session (for parent
        linking; four small columns, no arrays)."""
        return self.prefix_entries_of([session_id])[session_id]

    def recent_turns(self, session_id: str, limit: int) -> list[RecentTurn]:
        """The session's newest `limit` completions that carry a continuity key, newest
        first: key and packed ids (one indexed query, run when a turn's predecessor was
        served by another gateway process or before a restart)."""
        statement = (
            select(CompletionRow.id, CompletionRow.continuity_key, CompletionRow.prompt_ids,
                   CompletionRow.output_ids)
            .where(CompletionRow.session_id == session_id,
                   CompletionRow.continuity_key.is_not(None))
            .order_by(CompletionRow.created_at.desc(), CompletionRow.id.desc())
            .limit(limit)
        )  # fmt: skip
        with self._engine.connect() as connection:
            # The WHERE drops NULL keys: the column's Optional does not apply to these rows.
            rows = cast("Iterable[tuple[str, str, bytes, bytes]]", connection.execute(statement))
            return [RecentTurn(*row) for row in rows]

    def prefix_entries_of(self, session_ids: Collection[str]) -> dict[str, list[PrefixEntry]]:
        """`prefix_entries` of several sessions in one query (every id is a key)."""
        out: dict[str, list[PrefixEntry]] = {session_id: [] for session_id in session_ids}
        if not out:
            return out
        statement = select(CompletionRow.session_id, CompletionRow.id, CompletionRow.full_len,
                           CompletionRow.full_hash, CompletionRow.created_at).where(
            CompletionRow.session_id.in_(list(out)), CompletionRow.full_hash.is_not(None))
        with self._engine.connect() as connection:
            # IN and the WHERE drop NULL sessions and hashes (the columns' Optional).
            rows = cast("Iterable[tuple[str, str, int, str, float]]",
                        connection.execute(statement))
            for session_id, completion_id, length, digest, created_at in rows:
                out[session_id].append(PrefixEntry(completion_id, length, digest, created_at))
        return out

    # Rewards.

    def add_reward(self, record: RewardRecord) -> RewardRecord:
        """Insert a reward unless its (owner, id) exists; returns the stored reward either
        way (first write wins, so a retried POST is harmless). IntegrityError when the
        named completion or session does not exist."""
        stored = self.get_reward(record.id, record.owner)
        if stored is not None:
            return stored
        try:
            self._add(RewardRow(**row_values(record)))
        except IntegrityError:
            # Either a concurrent POST of the same id won the race (return its row), or
            # a foreign key failed (no row: re-raise).
            stored = self.get_reward(record.id, record.owner)
            if stored is None:
                raise
            return stored
        return record

    def accept_reward(self, record: RewardRecord, *, additive: bool = False) -> AcceptedReward:
        """The REST path: `record` stored unless its target is claimed, trained or dropped,
        or already has a reward of that name (RewardRefused), checked and inserted in one
        transaction (`reward_admission.py`); with the target's new total."""
        return accept_reward(self._engine, record, additive=additive)

    def get_reward(self, reward_id: str, owner: str = "") -> RewardRecord | None:
        """The reward `reward_id` posted by `owner` ("": the admin), or None."""
        return self._get(RewardRecord, RewardRow, (reward_id, owner))

    def list_rewards(
        self,
        *,
        session_id: str | None = None,
        completion_id: str | None = None,
        group_id: str | None = None,
        limit: int = 1000,
        offset: int = 0,
    ) -> list[RewardRecord]:
        """Rewards matching every given filter, oldest first."""
        statement = select(RewardRow).order_by(RewardRow.created_at, RewardRow.id)
        if session_id is not None:
            statement = statement.where(RewardRow.session_id == session_id)
        if completion_id is not None:
            statement = statement.where(RewardRow.completion_id == completion_id)
        if group_id is not None:
            statement = statement.where(RewardRow.group_id == group_id)
        return self._list(RewardRecord, paged(statement, limit, offset))

    # Weight versions.

    def add_weight_version(self, record: WeightVersionRecord) -> WeightVersionRecord:
        """Record a published version (IntegrityError when it exists)."""
        self._add(WeightVersionRow(**row_values(record)))
        return record

    def get_weight_version(self, version: int) -> WeightVersionRecord | None:
        """Version `version`, or None."""
        return self._get(WeightVersionRecord, WeightVersionRow, version)

    def latest_weight_version(self) -> WeightVersionRecord | None:
        """The highest published version, or None before the first publish."""
        found = self.list_weight_versions(limit=1)
        return found[0] if found else None

    def list_weight_versions(
        self, *, limit: int = 100, offset: int = 0
    ) -> list[WeightVersionRecord]:
        """Published versions, newest first."""
        statement = select(WeightVersionRow).order_by(WeightVersionRow.version.desc())
        return self._list(WeightVersionRecord, paged(statement, limit, offset))

    def update_weight_version_metadata(
        self, version: int, metadata: Mapping[str, Any]
    ) -> WeightVersionRecord | None:
        """Merge `metadata` into the version's metadata (top-level keys replaced) and
        return the result; None if the version is unknown. Safe against concurrent
        mergers: the no-op UPDATE first takes the row's write lock (PostgreSQL row lock;
        SQLite write lock, since pysqlite begins the transaction at the first write), so
        the read-modify-write cannot lose another writer's keys."""
        with self._sessions.begin() as session:
            locked = session.execute(
                update(WeightVersionRow)
                .where(WeightVersionRow.version == version)
                .values(version=WeightVersionRow.version)
                .execution_options(synchronize_session=False)
            )
            if not locked.rowcount:  # type: ignore[attr-defined]
                return None
            row = session.get(WeightVersionRow, version, populate_existing=True)
            assert row is not None
            row.meta = {**row.meta, **metadata}
            return to_record(WeightVersionRecord, row)

    def live_weight_version(self, *, after: int = -1, scan: int = 16
                            ) -> WeightVersionRecord | None:
        """The newest version above `after` the swap leader made live (`live_at` in its
        metadata), among the `scan` newest published; None when there is none. Followers
        poll this with their own live version as `after` (a few times a second), so the
        usual answer reads no row."""
        statement = (select(WeightVersionRow).where(WeightVersionRow.version > after)
                     .order_by(WeightVersionRow.version.desc()).limit(scan))
        for record in self._list(WeightVersionRecord, statement):
            if "live_at" in record.metadata:
                return record
        return None

    # Leases (`leases.py`).

    def acquire_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        """Take or renew lease `name` for `holder`; True when it is held afterwards."""
        return acquire_lease(self._engine, name, holder, ttl_s)

    def release_lease(self, name: str, holder: str) -> None:
        """Give lease `name` up if `holder` has it."""
        release_lease(self._engine, name, holder)

    def lease_holder(self, name: str) -> str | None:
        """The current holder of lease `name` (None: free or expired)."""
        return lease_holder(self._engine, name)

    # Staleness-window admissions (`admissions.py`).

    def reserve_admission(self, count: int, limit: int, ttl_s: float) -> tuple[str | None, int]:
        """Hold `count` places in a window of `limit` (None: no room) and the places
        taken before; atomic across every process on the store."""
        return reserve_admission(self._engine, count, limit, ttl_s)

    def release_admission(self, reservation: str) -> None:
        """Give a reservation's places back."""
        release_admission(self._engine, reservation)

    # Signed-out console cookies (`revocations.py`).

    def revoke_console_session(self, nonce: str, expires_at: float) -> None:
        """Refuse the console cookie with `nonce` on every process until `expires_at`."""
        revoke_console_session(self._engine, nonce, expires_at)

    def console_session_revoked(self, nonce: str) -> bool:
        """Whether the console cookie with `nonce` was signed out."""
        return console_session_revoked(self._engine, nonce)

    # Failed-credential counts shared by gateway processes (`auth_failures.py`).

    def exchange_auth_failures(self, holder: str, mine: Mapping[str, AuthFailures],
                               quiet_s: float, limit: int) -> dict[str, AuthFailures]:
        """Publish `holder`'s changed counts; the other holders' live counts per address
        (at most `limit` addresses, the most recent first)."""
        return exchange_auth_failures(self._engine, holder, mine, quiet_s, limit=limit)

    # Per-key counts shared by gateway processes (`key_counters.py`).

    def exchange_key_counts(self, holder: str, counts: Mapping[str, KeyCounts], fresh_s: float
                            ) -> tuple[dict[str, KeyCounts], dict[str, int]]:
        """Publish `holder`'s counts; the other holders' fresh counts and the stored
        `tokens_used` of the same keys."""
        return exchange_key_counts(self._engine, holder, counts, fresh_s)

    def forget_key_counts(self, holder: str) -> None:
        """Delete `holder`'s published counts (a clean shutdown)."""
        forget_key_counts(self._engine, holder)

    # Train steps.

    def add_train_step(self, record: TrainStepRecord) -> TrainStepRecord:
        """Record an optimizer step (IntegrityError when the step exists)."""
        self._add(TrainStepRow(**row_values(record)))
        return record

    def latest_train_step(self) -> TrainStepRecord | None:
        """The highest step, or None before the first."""
        statement = select(TrainStepRow).order_by(TrainStepRow.step.desc()).limit(1)
        found = self._list(TrainStepRecord, statement)
        return found[0] if found else None

    def list_train_steps(
        self, *, after_step: int | None = None, limit: int = 1000, offset: int = 0
    ) -> list[TrainStepRecord]:
        """Steps in ascending order, optionally only those after `after_step`."""
        statement = select(TrainStepRow).order_by(TrainStepRow.step)
        if after_step is not None:
            statement = statement.where(TrainStepRow.step > after_step)
        return self._list(TrainStepRecord, paged(statement, limit, offset))
