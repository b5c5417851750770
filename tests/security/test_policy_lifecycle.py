"""Issue 37, N6's other half and "roles are declared": runtime policies get roles from the
admin (API, console, CLI), and a runtime policy can be deleted.

- Roles: `POST /admin/policies {"roles": [...]}` and `PATCH /admin/policies/{name}` set
  the policies a runtime policy's episodes may open; a role that is not a named policy,
  the policy itself, `default` or listed twice is 400 `invalid_roles` (the config's
  checks); a config-declared policy's roles are the config's (409). An episode opens a
  declared role by its alias; once the role is removed the same turn stays in the
  episode's policy and a reward for that role is 400.
- Delete: `DELETE /admin/policies/{name}` refuses `default`, config policies and a
  policy that is another's role (409, saying why) and an unknown name (404); a deleted
  policy's untrained sessions are dropped with `policy_deleted: ...` (shown on the
  session and in the audit), what they recorded stays for export, keys bound to it get
  403 `policy_deleted` (in each wire's error shape, never a 500), and the other policies
  keep serving and recording.

Over HTTP on loopback, on SQLite and PostgreSQL; the console's forms (CSRF-checked) and
the CLI (on the gateway's own store) do the same."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from support.security_harness import STORES

from areal_service.types import role_session_id

ADMIN_KEY = "sk-test-admin"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module", params=STORES)
def gw(request: pytest.FixtureRequest, serve_on: Callable[..., Any]) -> Iterator[Any]:
    with serve_on(
        request.param,
        "default_policy.lora.rank=4",
        "gateway.sessions.staleness_gate=false",
        "policies=[{name: solver, model_names: [solver-model]}]",
    ) as gateway:
        yield gateway


def _call(gw: Any, method: str, path: str, body: Any = None) -> httpx.Response:
    return httpx.request(method, gw.url + path, headers=ADMIN, json=body, timeout=60)


def _create(gw: Any, name: str, **fields: Any) -> dict[str, Any]:
    made = _call(gw, "POST", "/admin/policies", {"name": name, **fields})
    assert made.status_code == 201, made.text
    return dict(made.json())


def _episode(gw: Any, policy: str) -> tuple[str, dict[str, str]]:
    """An episode of `policy` started by the admin: its id and its session key's header."""
    started = _call(gw, "POST", "/rl/sessions", {"group_size": 1, "policy": policy})
    assert started.status_code == 201, started.text
    session = started.json()["sessions"][0]
    return session["session_id"], {"authorization": f"Bearer {session['api_key']}"}


def _chat(gw: Any, headers: dict[str, str], model: str) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions",
        headers=headers,
        json={"model": model, "max_tokens": 2, "messages": HI},
        timeout=60,
    )


