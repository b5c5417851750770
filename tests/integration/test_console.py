"""The admin console through a real gateway (uvicorn on loopback, real engine, SQLite):
sign-in and its cookie, refusal of every other credential on every route, CSRF, keys,
and a session recorded through the gateway shown token by token with its reward."""

from __future__ import annotations

import dataclasses
import re
import time

import httpx
import openai
import pytest
from fastapi.routing import APIRoute
from support.harness import ADMIN_KEY

from areal_service.types import (
    SessionRecord,
    TrainStepRecord,
    WeightVersionRecord,
)
from gateway.console import auth, router

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
PUBLIC = {
    ("GET", "/console/login"),
    ("POST", "/console/login"),
    ("GET", "/console/static/{path:path}"),
}


def _csrf(html: str) -> str:
    return re.search(r'name="csrf_token" value="([^"]+)"', html).group(1)


def _login(gw, key: str = ADMIN_KEY) -> tuple[httpx.Client, httpx.Response]:
    http = httpx.Client(base_url=gw.url, timeout=60)
    page = http.get("/console/login")
    assert page.status_code == 200
    done = http.post(
        "/console/login",
        data={"csrf_token": _csrf(page.text), "admin_key": key, "next": "/console/keys"},
    )
    return http, done


def _admin_client(gw) -> httpx.Client:
    http, done = _login(gw)
    assert done.status_code == 303 and done.headers["location"] == "/console/keys", done.text
    return http


def _route_calls(session_id: str, key_id: str) -> list[tuple[str, str]]:
    """(method, url) of every console route but the public ones, path params filled."""
    calls = []
    for route in router.routes:
        assert isinstance(route, APIRoute)
        for method in route.methods:
            if (method, route.path) in PUBLIC:
                continue
            url = (
                route.path.replace("{session_id}", session_id)
                .replace("{key_id}", key_id)
                .replace("{name}", "default")  # a policy: the default one always exists
            )
            assert "{" not in url, url
            calls.append((method, url))
    return calls


def _start_session(gw, http: httpx.Client, **body) -> dict:
    started = http.post("/rl/sessions", json=body, headers=ADMIN)
    assert started.status_code == 201, started.text
    return started.json()


def test_login_sets_signed_httponly_strict_cookie(gateway):
    http, done = _login(gateway)
    assert done.status_code == 303 and done.headers["location"] == "/console/keys"
    cookie = done.headers["set-cookie"]
    assert cookie.startswith(f"{auth.COOKIE_NAME}=admin.")
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/console" in cookie
    page = http.get("/console")
    assert page.status_code == 200 and "Live weight version" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-frame-options"] == "DENY"
    assert "Sign out" in page.text
    # Sign out (with the token), then the cookie no longer opens anything.
    out = http.post("/console/logout", data={"csrf_token": _csrf(page.text)})
    assert out.status_code == 303 and out.headers["location"] == "/console/login"
    assert http.get("/console").status_code == 303


def test_only_the_admin_key_signs_in_and_no_route_opens_without_it(gateway):
    http = httpx.Client(base_url=gateway.url, timeout=60)
    started = _start_session(gateway, http, task_id="t")
    virtual = http.post("/admin/keys", json={"name": "v"}, headers=ADMIN).json()
    calls = _route_calls(started["session_id"], virtual["id"])
    assert len(calls) >= 12  # every page, partial, JSON endpoint and form post
    assert {m for m, _ in calls} == {"GET", "POST"}

    for key in (started["api_key"], virtual["api_key"], "sk-areal-wrong"):
        client, done = _login(gateway, key)
        assert done.status_code == 401 and "not the admin key" in done.text
        assert "admin." not in done.headers.get("set-cookie", "")

    forged = f"{auth.COOKIE_NAME}=admin.{int(time.time())}.abc.{'0' * 64}"
    credentials = [
        {},  # no cookie at all
        {"authorization": f"Bearer {started['api_key']}"},  # session key
        {"authorization": f"Bearer {virtual['api_key']}"},  # virtual key
        ADMIN,  # even the admin key as a bearer token: the console takes only its cookie
        {"cookie": forged},
    ]
    for headers in credentials:
        for method, url in calls:
            r = http.request(method, url, headers=headers, follow_redirects=False)
            assert r.status_code == 303, (method, url, headers, r.status_code)
            assert r.headers["location"].startswith("/console/login?next=")
    # A pre-login (anon) cookie opens nothing either.
    anon = httpx.Client(base_url=gateway.url, timeout=60)
    anon.get("/console/login")
    for method, url in calls:
        assert anon.request(method, url).status_code == 303, url
    # Nothing was revoked by all those posts.
    assert gateway.state.store.keys.get_api_key(virtual["id"]).revoked_at is None
    # The signed-in admin opens every page, partial and download.
    admin = _admin_client(gateway)
    for method, url in calls:
        if method == "GET":
            assert admin.get(url).status_code == 200, url


