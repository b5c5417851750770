"""TrajectoryStore: the trajectories (sessions, completions, rewards, weight versions,
train steps) and what reads them, as typed records of `types.py`; the entry point of the
store package.

It owns the engine and builds the package's other objects over it: `keys`
(`KeyStore`, `api_keys.py`) and `coordination` (`Coordination`, `coordination.py`:
leases, admissions, shared counters, console sign-outs). Single-table queries are
here; engine creation is `connect.py`'s, row <-> record conversion `rows.py`'s, the
driver-level completion insert `inserts.py`'s and its batching `writer.py`'s; the
multi-table reads are in `episode_reads.py`, `session_queries.py`, `readiness.py`,
`audit.py` and `merge_stats.py`, each called through a method here (claiming is
`claims.py`'s `EpisodeClaimer`). Nothing outside the package holds the engine.
Methods are synchronous, thread-safe, one transaction each (async callers: the writer or
a thread). Dialect-neutral SQL: a SQLite file (WAL) or PostgreSQL (`postgresql+psycopg://`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, cast

from sqlalchemy import Engine, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import aliased
from sqlalchemy.sql import Select

from areal_service.config import StoreConfig, TrainerConfig
from areal_service.store import audit, episode_reads, merge_stats, readiness, session_queries
from areal_service.store.access import RowAccess
from areal_service.store.admissions import take_admitted_place
from areal_service.store.api_keys import KeyStore
from areal_service.store.audit import EpisodeAudit
from areal_service.store.connect import create_store_engine
from areal_service.store.coordination import Coordination
from areal_service.store.group_membership import (
    GroupRefused,
    GroupRule,
    group_refusal,
    lock_group,
)
from areal_service.store.inserts import CompletionInserter, completion_row
from areal_service.store.linking import PrefixEntry
from areal_service.store.merge_stats import RECENT_COMPLETIONS, MergeStats
from areal_service.store.migrate import upgrade_engine
from areal_service.store.policy_registry import PolicyStore
from areal_service.store.readiness import SettlingCounts
from areal_service.store.reward_admission import AcceptedReward, accept_reward, accept_rewards
from areal_service.store.rows import (
    completion_from_row,
    paged,
    row_values,
    to_record,
    where_equal,
)
from areal_service.store.schema import (
    CompletionRow,
    RewardRow,
    SessionRow,
    TrainStepRow,
    WeightVersionRow,
)
from areal_service.store.session_queries import SessionQuery, SessionSummary
from areal_service.store.write_probe import probe_write
from areal_service.types import (
    DEFAULT_POLICY,
    CompletionRecord,
    RecentTurn,
    RewardRecord,
    SessionRecord,
    SessionStatus,
    TrainStepRecord,
    WeightVersionRecord,
    now,
)

logger = logging.getLogger(__name__)


def _filter_sessions(
    statement: Select[Any],
    status: SessionStatus | None,
    group_id: str | None,
    task_id: str | None,
    parent_session_id: str | None = None,
) -> Select[Any]:
    return where_equal(
        statement,
        (SessionRow.parent_session_id, parent_session_id),
        (SessionRow.status, status),
        (SessionRow.group_id, group_id),
        (SessionRow.task_id, task_id),
    )


class TrajectoryStore(RowAccess):
    """Sessions, completions, rewards, weight versions and train steps; `keys` and
    `coordination` are the other domains, over the same engine.

    List methods page with `limit`/`offset` and never load a whole table. Logprobs are
    stored as float32: a value comes back as the nearest float32 (exact for logprobs
    that a backend computed in float32 or lower precision)."""

    keys: KeyStore
    """The API keys (`api_keys.py`)."""
    coordination: Coordination
    """What gateway processes sharing the store agree on (`coordination.py`)."""
    policies: PolicyStore
    """The policies created at runtime (`policy_registry.py`)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self._completions = CompletionInserter(engine)
        self.keys = KeyStore(engine)
        self.coordination = Coordination(engine)
        self.policies = PolicyStore(engine)

    @classmethod
    def open(cls, url: str, config: StoreConfig) -> TrajectoryStore:
        """Create the engine for `url` and, when `config.auto_migrate`, upgrade to head."""
        engine = create_store_engine(
            url,
            sqlite_synchronous=config.sqlite_synchronous,
            sqlite_max_size_mb=config.sqlite_max_size_mb,
        )
        if config.auto_migrate:
            upgrade_engine(engine)
        logger.info("trajectory store at %s", engine.url)
        return cls(engine)

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine, for the store package's own objects (and tests); code
        outside `areal_service.store` calls named methods instead."""
        return self._engine

    def ping(self) -> None:
        """One trivial query (readiness probes); raises when the database is unreachable."""
        with self._engine.connect() as connection:
            connection.execute(select(1))

    def probe_write(self, *, check_room: bool = True) -> None:
        """One committed write, then (`check_room`, SQLite) the room check; raises what
        keeps writes from working (`write_probe.py`). Blocking: run it in a thread."""
        probe_write(self._engine, check_room=check_room)

    def close(self) -> None:
        """Close every connection (pooled, and the completion writer's own)."""
        self._completions.close()
        self._engine.dispose()

    # Sessions (episodes).

    def add_session(
        self,
        record: SessionRecord,
        admission: str | None = None,
        *,
        group_rule: GroupRule | None = None,
    ) -> SessionRecord:
        """Insert a session (IntegrityError when the id exists). `admission`: the
        staleness-window reservation it was admitted under, which gives the session its
        place in the same transaction (`admissions.py`). `group_rule`: who may join the
        record's group, checked under the group's lock in the same transaction
        (`group_membership.py`; GroupRefused, nothing inserted)."""
        with self._sessions.begin() as session:
            if group_rule is not None and record.group_id is not None:
                connection = session.connection()
                lock_group(connection, record.group_id)
                refused = group_refusal(connection, record.group_id, group_rule)
                if refused is not None:
                    raise refused
            session.add(SessionRow(**row_values(record)))
            if admission is not None:
                session.flush()
                take_admitted_place(session.connection(), admission)
        return record

    def group_refusal(self, group_id: str, rule: GroupRule) -> GroupRefused | None:
        """Why `rule` may not add a session to `group_id` now (a cheap early answer; the
        insert checks again under the group's lock), or None."""
        with self._engine.connect() as connection:
            return group_refusal(connection, group_id, rule)

    def get_session(self, session_id: str) -> SessionRecord | None:
        """The session `session_id`, or None."""
        return self._get(SessionRecord, SessionRow, session_id)

    def get_sessions(self, session_ids: Collection[str]) -> dict[str, SessionRecord]:
        """The sessions among `session_ids` (id -> session; an unknown id is absent), in
        one query: the gateway's session cache reloads every stale entry at once."""
        if not session_ids:
            return {}
        found = self._list(
            SessionRecord, select(SessionRow).where(SessionRow.id.in_(list(session_ids)))
        )
        return {record.id: record for record in found}

    def list_sessions(
        self,
        *,
        status: SessionStatus | None = None,
        group_id: str | None = None,
        task_id: str | None = None,
        parent_session_id: str | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> list[SessionRecord]:
        """Sessions matching every given filter, newest first (`parent_session_id`: the
        role sub-sessions of that episode)."""
        statement = select(SessionRow).order_by(SessionRow.created_at.desc(), SessionRow.id)
        statement = _filter_sessions(statement, status, group_id, task_id, parent_session_id)
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
        return self._count(statement)

    def count_admitted_sessions(self) -> int:
        """Sessions that hold a place in the staleness window: accepted or running
        (open, ended, claimed, trained), not dropped (AReaL's accepted + running)."""
        statement = select(func.count()).select_from(SessionRow)
        statement = statement.where(SessionRow.status != "dropped")
        return self._count(statement)

    def end_session(
        self, session_id: str, reason: str, *, at: float | None = None
    ) -> SessionRecord | None:
        """Move an `open` session to `ended`, and its open role sub-sessions with it (one
        transaction: a multi-agent episode ends whole, so each role's trainer sees it
        end when the others do). Idempotent: a session that is not open is returned
        unchanged (the first reason wins). None if unknown."""
        at = now() if at is None else at
        ended = {"status": "ended", "ended_at": at, "end_reason": reason, "last_activity_at": at}
        with self._engine.begin() as connection:
            connection.execute(
                update(SessionRow)
                .where(SessionRow.id == session_id, SessionRow.status == "open")
                .values(**ended)
            )
            # Indexed; no row for an episode of one policy.
            connection.execute(
                update(SessionRow)
                .where(SessionRow.parent_session_id == session_id, SessionRow.status == "open")
                .values(**ended)
            )
        return self.get_session(session_id)

    def end_idle_sessions(self, idle_s: float, *, at: float | None = None) -> list[str]:
        """End every `open` session idle for more than `idle_s` seconds (reason
        `idle_timeout`, ended_at `at`); returns their ids. Conditional on status, so a
        session ended concurrently keeps its own reason.

        A multi-agent episode is idle when its own session and every role sub-session
        are: a role is never timed out alone (its episode still runs) and ends with its
        episode; a role whose episode is no longer open ends too."""
        at = now() if at is None else at
        cutoff = at - idle_s
        role = aliased(SessionRow)
        busy_role = (
            select(role.id)
            .where(
                role.parent_session_id == SessionRow.id,
                role.status == "open",
                role.last_activity_at >= cutoff,
            )
            .exists()
        )
        values = {"status": "ended", "ended_at": at, "end_reason": "idle_timeout"}
        with self._engine.begin() as connection:
            ended = list(
                connection.execute(
                    update(SessionRow)
                    .where(
                        SessionRow.status == "open",
                        SessionRow.parent_session_id.is_(None),
                        SessionRow.last_activity_at < cutoff,
                        ~busy_role,
                    )
                    .values(**values)
                    .returning(SessionRow.id)
                ).scalars()
            )
            episode = aliased(SessionRow)
            episode_closed = (
                select(episode.id)
                .where(episode.id == SessionRow.parent_session_id, episode.status != "open")
                .exists()
            )
            ended += connection.execute(
                update(SessionRow)
                .where(
                    SessionRow.status == "open",
                    SessionRow.parent_session_id.is_not(None),
                    episode_closed,
                )
                .values(**values)
                .returning(SessionRow.id)
            ).scalars()
            return sorted(ended)

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
        statement = select(
            CompletionRow.session_id,
            CompletionRow.id,
            CompletionRow.full_len,
            CompletionRow.full_hash,
            CompletionRow.created_at,
        ).where(CompletionRow.session_id.in_(list(out)), CompletionRow.full_hash.is_not(None))
        with self._engine.connect() as connection:
            # IN and the WHERE drop NULL sessions and hashes (the columns' Optional).
            rows = cast("Iterable[tuple[str, str, int, str, float]]", connection.execute(statement))
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

    def accept_rewards(
        self, records: Sequence[RewardRecord], *, additive: bool = False
    ) -> list[AcceptedReward]:
        """`accept_reward` for an episode's reward and its roles' in one transaction: all
        stored, or none when one is refused."""
        return accept_rewards(self._engine, records, additive=additive)

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
        statement = where_equal(
            statement,
            (RewardRow.session_id, session_id),
            (RewardRow.completion_id, completion_id),
            (RewardRow.group_id, group_id),
        )
        return self._list(RewardRecord, paged(statement, limit, offset))

    # Weight versions.

    def add_weight_version(self, record: WeightVersionRecord) -> WeightVersionRecord:
        """Record a published version (IntegrityError when it exists)."""
        self._add(WeightVersionRow(**row_values(record)))
        return record

    def get_weight_version(
        self, version: int, policy: str = DEFAULT_POLICY
    ) -> WeightVersionRecord | None:
        """Version `version` of `policy`, or None."""
        return self._get(WeightVersionRecord, WeightVersionRow, (policy, version))

    def latest_weight_version(self, policy: str = DEFAULT_POLICY) -> WeightVersionRecord | None:
        """`policy`'s highest published version, or None before its first publish."""
        found = self.list_weight_versions(limit=1, policy=policy)
        return found[0] if found else None

    def latest_weight_versions(self) -> dict[str, WeightVersionRecord]:
        """Each policy's highest published version (policies without one are absent);
        one query, grouped by the primary key's leading column."""
        statement = _highest_per_policy(WeightVersionRow, "version")
        return {r.policy: r for r in self._list(WeightVersionRecord, statement)}

    def list_weight_versions(
        self, *, limit: int = 100, offset: int = 0, policy: str = DEFAULT_POLICY
    ) -> list[WeightVersionRecord]:
        """`policy`'s published versions, newest first."""
        statement = (
            select(WeightVersionRow)
            .where(WeightVersionRow.policy == policy)
            .order_by(WeightVersionRow.version.desc())
        )
        return self._list(WeightVersionRecord, paged(statement, limit, offset))

    def update_weight_version_metadata(
        self, version: int, metadata: Mapping[str, Any], policy: str = DEFAULT_POLICY
    ) -> WeightVersionRecord | None:
        """Merge `metadata` into the version's metadata (top-level keys replaced) and
        return the result; None if the version is unknown. Safe against concurrent
        mergers: the no-op UPDATE first takes the row's write lock (PostgreSQL row lock;
        SQLite write lock, since pysqlite begins the transaction at the first write), so
        the read-modify-write cannot lose another writer's keys."""
        with self._sessions.begin() as session:
            locked = session.execute(
                update(WeightVersionRow)
                .where(WeightVersionRow.policy == policy, WeightVersionRow.version == version)
                .values(version=WeightVersionRow.version)
                .execution_options(synchronize_session=False)
            )
            if not locked.rowcount:  # type: ignore[attr-defined]
                return None
            row = session.get(WeightVersionRow, (policy, version), populate_existing=True)
            assert row is not None
            row.meta = {**row.meta, **metadata}
            return to_record(WeightVersionRecord, row)

    def live_weight_version(
        self, *, after: int = -1, scan: int = 16, policy: str = DEFAULT_POLICY
    ) -> WeightVersionRecord | None:
        """The newest version above `after` the swap leader made live (`live_at` in its
        metadata), among the `scan` newest published; None when there is none. Followers
        poll this with their own live version as `after` (a few times a second), so the
        usual answer reads no row."""
        statement = (
            select(WeightVersionRow)
            .where(WeightVersionRow.policy == policy, WeightVersionRow.version > after)
            .order_by(WeightVersionRow.version.desc())
            .limit(scan)
        )
        for record in self._list(WeightVersionRecord, statement):
            if "live_at" in record.metadata:
                return record
        return None

    def group_policies(self, group_id: str) -> list[str]:
        """The policies of the group's sessions, sorted (a group id used under two
        policies makes two groups; a group reward lands on both)."""
        statement = (
            select(SessionRow.policy)
            .where(SessionRow.group_id == group_id)
            .distinct()
            .order_by(SessionRow.policy)
        )
        with self._engine.connect() as connection:
            return [str(p) for p in connection.execute(statement).scalars()]

    def count_sessions_by_policy(self) -> dict[str, dict[str, int]]:
        """Sessions per policy and status, `{policy: {status: n}}` (statuses without a
        session are absent): one grouped COUNT, for the console and `/metrics` (admin
        paths, never per request)."""
        statement = select(SessionRow.policy, SessionRow.status, func.count()).group_by(
            SessionRow.policy, SessionRow.status
        )
        out: dict[str, dict[str, int]] = {}
        with self._engine.connect() as connection:
            for policy, status, n in connection.execute(statement):
                out.setdefault(policy, {})[status] = int(n)
        return out

    # Train steps.

    def add_train_step(self, record: TrainStepRecord) -> TrainStepRecord:
        """Record an optimizer step (IntegrityError when the step exists)."""
        self._add(TrainStepRow(**row_values(record)))
        return record

    def latest_train_step(self, policy: str = DEFAULT_POLICY) -> TrainStepRecord | None:
        """`policy`'s highest step, or None before its first."""
        statement = (
            select(TrainStepRow)
            .where(TrainStepRow.policy == policy)
            .order_by(TrainStepRow.step.desc())
            .limit(1)
        )
        found = self._list(TrainStepRecord, statement)
        return found[0] if found else None

    def latest_train_steps(self) -> dict[str, TrainStepRecord]:
        """Each policy's highest step (policies without one are absent); one query,
        grouped by the primary key's leading column."""
        statement = _highest_per_policy(TrainStepRow, "step")
        return {r.policy: r for r in self._list(TrainStepRecord, statement)}

    def list_train_steps(
        self,
        *,
        after_step: int | None = None,
        limit: int = 1000,
        offset: int = 0,
        policy: str = DEFAULT_POLICY,
    ) -> list[TrainStepRecord]:
        """`policy`'s steps in ascending order, optionally only those after
        `after_step`."""
        statement = (
            select(TrainStepRow).where(TrainStepRow.policy == policy).order_by(TrainStepRow.step)
        )
        if after_step is not None:
            statement = statement.where(TrainStepRow.step > after_step)
        return self._list(TrainStepRecord, paged(statement, limit, offset))

    # Episode reads: many sessions at once (`episode_reads.py`, `session_queries.py`).

    def load_completions(
        self, session_ids: Sequence[str], *, with_json: bool = True
    ) -> dict[str, list[CompletionRecord]]:
        """The completions of each session, oldest first (every given id is a key);
        `with_json=False` leaves request_json/response_json empty (one query)."""
        return episode_reads.load_completions(self._engine, session_ids, with_json=with_json)

    def load_rewards(
        self, session_ids: Sequence[str], group_ids: Iterable[str] = ()
    ) -> list[RewardRecord]:
        """Every reward on these sessions, on their completions or on these groups, oldest
        first (one query)."""
        return episode_reads.load_rewards(self._engine, session_ids, group_ids)

    def sessions_after(
        self, query: SessionQuery, after: tuple[float, str] | None, limit: int
    ) -> list[SessionRecord]:
        """The next `limit` sessions of `query` after the (created_at, id) key `after`,
        oldest first (keyset paging, the export's)."""
        return session_queries.sessions_after(self._engine, query, after, limit)

    def session_summaries(
        self, query: SessionQuery, *, limit: int, offset: int
    ) -> tuple[int, list[SessionSummary]]:
        """(how many sessions match `query`, one page of them newest first with their
        turns, tokens and reward): the console's sessions table."""
        return session_queries.session_summaries(self._engine, query, limit=limit, offset=offset)

    # Figures for the console, metrics and probes (admin paths, never per request).

    def settling_counts(self) -> SettlingCounts:
        """Ended sessions awaiting a reward, and sessions dropped unrewarded (`readiness.py`)."""
        return readiness.settling_counts(self._engine)

    def episode_audit(self, trainer: TrainerConfig, *, at: float | None = None) -> EpisodeAudit:
        """Every session's state under the trainer settings `trainer`, with `unaccounted`
        (which must stay 0) and `overdue` (`audit.py`)."""
        return audit.episode_audit(self._engine, trainer, at=at)

    def merge_stats(self, recent: int = RECENT_COMPLETIONS) -> MergeStats:
        """How the newest `recent` session completions merge into training sequences
        (`merge_stats.py`)."""
        return merge_stats.merge_stats(self._engine, recent)


def _highest_per_policy(row: type[WeightVersionRow | TrainStepRow], column: str) -> Select[Any]:
    """The rows of `row`'s table holding each policy's highest `column`: one query, the
    per-policy maximum joined back on (policy, column), the primary key."""
    highest = (
        select(row.policy, func.max(getattr(row, column)).label(column))
        .group_by(row.policy)
        .subquery()
    )
    return select(row).join(
        highest,
        (row.policy == highest.c.policy) & (getattr(row, column) == highest.c[column]),
    )
