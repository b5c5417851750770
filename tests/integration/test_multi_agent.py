"""Multi-agent episodes on the real local engine (issue 29, multi-agent): one episode
served by two policies. A solver's session calls its own model name and a reviewer's;
the reviewer's completions land in the episode's role sub-session (policy `reviewer`),
the reward reaches both (the episode's value, or a per-role one), and each policy's
trainer trains on its own role's completions only. Ending, dropping and ownership hold
for the roles as for any session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import select
from support.harness import ADMIN_KEY, run_gateway
from support.trainer_run import train_in_thread

from areal_service.store import TrajectoryStore
from areal_service.store.schema import SessionRow
from areal_service.types import role_session_id
from engine.testing import start_engine_in_thread
from examples.multi_agent.agent import last_number

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
POLICIES = (
    "trainer.lora.rank=8",
    "trainer.lora.alpha=16",
    "policies=[{name: solver, model_names: [solver-model], roles: [reviewer]}, "
    "{name: reviewer, model_names: [reviewer-model]}]",
)
TRAINING = (
    "trainer.group_size=2",
    "trainer.batch_groups=2",
    "trainer.lr=1e-2",
    "trainer.total_steps=1",
    "trainer.reward_wait_s=0",
    "gateway.sessions.staleness_gate=false",
)


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _group(gw: Any) -> list[dict[str, Any]]:
    """A group of 2 solver episodes opened by the admin (one session key each)."""
    started = httpx.post(
        f"{gw.url}/rl/sessions",
        json={"group_size": 2, "policy": "solver"},
        headers=ADMIN,
        timeout=30,
    )
    assert started.status_code == 201, started.text
    return list(started.json()["sessions"])


def _ask(gw: Any, key: str, model: str, text: str) -> str:
    client = openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0)
    reply = client.chat.completions.create(
        model=model, max_tokens=6, messages=[{"role": "user", "content": text}]
    )
    return reply.id


def _play(gw: Any, session: dict[str, Any]) -> tuple[str, str]:
    """One solver turn and one reviewer turn of an episode: their completion ids."""
    key = session["api_key"]
    return _ask(gw, key, "solver-model", "2+3="), _ask(gw, key, "reviewer-model", "2+3=5?")


def _statuses(store: TrajectoryStore) -> dict[str, tuple[str, str, str | None]]:
    """Every session's (policy, status, drop reason)."""
    with store.engine.connect() as connection:
        rows = connection.execute(
            select(SessionRow.id, SessionRow.policy, SessionRow.status, SessionRow.drop_reason)
        )
        return {sid: (policy, status, why) for sid, policy, status, why in rows}