def test_forms_without_the_csrf_token_are_refused(gateway):
    admin = _admin_client(gateway)
    http = httpx.Client(base_url=gateway.url, timeout=60)
    virtual = http.post("/admin/keys", json={"name": "keep"}, headers=ADMIN).json()
    token = _csrf(admin.get("/console/keys").text)
    other = _csrf(_admin_client(gateway).get("/console/keys").text)  # another sign-in's token
    assert other != token
    for data in ({}, {"csrf_token": ""}, {"csrf_token": "x" * 64}, {"csrf_token": other}):
        assert admin.post("/console/keys", data={**data, "name": "n"}).status_code == 403
        revoke = admin.post(f"/console/keys/{virtual['id']}/revoke", data=data)
        assert revoke.status_code == 403
        assert admin.post("/console/logout", data=data).status_code == 403
    assert gateway.state.store.keys.get_api_key(virtual["id"]).revoked_at is None
    assert [k.name for k in gateway.state.store.keys.list_api_keys()] == ["keep"]
    # The login form needs its pre-login token too.
    bare = httpx.Client(base_url=gateway.url, timeout=60)
    bare.get("/console/login")
    assert bare.post("/console/login", data={"admin_key": ADMIN_KEY}).status_code == 403
    assert admin.get("/console").status_code == 200  # still signed in


def test_keys_create_shows_plaintext_once_and_revoke_takes_effect(gateway):
    admin = _admin_client(gateway)
    token = _csrf(admin.get("/console/keys").text)
    created = admin.post("/console/keys", data={"csrf_token": token, "name": "runner-1"})
    assert created.status_code == 201
    assert created.headers["cache-control"] == "no-store"
    plaintext = re.search(r'id="new-key">(sk-areal-[^<]+)<', created.text).group(1)
    key_id = re.search(r'id <span class="mono">(key_[0-9a-f]+)</span>', created.text).group(1)
    models = httpx.get(f"{gateway.v1}/models", headers={"authorization": f"Bearer {plaintext}"})
    assert models.status_code == 200

    listing = admin.get("/console/keys").text
    assert plaintext not in listing and "runner-1" in listing
    record = gateway.state.store.keys.get_api_key(key_id)
    assert record.key_hash[:12] in listing and record.display in listing

    revoked = admin.post(f"/console/keys/{key_id}/revoke", data={"csrf_token": token})
    assert revoked.status_code == 303
    page = admin.get(revoked.headers["location"])
    assert "revoked" in page.text and f'id="key-{key_id}" class="revoked"' in page.text
    models = httpx.get(f"{gateway.v1}/models", headers={"authorization": f"Bearer {plaintext}"})
    assert models.status_code == 401


