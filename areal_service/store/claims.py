"""Readiness and claiming of episodes for training (store -> trainer hop).

Owns the session states after `ended`: ended -> claimed -> trained, claimed -> ended
(release), ended/claimed -> dropped (with `drop_reason`). A claim is a conditional
UPDATE (`WHERE status = 'ended'`) checked row by row inside one transaction, so two
trainers on two connections never hold the same session; PostgreSQL also takes row
locks with SKIP LOCKED first, so concurrent claimers never wait on or deadlock with
each other. Sequences and returns come from `episodes.py`; completions are only read (through the
store's `load_completions`). An object over the store's engine, like the store's own.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Sequence
from typing import Literal

from sqlalchemy import and_, bindparam, select, update
from sqlalchemy.sql import ColumnElement

from areal_service.config import TrainerConfig
from areal_service.episodes import SessionEpisode, build_episode
from areal_service.store.readiness import (
    UNREWARDED,
    ReadyGroup,
    ready_groups,
    rewarded_sessions,
)
from areal_service.store.schema import SessionRow
from areal_service.store.trajectory import TrajectoryStore
from areal_service.types import (
    DEFAULT_POLICY,
    END_FAILED,
    ClaimResult,
    CompletionRecord,
    DroppedEpisodes,
    EpisodeGroup,
    RewardRecord,
    now,
)

UnrewardedPolicy = Literal["drop_group", "default_reward"]

FAILED = "failed"
"""Prefix of the `drop_reason` of a member whose agent failed (dropped alone)."""
INCOMPLETE = "group incomplete"
"""Prefix of the `drop_reason` of a group left with fewer than 2 trainable members."""

logger = logging.getLogger(__name__)

_RELEASED = {"status": "ended", "claim_id": None, "claimed_by": None, "claimed_at": None}


def staleness_of(completions: Iterable[CompletionRecord], current_version: int) -> int:
    """current_version − the oldest version of any generated token (0 without tokens)."""
    versions = [min(c.output_versions) for c in completions if c.output_versions]
    return current_version - min(versions) if versions else 0


def _group(
    ready: ReadyGroup, kept: list[SessionEpisode], staleness: int, claim_id: str
) -> EpisodeGroup:
    return EpisodeGroup(
        group_id=ready.key,
        session_ids=tuple(e.session_id for e in kept),
        sequences=tuple(s for e in kept for s in e.sequences),
        session_returns=tuple(e.session_return or 0.0 for e in kept),
        staleness=staleness,
        claim_id=claim_id,
        grouped=ready.grouped,
        task_id=ready.task_id,
    )


class EpisodeClaimer:
    """Claims finished, settled episodes as groups; marks them trained or released.

    `turn_discount` is γ of R_i = r_i + γ·R_{i+1}. Reward settling: a group is
    claimable once every session has ended and is rewarded or declared that no reward
    will come (end reason `no_reward`), or once `reward_wait_s` passed since its last
    session ended. A session still without a reward then follows `unrewarded_policy`:
    `drop_group` drops its whole group (reason `unrewarded: ...`), `default_reward`
    trains it with return `default_reward`. Counters of both outcomes (cumulative, this
    process) are in `settling_metrics`.

    Partial groups: a group with fewer ended sessions than `group_size` (and none open)
    settles `partial_group_wait_s` after its last session ended (None: never) and trains
    with its real size. A member that failed (end reason `failed`) or has a missing part
    is dropped alone; the rest of its group trains when at least 2 remain (GRPO needs two
    returns to compare; the advantages are computed over the members kept), else it is
    dropped with reason `group incomplete: ...`. Ungrouped sessions are groups of one;
    their advantage is the trainer's (`trainer.ungrouped_baseline`)."""

    def __init__(
        self,
        store: TrajectoryStore,
        *,
        turn_discount: float = 1.0,
        reward_wait_s: float = 60.0,
        unrewarded_policy: UnrewardedPolicy = "drop_group",
        default_reward: float = 0.0,
        partial_group_wait_s: float | None = None,
        policy: str = DEFAULT_POLICY,
    ) -> None:
        if reward_wait_s < 0:
            raise ValueError(f"reward_wait_s ({reward_wait_s}) must be >= 0")
        self._store = store
        self._engine = store.engine
        self._gamma = turn_discount
        self._reward_wait_s = reward_wait_s
        self._policy = unrewarded_policy
        self._default_reward = default_reward
        self._partial_wait_s = partial_group_wait_s
        self._trains = policy
        """The policy whose episodes this claimer takes (`trainer.policy`)."""
        self._dropped_unrewarded = 0
        self._default_rewarded = 0
        self._awaiting = 0

    @classmethod
    def from_config(cls, store: TrajectoryStore, config: TrainerConfig) -> EpisodeClaimer:
        """A claimer with the `trainer:` settings (discount, settling window, policy)."""
        return cls(
            store,
            turn_discount=config.turn_discount,
            reward_wait_s=config.reward_wait_s,
            unrewarded_policy=config.unrewarded_policy,
            default_reward=config.reward_default_for_unrewarded or 0.0,
            partial_group_wait_s=config.partial_group_wait_s,
            policy=config.policy,
        )

    def settling_metrics(self) -> dict[str, float]:
        """Groups awaiting a reward at the last claim, and the sessions the unrewarded
        policy dropped or trained with the default reward (totals since start)."""
        return {
            "groups_awaiting_reward": float(self._awaiting),
            "sessions_dropped_unrewarded_total": float(self._dropped_unrewarded),
            "sessions_default_reward_total": float(self._default_rewarded),
        }

    def claim_groups(
        self,
        *,
        group_size: int | None,
        max_groups: int,
        current_version: int,
        max_staleness: int | None,
        claimer: str,
    ) -> ClaimResult:
        """Claim up to `max_groups` ready, settled groups, oldest first, for `claimer`.

        A group is ready when none of its sessions is open and at least `group_size` are
        ended (all of them are claimed; with `group_size=None`, every group and every
        ungrouped session counts, an ungrouped session being a group of one keyed by its
        session id), and settled as the class docstring says. Dropped instead of
        claimed, and returned in `dropped`: groups whose staleness exceeds
        `max_staleness` (the trainer passes `TrainerConfig.train_staleness_bound`); groups with an unrewarded session under `drop_group`; sessions
        with a missing part, and the rest of their group when fewer than `group_size`
        remain. Never waits for episodes: an empty result when none is ready.
        """
        if max_groups < 1:
            raise ValueError(f"max_groups ({max_groups}) must be >= 1")
        groups: list[EpisodeGroup] = []
        dropped: list[DroppedEpisodes] = []
        seen: set[str] = set()
        awaiting = 0
        partial_before = None if self._partial_wait_s is None else now() - self._partial_wait_s
        while len(groups) < max_groups:
            with self._engine.connect() as connection:
                ready = ready_groups(
                    connection,
                    group_size,
                    max_groups - len(groups),
                    seen,
                    partial_before=partial_before,
                    policy=self._trains,
                )
            if not ready:
                break
            seen.update(r.key for r in ready)
            settled = self._settled(ready)
            awaiting += len(ready) - len(settled)
            claimed = self._claim(settled, claimer)
            built, lost = self._build(claimed, current_version, max_staleness, group_size)
            if lost:
                self._drop(lost)
            groups.extend(built)
            dropped.extend(lost)
        self._awaiting = awaiting
        return ClaimResult(groups=tuple(groups), dropped=tuple(dropped))

    def _settled(self, ready: list[ReadyGroup]) -> list[ReadyGroup]:
        """`ready` without the groups still waiting for a reward: an unrewarded,
        undeclared session whose group's last end is less than `reward_wait_s` ago."""
        cutoff = now() - self._reward_wait_s
        recent = [r for r in ready if r.last_ended_at > cutoff]
        if not recent:
            return ready
        rewarded = rewarded_sessions(self._engine, recent)
        waiting = {
            r.key
            for r in recent
            if not rewarded.union(r.declared, r.failed).issuperset(r.session_ids)
        }
        return [r for r in ready if r.key not in waiting]

    def _claim(self, ready: list[ReadyGroup], claimer: str) -> list[tuple[ReadyGroup, str]]:
        """Atomically claim whole groups; a group any of whose sessions another claimer
        holds is left alone (its rows are put back inside the same transaction)."""
        if not ready:
            return []
        claims = {r.key: uuid.uuid4().hex for r in ready}
        ids = [sid for r in ready for sid in r.session_ids]
        at = now()
        with self._engine.begin() as connection:
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
        claimed: list[tuple[ReadyGroup, str]],
        current_version: int,
        max_staleness: int | None,
        group_size: int | None,
    ) -> tuple[list[EpisodeGroup], list[DroppedEpisodes]]:
        """Sequences and returns of claimed groups; what must not be trained goes to the
        second list (still `claimed` in the store until `_drop`)."""
        ids = [sid for ready, _ in claimed for sid in ready.session_ids]
        completions = self._store.load_completions(ids, with_json=False)
        rewards = self._store.load_rewards(ids, [r.key for r, _ in claimed if r.grouped])
        built: list[EpisodeGroup] = []
        dropped: list[DroppedEpisodes] = []
        for ready, claim_id in claimed:
            staleness = staleness_of(
                (c for sid in ready.session_ids for c in completions[sid]), current_version
            )
            if max_staleness is not None and staleness > max_staleness:
                reason = f"stale: {staleness} versions > max_train_staleness {max_staleness}"
                dropped.append(DroppedEpisodes(ready.key, ready.session_ids, reason, staleness))
                continue
            kept: list[SessionEpisode] = []
            for sid in ready.session_ids:
                if sid in ready.failed:
                    reason = f"{FAILED}: the agent reported a failure (end reason {END_FAILED})"
                    dropped.append(DroppedEpisodes(ready.key, (sid,), reason, staleness))
                    continue
                episode = build_episode(
                    sid,
                    completions[sid],
                    rewards,
                    group_id=ready.key if ready.grouped else None,
                    gamma=self._gamma,
                    default_reward=None,
                )
                if episode.problem:
                    dropped.append(DroppedEpisodes(ready.key, (sid,), episode.problem, staleness))
                else:
                    kept.append(episode)
            unrewarded = [e.session_id for e in kept if e.session_return is None]
            if unrewarded and self._policy == "drop_group":
                reason = self._unrewarded_reason(ready, unrewarded, len(kept))
                left = tuple(e.session_id for e in kept)
                dropped.append(DroppedEpisodes(ready.key, left, reason, staleness))
                self._dropped_unrewarded += len(left)
                continue
            if unrewarded:
                kept = [self._with_default(e, completions, rewards, ready) for e in kept]
            # A group needs two returns to compare; ungrouped sessions (and every group
            # when the trainer runs ungrouped, group_size None) get a baseline instead.
            least = min(2, group_size) if ready.grouped and group_size is not None else 1
            if len(kept) >= least:
                built.append(_group(ready, kept, staleness, claim_id))
            elif kept:
                reason = (
                    f"{INCOMPLETE}: {len(kept)} of {len(ready.session_ids)} sessions "
                    "left (a group trains with >= 2)"
                )
                left = tuple(e.session_id for e in kept)
                dropped.append(DroppedEpisodes(ready.key, left, reason, staleness))
        return built, dropped

    def _unrewarded_reason(self, ready: ReadyGroup, unrewarded: list[str], kept: int) -> str:
        declared = sum(1 for sid in unrewarded if sid in ready.declared)
        waited = len(unrewarded) - declared
        why = [f"{declared} declared no reward"] if declared else []
        if waited:
            why.append(f"{waited} got none within reward_wait_s={self._reward_wait_s:g}s")
        return f"{UNREWARDED}: {len(unrewarded)} of {kept} sessions ({', '.join(why)})"

    def _with_default(
        self,
        episode: SessionEpisode,
        completions: dict[str, list[CompletionRecord]],
        rewards: list[RewardRecord],
        ready: ReadyGroup,
    ) -> SessionEpisode:
        """`episode` as built with the default reward when no reward targets it."""
        if episode.session_return is not None:
            return episode
        self._default_rewarded += 1
        logger.info(
            "session %s of %s: no reward, trained with the default %g",
            episode.session_id,
            ready.key,
            self._default_reward,
        )
        return build_episode(
            episode.session_id,
            completions[episode.session_id],
            rewards,
            group_id=ready.key if ready.grouped else None,
            gamma=self._gamma,
            default_reward=self._default_reward,
        )

    def _drop(self, dropped: list[DroppedEpisodes]) -> None:
        params = [{"sid": sid, "why": d.reason} for d in dropped for sid in d.session_ids]
        with self._engine.begin() as connection:
            connection.execute(
                update(SessionRow)
                .where(SessionRow.id == bindparam("sid"), SessionRow.status == "claimed")
                .values(status="dropped", drop_reason=bindparam("why")),
                params,
            )
        # A WARNING: a dropped episode is work its sender did that trains nothing; they
        # read the reason at `GET /rl/sessions/{id}` (`drop_reason`), and `/metrics`
        # counts it per reason.
        for d in dropped:
            shown = ", ".join(d.session_ids[:4]) + (" ..." if len(d.session_ids) > 4 else "")
            logger.warning(
                "dropped %d session(s) of %s (%s): %s",
                len(d.session_ids),
                d.group_id,
                shown,
                d.reason,
            )

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
        # Only this claimer's policy: another policy's trainer holds its own claims.
        condition = and_(condition, SessionRow.policy == self._trains)
        with self._engine.begin() as connection:
            result = connection.execute(
                update(SessionRow).where(condition, SessionRow.status == "claimed").values(**values)
            )
            return int(result.rowcount)
