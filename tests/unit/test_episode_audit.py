"""The episode audit: every session counted in one state, the dropped by reason, and
`unaccounted` for the sessions no rule will ever move (a partial group that never
settles, a drop without a reason), on SQLite and PostgreSQL."""

from __future__ import annotations

from sqlalchemy import update
from test_claims import add_episode, claim

from areal_service.config import TrainerConfig
from areal_service.store import TrajectoryStore
from areal_service.store.audit import OVERDUE_GRACE_S
from areal_service.store.claims import EpisodeClaimer
from areal_service.store.schema import SessionRow
from areal_service.types import END_FAILED, SessionRecord, now


def test_every_session_is_counted_once_and_unaccounted_ones_are_named(store: TrajectoryStore):
    t = now() - 10
    for i in range(2):
        add_episode(store, f"ok-{i}", group_id="ok", at=t + i, reward=float(i))
    add_episode(store, "old", group_id="stale", at=t, version=0)
    add_episode(store, "old2", group_id="stale", at=t, version=0)
    add_episode(store, "gone", group_id="fail", at=t, reward=None, end=False)
    store.end_session("gone", END_FAILED)
    add_episode(store, "kept", group_id="fail", at=t)
    add_episode(store, "part-0", group_id="part", at=t)  # 1 of group_size 2, none open
    add_episode(store, "solo", at=t)
    store.add_session(SessionRecord(id="live", group_id="open", created_at=t))
    result = claim(EpisodeClaimer(store, reward_wait_s=0), group_size=2, max_staleness=2)
    EpisodeClaimer(store).mark_trained([g.claim_id for g in result.groups])

    never = TrainerConfig(group_size=2, partial_group_wait_s=None)
    audit = store.episode_audit(never)
    assert audit.total == 9
    assert audit.states == {"open": 1, "ended": 1, "claimed": 0, "trained": 3, "dropped": 4}
    assert audit.dropped_by_reason == {"stale": 2, "failed": 1, "group incomplete": 1}
    assert audit.unaccounted == 1
    assert audit.unaccounted_why == {"partial group that never settles": 1}
    # Partial groups that settle after a window are in flight, not lost.
    assert store.episode_audit(TrainerConfig(group_size=2)).unaccounted == 0
    late = now() + 120 + 60 + OVERDUE_GRACE_S + 1
    assert store.episode_audit(TrainerConfig(group_size=2), at=late).overdue == 1
    # A drop without a reason is a lost episode too.
    with store.engine.begin() as connection:
        connection.execute(
            update(SessionRow).where(SessionRow.id == "old").values(drop_reason=None)
        )
    audit = store.episode_audit(TrainerConfig(group_size=2))
    assert audit.unaccounted_why == {"dropped without a reason": 1}
    assert audit.dropped_by_reason == {"stale": 1, "failed": 1, "group incomplete": 1}
