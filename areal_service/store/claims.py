"""Readiness and claiming of episodes for training (store -> trainer hop).

Owns the session states after `ended`: ended -> claimed -> trained, claimed -> ended
(release), ended/claimed -> dropped (with `drop_reason`). A claim is a conditional
UPDATE (`WHERE status = 'ended'`) checked row by row inside one transaction, so two
trainers on two connections never hold the same session; PostgreSQL also takes row
locks with SKIP LOCKED first, so concurrent claimers never wait on or deadlock with
each other. Sequences and returns come from `episodes.py`; completions are only read
(`episode_reads.py`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, bindparam, case, func, select, update
from sqlalchemy.sql import ColumnElement, or_

from areal_service.episodes import SessionEpisode, build_episode
from areal_service.store.episode_reads import load_completions, load_rewards
from areal_service.store.schema import CompletionRow, RewardRow, SessionRow
from areal_service.store.trajectory import TrajectoryStore
from areal_service.types import (
    ClaimResult,
    CompletionRecord,
    DroppedEpisodes,
    EpisodeGroup,
    now,
)

logger = logging.getLogger(__name__)

_RELEASED = {"status": "ended", "claim_id": None, "claimed_by": None, "claimed_at": None}


def staleness_of(completions: Iterable[CompletionRecord], current_version: int) -> int:
    """current_version − the oldest version of any generated token (0 without tokens)."""
    versions = [min(c.output_versions) for c in completions if c.output_versions]
    return current_version - min(versions) if versions else 0


@dataclass(frozen=True, slots=True)
class _Ready:
    """A ready group: `key` is its group_id, or the session id of an ungrouped session."""

    key: str
    grouped: bool
    session_ids: tuple[str, ...]
    last_ended_at: float


def _ready_groups(
    connection: Connection, group_size: int | None, limit: int, exclude: set[str]
) -> list[_Ready]:
    """Oldest-first groups whose sessions (not yet claimed/trained/dropped) are all
    `ended`, at least `group_size` of them (ungrouped sessions only when group_size is
    None). Two indexed queries; `exclude` keys are skipped."""
    solo = case((SessionRow.group_id.is_(None), SessionRow.id), else_=None)
    n_open = func.sum(case((SessionRow.status == "open", 1), else_=0))
    n_ended = func.count() - n_open
    statement = (
        select(SessionRow.group_id, solo, func.max(SessionRow.ended_at))
        .where(SessionRow.status.in_(("open", "ended")))
        .group_by(SessionRow.group_id, solo)
        .having(n_open == 0, n_ended >= (group_size or 1))
        .order_by(func.min(SessionRow.created_at), SessionRow.group_id, solo)
        .limit(limit + len(exclude))
    )
    if group_size is not None:
        statement = statement.where(SessionRow.group_id.is_not(None))
    heads = [
        (group_id or solo_id, group_id is not None, ended_at)
        for group_id, solo_id, ended_at in connection.execute(statement)
        if (group_id or solo_id) not in exclude
    ][:limit]
    if not heads:
        return []
    grouped = [key for key, is_group, _ in heads if is_group]
    members: dict[str, list[str]] = {key: [] for key, _, _ in heads}
    rows = connection.execute(
        select(SessionRow.id, SessionRow.group_id)
        .where(SessionRow.status == "ended")
        .where(
            or_(
                SessionRow.group_id.in_(grouped),
                SessionRow.id.in_([key for key, is_group, _ in heads if not is_group]),
            )
        )
        .order_by(SessionRow.created_at, SessionRow.id)
    )
    for session_id, group_id in rows:
        members[group_id or session_id].append(session_id)
    return [
        _Ready(key, is_group, tuple(members[key]), ended_at or 0.0)
        for key, is_group, ended_at in heads
        if members[key]
    ]


def _rewarded_sessions(store: TrajectoryStore, ready: list[_Ready]) -> set[str]:
    """Which sessions of `ready` some reward targets (session, completion or group)."""
    ids = [sid for r in ready for sid in r.session_ids]
    groups = {r.key: r.session_ids for r in ready if r.grouped}
    direct = select(RewardRow.session_id).where(RewardRow.session_id.in_(ids))
    via_completion = (
        select(CompletionRow.session_id)
        .join(RewardRow, RewardRow.completion_id == CompletionRow.id)
        .where(CompletionRow.session_id.in_(ids))
    )
    of_group = select(RewardRow.group_id).where(RewardRow.group_id.in_(list(groups)))
    with store.engine.connect() as connection:
        found = set(connection.execute(direct.union(via_completion)).scalars())
        for group_id in connection.execute(of_group).scalars():
            found.update(groups[group_id])
    return found


def _group(key: str, kept: list[SessionEpisode], staleness: int, claim_id: str) -> EpisodeGroup:
    return EpisodeGroup(
        group_id=key,
        session_ids=tuple(e.session_id for e in kept),
        sequences=tuple(s for e in kept for s in e.sequences),
        session_returns=tuple(e.session_return or 0.0 for e in kept),
        staleness=staleness,
        claim_id=claim_id,
    )


class EpisodeClaimer:
    """Claims finished, rewarded episodes as groups; marks them trained or released.

    `turn_discount` is γ of R_i = r_i + γ·R_{i+1}; `default_reward` is the reward of a
    session no reward targets (None: drop such sessions); `reward_wait_s` lets a judge
    post a reward after the session ended: a group with an unrewarded session is not
    claimed until that long after its last session ended."""

    def __init__(
        self,
        store: TrajectoryStore,
        *,
        turn_discount: float = 1.0,
        default_reward: float | None = 0.0,
        reward_wait_s: float = 0.0,
    ) -> None:
        self._store = store
        self._gamma = turn_discount
        self._default_reward = default_reward
        self._reward_wait_s = reward_wait_s

    def claim_groups(
        self,
        *,
        group_size: int | None,
        max_groups: int,
        current_version: int,
        max_staleness: int | None,
        claimer: str,
    ) -> ClaimResult:
        """Claim up to `max_groups` ready groups, oldest first, for `claimer`.

        A group is ready when none of its sessions is open and at least `group_size` are
        ended (all of them are claimed; with `group_size=None`, every group and every
        ungrouped session counts, an ungrouped session being a group of one keyed by its
        session id). Dropped instead of claimed, and returned in `dropped`: groups whose
        staleness exceeds `max_staleness`; sessions with a missing part or (with
        default_reward None) no reward, and the rest of their group when fewer than
        `group_size` remain. Never waits for episodes: an empty result when none is ready.
        """
        if max_groups < 1:
            raise ValueError(f"max_groups ({max_groups}) must be >= 1")
        groups: list[EpisodeGroup] = []
        dropped: list[DroppedEpisodes] = []
        seen: set[str] = set()
        while len(groups) < max_groups:
            with self._store.engine.connect() as connection:
                ready = _ready_groups(connection, group_size, max_groups - len(groups), seen)
            if not ready:
                break
            seen.update(r.key for r in ready)
            ready = self._settled(ready)
            claimed = self._claim(ready, claimer)
            built, lost = self._build(claimed, current_version, max_staleness, group_size)
            if lost:
                self._drop(lost)
            groups.extend(built)
            dropped.extend(lost)
        return ClaimResult(groups=tuple(groups), dropped=tuple(dropped))

    def _settled(self, ready: list[_Ready]) -> list[_Ready]:
        """`ready` without the groups still waiting for a late reward."""
        if self._reward_wait_s <= 0:
            return ready
        cutoff = now() - self._reward_wait_s
        recent = [r for r in ready if r.last_ended_at > cutoff]
        if not recent:
            return ready
        rewarded = _rewarded_sessions(self._store, recent)
        waiting = {r.key for r in recent if not rewarded.issuperset(r.session_ids)}
        return [r for r in ready if r.key not in waiting]

    def _claim(self, ready: list[_Ready], claimer: str) -> list[tuple[_Ready, str]]:
        """Atomically claim whole groups; a group any of whose sessions another claimer
        holds is left alone (its rows are put back inside the same transaction)."""
        if not ready:
            return []
        claims = {r.key: uuid.uuid4().hex for r in ready}
        ids = [sid for r in ready for sid in r.session_ids]
        at = now()
        with self._store.engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                locked = set(
                    connection.execute(
                        select(SessionRow.id)
                        .where(SessionRow.id.in_(ids), SessionRow.status == "ended")
                        .with_for_update(skip_locked=True)
                    ).scalars()
                )
                ready = [r for r in ready if locked.issuperset(r.session_ids)]
            if not ready:
                return []
            connection.execute(
                update(SessionRow)
                .where(SessionRow.id == bindparam("sid"), SessionRow.status == "ended")
                .values(
                    status="claimed", claim_id=bindparam("cid"), claimed_by=claimer, claimed_at=at
                ),
                [{"sid": sid, "cid": claims[r.key]} for r in ready for sid in r.session_ids],
            )
            holders = select(SessionRow.id, SessionRow.claim_id).where(
                SessionRow.id.in_(ids), SessionRow.status == "claimed"
            )
            holder: dict[str, str] = dict(connection.execute(holders).all())  # type: ignore[arg-type]
            won = [r for r in ready if all(holder.get(s) == claims[r.key] for s in r.session_ids)]
            lost = sorted(set(claims.values()) - {claims[r.key] for r in won})
            if lost:
                connection.execute(
                    update(SessionRow)
                    .where(SessionRow.claim_id.in_(lost), SessionRow.status == "claimed")
                    .values(**_RELEASED)
                )
        return [(r, claims[r.key]) for r in won]

    def _build(
        self,
        claimed: list[tuple[_Ready, str]],
        current_version: int,
        max_staleness: int | None,
        group_size: int | None,
    ) -> tuple[list[EpisodeGroup], list[DroppedEpisodes]]:
        """Sequences and returns of claimed groups; what must not be trained goes to the
        second list (still `claimed` in the store until `_drop`)."""
        ids = [sid for ready, _ in claimed for sid in ready.session_ids]
        completions = load_completions(self._store, ids, with_json=False)
        rewards = load_rewards(self._store, ids, [r.key for r, _ in claimed if r.grouped])
        built: list[EpisodeGroup] = []
        dropped: list[DroppedEpisodes] = []
        for ready, claim_id in claimed:
            staleness = staleness_of(
                (c for sid in ready.session_ids for c in completions[sid]), current_version
            )
            if max_staleness is not None and staleness > max_staleness:
                reason = f"stale: {staleness} versions > max_staleness {max_staleness}"
                dropped.append(DroppedEpisodes(ready.key, ready.session_ids, reason, staleness))
                continue
            kept: list[SessionEpisode] = []
            for sid in ready.session_ids:
                episode = build_episode(
                    sid,
                    completions[sid],
                    rewards,
                    group_id=ready.key if ready.grouped else None,
                    gamma=self._gamma,
                    default_reward=self._default_reward,
                )
                reason = episode.problem or ("no reward" if episode.session_return is None else "")
                if reason:
                    dropped.append(DroppedEpisodes(ready.key, (sid,), reason, staleness))
                else:
                    kept.append(episode)
            if len(kept) >= (group_size or 1):
                built.append(_group(ready.key, kept, staleness, claim_id))
            elif kept:
                reason = f"group incomplete: {len(kept)} of {group_size} sessions left"
                left = tuple(e.session_id for e in kept)
                dropped.append(DroppedEpisodes(ready.key, left, reason, staleness))
        return built, dropped

    def _drop(self, dropped: list[DroppedEpisodes]) -> None:
        params = [{"sid": sid, "why": d.reason} for d in dropped for sid in d.session_ids]
        with self._store.engine.begin() as connection:
            connection.execute(
                update(SessionRow)
                .where(SessionRow.id == bindparam("sid"), SessionRow.status == "claimed")
                .values(status="dropped", drop_reason=bindparam("why")),
                params,
            )
        for d in dropped:
            logger.info("dropped %d session(s) of %s: %s", len(d.session_ids), d.group_id, d.reason)

    def mark_trained(self, claim_id: str | Sequence[str], *, at: float | None = None) -> int:
        """Claimed sessions of `claim_id` (or of several claims: one transaction) ->
        `trained`; how many (0: released meanwhile, e.g. by `release_stale_claims`)."""
        ids = [claim_id] if isinstance(claim_id, str) else list(claim_id)
        return self._transition(
            SessionRow.claim_id.in_(ids),
            status="trained",
            trained_at=now() if at is None else at,
        )

    def release_claim(self, claim_id: str | Sequence[str]) -> int:
        """Claimed sessions of `claim_id` (or several) back to `ended`, claimable again
        (e.g. a trainer that could not train them); how many."""
        ids = [claim_id] if isinstance(claim_id, str) else list(claim_id)
        return self._transition(SessionRow.claim_id.in_(ids), **_RELEASED)

    def release_stale_claims(self, older_than_s: float, *, at: float | None = None) -> int:
        """Release every claim taken more than `older_than_s` ago (a trainer that
        crashed before `mark_trained`); how many sessions."""
        at = now() if at is None else at
        return self._transition(SessionRow.claimed_at < at - older_than_s, **_RELEASED)

    def _transition(self, condition: ColumnElement[bool], **values: object) -> int:
        with self._store.engine.begin() as connection:
            result = connection.execute(
                update(SessionRow).where(condition, SessionRow.status == "claimed").values(**values)
            )
            return int(result.rowcount)
