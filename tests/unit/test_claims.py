"""Claims: readiness (groups, sizes, ungrouped sessions), oldest first, staleness and
missing-part drops, default and late rewards, trained/release transitions, idle timeout,
and two trainers on two connections racing: every session is claimed exactly once."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import select

from areal_service.config import StoreConfig, TrainerConfig
from areal_service.store import TrajectoryStore
from areal_service.store import claims as claims_module
from areal_service.store.claims import EpisodeClaimer
from areal_service.store.readiness import SettlingCounts
from areal_service.store.schema import SessionRow
from areal_service.types import (
    END_FAILED,
    END_NO_REWARD,
    ClaimResult,
    CompletionRecord,
    RewardRecord,
    SessionRecord,
    now,
)
from trainer.advantage import group_advantages


def add_episode(
    store: TrajectoryStore,
    sid: str,
    *,
    group_id: str | None = None,
    at: float = 1.0,
    version: int = 5,
    turns: int = 1,
    reward: float | None = 1.0,
    end: bool = True,
    parent_of_first: str | None = None,
) -> None:
    """A session of `turns` chained completions, rewarded and ended as asked."""
    store.add_session(SessionRecord(id=sid, group_id=group_id, created_at=at, last_activity_at=at))
    prompt: tuple[int, ...] = (1, 2, 3)
    parent = parent_of_first
    records = []
    for turn in range(turns):
        output = (10 + turn, 20 + turn)
        cid = f"{sid}-c{turn}"
        records.append(
            CompletionRecord(
                id=cid,
                model="m",
                prompt_ids=prompt,
                output_ids=output,
                output_logprobs=(-0.5, -0.25),
                output_versions=(version, version + 1),
                finish_reason="stop",
                session_id=sid,
                parent_id=parent,
                created_at=at + turn * 0.01,
            )
        )
        prompt, parent = prompt + output + (4,), cid
    store.add_completions(records)
    if reward is not None:
        store.add_reward(RewardRecord(id=f"r-{sid}", value=reward, session_id=sid))
    if end:
        store.end_session(sid, "client", at=at + 1)


def claim(claimer: EpisodeClaimer, **kw):
    args = dict(group_size=None, max_groups=10, current_version=6, max_staleness=None)
    return claimer.claim_groups(claimer="t0", **{**args, **kw})


def test_group_is_ready_when_all_its_sessions_ended(store: TrajectoryStore):
    for i in range(3):
        add_episode(store, f"g-{i}", group_id="g", at=1.0 + i, end=i < 2)
    claimer = EpisodeClaimer(store)
    assert claim(claimer).groups == ()  # one session still open
    assert claim(claimer, group_size=4).groups == ()
    store.end_session("g-2", "client")
    assert claim(claimer, group_size=4).groups == ()  # 3 < group_size
    (group,) = claim(claimer, group_size=3).groups
    assert group.group_id == "g" and group.session_ids == ("g-0", "g-1", "g-2")
    assert group.session_returns == (1.0, 1.0, 1.0) and group.staleness == 1
    assert [s.session_id for s in group.sequences] == ["g-0", "g-1", "g-2"]
    assert all(s.group_id == "g" for s in group.sequences)
    assert {store.get_session(f"g-{i}").status for i in range(3)} == {"claimed"}
    assert claim(claimer).groups == ()  # claimed once


def test_oldest_first_max_groups_and_ungrouped_singletons(store: TrajectoryStore):
    add_episode(store, "late", group_id="b", at=50.0)
    add_episode(store, "solo", at=20.0, turns=3, reward=2.0)
    add_episode(store, "early", group_id="a", at=10.0)
    claimer = EpisodeClaimer(store, turn_discount=0.5)
    # group_size 2: the one-session groups wait for a second member; the ungrouped
    # session is claimed at once, as a group of its own (its advantage is a baseline's).
    (solo,) = claim(claimer, group_size=2).groups
    assert solo.group_id == "solo" and not solo.grouped
    assert solo.session_ids == ("solo",) and solo.sequences[0].group_id is None
    # Three chained turns: one sequence whose reward is the first turn's return.
    assert solo.session_returns == (0.5,) and solo.sequences[0].reward == 0.5
    assert solo.sequences[0].completion_ids == ("solo-c0", "solo-c1", "solo-c2")
    add_episode(store, "early2", group_id="c", at=5.0)
    add_episode(store, "solo2", at=30.0)
    first = claim(claimer, max_groups=2).groups
    assert [(g.group_id, g.grouped) for g in first] == [("c", True), ("a", True)]
    assert [g.group_id for g in claim(claimer).groups] == ["solo2", "b"]


def test_stale_and_broken_episodes_are_dropped_not_claimed(store: TrajectoryStore):
    add_episode(store, "old", group_id="stale", version=1)
    add_episode(store, "ok", group_id="mixed", at=2.0)
    add_episode(store, "broken", group_id="mixed", at=3.0, parent_of_first="lost-capture")
    store.add_session(SessionRecord(id="empty", group_id="mixed", created_at=4.0))
    store.end_session("empty", END_NO_REWARD)  # unrewarded: would wait reward_wait_s
    add_episode(store, "fine", group_id="strict", at=5.0)
    add_episode(store, "bad", group_id="strict", at=6.0, parent_of_first="nope")
    result = claim(EpisodeClaimer(store), max_staleness=2)
    assert [(g.group_id, g.session_ids) for g in result.groups] == [
        ("mixed", ("ok",)),
        ("strict", ("fine",)),  # group_size=None: the rest of a group still trains
    ]
    reasons = {(d.group_id, d.session_ids): d.reason for d in result.dropped}
    assert reasons == {
        ("stale", ("old",)): "stale: 5 versions > max_train_staleness 2",
        ("mixed", ("broken",)): "missing parent lost-capture of broken-c0",
        ("mixed", ("empty",)): "no completions",
        ("strict", ("bad",)): "missing parent nope of bad-c0",
    }
    for sid in ("old", "broken", "empty", "bad"):
        session = store.get_session(sid)
        assert session.status == "dropped"
    assert store.get_session("fine").status == "claimed"
    # With group_size=2 the rest of a group that lost a member is dropped too.
    add_episode(store, "x1", group_id="pair", at=7.0)
    add_episode(store, "x2", group_id="pair", at=8.0, parent_of_first="gone")
    result = claim(EpisodeClaimer(store), group_size=2)
    assert result.groups == ()
    assert {d.reason for d in result.dropped} == {
        "missing parent gone of x2-c0",
        "group incomplete: 1 of 2 sessions left (a group trains with >= 2)",
    }


def test_a_member_without_completions_is_dropped_alone_the_rest_trains(store):
    """Three rewarded episodes used to be dropped with their empty fourth member."""
    for i, value in enumerate((1.0, 0.0, 1.0)):
        add_episode(store, f"m-{i}", group_id="g4", at=1.0 + i, reward=value)
    store.add_session(SessionRecord(id="m-empty", group_id="g4", created_at=4.0))
    store.end_session("m-empty", "client")
    result = claim(EpisodeClaimer(store, reward_wait_s=0), group_size=4)
    (group,) = result.groups
    assert group.session_ids == ("m-0", "m-1", "m-2")
    assert [(d.session_ids, d.reason) for d in result.dropped] == [(("m-empty",), "no completions")]
    assert store.get_session("m-empty").status == "dropped"
    # The advantages are those of a group of three: centred and scaled over the kept.
    (advantages,) = group_advantages([group.session_returns], "grpo", 1e-6)
    assert sum(advantages) == pytest.approx(0.0, abs=1e-9)
    assert advantages == pytest.approx([2**-0.5, -(2**0.5), 2**-0.5], rel=1e-5)


def test_a_failed_member_settles_at_once_and_is_dropped_alone(store: TrajectoryStore):
    add_episode(store, "f-0", group_id="f", at=1.0, reward=1.0)
    add_episode(store, "f-1", group_id="f", at=2.0, reward=0.0)
    add_episode(store, "f-2", group_id="f", at=3.0, reward=None, end=False)
    store.end_session("f-2", END_FAILED)  # no reward will come: no reward_wait_s wait
    add_episode(store, "p-0", group_id="pair", at=4.0, reward=1.0)
    add_episode(store, "p-1", group_id="pair", at=5.0, reward=None, end=False)
    store.end_session("p-1", END_FAILED)
    result = claim(EpisodeClaimer(store, reward_wait_s=60, partial_group_wait_s=0), group_size=3)
    assert [(g.group_id, g.session_ids) for g in result.groups] == [("f", ("f-0", "f-1"))]
    reasons = {d.session_ids: d.reason for d in result.dropped}
    assert reasons[("f-2",)].startswith("failed:") and reasons[("p-1",)].startswith("failed:")
    assert reasons[("p-0",)] == "group incomplete: 1 of 2 sessions left (a group trains with >= 2)"
    assert store.settling_counts().awaiting_reward == 0


def test_a_partial_group_settles_after_the_window_with_its_real_size(store):
    for i in range(3):
        add_episode(store, f"q-{i}", group_id="q", at=now() - 10 + i, reward=float(i))
    assert claim(EpisodeClaimer(store), group_size=4).groups == ()  # waits for a 4th
    waiting = EpisodeClaimer(store, partial_group_wait_s=3600)
    assert claim(waiting, group_size=4).groups == ()  # ended just now: inside the window
    (group,) = claim(EpisodeClaimer(store, partial_group_wait_s=0), group_size=4).groups
    assert group.session_ids == ("q-0", "q-1", "q-2") and group.grouped
    add_episode(store, "lone", group_id="one", at=9.0)
    result = claim(EpisodeClaimer(store, partial_group_wait_s=0), group_size=4)
    assert [(d.session_ids, d.reason) for d in result.dropped] == [
        (("lone",), "group incomplete: 1 of 1 sessions left (a group trains with >= 2)")
    ]
    assert result.groups == () and store.get_session("lone").status == "dropped"


def test_staleness_boundary_is_exactly_max_staleness(store: TrajectoryStore):
    # Oldest token version 5 at current version 6+k: staleness 1+k.
    add_episode(store, "at-eta", group_id="at-eta", at=1.0, version=4)  # staleness 2
    add_episode(store, "past-eta", group_id="past-eta", at=2.0, version=3)  # staleness 3
    result = claim(EpisodeClaimer(store), max_staleness=2)
    assert [(g.group_id, g.staleness) for g in result.groups] == [("at-eta", 2)]
    assert [(d.group_id, d.staleness) for d in result.dropped] == [("past-eta", 3)]
    assert result.dropped[0].reason == "stale: 3 versions > max_train_staleness 2"
    assert store.get_session("past-eta").status == "dropped"


def test_late_reward_within_the_window_is_trained_with_its_value(store: TrajectoryStore):
    # The trainer's claimer (from the default config) waits for a judge that scores after
    # the end: the group is claimed with the real rewards, not a default 0.
    claimer = EpisodeClaimer.from_config(store, TrainerConfig(group_size=2))
    ended = now() - 1.0
    for sid in ("a", "b"):
        add_episode(store, sid, group_id="g", at=ended - 5, reward=None, end=False)
        store.end_session(sid, "client", at=ended)
    store.add_reward(RewardRecord(id="ra", value=1.0, session_id="a"))
    assert claim(claimer, group_size=2) == ClaimResult(groups=(), dropped=())
    assert claimer.settling_metrics()["groups_awaiting_reward"] == 1.0
    assert store.settling_counts().awaiting_reward == 1
    store.add_reward(RewardRecord(id="rb", value=1.0, completion_id="b-c0"))  # 1 s late
    (group,) = claim(claimer, group_size=2).groups
    assert group.session_returns == (1.0, 1.0)
    assert group_advantages([group.session_returns], "grpo", 1e-6) == [[0.0, 0.0]]
    assert claimer.settling_metrics()["groups_awaiting_reward"] == 0.0


def _claims_clock_ahead(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """The claimer's clock `seconds` ahead of the wall clock: the reward window passes
    without sleeping, so a window wide enough for a loaded machine costs no test time."""
    monkeypatch.setattr(claims_module, "now", lambda: now() + seconds)


def test_unrewarded_group_is_dropped_after_the_window(
    store: TrajectoryStore, monkeypatch: pytest.MonkeyPatch
):
    claimer = EpisodeClaimer(store, reward_wait_s=30)  # drop_group: the default policy
    for sid in ("a", "b"):
        add_episode(store, sid, group_id="g", at=1.0, reward=None, end=False)
    add_episode(store, "ok", group_id="h", at=2.0)  # rewarded: claimed at once
    store.add_reward(RewardRecord(id="ra", value=1.0, session_id="a"))
    store.end_session("a", "client")
    store.end_session("b", "client")
    first = claim(claimer)
    assert [g.group_id for g in first.groups] == ["h"] and first.dropped == ()
    assert store.settling_counts().awaiting_reward == 1  # b
    assert claim(claimer).dropped == ()  # still inside the window
    _claims_clock_ahead(monkeypatch, 31)
    result = claim(claimer)
    assert result.groups == ()
    (dropped,) = result.dropped
    assert dropped.session_ids == ("a", "b")  # the whole group, the rewarded one too
    assert dropped.reason == "unrewarded: 1 of 2 sessions (1 got none within reward_wait_s=30s)"
    assert {store.get_session(s).status for s in ("a", "b")} == {"dropped"}
    assert store.settling_counts() == SettlingCounts(awaiting_reward=0, dropped_unrewarded=2)
    assert claimer.settling_metrics()["sessions_dropped_unrewarded_total"] == 2.0


def test_default_reward_policy_trains_the_unrewarded_with_the_default(
    store: TrajectoryStore, monkeypatch: pytest.MonkeyPatch
):
    config = TrainerConfig(
        group_size=2,
        reward_wait_s=30,
        unrewarded_policy="default_reward",
        reward_default_for_unrewarded=-0.5,
    )
    claimer = EpisodeClaimer.from_config(store, config)
    add_episode(store, "a", group_id="g", at=1.0, end=False)
    add_episode(store, "b", group_id="g", at=1.0, reward=None, end=False)
    store.end_session("a", "client")
    store.end_session("b", "client")
    assert claim(claimer, group_size=2).groups == ()  # still inside the window
    _claims_clock_ahead(monkeypatch, 31)
    (group,) = claim(claimer, group_size=2).groups
    assert group.session_ids == ("a", "b") and group.session_returns == (1.0, -0.5)
    assert claimer.settling_metrics()["sessions_default_reward_total"] == 1.0
    # A group reward posted in time counts for every session of the group.
    add_episode(store, "c", group_id="team", at=4.0, reward=None)
    add_episode(store, "d", group_id="team", at=5.0, reward=None)
    store.add_reward(RewardRecord(id="team-r", value=2.0, group_id="team"))
    assert len(store.load_rewards(["c"], ["team"])) == 1
    (group,) = claim(claimer, group_size=2).groups
    assert group.session_returns == (2.0, 2.0)


@pytest.mark.parametrize("policy", ["drop_group", "default_reward"])
def test_declared_no_reward_settles_at_once(store: TrajectoryStore, policy: str):
    claimer = EpisodeClaimer(store, reward_wait_s=3600.0, unrewarded_policy=policy)
    add_episode(store, "judged", group_id="g", at=1.0, end=False)
    add_episode(store, "skipped", group_id="g", at=2.0, reward=None, end=False)
    store.end_session("judged", "client")
    store.end_session("skipped", END_NO_REWARD)
    assert store.settling_counts().awaiting_reward == 0
    result = claim(claimer)
    if policy == "drop_group":
        assert result.groups == ()
        assert result.dropped[0].reason == "unrewarded: 1 of 2 sessions (1 declared no reward)"
    else:
        (group,) = result.groups
        assert group.session_returns == (1.0, 0.0)


def test_trainer_config_policy_needs_a_default_reward():
    with pytest.raises(ValueError, match="reward_default_for_unrewarded"):
        TrainerConfig(unrewarded_policy="default_reward", reward_default_for_unrewarded=None)
    assert TrainerConfig().unrewarded_return() is None
    assert TrainerConfig(unrewarded_policy="default_reward").unrewarded_return() == 0.0


def test_mark_trained_release_and_stale_claims(store: TrajectoryStore):
    for sid in ("a", "b", "c"):
        add_episode(store, sid, group_id=sid)
    claimer = EpisodeClaimer(store)
    a, b, c = claim(claimer).groups
    assert len({a.claim_id, b.claim_id, c.claim_id}) == 3
    assert claimer.mark_trained(a.claim_id) == 1
    assert claimer.mark_trained(a.claim_id) == 0  # already trained
    session = store.get_session("a")
    assert session.status == "trained"
    assert claimer.release_claim(b.claim_id) == 1
    assert store.get_session("b").status == "ended"
    assert claimer.release_stale_claims(3600.0) == 0  # c was claimed just now
    assert claimer.release_stale_claims(3600.0, at=now() + 7200.0) == 1
    assert claimer.mark_trained(c.claim_id) == 0  # released: the trainer must not count it
    again = claim(claimer).groups
    assert sorted(g.group_id for g in again) == ["b", "c"]
    assert claimer.release_claim("no-such-claim") == 0


def test_end_idle_sessions(store: TrajectoryStore):
    for sid, active in (("idle", 100.0), ("busy", 190.0), ("done", 50.0)):
        store.add_session(SessionRecord(id=sid, created_at=active, last_activity_at=active))
    store.end_session("done", "client", at=60.0)
    assert store.end_idle_sessions(60.0, at=200.0) == ["idle"]
    idle = store.get_session("idle")
    assert (idle.status, idle.end_reason, idle.ended_at) == ("ended", "idle_timeout", 200.0)
    assert store.get_session("done").end_reason == "client"
    assert store.end_idle_sessions(60.0, at=200.0) == []
    assert store.get_session("busy").status == "open"


def test_two_trainers_racing_claim_each_session_exactly_once(store_url: str, store):
    sessions = [f"s{i:03d}" for i in range(120)]
    for i, sid in enumerate(sessions):
        group = None if i % 5 == 0 else f"g{i // 4}"
        add_episode(store, sid, group_id=group, at=float(i % 7))  # many created_at ties
    claimed: dict[str, list[str]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def trainer(name: str) -> None:
        own = TrajectoryStore.open(store_url, StoreConfig(auto_migrate=False))  # own pool
        claimer = EpisodeClaimer(own)
        try:
            start.wait()
            while True:
                result = claimer.claim_groups(
                    group_size=None,
                    max_groups=3,
                    current_version=6,
                    max_staleness=None,
                    claimer=name,
                )
                if not result.groups and not result.dropped:
                    return
                for group in result.groups:
                    claimed.setdefault(name, []).extend(group.session_ids)
        except BaseException as error:  # reported by the main thread
            errors.append(error)
        finally:
            own.close()

    threads = [threading.Thread(target=trainer, args=(f"t{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    everything = [sid for ids in claimed.values() for sid in ids]
    assert sorted(everything) == sessions  # each exactly once, none lost
    assert store.count_sessions(status="claimed") == len(sessions)
    with store.engine.connect() as connection:
        holders = dict(connection.execute(select(SessionRow.id, SessionRow.claimed_by)).all())
    assert holders == {sid: name for name, ids in claimed.items() for sid in ids}


def test_invalid_max_groups(store: TrajectoryStore):
    with pytest.raises(ValueError, match="max_groups"):
        claim(EpisodeClaimer(store), max_groups=0)


def test_trainer_group_size_one_claims_ungrouped_sessions(store):
    from areal_service.config import TrainerConfig
    from trainer.train import claim_group_size

    assert claim_group_size(TrainerConfig(group_size=4)) == 4
    assert claim_group_size(TrainerConfig(group_size=1, advantage="batch")) is None


def test_settling_counts_every_way_a_session_is_rewarded(store: TrajectoryStore):
    """Ended sessions count as awaiting a reward unless one names the session, one of its
    completions or its group, or it ended with no_reward."""
    for sid in ("direct", "via-completion", "via-group", "declined", "waiting", "alone"):
        add_episode(
            store, sid, group_id=None if sid == "alone" else f"g-{sid}", reward=None, end=False
        )
        store.end_session(sid, "no_reward" if sid == "declined" else "client")
    add_episode(store, "open", group_id="g-open", reward=None, end=False)  # not ended
    store.add_reward(RewardRecord(id="r1", value=1.0, session_id="direct"))
    store.add_reward(RewardRecord(id="r2", value=1.0, completion_id="via-completion-c0"))
    store.add_reward(RewardRecord(id="r3", value=1.0, group_id="g-via-group"))
    store.add_reward(RewardRecord(id="r4", value=1.0, group_id="g-open"))
    assert store.settling_counts().awaiting_reward == 2  # waiting, alone