def test_session_detail_shows_tokens_reward_and_sequence(gateway):
    http = httpx.Client(base_url=gateway.url, timeout=60)
    started = _start_session(gateway, http, task_id="console-task")
    sid, key = started["session_id"], started["api_key"]
    client = openai.OpenAI(base_url=gateway.v1, api_key=key, max_retries=0)
    reply = client.chat.completions.create(
        model=gateway.config.gateway.model_name,
        max_tokens=6,
        messages=[{"role": "user", "content": "Name a colour, please."}],
    )
    reward = http.post(
        "/v1/rewards",
        json={"session_id": sid, "value": 0.75, "end_session": True},
        headers={"authorization": f"Bearer {key}"},
    )
    assert reward.status_code == 201, reward.text

    admin = _admin_client(gateway)
    page = admin.get(f"/console/sessions/{sid}")
    assert page.status_code == 200
    html = page.text
    stored = gateway.state.store.get_completion(reply.id)
    assert reply.id in html and "Name a colour, please." in html
    assert re.search(r'class="num reward-value">0\.75<', html)
    assert re.search(r'id="session-return">0\.75', html)
    # Every output token is drawn with its id, logprob and version in the hover title.
    for token_id, logprob, version in zip(
        stored.output_ids, stored.output_logprobs, stored.output_versions, strict=True
    ):
        assert f'title="id {token_id} · logprob {logprob:.4f}' in html
        assert f"· version {version}" in html
    # The training sequence: prompt tokens as context, output tokens trained.
    assert "Training sequences" in html
    assert (
        f"{len(stored.prompt_ids) + len(stored.output_ids)} tokens, "
        f"{len(stored.output_ids)} trained" in html
    )
    assert html.count("context (loss mask 0)") == len(stored.prompt_ids)

    listing = admin.get("/console/sessions", params={"task_id": "console-task"}).text
    assert sid in listing and "0.75" in listing
    assert sid not in admin.get("/console/sessions", params={"status": "open"}).text
    exported = admin.get(
        "/console/export/download", params={"format": "jsonl", "task_id": "console-task"}
    )
    assert exported.status_code == 200 and sid in exported.text
    assert admin.get("/console/sessions/sess_nope").status_code == 404


def test_sessions_pages_training_and_weights(gateway, tiny_model_dir):
    store = gateway.state.store
    now = time.time()
    for i in range(55):
        store.add_session(
            SessionRecord(
                id=f"sess_bulk{i:03d}", task_id="bulk", status="ended", created_at=now + i
            )
        )
    for step in range(1, 4):
        store.add_train_step(
            TrainStepRecord(
                step,
                step,
                {
                    "task_reward": 0.1 * step,
                    "loss": -0.5 / step,
                    "time_train_s": 1.5,
                    "mismatch_kl": 0.01 * step,
                    "mismatch_masked_ratio": 0.125,
                },
            )
        )
    # Version 2 points at the served checkpoint: the gateway's syncer really swaps to it
    # and replaces the stand-in swap record with its own timings.
    store.add_weight_version(
        WeightVersionRecord(
            2,
            str(tiny_model_dir),
            metadata={
                "step": 2,
                "swap": {
                    "http://b1": {
                        "pause_s": 0.01,
                        "update_s": 0.2,
                        "continue_s": 0.003,
                        "total_s": 0.213,
                    }
                },
                "swap_s": 0.22,
                "publish_to_live_s": 0.45,
            },
        )
    )
    deadline = time.monotonic() + 30
    while gateway.state.live_version != 2:
        assert time.monotonic() < deadline, "the gateway never swapped to version 2"
        time.sleep(0.05)
    admin = _admin_client(gateway)

    first = admin.get("/console/sessions", params={"task_id": "bulk"}).text
    second = admin.get("/console/sessions", params={"task_id": "bulk", "page": 2}).text
    assert "55 matching" in first and "page 1 of 2" in first
    assert first.count('href="/console/sessions/sess_bulk') == 50
    assert second.count('href="/console/sessions/sess_bulk') == 5
    assert "sess_bulk054" in first and "sess_bulk000" in second  # newest first
    today = time.strftime("%Y-%m-%d", time.gmtime(now))
    yesterday = time.strftime("%Y-%m-%d", time.gmtime(now - 86400))
    assert (
        "55 matching"
        in admin.get(
            "/console/sessions", params={"task_id": "bulk", "since": today, "until": today}
        ).text
    )
    assert (
        "0 matching"
        in admin.get("/console/sessions", params={"task_id": "bulk", "until": yesterday}).text
    )
    assert admin.get("/console/sessions", params={"since": "22/11/2026"}).status_code == 400

    data = admin.get("/console/training/data.json").json()
    assert data["steps"] == [1, 2, 3]
    charts = {c["title"]: c["series"] for c in data["charts"]}
    assert charts["Task reward"] == [
        {"name": "task_reward", "values": pytest.approx([0.1, 0.2, 0.3])}
    ]
    assert charts["Step time (s)"][0]["name"] == "time_train_s"
    assert [series["name"] for series in charts["Train-inference mismatch"]] == [
        "mismatch_kl",
        "mismatch_masked_ratio",
    ]
    assert "0.125" in admin.get("/console/training").text  # the steps table's Masked
    assert "Entropy" not in charts  # no step reported it
    weights = admin.get("/console/weights").text
    recorded = store.get_weight_version(2).metadata
    (backend,) = recorded["swap"]  # the syncer replaced the stand-in with its own timings
    assert backend == gateway.state.backends.status()[0].url and backend in weights
    assert "http://b1" not in weights and "live: v2" in weights
    total_s = recorded["swap"][backend]["total_s"]
    assert (f"{total_s * 1000:.0f} ms" if total_s < 1 else f"{total_s:.2f} s") in weights