def _error(reply: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    error = dict(reply.json()["error"])
    assert error["code"] == code, error
    return error


def test_roles_of_a_runtime_policy_are_declared_and_checked(gw: Any) -> None:
    _create(gw, "critic", model_names=["critic-model"])
    made = _create(gw, "writer", model_names=["writer-model"], roles=["critic"])
    assert made["roles"] == ["critic"] and made["source"] == "runtime"
    for roles, words in [
        (["nobody"], "'nobody' is not a named policy"),
        (["critic", "critic"], "listed twice"),
        (["default"], "'default' is not a named policy"),
        (["Bad!"], "not a policy name"),
    ]:
        refused = _call(gw, "POST", "/admin/policies", {"name": "other", "roles": roles})
        error = _error(refused, 400, "invalid_roles")
        assert error["param"] == "roles" and words in error["message"], error
        patched = _call(gw, "PATCH", "/admin/policies/writer", {"roles": roles})
        assert words in _error(patched, 400, "invalid_roles")["message"]
    itself = _call(gw, "PATCH", "/admin/policies/writer", {"roles": ["writer"]})
    assert "the policy itself" in _error(itself, 400, "invalid_roles")["message"]
    config = _call(gw, "PATCH", "/admin/policies/solver", {"roles": ["critic"]})
    assert "declared in the config" in _error(config, 409, "config_policy")["message"]
    _error(_call(gw, "PATCH", "/admin/policies/default", {"roles": []}), 409, "config_policy")
    _error(_call(gw, "PATCH", "/admin/policies/nobody", {"roles": []}), 404, "policy_not_found")
    listed = {p["name"]: p for p in _call(gw, "GET", "/admin/policies").json()["data"]}
    assert listed["writer"]["roles"] == ["critic"] and listed["critic"]["roles"] == []

    # The declared role opens a role sub-session, and takes a role reward.
    sid, key = _episode(gw, "writer")
    for model in ("writer-model", "critic-model"):
        assert _chat(gw, key, model).status_code == 200
    role = role_session_id(sid, "critic")
    assert gw.state.store.get_session(role).policy == "critic"
    rewarded = httpx.post(
        gw.url + "/v1/rewards",
        headers=key,
        json={"session_id": sid, "value": 1.0, "role_rewards": {"critic": 0.5}},
        timeout=60,
    )
    assert rewarded.status_code == 201 and rewarded.json()["roles"] == {"critic": 0.5}

    # Roles removed: the same turn stays in the episode's policy; the role reward is 400.
    cleared = _call(gw, "PATCH", "/admin/policies/writer", {"roles": []})
    assert cleared.status_code == 200 and cleared.json()["roles"] == []
    sid, key = _episode(gw, "writer")
    assert _chat(gw, key, "critic-model").status_code == 200
    assert gw.state.store.get_session(role_session_id(sid, "critic")) is None
    refused = httpx.post(
        gw.url + "/v1/rewards",
        headers=key,
        json={"session_id": sid, "value": 1.0, "role_rewards": {"critic": 0.5}},
        timeout=60,
    )
    _error(refused, 400, "unknown_role")
    assert _call(gw, "PATCH", "/admin/policies/writer", {"roles": ["critic"]}).status_code == 200


def test_deleting_a_policy_drops_its_sessions_and_refuses_its_keys(gw: Any) -> None:
    _create(gw, "tenantc", model_names=["tenantc-model"])
    _create(gw, "boss", roles=["tenantc"])
    # Refused, each saying why.
    for name, status, code, words in [
        ("default", 409, "config_policy", "the default policy"),
        ("solver", 409, "config_policy", "declared in the config"),
        ("nobody", 404, "policy_not_found", "no policy 'nobody'"),
        ("tenantc", 409, "policy_in_use", "is a role of 'boss'"),
    ]:
        refused = _call(gw, "DELETE", f"/admin/policies/{name}")
        assert words in _error(refused, status, code)["message"]
    assert _call(gw, "PATCH", "/admin/policies/boss", {"roles": []}).status_code == 200

    # Tenant C: a user key, an open episode and an ended (rewarded) one; solver beside.
    user = _call(gw, "POST", "/admin/keys", {"name": "c", "policy": "tenantc"}).json()
    user_key = {"authorization": f"Bearer {user['api_key']}"}
    assert _chat(gw, user_key, "m").status_code == 200
    open_sid, open_key = _episode(gw, "tenantc")
    ended_sid, ended_key = _episode(gw, "tenantc")
    for key in (open_key, ended_key):
        assert _chat(gw, key, "tenantc-model").status_code == 200
    ended = httpx.post(
        gw.url + "/v1/rewards",
        headers=ended_key,
        json={"session_id": ended_sid, "value": 1.0, "end_session": True},
        timeout=60,
    )
    assert ended.status_code == 201, ended.text
    solver_sid, solver_key = _episode(gw, "solver")

    deleted = _call(gw, "DELETE", "/admin/policies/tenantc")
    assert deleted.status_code == 200, deleted.text
    # The two episodes and the session the user key's chat opened.
    assert deleted.json() == {"name": "tenantc", "deleted": True, "sessions_dropped": 3}
    names = [p["name"] for p in _call(gw, "GET", "/admin/policies").json()["data"]]
    assert "tenantc" not in names
    _error(_call(gw, "DELETE", "/admin/policies/tenantc"), 404, "policy_not_found")

    # Its sessions: dropped with the reason, visible where drop reasons are.
    for sid in (open_sid, ended_sid):
        shown = _call(gw, "GET", f"/rl/sessions/{sid}").json()
        assert shown["status"] == "dropped", shown
        assert shown["drop_reason"].startswith("policy_deleted: policy 'tenantc'"), shown
    audit = _call(gw, "GET", "/admin/episodes/audit").json()
    assert audit["dropped_by_reason"]["policy_deleted"] == 3, audit
    assert audit["unaccounted"] == 0
    # What they recorded stays for export.
    exported = httpx.get(gw.url + "/admin/export?dropped=true", headers=ADMIN, timeout=60)
    rows = [json.loads(line) for line in exported.text.splitlines() if line]
    assert {open_sid, ended_sid} <= {r["session_id"] for r in rows}
    plain = httpx.get(gw.url + "/admin/export", headers=ADMIN, timeout=60).text
    assert open_sid not in plain and ended_sid not in plain

    # Its keys: 403 `policy_deleted` on every wire, never a 500; the connection lives.
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        for headers in (user_key, open_key):
            chat = http.post(
                "/v1/chat/completions",
                headers=headers,
                json={"model": "m", "max_tokens": 2, "messages": HI},
            )
            assert "was deleted" in _error(chat, 403, "policy_deleted")["message"]
            reward = http.post("/v1/rewards", headers=headers, json={"value": 1.0})
            _error(reward, 403, "policy_deleted")
        messages = http.post(
            "/v1/messages",
            headers={"x-api-key": user["api_key"], "anthropic-version": "2023-06-01"},
            json={"model": "m", "max_tokens": 2, "messages": HI},
        )
        assert messages.status_code == 403 and messages.json()["type"] == "error"
        assert http.get("/health/liveness").status_code == 200

    # The other policies: unaffected.
    assert _chat(gw, solver_key, "m").status_code == 200
    solver = gw.state.store.get_session(solver_sid)
    assert solver.status == "open" and solver.policy == "solver"


def _console(gw: Any) -> tuple[httpx.Client, str]:
    """An httpx client signed in to the console, and a CSRF token of its session."""
    http = httpx.Client(base_url=gw.url, timeout=60)  # closed by the caller
    page = http.get("/console/login")
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)  # type: ignore[union-attr]
    signed = http.post("/console/login", data={"csrf_token": csrf, "admin_key": ADMIN_KEY})
    assert signed.status_code in (302, 303)
    form = http.get("/console/policies/new")
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', form.text).group(1)  # type: ignore[union-attr]
    return http, csrf