def _reward(gw: Any, key: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/rewards", json=body, headers=_bearer(key), timeout=30)


def test_roles_train_their_own_policies(tmp_path: Path, tiny_model_dir: Path) -> None:
    with (
        start_engine_in_thread(tiny_model_dir) as engine,
        run_gateway(tmp_path, tiny_model_dir, [engine], *POLICIES, *TRAINING) as gw,
    ):
        store = gw.state.store
        # Oldest group first: one episode fails, so each policy drops that group.
        failing = _group(gw)
        for s in failing:
            _play(gw, s)
        end = httpx.post(
            f"{gw.url}/rl/sessions/{failing[0]['session_id']}/end",
            json={"failed": True},
            headers=_bearer(failing[0]["api_key"]),
        )
        assert end.status_code == 200, end.text
        assert (
            store.get_session(role_session_id(failing[0]["session_id"], "reviewer")).end_reason
            == "failed"
        )
        assert (
            _reward(
                gw,
                failing[1]["api_key"],
                session_id=failing[1]["session_id"],
                value=1.0,
                end_session=True,
            ).status_code
            == 201
        )

        expected: dict[str, tuple[float, float]] = {}
        served: dict[str, tuple[str, str]] = {}
        for g in range(2):
            for j, s in enumerate(_group(gw)):
                sid = s["session_id"]
                served[sid] = _play(gw, s)
                solver_value, reviewer_value = float(j), 0.5 + g - j * 0.25
                body: dict[str, Any] = {
                    "session_id": sid,
                    "value": solver_value,
                    "end_session": True,
                }
                if j == 1:  # per-role reward; the other episode's reviewer takes `value`
                    body["role_rewards"] = {"reviewer": reviewer_value}
                else:
                    reviewer_value = solver_value
                posted = _reward(gw, s["api_key"], **body)
                assert posted.status_code == 201, posted.text
                assert posted.json()["roles"] == {"reviewer": reviewer_value}
                expected[sid] = (solver_value, reviewer_value)

        for sid, (solver_id, reviewer_id) in served.items():
            episode, role = (
                store.get_session(sid),
                store.get_session(role_session_id(sid, "reviewer")),
            )
            assert (episode.policy, episode.status, episode.parent_session_id) == (
                "solver",
                "ended",
                None,
            )
            assert (role.policy, role.status, role.end_reason) == ("reviewer", "ended", "reward")
            assert (role.parent_session_id, role.group_id, role.api_key_id) == (
                sid,
                episode.group_id,
                episode.api_key_id,
            )
            assert [c.id for c in store.list_completions(sid)] == [solver_id]
            assert [c.id for c in store.list_completions(role.id)] == [reviewer_id]
            assert store.get_completion(solver_id).model == "solver"
            assert store.get_completion(reviewer_id).model == "reviewer"
            rewards = {r.session_id: r.value for r in store.load_rewards([sid, role.id], [])}
            assert (rewards[sid], rewards[role.id]) == expected[sid]

        # The solver's trainer: only the episodes' own sessions, never a role's.
        solver_cfg = gw.config.model_copy(
            update={"trainer": gw.config.trainer.model_copy(update={"policy": "solver"})}
        )
        train_in_thread(solver_cfg, timeout_s=240)
        statuses = _statuses(store)
        for sid in served:
            assert statuses[sid][:2] == ("solver", "trained")
            assert statuses[role_session_id(sid, "reviewer")][:2] == ("reviewer", "ended")
        failed, rest = (s["session_id"] for s in failing)
        assert statuses[failed][1] == "dropped" and statuses[failed][2].startswith("failed")
        assert statuses[rest][1] == "dropped" and statuses[rest][2].startswith("group incomplete")
        assert statuses[role_session_id(failed, "reviewer")][1] == "ended"
        assert [(t.step, t.version) for t in store.list_train_steps(policy="solver")] == [(1, 1)]
        assert store.list_train_steps(policy="reviewer") == []

        # The reviewer's trainer: the roles only, grouped by the episodes' group ids.
        reviewer_cfg = gw.config.model_copy(
            update={"trainer": gw.config.trainer.model_copy(update={"policy": "reviewer"})}
        )
        train_in_thread(reviewer_cfg, timeout_s=240)
        statuses = _statuses(store)
        for sid in served:
            assert statuses[sid][1] == "trained"
            assert statuses[role_session_id(sid, "reviewer")][1] == "trained"
        assert statuses[role_session_id(failed, "reviewer")][2].startswith("failed")
        assert statuses[role_session_id(rest, "reviewer")][2].startswith("group incomplete")
        assert [(t.step, t.version) for t in store.list_train_steps(policy="reviewer")] == [(1, 1)]
        assert store.list_train_steps() == []  # the default policy trained nothing
        assert (tmp_path / "weights" / "reviewer" / "v1" / "adapter_model.safetensors").exists()


@pytest.fixture(scope="module")
def gw(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, engine_url: str
) -> Iterator[Any]:
    with run_gateway(
        tmp_path_factory.mktemp("multi-agent"),
        tiny_model_dir,
        [engine_url],
        *POLICIES,
        "gateway.sessions.staleness_gate=false",
    ) as gateway:
        yield gateway


def _error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] and error["message"]
    if code is not None:
        assert error["code"] == code, error
    return dict(error)