def test_empty_states_show_the_gateway_url(gateway):
    admin = _admin_client(gateway)
    for path, expect in (
        ("/console", "/rl/sessions"),
        ("/console/sessions", "/rl/sessions"),
        ("/console/training", "areal-service trainer --config"),
        ("/console/weights", "No weight versions"),
    ):
        page = admin.get(path)
        assert page.status_code == 200 and expect in page.text, path
    assert f"{gateway.url}/v1/chat/completions" in admin.get("/console").text


def test_static_assets_are_served_and_confined(gateway):
    http = httpx.Client(base_url=gateway.url, timeout=60)
    for name in ("vendor/htmx.min.js", "vendor/uPlot.iife.min.js", "console.css", "training.js"):
        assert http.get(f"/console/static/{name}").status_code == 200, name
    assert http.get("/console/static/..%2Froutes.py").status_code == 404
    assert http.get("/console/static/vendor").status_code == 404


def test_cookie_signature_expiry_and_key_rotation():
    value, session = auth.issue_cookie("k1", "admin", now=1000.0)
    assert auth.read_cookie("k1", value, now=1000.0 + 60) == session
    assert auth.read_cookie("k1", value, now=1000.0 + auth.MAX_AGE_S + 1) is None
    assert auth.read_cookie("k2", value, now=1000.0) is None  # admin key rotated
    role, issued, nonce, sig = value.split(".")
    assert auth.read_cookie("k1", f"admin.{issued}.other.{sig}", now=1000.0) is None
    assert auth.read_cookie("k1", f"anon.{issued}.{nonce}.{sig}", now=1000.0) is None
    assert auth.csrf_token("k1", session) != auth.csrf_token("k2", session)


def test_own_keys_stay_listed_among_many_session_keys(gateway):
    """A demo run makes over a thousand session keys; the user's own key (older than all
    of them) is still listed, and the session keys are counted, not silently capped."""
    from areal_service.keys import new_api_key

    store = gateway.state.store
    _, mine = new_api_key(name="my-agent")
    store.keys.add_api_key(dataclasses.replace(mine, created_at=1.0))  # the oldest key
    for _ in range(520):
        store.keys.add_api_key(new_api_key(kind="session", session_id="sess_x")[1])
    page = _admin_client(gateway).get("/console/keys").text
    assert "my-agent" in page and mine.id in page
    sessions = store.keys.count_api_keys(kinds=("session",))
    assert sessions >= 520
    assert f"{sessions:,} session keys (one per session) are not listed." in page
    everything = _admin_client(gateway).get("/console/keys?all=1").text
    assert "(the newest 500 keys)" in everything


def test_console_wording_for_newcomers(gateway):
    """The login page says where the generated admin key is; with the gate off the
    staleness tile says "gate off" instead of a window that does not apply; large rates
    are plain numbers (1,957 tokens/s, not 1.96e+03)."""
    from gateway.console.routes import _num

    login = httpx.get(gateway.url + "/console/login").text
    assert "<code>data/admin_key</code>" in login
    assert not gateway.config.gateway.sessions.staleness_gate
    tile = _admin_client(gateway).get("/console").text.split("Staleness window", 1)[1]
    assert '<div class="value">gate off</div>' in tile[:300]
    assert _num(1957.3, 3) == "1,957" and _num(0.01234) == "0.01234" and _num(12.5) == "12.5"
