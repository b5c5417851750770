"""N3: requests without an API key have their own small budget per client address, the
console's sign-in and form posts a pool apart from API traffic, and keyless bodies a
short deadline. Before: 260 keyless connections each holding a 1-byte body kept the
admin's correct console sign-in at 503 for 60 s."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import httpx

ADMIN_KEY = "sk-test-admin"
BUDGETS = (
    "gateway.limits.max_anonymous_requests=4",
    "gateway.limits.max_anonymous_per_address=2",
    'gateway.auth.forwarded_allow_ips=["127.0.0.1"]',
)


def _stalled(url: str, path: str, address: str) -> socket.socket:
    """A keyless post "from" `address` that sends 1 byte of its 100-byte body."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nhost: x\r\nx-forwarded-for: {address}\r\n"
        "content-type: application/json\r\ncontent-length: 100\r\n\r\n{".encode()
    )
    return sock


def _post(url: str, path: str, address: str) -> int:
    return httpx.post(
        url + path, json={}, headers={"x-forwarded-for": address}, timeout=10
    ).status_code


def _sign_in(url: str, address: str) -> int:
    with httpx.Client(base_url=url, timeout=10, headers={"x-forwarded-for": address}) as http:
        page = http.get("/console/login")
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)  # type: ignore[union-attr]
        return http.post(
            "/console/login", data={"csrf_token": csrf, "admin_key": ADMIN_KEY}
        ).status_code


def _hold(stack: ExitStack, sockets: Iterator[socket.socket]) -> None:
    for sock in sockets:
        stack.callback(sock.close)
    time.sleep(0.3)  # their headers are in: each holds its place


def test_keyless_floods_never_take_the_console_sign_in(
    serve: Callable[..., AbstractContextManager[Any]],
) -> None:
    with serve(*BUDGETS) as gw, ExitStack() as stack:
        url = gw.url
        # One address holds its share of the API pool; its next keyless post is refused.
        _hold(stack, (_stalled(url, "/rl/sessions", "10.0.0.1") for _ in range(2)))
        assert _post(url, "/rl/sessions", "10.0.0.1") == 503
        assert _post(url, "/rl/sessions", "10.0.0.2") == 401  # another address: served
        # Another address fills the API pool: keyless API posts are refused everywhere...
        _hold(stack, (_stalled(url, "/rl/sessions", "10.0.0.2") for _ in range(2)))
        assert _post(url, "/rl/sessions", "10.0.0.3") == 503
        # ...while the console's pool is apart: the admin signs in.
        assert _sign_in(url, "10.0.0.9") == 303
        # Stalled sign-ins from one address fill only that address's share of it.
        _hold(stack, (_stalled(url, "/console/login", "10.0.0.1") for _ in range(2)))
        assert _post(url, "/console/login", "10.0.0.1") == 503
        assert _sign_in(url, "10.0.0.9") == 303
        # A request with a key is not counted at all.
        admin = {"authorization": f"Bearer {ADMIN_KEY}", "x-forwarded-for": "10.0.0.1"}
        assert httpx.get(url + "/admin/keys", headers=admin, timeout=10).status_code == 200


def test_a_keyless_body_has_a_short_deadline(
    serve: Callable[..., AbstractContextManager[Any]],
) -> None:
    with serve("gateway.limits.anonymous_body_timeout_s=1") as gw:
        sock = _stalled(gw.url, "/console/login", "127.0.0.1")
        started = time.monotonic()
        sock.settimeout(5)
        data = b""
        while chunk := sock.recv(65536):  # until the server closes the connection
            data += chunk
        took = time.monotonic() - started
        sock.close()
        assert data.startswith(b"HTTP/1.1 408"), data
        assert b'"request_timeout"' in data
        assert 0.8 < took < 3, took
        # A request with a key keeps the general body deadline (60 s): still open at 1.5 s.
        host, port = gw.url.removeprefix("http://").split(":")
        keyed = socket.create_connection((host, int(port)), timeout=5)
        keyed.sendall(
            b"POST /rl/sessions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer "
            + ADMIN_KEY.encode()
            + b"\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{"
        )
        time.sleep(1.5)
        keyed.sendall(b"}")
        keyed.settimeout(10)
        assert keyed.recv(65536).startswith(b"HTTP/1.1 201")
        keyed.close()


def test_the_audit_flood_leaves_the_sign_in_open(
    serve: Callable[..., AbstractContextManager[Any]],
) -> None:
    """The audit's attack as written, with the default budgets: 260 keyless connections
    each holding 1 byte of a sign-in body. Before, the admin's correct sign-in got 503 for
    60 s; now the flood holds its address's share only, and is cut at the keyless deadline."""
    with serve('gateway.auth.forwarded_allow_ips=["127.0.0.1"]') as gw, ExitStack() as stack:
        flood = [_stalled(gw.url, "/console/login", "10.6.6.6") for _ in range(260)]
        _hold(stack, iter(flood))
        assert _sign_in(gw.url, "10.0.0.9") == 303
        # The flood's connections beyond its share were refused at once; the rest get 408
        # at the keyless body deadline (5 s), not the general 60 s.
        started = time.monotonic()
        answers = []
        for sock in flood:
            sock.settimeout(10)
            answers.append(sock.recv(64)[:12])
        assert answers.count(b"HTTP/1.1 503") == 252, answers
        assert answers.count(b"HTTP/1.1 408") == 8, answers
        assert time.monotonic() - started < 7
