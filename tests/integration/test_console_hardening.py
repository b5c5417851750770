"""Console hardening through a real gateway: hostile cookie and CSRF bytes are a plain
"not signed in" / 403 (never a 500, and the keep-alive connection stays usable), and
sign-out revokes the session server-side."""

from __future__ import annotations

import re
import socket

import httpx
from support.harness import ADMIN_KEY

from gateway.console import auth


def _csrf(html: str) -> str:
    return re.search(r'name="csrf_token" value="([^"]+)"', html).group(1)


def _signed_in(gw) -> httpx.Client:
    http = httpx.Client(base_url=gw.url, timeout=60)
    page = http.get("/console/login")
    done = http.post(
        "/console/login",
        data={"csrf_token": _csrf(page.text), "admin_key": ADMIN_KEY, "next": "/console"},
    )
    assert done.status_code == 303, done.text
    return http


def _raw_requests(url: str, requests: list[bytes]) -> list[int]:
    """Status codes of `requests` sent one after another on ONE keep-alive connection."""
    host, port = url.removeprefix("http://").split(":")
    statuses = []
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        reader = sock.makefile("rb")
        for raw in requests:
            sock.sendall(raw)
            status = int(reader.readline().split()[1])
            length = 0
            while (line := reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            reader.read(length)
            statuses.append(status)
    return statuses


def test_non_ascii_cookie_is_not_signed_in_and_connection_survives(gateway):
    sig = "é" * 64
    cookies = [
        f"admin.1.nonce.{sig}".encode(),
        f"admin.1.nonce.{sig}".encode("latin-1"),
        "anon.١٢.n.x".encode(),
        b"\xff\xfe.\x80.\x81.\x82",
    ]
    requests = []
    for cookie in cookies:
        requests.append(
            b"GET /console HTTP/1.1\r\nhost: x\r\ncookie: areal_console=" + cookie + b"\r\n\r\n"
        )
        requests.append(
            b"GET /console/login HTTP/1.1\r\nhost: x\r\ncookie: areal_console="
            + cookie
            + b"\r\n\r\n"
        )
        form = b"csrf_token=x&admin_key=y"
        requests.append(
            b"POST /console/login HTTP/1.1\r\nhost: x\r\ncookie: areal_console="
            + cookie
            + b"\r\ncontent-type: application/x-www-form-urlencoded\r\n"
            b"content-length: " + str(len(form)).encode() + b"\r\n\r\n" + form
        )
    requests.append(b"GET /health/liveness HTTP/1.1\r\nhost: x\r\n\r\n")
    statuses = _raw_requests(gateway.url, requests)
    assert statuses[-1] == 200
    for cookie_statuses in zip(*[iter(statuses[:-1])] * 3, strict=True):
        assert cookie_statuses == (303, 200, 403), statuses


def test_non_ascii_csrf_field_is_403(gateway):
    http = httpx.Client(base_url=gateway.url, timeout=60)
    http.get("/console/login")
    for field in ("é" * 64, "\u00ff", "\U0001f600"):
        bad = http.post("/console/login", data={"csrf_token": field, "admin_key": ADMIN_KEY})
        assert bad.status_code == 403, bad.text
    admin = _signed_in(gateway)
    for field in ("é" * 64, "ü"):
        for path in ("/console/keys", "/console/logout"):
            bad = admin.post(path, data={"csrf_token": field, "name": "x"})
            assert bad.status_code == 403, bad.text
    assert admin.get("/console").status_code == 200  # still signed in, nothing broke


def test_sign_out_revokes_the_cookie_server_side(gateway):
    admin = _signed_in(gateway)
    page = admin.get("/console/keys")
    assert page.status_code == 200
    token = _csrf(page.text)
    old_cookie = admin.cookies[auth.COOKIE_NAME]
    out = admin.post("/console/logout", data={"csrf_token": token})
    assert out.status_code == 303
    # A client that kept the old cookie (copied, or a browser that ignored the clearing).
    stale = httpx.Client(base_url=gateway.url, timeout=60, cookies={auth.COOKIE_NAME: old_cookie})
    assert stale.get("/console").status_code == 303
    assert stale.get("/console/keys").headers["location"].startswith("/console/login")
    created = stale.post("/console/keys", data={"csrf_token": token, "name": "after-logout"})
    assert created.status_code == 303 and "after-logout" not in created.text
    assert not [
        k for k in gateway.state.store.keys.list_api_keys(limit=50) if k.name == "after-logout"
    ]
    # A fresh sign-in works as before.
    assert _signed_in(gateway).get("/console").status_code == 200


def test_revoked_sessions_are_bounded_and_expire():
    revoked = auth.RevokedSessions(max_entries=3)
    old = auth.ConsoleSession("admin", 1000, "old")
    revoked.revoke(old, now=1000)
    assert old in revoked
    sessions = [auth.ConsoleSession("admin", 2000 + i, f"n{i}") for i in range(5)]
    for s in sessions:
        revoked.revoke(s, now=1000 + auth.MAX_AGE_S + 61 + 0)  # `old` has expired
    assert old not in revoked and len(revoked) == 3
    assert sessions[-1] in revoked and sessions[0] not in revoked


def test_sign_out_on_one_process_is_refused_by_another(
    tmp_path, tiny_model_dir, engine_url, gateway_factory
):
    """Two gateway processes on one store (workers or replicas): a cookie signed out on
    one no longer opens the other, at once."""
    with (
        gateway_factory(tmp_path, tiny_model_dir, [engine_url]) as one,
        gateway_factory(tmp_path, tiny_model_dir, [engine_url]) as other,
    ):
        admin = _signed_in(one)
        cookie = admin.cookies[auth.COOKIE_NAME]
        elsewhere = httpx.Client(base_url=other.url, timeout=60, cookies={auth.COOKIE_NAME: cookie})
        page = elsewhere.get("/console/keys")
        assert page.status_code == 200  # one admin cookie opens every process
        out = admin.post("/console/logout", data={"csrf_token": _csrf(page.text)})
        assert out.status_code == 303
        refused = elsewhere.get("/console/keys")
        assert refused.status_code == 303
        assert refused.headers["location"].startswith("/console/login")
        assert (
            elsewhere.post(
                "/console/keys", data={"csrf_token": _csrf(page.text), "name": "after"}
            ).status_code
            == 303
        )
        assert not [k for k in other.state.store.keys.list_api_keys(limit=50) if k.name == "after"]


def test_an_unreachable_store_refuses_console_pages_with_503(gateway, monkeypatch):
    """Sign-outs cannot be checked without the store: a page is refused (503, retry-after,
    the OpenAI error shape), never opened unchecked, never a 500."""
    admin = _signed_in(gateway)

    def unreachable(nonce: str) -> bool:
        raise OSError("connection refused")

    monkeypatch.setattr(gateway.state.store.coordination, "console_session_revoked", unreachable)
    page = admin.get("/console/keys")
    assert page.status_code == 503 and page.headers["retry-after"] == "1"
    assert "sign-outs cannot be checked" in page.json()["error"]["message"]
    monkeypatch.undo()
    assert admin.get("/console/keys").status_code == 200


def test_a_sign_out_the_store_cannot_record_is_503(gateway, monkeypatch):
    """Other processes would still accept the cookie: the sign-out says it failed (503)
    instead of pretending, changes nothing, and a retry then signs out everywhere."""
    admin = _signed_in(gateway)
    token = _csrf(admin.get("/console/keys").text)
    cookie = admin.cookies[auth.COOKIE_NAME]

    def unreachable(nonce: str, expires_at: float) -> None:
        raise OSError("connection refused")

    monkeypatch.setattr(gateway.state.store.coordination, "revoke_console_session", unreachable)
    out = admin.post("/console/logout", data={"csrf_token": token})
    assert out.status_code == 503 and "still signed in" in out.json()["error"]["message"]
    assert admin.get("/console/keys").status_code == 200
    monkeypatch.undo()
    assert admin.post("/console/logout", data={"csrf_token": token}).status_code == 303
    assert gateway.state.store.coordination.console_session_revoked(cookie.split(".")[2])
    stale = httpx.Client(base_url=gateway.url, timeout=60, cookies={auth.COOKIE_NAME: cookie})
    assert stale.get("/console/keys").status_code == 303
