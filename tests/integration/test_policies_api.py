"""Named policies through the REST API (issue 29, second slice): keys are bound to a
policy at creation, a key's sessions take its policy (the admin may name one), unknown
policies are refused with a 400 in the OpenAI error shape, and `GET /admin/policies`
lists each policy with its latest version. Ownership rules are unchanged by policies:
one key cannot read, reward or end another key's session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from areal_service.types import WeightVersionRecord

ADMIN = {"Authorization": "Bearer sk-test-admin"}
POLICIES = (
    "trainer.lora.rank=4",
    "policies=[{name: solver, model_names: [solver-model]}, {name: verifier}]",
)


@pytest.fixture(scope="module")
def gw(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, engine_url: str
) -> Iterator[Any]:
    from support.harness import run_gateway

    with run_gateway(
        tmp_path_factory.mktemp("policies"), tiny_model_dir, [engine_url], *POLICIES
    ) as gateway:
        yield gateway


def _post(gw: Any, path: str, body: dict[str, Any], key: str | None = None) -> httpx.Response:
    headers = ADMIN if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(gw.url + path, json=body, headers=headers, timeout=30)


def _key(gw: Any, **body: Any) -> dict[str, Any]:
    created = _post(gw, "/admin/keys", body)
    assert created.status_code == 201, created.text
    return created.json()


def test_keys_bind_policies_and_their_sessions_take_them(gw: Any) -> None:
    solver, plain = _key(gw, name="a", policy="solver"), _key(gw, name="b")
    assert solver["policy"] == "solver" and plain["policy"] == "default"
    listed = {
        k["id"]: k["policy"]
        for k in httpx.get(gw.url + "/admin/keys", headers=ADMIN).json()["data"]
    }
    assert listed[solver["id"]] == "solver"
    # A user key opens (refreshes) its session: the key's policy.
    started = _post(gw, "/rl/sessions", {}, key=solver["api_key"])
    assert started.status_code == 201, started.text
    assert started.json()["policy"] == "solver"
    assert gw.state.store.get_session(started.json()["session_id"]).policy == "solver"
    # ...and may not pick another one; the admin may, for the sessions it opens.
    other = _post(gw, "/rl/sessions", {"policy": "verifier"}, key=solver["api_key"])
    assert other.status_code == 403 and other.json()["error"]["code"] == "policy_forbidden"
    group = _post(gw, "/rl/sessions", {"policy": "verifier", "group_size": 2})
    assert group.status_code == 201, group.text
    for s in group.json()["sessions"]:
        assert s["policy"] == "verifier"
        assert gw.state.store.get_session(s["session_id"]).policy == "verifier"
    default = _post(gw, "/rl/sessions", {})
    assert default.json()["sessions"][0]["policy"] == "default"
    # The admin refreshing a key keeps the key's binding.
    mismatch = _post(gw, "/rl/sessions", {"api_key": plain["api_key"], "policy": "solver"})
    assert mismatch.status_code == 400 and mismatch.json()["error"]["code"] == "policy_mismatch"


@pytest.mark.parametrize("path", ["/admin/keys", "/rl/sessions"])
def test_unknown_policy_is_a_400_in_the_openai_shape(gw: Any, path: str) -> None:
    refused = _post(gw, path, {"policy": "nobody"})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "unknown_policy" and error["param"] == "policy"
    assert error["type"] == "invalid_request_error" and "solver" in error["message"]


def test_policies_list_their_latest_version(gw: Any) -> None:
    store = gw.state.store
    store.add_weight_version(WeightVersionRecord(version=1, path="/w/solver/v1", policy="solver"))
    store.add_weight_version(WeightVersionRecord(version=2, path="/w/solver/v2", policy="solver"))
    # Versions count per policy: the default policy's v1 is another row.
    store.add_weight_version(WeightVersionRecord(version=1, path="/w/v1"))
    listed = httpx.get(gw.url + "/admin/policies", headers=ADMIN)
    assert listed.status_code == 200, listed.text
    views = {p["name"]: p for p in listed.json()["data"]}
    assert list(views) == ["default", "solver", "verifier"]
    assert views["solver"]["latest_version"] == 2
    assert views["solver"]["model_names"] == ["solver-model"]
    assert views["default"]["latest_version"] == 1 and views["verifier"]["latest_version"] is None
    assert views["verifier"]["lora_rank"] == 4
    assert store.latest_weight_version().path == "/w/v1"
    assert store.latest_weight_version("solver").path == "/w/solver/v2"
    user = _key(gw, policy="solver")
    assert httpx.get(
        gw.url + "/admin/policies",
        timeout=30,
        headers={"Authorization": f"Bearer {user['api_key']}"},
    ).status_code in (401, 403)


def test_tenants_on_two_policies_cannot_touch_each_other(gw: Any) -> None:
    a, b = _key(gw, policy="solver"), _key(gw, policy="verifier")
    sa = _post(gw, "/rl/sessions", {}, key=a["api_key"]).json()["session_id"]
    sb = _post(gw, "/rl/sessions", {}, key=b["api_key"]).json()["session_id"]
    read = httpx.get(
        f"{gw.url}/rl/sessions/{sb}",
        timeout=30,
        headers={"Authorization": f"Bearer {a['api_key']}"},
    )
    assert read.status_code == 403
    reward = _post(gw, "/v1/rewards", {"session_id": sb, "value": 1.0}, key=a["api_key"])
    assert reward.status_code == 403
    end = _post(gw, f"/rl/sessions/{sb}/end", {}, key=a["api_key"])
    assert end.status_code == 403
    assert gw.state.store.get_session(sb).status == "open"
    own = _post(gw, f"/rl/sessions/{sa}/end", {}, key=a["api_key"])
    assert own.status_code == 200 and own.json()["policy"] == "solver"


def test_every_wire_protocol_serves_and_records_the_keys_policy(gw: Any) -> None:
    """Chat Completions, Anthropic Messages and Responses share one pipeline: a key bound
    to a policy is served by that policy on each of them (any model name), and so is a
    policy's model-name alias used by the admin."""
    import anthropic
    import openai

    key = _key(gw, policy="solver")["api_key"]
    session = _post(gw, "/rl/sessions", {}, key=key).json()["session_id"]
    headers = {"x-session-id": session}
    chat = openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0, default_headers=headers)
    ids = [chat.chat.completions.create(model="gpt-x", max_tokens=4, messages=[_HI]).id]
    ids.append(chat.responses.create(model="codex-x", input="hi", max_output_tokens=4).id)
    claude = anthropic.Anthropic(
        base_url=gw.url, api_key=key, max_retries=0, default_headers=headers
    )
    ids.append(claude.messages.create(model="claude-x", max_tokens=4, messages=[_HI]).id)
    store = gw.state.store
    recorded = store.list_completions(session)
    assert len(recorded) == 3, (ids, recorded)
    assert {c.model for c in recorded} == {"solver"}
    assert {c.requested_model for c in recorded} == {"gpt-x", "codex-x", "claude-x"}


_HI = {"role": "user", "content": "hi"}
