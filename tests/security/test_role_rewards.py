"""N10: a multi-agent episode's reward refused with a 409 for one of its roles leaves
nothing committed (the episode's reward, its other roles' and its end go together), so a
corrected retry of the same id succeeds; role rewards are capped like rewards."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import httpx

from areal_service.types import role_session_id

ADMIN = {"authorization": "Bearer sk-test-admin"}
ROLES = (
    "trainer.lora.rank=8",
    "trainer.lora.alpha=16",
    "policies=[{name: solver, model_names: [solver-model], roles: [reviewer]}, "
    "{name: reviewer, model_names: [reviewer-model]}]",
    "gateway.sessions.staleness_gate=false",
)


def _episode(http: httpx.Client) -> tuple[str, dict[str, str]]:
    """A solver episode that has called the reviewer once: its id and its key's header."""
    started = http.post("/rl/sessions", headers=ADMIN, json={"group_size": 1, "policy": "solver"})
    assert started.status_code == 201, started.text
    session = started.json()["sessions"][0]
    key = {"authorization": f"Bearer {session['api_key']}"}
    for model in ("solver-model", "reviewer-model"):
        turn = http.post(
            "/v1/chat/completions",
            headers=key,
            json={
                "model": model,
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "1+1"}],
            },
        )
        assert turn.status_code == 200, turn.text
    return session["session_id"], key


def test_a_refused_role_reward_commits_nothing(
    serve: Callable[..., AbstractContextManager[Any]],
) -> None:
    with serve(*ROLES) as gw, httpx.Client(base_url=gw.url, timeout=60) as http:
        sid, key = _episode(http)
        role = role_session_id(sid, "reviewer")
        store = gw.state.store
        # The key scores its role directly first, then the episode under the same name.
        direct = http.post("/v1/rewards", headers=key, json={"session_id": role, "value": 0.5})
        assert direct.status_code == 201, direct.text
        body = {
            "id": "ep-1",
            "session_id": sid,
            "value": 1.0,
            "role_rewards": {"reviewer": 0.0},
            "end_session": True,
        }
        for _ in range(2):  # the same retry: the same answer, still nothing committed
            refused = http.post("/v1/rewards", headers=key, json=body)
            assert refused.status_code == 409, refused.text
            assert refused.json()["error"]["code"] == "reward_exists"
            assert [r.session_id for r in store.load_rewards([sid, role], [])] == [role]
            assert store.get_session(sid).status == "open"
        # Corrected (the role's score adds up), the same id goes through whole.
        fixed = http.post("/v1/rewards", headers=key, json={**body, "additive": True})
        assert fixed.status_code == 201, fixed.text
        assert fixed.json()["roles"] == {"reviewer": 0.0}
        stored = sorted((r.id, r.session_id, r.value) for r in store.load_rewards([sid, role], []))
        assert stored == sorted(
            [("ep-1", sid, 1.0), ("ep-1~reviewer", role, 0.0), (direct.json()["id"], role, 0.5)]
        )
        assert store.get_session(sid).status == "ended"
        # A retry is a no-op; the same id with another role value is a 409 that adds nothing.
        again = http.post("/v1/rewards", headers=key, json={**body, "additive": True})
        assert again.status_code == 201 and again.json()["roles"] == {"reviewer": 0.0}
        changed = {**body, "additive": True, "role_rewards": {"reviewer": 0.25}}
        conflict = http.post("/v1/rewards", headers=key, json=changed)
        assert conflict.status_code == 409 and conflict.json()["error"]["code"] == (
            "reward_id_conflict"
        )
        assert len(store.load_rewards([sid, role], [])) == 3


def test_role_rewards_are_capped_like_rewards(
    serve: Callable[..., AbstractContextManager[Any]],
) -> None:
    with serve(*ROLES, "gateway.limits.reward_max_abs=10") as gw:
        with httpx.Client(base_url=gw.url, timeout=60) as http:
            sid, key = _episode(http)
            for value in (1_000_000.0, 11.0, -11.0):
                capped = http.post(
                    "/v1/rewards",
                    headers=key,
                    json={"session_id": sid, "value": 1.0, "role_rewards": {"reviewer": value}},
                )
                assert capped.status_code == 400, capped.text
                error = capped.json()["error"]
                assert error["param"] == "role_rewards.reviewer", error
            # NaN is not JSON; a string "Infinity" is not a float the cap lets through.
            inf = http.post(
                "/v1/rewards",
                headers=key,
                content=b'{"session_id": "%s", "value": 1, "role_rewards": {"reviewer": 1e999}}'
                % sid.encode(),
            )
            assert inf.status_code == 400, inf.text
            assert gw.state.store.load_rewards([sid, role_session_id(sid, "reviewer")], []) == []
