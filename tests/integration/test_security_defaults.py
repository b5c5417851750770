"""Security defaults through a real gateway: the shipped admin key is never in force
(generated per data dir on loopback, refused elsewhere), credential guessing is
throttled per address with exponential backoff and an OpenAI-shaped 429, docs and
metrics need the admin key unless made public, and a user key cannot join another
key's group."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from support.harness import ADMIN_KEY
from typer.testing import CliRunner

from areal_service.admin_key import DEFAULT_ADMIN_KEY, DefaultAdminKeyError
from areal_service.config import load_config, with_admin_key
from gateway.app import create_app
from launcher.cli import app as cli_app
from launcher.demo import demo_config
from launcher.evaluate import eval_config

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def test_default_admin_key_is_generated_per_data_dir(tmp_path, caplog):
    path = tmp_path / "admin_key"
    loaded = load_config(overrides=[f"data_dir={tmp_path}"])
    # Loading a config creates nothing: only what serves generates the key.
    assert loaded.gateway.auth.admin_key.get_secret_value() == DEFAULT_ADMIN_KEY
    assert not path.exists() and "generated an admin key" not in caplog.text
    first = with_admin_key(loaded).gateway.auth.admin_key
    key = first.get_secret_value()
    assert key != DEFAULT_ADMIN_KEY and len(key) > 30
    assert path.read_text().strip() == key and (path.stat().st_mode & 0o777) == 0o600
    assert caplog.text.count("generated an admin key") == 1
    again = load_config(overrides=[f"data_dir={tmp_path}", "gateway.auth.admin_key=sk-areal-admin"])
    assert again.gateway.auth.admin_key.get_secret_value() == key  # same dir, same key (read)
    assert with_admin_key(again).gateway.auth.admin_key.get_secret_value() == key
    assert caplog.text.count("generated an admin key") == 1  # logged once, when created
    other = with_admin_key(load_config(overrides=[f"data_dir={tmp_path / 'other'}"]))
    assert other.gateway.auth.admin_key.get_secret_value() not in (key, DEFAULT_ADMIN_KEY)
    mine = load_config(overrides=[f"data_dir={tmp_path}", "gateway.auth.admin_key=sk-mine"])
    assert mine.gateway.auth.admin_key.get_secret_value() == "sk-mine"


def test_only_serving_commands_create_the_admin_key(tmp_path):
    """`keys`, `config show`, `db upgrade` and `export` work on a fresh data dir without
    writing or logging an admin key; the demo's and the evaluation's configs (they start
    a gateway) create it and carry it to their children."""
    data = tmp_path / "data"
    runner = CliRunner()
    for argv in (
        ["keys", "create", "--name", "ci"],
        ["keys", "list"],
        ["config", "show"],
        ["db", "upgrade"],
        ["export", str(tmp_path / "out.jsonl")],
    ):
        result = runner.invoke(cli_app, [*argv, "--set", f"data_dir={data}"])
        assert result.exit_code == 0, (argv, result.output)
        assert "generated an admin key" not in result.output
    listed = runner.invoke(cli_app, ["keys", "list", "--set", f"data_dir={data}"])
    assert '"name": "ci"' in listed.output
    assert not (data / "admin_key").exists()
    config = load_config(overrides=[f"data_dir={data}"])
    demo = demo_config(config, steps=1)
    key = (data / "admin_key").read_text().strip()
    assert demo.gateway.auth.admin_key.get_secret_value() == key != DEFAULT_ADMIN_KEY
    assert eval_config(config, None).gateway.auth.admin_key.get_secret_value() == key


def test_default_admin_key_on_a_reachable_address_refuses_to_start(tmp_path):
    for host in ("0.0.0.0", "'::'", "10.1.2.3", "gateway.example"):
        cfg = load_config(overrides=[f"data_dir={tmp_path}", f"gateway.host={host}"])
        assert cfg.gateway.auth.admin_key.get_secret_value() == DEFAULT_ADMIN_KEY
        with pytest.raises(DefaultAdminKeyError, match="gateway.auth.admin_key"):
            with_admin_key(cfg, binding=True)
        with pytest.raises(DefaultAdminKeyError), TestClient(create_app(cfg)):
            pass  # the lifespan refuses before anything is built
    explicit = load_config(
        overrides=[
            f"data_dir={tmp_path}",
            "gateway.host=0.0.0.0",
            "gateway.auth.admin_key=sk-long-secret",
        ]
    )
    assert with_admin_key(explicit, binding=True) is explicit
    # The CLI says so and exits before starting anything (no engine, no port).
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "serve",
            "--set",
            f"data_dir={tmp_path / 'cli'}",
            "--set",
            "gateway.host=0.0.0.0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "AREAL_GATEWAY__AUTH__ADMIN_KEY"},
    )
    assert run.returncode != 0
    assert "refusing to serve on 0.0.0.0 with the default admin key" in run.stderr
    assert not (tmp_path / "cli" / "logs").exists()


def test_gateway_with_the_default_key_uses_the_generated_one(
    tmp_path, tiny_model_dir, engine_url, gateway_factory
):
    with gateway_factory(
        tmp_path, tiny_model_dir, [engine_url], f"gateway.auth.admin_key={DEFAULT_ADMIN_KEY}"
    ) as gw:
        key = (tmp_path / "admin_key").read_text().strip()
        assert gw.state.config.gateway.auth.admin_key.get_secret_value() == key
        http = httpx.Client(base_url=gw.url, timeout=30)
        assert (
            http.get(
                "/admin/status", headers={"authorization": f"Bearer {DEFAULT_ADMIN_KEY}"}
            ).status_code
            == 401
        )
        assert (
            http.get("/admin/status", headers={"authorization": f"Bearer {key}"}).status_code == 200
        )


def _csrf(html: str) -> str:
    return re.search(r'name="csrf_token" value="([^"]+)"', html).group(1)


BACKOFF_S = 5
"""The first lock-out: the checks made while it lasts (two chats among them) have 5 s,
room enough on a loaded machine; the test waits it out once."""


def test_bearer_and_login_failures_back_off_exponentially(
    tmp_path, tiny_model_dir, engine_url, gateway_factory
):
    with gateway_factory(
        tmp_path,
        tiny_model_dir,
        [engine_url],
        "gateway.auth.free_failures=3",
        f"gateway.auth.backoff_s={BACKOFF_S}",
        "gateway.auth.max_backoff_s=60",
    ) as gw:
        http = httpx.Client(base_url=gw.url, timeout=30)
        user = http.post("/admin/keys", json={"name": "agent"}, headers=ADMIN).json()
        agent = {"authorization": f"Bearer {user['api_key']}"}
        assert http.get("/v1/models", headers=agent).status_code == 200
        wrong = {"authorization": "Bearer sk-guess"}
        assert [http.get("/v1/models", headers=wrong).status_code for _ in range(4)] == [
            401
        ] * 4  # 3 free failures; the 4th locks the address out for BACKOFF_S
        started = time.monotonic()
        refused = http.post("/v1/chat/completions", headers=wrong, json={})
        assert refused.status_code == 429
        assert 1 <= int(refused.headers["retry-after"]) <= BACKOFF_S
        assert refused.json() == {
            "error": {
                "message": refused.json()["error"]["message"],
                "type": "rate_limit_error",
                "param": None,
                "code": "too_many_auth_failures",
            }
        }
        # A console login attempt with a wrong key is refused; the right key signs in.
        page = http.get("/console/login")
        assert page.status_code == 200
        login = http.post(
            "/console/login", data={"csrf_token": _csrf(page.text), "admin_key": "sk-wrong"}
        )
        assert login.status_code == 429 and login.headers["retry-after"]
        login = http.post(
            "/console/login", data={"csrf_token": _csrf(page.text), "admin_key": ADMIN_KEY}
        )
        assert login.status_code in (200, 303), login.text
        # Working credentials from the same address keep working, also a user key whose
        # first chat opens and binds a session (the key cache drops it on the rebind).
        assert http.get("/v1/models", headers=agent).status_code == 200
        chat = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
        for _ in range(2):
            assert http.post("/v1/chat/completions", headers=agent, json=chat).status_code == 200
        fresh = http.post("/admin/keys", json={}, headers=ADMIN).json()["api_key"]
        assert (
            http.get("/v1/models", headers={"authorization": f"Bearer {fresh}"}).status_code == 200
        )  # created here: known at once
        assert http.get("/admin/status", headers=ADMIN).status_code == 200
        # Still locked out: every check above was made inside the lock-out.
        assert http.get("/v1/models", headers=wrong).status_code == 429, (
            "the lock-out ended before the checks inside it were done"
        )
        # After the lock-out a guess is answered again; the next failure locks for twice
        # as long (retry-after above one lock-out).
        time.sleep(max(0.0, started + BACKOFF_S + 0.05 - time.monotonic()))
        assert http.get("/v1/models", headers=wrong).status_code == 401
        doubled = http.get("/v1/models", headers=wrong)
        assert doubled.status_code == 429
        assert BACKOFF_S < int(doubled.headers["retry-after"]) <= 2 * BACKOFF_S
        # Failed console logins count the same way, per address: another loopback
        # address starts with its own free failures (no waiting out this one's lock).
        other = httpx.Client(
            base_url=gw.url, timeout=30, transport=httpx.HTTPTransport(local_address="127.0.0.2")
        )
        page = other.get("/console/login")
        for _ in range(4):  # 3 free failures, the 4th locks
            bad = other.post(
                "/console/login", data={"csrf_token": _csrf(page.text), "admin_key": "sk-wrong"}
            )
            assert bad.status_code == 401
        assert (
            other.post(
                "/console/login", data={"csrf_token": _csrf(page.text), "admin_key": "sk-wrong"}
            ).status_code
            == 429
        )


def test_failures_on_every_process_sharing_the_store_lock_the_address_out(
    tmp_path, tiny_model_dir, engine_url, gateway_factory
):
    """Two gateway processes on one store (workers or replicas), five free failures:
    three guesses on each, and within one sync interval both refuse the address (429),
    though neither saw more than its free failures. Counted per process, the next guess
    on each would be a plain 401."""
    settings = (
        "gateway.scale.replicas=true",
        "gateway.auth.free_failures=5",
        "gateway.auth.backoff_s=60",
        "gateway.auth.throttle_sync_s=0.2",
    )
    with (
        gateway_factory(tmp_path, tiny_model_dir, [engine_url], *settings) as one,
        gateway_factory(tmp_path, tiny_model_dir, [engine_url], *settings) as other,
    ):
        wrong = {"authorization": "Bearer sk-guess"}
        clients = [httpx.Client(base_url=gw.url, timeout=30) for gw in (one, other)]
        for http in clients:
            assert [http.get("/v1/models", headers=wrong).status_code for _ in range(3)] == [
                401
            ] * 3
        throttles = [gw.app.state.auth_throttle for gw in (one, other)]
        deadline = time.monotonic() + 10
        while not all(t.retry_after("127.0.0.1") > 0 for t in throttles):
            assert time.monotonic() < deadline, "the lock-out did not reach both processes"
            time.sleep(0.05)
        for http in clients:
            refused = http.get("/v1/models", headers=wrong)
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "too_many_auth_failures"
            assert http.get("/v1/models", headers=ADMIN).status_code == 200  # known good


def test_docs_and_metrics_need_the_admin_key_unless_public(
    tmp_path, tiny_model_dir, engine_url, gateway_factory
):
    paths = ("/metrics", "/docs", "/openapi.json")
    with gateway_factory(tmp_path / "a", tiny_model_dir, [engine_url]) as gw:
        http = httpx.Client(base_url=gw.url, timeout=30)
        user = http.post("/admin/keys", json={}, headers=ADMIN).json()["api_key"]
        for path in paths:
            bare = http.get(path)
            assert bare.status_code == 401 and bare.json()["error"]["code"] == "admin_required"
            setting = "public_metrics" if path == "/metrics" else "public_docs"
            assert f"gateway.auth.{setting}" in bare.json()["error"]["message"]  # where to set it
            assert http.get(path, headers={"authorization": f"Bearer {user}"}).status_code == 401
            assert http.get(path, headers=ADMIN).status_code == 200
    with gateway_factory(
        tmp_path / "b",
        tiny_model_dir,
        [engine_url],
        "gateway.auth.public_docs=true",
        "gateway.auth.public_metrics=true",
    ) as gw:
        for path in paths:
            assert httpx.get(gw.url + path, timeout=30).status_code == 200


def test_a_user_key_cannot_join_another_keys_group(gateway):
    http = httpx.Client(base_url=gateway.url, timeout=30)
    group = http.post("/rl/sessions", json={"group_size": 2}, headers=ADMIN).json()["group_id"]
    user = http.post("/admin/keys", json={}, headers=ADMIN).json()["api_key"]
    mine = {"authorization": f"Bearer {user}"}
    joined = http.post("/rl/sessions", json={"group_id": group}, headers=mine)
    assert joined.status_code == 403 and joined.json()["error"]["code"] == "group_not_owned"
    assert len(gateway.state.store.list_sessions(group_id=group)) == 2
    # Its own group: a new one, then joined again by the same key's next refresh.
    assert http.post("/rl/sessions", json={"group_id": "grp-mine"}, headers=mine).status_code == 201
    assert http.post("/rl/sessions", json={"group_id": "grp-mine"}, headers=mine).status_code == 201
    assert len(gateway.state.store.list_sessions(group_id="grp-mine")) == 2
    # A session key cannot start or refresh sessions at all.
    session_key = http.post("/rl/sessions", json={}, headers=ADMIN).json()["api_key"]
    assert (
        http.post(
            "/rl/sessions",
            json={"group_id": "grp-mine"},
            headers={"authorization": f"Bearer {session_key}"},
        ).status_code
        == 403
    )
