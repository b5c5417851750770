"""Episodes over REST through the real gateway and engine: sessions, keys, rewards."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from support.harness import ADMIN_KEY, run_gateway

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def _chat(gw, key, content="hi", **extra):
    client = openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0)
    return client.chat.completions.create(
        model="areal-policy", messages=[{"role": "user", "content": content}], max_tokens=6, **extra
    )


def test_group_sessions_completions_rewards(gateway, engine_url):
    http = httpx.Client(base_url=gateway.url, timeout=60)
    started = http.post("/rl/sessions", json={"group_size": 2, "task_id": "t1"}, headers=ADMIN)
    assert started.status_code == 201, started.text
    body = started.json()
    assert len(body["sessions"]) == 2 and body["group_id"].startswith("grp_")
    s1, s2 = body["sessions"]
    assert s1["api_key"] != s2["api_key"]

    first = _chat(gateway, s1["api_key"])
    stored = gateway.state.store.get_completion(first.id)
    assert stored.session_id == s1["session_id"]
    assert stored.backend == engine_url  # which backend generated it

    # A second turn replaying the first: its parent is the first completion.
    client = openai.OpenAI(base_url=gateway.v1, api_key=s1["api_key"], max_retries=0)
    second = client.chat.completions.create(
        model="areal-policy",
        max_tokens=6,
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "more"},
        ],
    )
    child = gateway.state.store.get_completion(second.id)
    if first.choices[0].finish_reason == "stop":  # a cut-off reply cannot be a prefix
        assert child.parent_id == first.id

    key1 = {"authorization": f"Bearer {s1['api_key']}"}
    key2 = {"authorization": f"Bearer {s2['api_key']}"}
    r = http.post(
        "/v1/rewards", json={"id": "r1", "completion_id": first.id, "value": 0.5}, headers=key1
    )
    assert r.status_code == 201, r.text
    again = http.post(
        "/v1/rewards", json={"id": "r1", "completion_id": first.id, "value": 0.5}, headers=key1
    )
    assert again.json()["id"] == "r1"
    assert len(gateway.state.store.list_rewards(completion_id=first.id)) == 1
    conflict = http.post(
        "/v1/rewards", json={"id": "r1", "completion_id": first.id, "value": 0.9}, headers=key1
    )
    assert conflict.status_code == 409
    assert conflict.json()["error"]["code"] == "reward_id_conflict"
    # Another session's key may not score this session.
    forbidden = http.post(
        "/v1/rewards", json={"session_id": s1["session_id"], "value": 1}, headers=key2
    )
    assert forbidden.status_code == 403
    assert (
        http.post(
            "/v1/rewards", json={"completion_id": "chatcmpl-nope", "value": 1}, headers=ADMIN
        ).status_code
        == 404
    )
    nan = http.post(
        "/v1/rewards",
        content=b'{"session_id": "%s", "value": NaN}' % s1["session_id"].encode(),
        headers=key1,
    )
    assert nan.status_code == 400 and nan.json()["error"]["param"] == "value"
    two_targets = http.post(
        "/v1/rewards", json={"session_id": "a", "group_id": "b", "value": 1}, headers=ADMIN
    )
    assert two_targets.status_code == 400

    end = http.post(f"/rl/sessions/{s1['session_id']}/end", headers=key1)
    assert end.status_code == 200 and end.json()["completions"] == 2
    assert http.post(f"/rl/sessions/{s1['session_id']}/end", headers=key1).status_code == 409
    with pytest.raises(openai.ConflictError):
        _chat(gateway, s1["api_key"])
    detail = http.get(f"/rl/sessions/{s1['session_id']}", headers=key1).json()
    assert detail["status"] == "ended" and len(detail["rewards"]) == 1
    assert http.get(f"/rl/sessions/{s1['session_id']}", headers=key2).status_code == 403
    group = http.post("/v1/rewards", json={"group_id": body["group_id"], "value": 1}, headers=ADMIN)
    assert group.status_code == 201


def test_user_key_auto_session_refresh_and_header(gateway):
    http = httpx.Client(base_url=gateway.url, timeout=60)
    key = http.post("/admin/keys", json={"name": "openclaw"}, headers=ADMIN).json()["api_key"]
    a = _chat(gateway, key)
    b = _chat(gateway, key)
    sa = gateway.state.store.get_completion(a.id).session_id
    assert sa is not None and gateway.state.store.get_completion(b.id).session_id == sa

    refreshed = http.post(
        "/rl/sessions", json={"task_id": "next"}, headers={"authorization": f"Bearer {key}"}
    )
    assert refreshed.status_code == 201, refreshed.text
    assert refreshed.json()["previous_session_id"] == sa
    assert gateway.state.store.get_session(sa).end_reason == "refresh"
    c = _chat(gateway, key)
    assert gateway.state.store.get_completion(c.id).session_id == refreshed.json()["session_id"]

    # The admin names a session with a header; an unknown one is a 404.
    opened = http.post("/rl/sessions", json={}, headers=ADMIN).json()
    d = _chat(gateway, ADMIN_KEY, extra_headers={"x-session-id": opened["session_id"]})
    assert gateway.state.store.get_completion(d.id).session_id == opened["session_id"]
    with pytest.raises(openai.NotFoundError):
        _chat(gateway, ADMIN_KEY, extra_headers={"x-session-id": "sess_unknown"})


def test_idle_sessions_time_out(tmp_path, tiny_model_dir, engine_url):
    with run_gateway(
        tmp_path,
        tiny_model_dir,
        [engine_url],
        "gateway.sessions.idle_timeout_s=0.3",
        "gateway.sessions.sweep_interval_s=0.1",
    ) as gw:
        opened = httpx.post(f"{gw.url}/rl/sessions", json={}, headers=ADMIN).json()
        deadline = time.monotonic() + 10
        while gw.state.store.get_session(opened["session_id"]).status == "open":
            assert time.monotonic() < deadline, "idle session was never ended"
            time.sleep(0.1)
        assert gw.state.store.get_session(opened["session_id"]).end_reason == "idle_timeout"