def test_roles_show_in_the_api_and_stay_their_keys(gw: Any) -> None:
    mine, theirs = _group(gw)
    sid, key = mine["session_id"], mine["api_key"]
    _play(gw, mine)
    _play(gw, mine)  # the role's second turn goes to the same sub-session
    role = role_session_id(sid, "reviewer")
    read = httpx.get(f"{gw.url}/rl/sessions/{sid}", headers=_bearer(key)).json()
    assert [(r["session_id"], r["policy"], r["parent_session_id"]) for r in read["roles"]] == [
        (role, "reviewer", sid)
    ]
    assert len(read["completions"]) == 2
    role_read = httpx.get(f"{gw.url}/rl/sessions/{role}", headers=_bearer(key)).json()
    assert role_read["policy"] == "reviewer" and len(role_read["completions"]) == 2
    listed = httpx.get(f"{gw.url}/rl/sessions", params={"parent_session_id": sid}, headers=ADMIN)
    assert [s["session_id"] for s in listed.json()["data"]] == [role]

    # Another key reads, rewards and ends neither the episode nor its role.
    other = theirs["api_key"]
    for target in (sid, role):
        _error(httpx.get(f"{gw.url}/rl/sessions/{target}", headers=_bearer(other)), 403)
        _error(_reward(gw, other, session_id=target, value=1.0), 403)
        _error(httpx.post(f"{gw.url}/rl/sessions/{target}/end", headers=_bearer(other)), 403)
    _error(_reward(gw, other, session_id=sid, value=1.0, role_rewards={"reviewer": 1.0}), 403)
    # ...nor writes into it by naming it (a user key; a session key's own session wins).
    user = httpx.post(f"{gw.url}/admin/keys", json={"policy": "reviewer"}, headers=ADMIN)
    client = openai.OpenAI(base_url=gw.v1, api_key=user.json()["api_key"], max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):
        client.chat.completions.create(
            model="reviewer-model",
            max_tokens=2,
            messages=[{"role": "user", "content": "x"}],
            extra_headers={"x-session-id": role},
        )

    # Bad per-role rewards: clear 400s, and nothing stored.
    _error(
        _reward(gw, key, session_id=sid, value=1.0, role_rewards={"nobody": 1.0}),
        400,
        "unknown_policy",
    )
    _error(
        _reward(gw, key, session_id=sid, value=1.0, role_rewards={"solver": 1.0}),
        400,
        "unknown_role",
    )
    _error(
        _reward(gw, key, session_id=role, value=1.0, role_rewards={"reviewer": 1.0}),
        400,
        "role_session",
    )
    _error(_reward(gw, key, session_id=sid, value=1.0, role_rewards={"reviewer": 1e9}), 400)
    _error(_reward(gw, key, completion_id="x", value=1.0, role_rewards={"reviewer": 1.0}), 400)
    _error(
        httpx.post(f"{gw.url}/rl/sessions/{role}/end", headers=_bearer(key)), 400, "role_session"
    )
    assert gw.state.store.load_rewards([sid, role], []) == []

    # The episode's end ends its role; a role's later turn is refused, not recorded.
    ended = httpx.post(f"{gw.url}/rl/sessions/{sid}/end", headers=_bearer(key))
    assert ended.status_code == 200, ended.text
    assert gw.state.store.get_session(role).status == "ended"
    with pytest.raises(openai.ConflictError):
        _ask(gw, key, "reviewer-model", "late")
    # An ended episode still takes its reward; a retry is a no-op, a changed one a 409.
    body = {"id": "r1", "session_id": sid, "value": 1.0, "role_rewards": {"reviewer": -1.0}}
    first = _reward(gw, key, **body)
    assert first.status_code == 201 and first.json()["roles"] == {"reviewer": -1.0}
    assert _reward(gw, key, **body).json()["roles"] == {"reviewer": -1.0}
    _error(
        _reward(gw, key, **{**body, "role_rewards": {"reviewer": 0.5}}), 409, "reward_id_conflict"
    )
    stored = {r.session_id: r.value for r in gw.state.store.load_rewards([sid, role], [])}
    assert stored == {sid: 1.0, role: -1.0}


def test_a_tenant_key_cannot_train_another_policy(gw: Any) -> None:
    """A user key (a tenant bound to one policy) naming another policy's model name is
    served by its own policy and opens no role (issue 37, N2): its completion stays in its
    own session, trained by its own policy."""
    created = httpx.post(f"{gw.url}/admin/keys", json={"policy": "reviewer"}, headers=ADMIN)
    key = created.json()["api_key"]
    completion = _ask(gw, key, "solver-model", "2+2=")
    record = gw.state.store.get_completion(completion)
    own = gw.state.store.get_session(record.session_id)
    assert record.model == "reviewer"  # served by its own policy, not the alias's...
    assert (own.policy, own.parent_session_id) == ("reviewer", None)  # ...kept in its session
    assert gw.state.store.list_sessions(parent_session_id=own.id) == []


