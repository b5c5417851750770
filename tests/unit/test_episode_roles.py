"""Role sub-sessions of multi-agent episodes in the store (SQLite and PostgreSQL): they
end with their episode (explicitly or by the idle sweep, which never times a role out
alone nor its episode while a role is busy), and each policy's claimer takes only its
own: the episode's sessions for its policy, the roles' for theirs, each group apart."""

from __future__ import annotations

from areal_service.store import TrajectoryStore
from areal_service.store.claims import EpisodeClaimer
from areal_service.types import (
    CompletionRecord,
    RewardRecord,
    SessionRecord,
    role_session_id,
)


def _episode(store: TrajectoryStore, sid: str, *, at: float, group: str | None = None) -> str:
    """An episode of policy `solver` with a `verifier` role, both active at `at`."""
    store.add_session(
        SessionRecord(id=sid, group_id=group, policy="solver", created_at=at, last_activity_at=at)
    )
    role = role_session_id(sid, "verifier")
    store.add_session(
        SessionRecord(
            id=role,
            group_id=group,
            policy="verifier",
            parent_session_id=sid,
            created_at=at,
            last_activity_at=at,
        )
    )
    return role


def test_roles_end_with_their_episode(store: TrajectoryStore) -> None:
    role = _episode(store, "e1", at=1.0)
    lone = "e2"
    store.add_session(SessionRecord(id=lone, policy="solver", created_at=1.0))
    ended = store.end_session("e1", "reward")
    assert ended is not None and ended.status == "ended"
    got = store.get_session(role)
    assert got is not None and (got.status, got.end_reason) == ("ended", "reward")
    assert got.parent_session_id == "e1" and got.policy == "verifier"
    assert store.get_session(lone).status == "open"  # another episode is untouched
    assert [s.id for s in store.list_sessions(parent_session_id="e1")] == [role]
    assert store.list_sessions(parent_session_id=lone) == []


def test_idle_sweep_ends_episodes_whole(store: TrajectoryStore) -> None:
    idle_role = _episode(store, "idle", at=10.0)
    busy_role = _episode(store, "busy", at=10.0)
    # The busy episode's verifier ran recently, its own session did not.
    store.add_completion(
        CompletionRecord(
            id="c-busy",
            model="verifier",
            prompt_ids=(1, 2),
            output_ids=(3,),
            output_logprobs=(-0.5,),
            output_versions=(0,),
            finish_reason="stop",
            session_id=busy_role,
            created_at=95.0,
        )
    )
    # A role whose episode already ended (a race with its first completion) is closed
    # by the next sweep, whatever its own activity.
    late_role = _episode(store, "late", at=95.0)
    store.end_session("late", "client")
    store.add_session(
        SessionRecord(
            id=role_session_id("late", "judge"),
            policy="judge",
            parent_session_id="late",
            created_at=99.0,
            last_activity_at=99.0,
        )
    )
    ended = store.end_idle_sessions(30.0, at=100.0)
    assert ended == sorted(["idle", idle_role, role_session_id("late", "judge")])
    assert store.get_session(late_role).end_reason == "client"
    for sid in ("busy", busy_role):
        assert store.get_session(sid).status == "open"
    # Once every part is idle, the episode and its role end together.
    assert store.end_idle_sessions(30.0, at=200.0) == sorted(["busy", busy_role])


def _completion(cid: str, sid: str, model: str) -> CompletionRecord:
    return CompletionRecord(
        id=cid,
        model=model,
        prompt_ids=(1, 2, 3),
        output_ids=(4, 5),
        output_logprobs=(-0.1, -0.2),
        output_versions=(0, 0),
        finish_reason="stop",
        session_id=sid,
    )


def test_each_policy_claims_its_own_part_of_a_group(store: TrajectoryStore) -> None:
    roles = {}
    for i, value in enumerate((1.0, 0.0)):
        sid = f"g-{i}"
        roles[sid] = _episode(store, sid, at=1.0 + i, group="g")
        store.add_completion(_completion(f"s-{i}", sid, "solver"))
        store.add_completion(_completion(f"v-{i}", roles[sid], "verifier"))
        store.add_reward(RewardRecord(id=f"r-{i}", value=value, session_id=sid))
        store.add_reward(RewardRecord(id=f"r-{i}~v", value=1 - value, session_id=roles[sid]))
        store.end_session(sid, "reward")
    claims = {
        policy: EpisodeClaimer(store, reward_wait_s=0.0, policy=policy).claim_groups(
            group_size=2, max_groups=4, current_version=0, max_staleness=None, claimer=policy
        )
        for policy in ("solver", "verifier", "default")
    }
    assert claims["default"].groups == ()
    solver, verifier = claims["solver"].groups, claims["verifier"].groups
    assert [g.session_ids for g in solver] == [("g-0", "g-1")]
    assert [g.session_ids for g in verifier] == [(roles["g-0"], roles["g-1"])]
    assert solver[0].session_returns == (1.0, 0.0)
    assert verifier[0].session_returns == (0.0, 1.0)
    assert [s.completion_ids for s in solver[0].sequences] == [("s-0",), ("s-1",)]
    assert [s.completion_ids for s in verifier[0].sequences] == [("v-0",), ("v-1",)]
