"""Issue 37, N1 / N2 / N6: a request's policy comes from its principal (the serving plan,
`areal_service/serving_plan.py`), not from the model name it sends.

- N1: a `solver` episode's session key naming tenant B's alias (`tenantb-model`) on chat,
  Responses and Anthropic Messages was served by B and opened the role `<episode>~tenantb`
  in B's policy, and `role_rewards: {"tenantb": 1e6}` was accepted. Now: served and
  recorded by `solver`, no role is opened, and that role reward is 400.
- N2: a user key bound to `solver` naming `tenantb-model` was served by B's adapter and
  recorded in its own `solver` session. Now: served by `solver`.
- N6: a runtime policy could take the model name every agent sends. Now 400.

Each attack as the audit sent it, over HTTP on loopback, against the served gateway."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import httpx
from sqlalchemy import select

from areal_service.serving_plan import reserved_model_names
from areal_service.store import TrajectoryStore
from areal_service.store.schema import CompletionRow, SessionRow
from areal_service.types import role_session_id

ADMIN = {"authorization": "Bearer sk-test-admin"}
TENANTS = (
    "default_policy.lora.rank=4",
    "policies=[{name: solver, model_names: [solver-model], roles: [reviewer]}, "
    "{name: reviewer, model_names: [reviewer-model]}, "
    "{name: tenantb, model_names: [tenantb-model]}]",
)
HI = [{"role": "user", "content": "hi"}]


def _post(gw: Any, path: str, headers: dict[str, str], body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gw.url + path, headers=headers, json=body, timeout=60)


def _every_wire(gw: Any, key: str, model: str) -> list[httpx.Response]:
    """One turn naming `model` on chat, Responses and Anthropic Messages."""
    bearer = {"authorization": f"Bearer {key}"}
    return [
        _post(
            gw, "/v1/chat/completions", bearer, {"model": model, "max_tokens": 2, "messages": HI}
        ),
        _post(gw, "/v1/responses", bearer, {"model": model, "max_output_tokens": 2, "input": "hi"}),
        _post(
            gw,
            "/v1/messages",
            {"x-api-key": key, "anthropic-version": "2023-06-01"},
            {"model": model, "max_tokens": 2, "messages": HI},
        ),
    ]


def _served(store: TrajectoryStore) -> list[tuple[str, str | None, str]]:
    """Every completion's (policy served, session, that session's policy)."""
    with store.engine.connect() as connection:
        rows = connection.execute(
            select(CompletionRow.model, CompletionRow.session_id, SessionRow.policy).join(
                SessionRow, SessionRow.id == CompletionRow.session_id
            )
        )
        return [(model, session, policy) for model, session, policy in rows]


def test_n1_an_episodes_key_cannot_open_a_role_in_another_tenants_policy(
    serve: Callable[..., AbstractContextManager[Any]],
) -> None:
    with serve(*TENANTS) as gw:
        started = _post(gw, "/rl/sessions", ADMIN, {"policy": "solver", "group_size": 1})
        assert started.status_code == 201, started.text
        episode = started.json()["sessions"][0]
        replies = _every_wire(gw, episode["api_key"], "tenantb-model")
        assert [r.status_code for r in replies] == [200, 200, 200], [r.text for r in replies]
        store = gw.state.store
        # Served and recorded by the episode's own policy; no role in tenant B's.
        assert store.get_session(role_session_id(episode["session_id"], "tenantb")) is None
        served = _served(store)
        assert len(served) == 3
        assert {(m, s, p) for m, s, p in served} == {("solver", episode["session_id"], "solver")}
        # The role reward for tenant B names no role of the episode: 400, nothing stored.
        reward = _post(
            gw,
            "/v1/rewards",
            {"authorization": f"Bearer {episode['api_key']}"},
            {"session_id": episode["session_id"], "value": 0, "role_rewards": {"tenantb": 1e6}},
        )
        assert reward.status_code == 400, reward.text
        assert reward.json()["error"]["code"] == "unknown_role"
        # A role the solver declares is still opened, in that role's policy.
        role = _every_wire(gw, episode["api_key"], "reviewer-model")[0]
        assert role.status_code == 200, role.text
        reviewer = role_session_id(episode["session_id"], "reviewer")
        assert store.get_session(reviewer) is not None
        assert all(m == p for m, _, p in _served(store))


def test_n2_a_bound_user_key_is_served_by_its_own_policy_whatever_model_it_names(
    serve: Callable[..., AbstractContextManager[Any]],
) -> None:
    with serve(*TENANTS) as gw:
        key = _post(gw, "/admin/keys", ADMIN, {"name": "a", "policy": "solver"})
        assert key.status_code == 201, key.text
        replies = _every_wire(gw, key.json()["api_key"], "tenantb-model")
        assert [r.status_code for r in replies] == [200, 200, 200], [r.text for r in replies]
        assert replies[0].json()["model"] == "tenantb-model"  # the agent keeps its name
        served = _served(gw.state.store)
        assert len(served) == 3 and {(m, p) for m, _, p in served} == {("solver", "solver")}
        # An unbound key is the default policy's, whatever alias it names; the admin may
        # name any policy.
        plain = _post(gw, "/admin/keys", ADMIN, {"name": "plain"}).json()["api_key"]
        default = _every_wire(gw, plain, "tenantb-model")[0]
        assert default.status_code == 200, default.text
        completion = gw.state.store.get_completion(default.json()["id"])
        assert completion is not None and completion.model == gw.config.gateway.model_name
        admin = _post(
            gw,
            "/v1/chat/completions",
            ADMIN,
            {"model": "tenantb-model", "max_tokens": 2, "messages": HI},
        )
        assert admin.status_code == 200, admin.text
        by_admin = gw.state.store.get_completion(admin.json()["id"])
        assert by_admin is not None and by_admin.model == "tenantb"


def test_n6_an_alias_may_not_take_the_name_every_agent_sends(
    serve: Callable[..., AbstractContextManager[Any]],
) -> None:
    with serve(*TENANTS, "gateway.model_names=[m]") as gw:
        # `m` (gateway.model_names), gateway.model_name and the engine's served name:
        # the names every key sends by default.
        reserved = reserved_model_names(gw.config)
        assert {"m", gw.config.gateway.model_name} < reserved
        for name in sorted(reserved):
            taken = _post(gw, "/admin/policies", ADMIN, {"name": "grab", "model_names": [name]})
            assert taken.status_code == 400, taken.text
            error = taken.json()["error"]
            assert error["code"] == "model_name_reserved" and error["param"] == "model_names"
            assert "every key may send it" in error["message"]
        fine = _post(gw, "/admin/policies", ADMIN, {"name": "grab", "model_names": ["grab-model"]})
        assert fine.status_code == 201, fine.text