def test_the_console_sets_roles_and_deletes(gw: Any) -> None:
    http, csrf = _console(gw)
    try:
        made = http.post(
            "/console/policies/new",
            data={"csrf_token": csrf, "name": "judge", "roles": "solver"},
        )
        assert made.status_code == 303, made.text
        page = http.get("/console/policies/judge")
        assert 'action="/console/policies/judge/roles"' in page.text
        assert 'action="/console/policies/judge/delete"' in page.text
        assert "/console/policies/solver/delete" not in http.get("/console/policies/solver").text
        # CSRF-checked like the other forms.
        assert http.post("/console/policies/judge/roles", data={"roles": ""}).status_code == 403
        assert http.post("/console/policies/judge/delete", data={}).status_code == 403
        bad = http.post("/console/policies/judge/roles", data={"csrf_token": csrf, "roles": "x"})
        assert bad.status_code == 400 and "is not a named policy" in bad.text
        saved = http.post(
            "/console/policies/judge/roles", data={"csrf_token": csrf, "roles": "solver, critic"}
        )
        assert saved.status_code == 303
        assert gw.state.policy_registry.plan["judge"].roles == ("solver", "critic")
        config = http.post("/console/policies/solver/delete", data={"csrf_token": csrf})
        assert config.status_code == 409 and "declared in the config" in config.text
        gone = http.post("/console/policies/judge/delete", data={"csrf_token": csrf})
        assert gone.status_code == 303 and "deleted=judge" in gone.headers["location"]
        assert "judge" in http.get(gone.headers["location"]).text
        assert "judge" not in gw.state.policy_registry
    finally:
        http.close()


def test_the_cli_sets_roles_and_deletes(gw: Any) -> None:
    from typer.testing import CliRunner

    from launcher.cli import app

    _create(gw, "cli-a", model_names=["cli-a-model"])
    sets = ["--set", f"data_dir={gw.state.config.data_dir}"]
    sets += ["--set", f"store.url={gw.state.config.database_url()}"]
    sets += ["--set", "default_policy.lora.rank=4"]
    sets += ["--set", "policies=[{name: solver, model_names: [solver-model]}]"]
    runner = CliRunner()
    made = runner.invoke(app, ["policies", "create", "cli-b", "--role", "cli-a", *sets])
    assert made.exit_code == 0, made.output
    assert json.loads(made.stdout)["roles"] == ["cli-a"]
    refused = runner.invoke(app, ["policies", "roles", "cli-b", "--role", "nobody", *sets])
    assert refused.exit_code == 2 and "'nobody' is not a named policy" in refused.output
    in_use = runner.invoke(app, ["policies", "delete", "cli-a", *sets])
    assert in_use.exit_code == 2 and "is a role of 'cli-b'" in in_use.output
    config = runner.invoke(app, ["policies", "delete", "solver", *sets])
    assert config.exit_code == 2 and "declared in the config" in config.output
    cleared = runner.invoke(app, ["policies", "roles", "cli-b", *sets])
    assert cleared.exit_code == 0 and json.loads(cleared.stdout)["roles"] == []
    gone = runner.invoke(app, ["policies", "delete", "cli-a", *sets])
    assert gone.exit_code == 0, gone.output
    assert json.loads(gone.stdout) == {"name": "cli-a", "deleted": True, "sessions_dropped": 0}
    listed = {r["name"] for r in json.loads(runner.invoke(app, ["policies", "list", *sets]).stdout)}
    assert "cli-a" not in listed and "cli-b" in listed
    # The running gateway sees it within its refresh.
    names = [p["name"] for p in _call(gw, "GET", "/admin/policies").json()["data"]]
    assert "cli-a" not in names and "cli-b" in names