def test_one_policy_episodes_are_unchanged(gw: Any) -> None:
    """An episode that uses only its own policy's names has no role sub-session, and its
    reward reply names no roles."""
    session = _group(gw)[0]
    _ask(gw, session["api_key"], "solver-model", "1+1=")
    _ask(gw, session["api_key"], "my-agent", "1+2=")  # any other name: the key's policy
    posted = _reward(gw, session["api_key"], session_id=session["session_id"], value=1.0)
    assert posted.status_code == 201 and posted.json()["roles"] == {}
    assert gw.state.store.list_sessions(parent_session_id=session["session_id"]) == []


def test_the_example_agent_runs_its_episodes(gw: Any) -> None:
    """`examples/multi_agent/agent.py` on the tiny model: one group of episodes lands as
    solver episodes with reviewer roles, rewarded as the agent scored them; the
    reviewer's prompt carries the solver's proposal, and the evaluation scores it."""
    import asyncio

    from examples.multi_agent.agent import MultiAgent, Question

    async def run() -> tuple[list[Any], dict[str, float]]:
        agent = MultiAgent(gw.url, ADMIN_KEY)
        try:
            outcomes = await agent.group(Question(2, 3), 2)
            held_out = [Question(1, 1), Question(4, 4)]
            proposals = await agent.solver_proposals(held_out, samples=2)
            assert len(proposals) == 4
            return outcomes, await agent.evaluate(held_out, proposals)
        finally:
            await agent.aclose()

    outcomes, scores = asyncio.run(run())
    parts = ("", "_right", "_wrong", "_balanced", "_copied_wrong")
    assert set(scores) == {
        "solver",
        "proposals_right_share",
        *(f"{prefix}{part}" for prefix in ("near_miss", "proposals") for part in parts),
    }
    assert all(0.0 <= v <= 1.0 for v in scores.values())
    store = gw.state.store
    episodes = store.list_sessions(task_id="add-2-3", limit=10)
    own = sorted((s for s in episodes if s.parent_session_id is None), key=lambda s: s.id)
    assert len(own) == 2 and {s.policy for s in own} == {"solver"}
    got = {
        (r.value, rr.value)
        for s in own
        for r in store.load_rewards([s.id], [])
        for rr in store.load_rewards([role_session_id(s.id, "reviewer")], [])
    }
    assert got == {(o.solver, o.reviewer) for o in outcomes}
    for s in own:
        role = store.get_session(role_session_id(s.id, "reviewer"))
        assert (role.status, role.task_id) == ("ended", "add-2-3")
        completions = store.list_completions(role.id)
        assert [c.model for c in completions] == ["reviewer"]
        # The reviewer was shown what the solver proposed in this episode.
        (solver_turn,) = store.list_completions(s.id)
        proposal = last_number(solver_turn.response_json["choices"][0]["message"]["content"])
        shown = f"Someone answered {'nothing' if proposal is None else proposal}."
        assert shown in str(completions[0].request_json["messages"])


def test_review_scores_separate_copying_from_correcting() -> None:
    """The reviewer's evaluation: a reviewer that copies every proposal scores 0.5 on a
    half-wrong set and copies every wrong one; one that computes the sum scores 1."""
    from examples.multi_agent.agent import Proposal, Question, Review, review_scores

    q = Question(3, 4)
    proposals = [Proposal(q, "7"), Proposal(q, "8"), Proposal(q, "nothing")]
    copier = review_scores([Review(p, last_number(p.text)) for p in proposals], "p")
    assert copier["p_balanced"] == 0.5 and copier["p_right"] == 1.0
    assert copier["p_wrong"] == 0.0 and copier["p_copied_wrong"] == 0.5  # "nothing" is no copy
    solver = review_scores([Review(p, 7) for p in proposals], "p")
    assert solver["p"] == solver["p_balanced"] == 1.0 and solver["p_copied_wrong"] == 0.0
