"""H1: slow or unfinished requests, and what a client without a key can make the gateway
hold. Raw sockets on loopback against both of uvicorn's HTTP/1.1 implementations; every
slow client is bounded to a few seconds."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import httpx
import pytest

ADMIN = "sk-test-admin"
FAST = ("gateway.limits.header_timeout_s=1", "gateway.limits.body_timeout_s=1")


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    return sock


def _read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes (or `limit_s` passes), and when."""
    started = time.monotonic()
    sock.settimeout(0.2)
    data = b""
    while time.monotonic() - started < limit_s:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - started


@pytest.fixture(params=["httptools", "h11"])
def fast_gw(
    request: pytest.FixtureRequest, serve: Callable[..., AbstractContextManager[Any]]
) -> Iterator[Any]:
    with serve(
        *FAST,
        "gateway.limits.max_connections=8",
        "gateway.limits.max_anonymous_requests=1",
        http=request.param,
    ) as gw:
        yield gw


def test_trickled_headers_get_408_and_are_closed(fast_gw: Any) -> None:
    sock = _connect(fast_gw.url)
    stop = threading.Event()

    def trickle() -> None:  # one header byte every 0.1 s: never idle, never done
        try:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
            while not stop.wait(0.1):
                sock.sendall(b"x")
        except OSError:
            pass

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        data, took = _read_until_closed(sock, 6)
    finally:
        stop.set()
        thread.join(2)
        sock.close()
    assert data.startswith(b"HTTP/1.1 408"), data
    assert b'"code":"request_timeout"' in data
    assert took < 4, took


def test_silent_connection_is_closed(fast_gw: Any) -> None:
    with _connect(fast_gw.url) as sock:
        data, took = _read_until_closed(sock, 6)
    assert took < 4 and data.startswith(b"HTTP/1.1 408"), (took, data)


def test_stalled_body_is_closed_and_the_next_request_served(fast_gw: Any) -> None:
    with _connect(fast_gw.url) as sock:
        sock.sendall(
            b"POST /rl/sessions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer "
            + ADMIN.encode()
            + b"\r\ncontent-type: application/json\r\n"
            b'content-length: 1000\r\n\r\n{"metadata": '
        )
        data, took = _read_until_closed(sock, 6)
    assert took < 4, took
    assert data == b"" or data.startswith(b"HTTP/1.1 408"), data
    assert httpx.get(fast_gw.url + "/health/liveness", timeout=5).status_code == 200


def test_a_slow_reply_is_not_a_slow_client(fast_gw: Any) -> None:
    """The timeouts bound what the client owes, never a reply being generated: a chat
    completion taking longer than both still completes."""
    response = httpx.post(
        fast_gw.url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {ADMIN}"},
        json={
            "model": "areal-policy",
            "max_tokens": 64,
            "messages": [{"role": "user", "content": "hi"}],
        },
        timeout=30,
    )
    assert response.status_code == 200, response.text


def test_connections_beyond_the_cap_get_503(fast_gw: Any) -> None:
    with ExitStack() as stack:
        for _ in range(8):
            stack.enter_context(_connect(fast_gw.url))
        time.sleep(0.2)
        with _connect(fast_gw.url) as extra:
            data, _ = _read_until_closed(extra, 3)
        assert data.startswith(b"HTTP/1.1 503"), data
        assert b"too_many_connections" in data
    time.sleep(0.2)
    assert httpx.get(fast_gw.url + "/health/liveness", timeout=5).status_code == 200


def test_wrong_key_is_refused_before_its_body_is_read(fast_gw: Any) -> None:
    """A 30 MB body announced with a wrong key: 401 at once, not after the body (the
    audit's 32 MiB per stalled connection before authentication)."""
    with _connect(fast_gw.url) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: "
            b"Bearer sk-wrong\r\ncontent-type: application/json\r\n"
            b'content-length: 30000000\r\n\r\n{"messages": ['
        )
        started = time.monotonic()
        first = sock.recv(65536)
        took = time.monotonic() - started
    assert first.startswith(b"HTTP/1.1 401"), first
    assert took < 0.9  # answered before the body timeout would have closed it


def test_body_limits_by_route_and_key(fast_gw: Any) -> None:
    # No key: a small body only (the console's sign-in form is the largest such).
    r = httpx.post(
        fast_gw.url + "/rl/sessions",
        content=b"{" + b" " * 100_000 + b"}",
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    # A key, on a route that generates nothing: gateway.limits.control_body_bytes (4 MiB).
    r = httpx.post(
        fast_gw.url + "/v1/rewards",
        content=b"{" + b" " * 5_000_000 + b"}",
        headers={"authorization": f"Bearer {ADMIN}", "content-type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 413, r.text
    # Chunked (no length): counted as it arrives, same limit.
    r = httpx.post(
        fast_gw.url + "/rl/sessions",
        content=iter([b"{", b" " * 100_000, b"}"]),
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 413, r.text


def test_requests_without_a_key_are_capped(fast_gw: Any) -> None:
    """gateway.limits.max_anonymous_requests=1: one stalled sign-in holds the only slot; another
    keyless post gets 503, liveness is still answered, a keyed request still served."""
    with _connect(fast_gw.url) as sock:
        sock.sendall(
            b"POST /console/login HTTP/1.1\r\nhost: x\r\ncontent-type: "
            b"application/x-www-form-urlencoded\r\ncontent-length: 100\r\n\r\nkey="
        )
        time.sleep(0.3)
        r = httpx.post(fast_gw.url + "/console/login", data={"key": "x"}, timeout=5)
        assert r.status_code == 503, r.text
        assert httpx.get(fast_gw.url + "/health/liveness", timeout=5).status_code == 200
        r = httpx.get(
            fast_gw.url + "/admin/keys", headers={"authorization": f"Bearer {ADMIN}"}, timeout=5
        )
        assert r.status_code == 200, r.text
