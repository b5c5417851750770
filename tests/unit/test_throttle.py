"""AuthThrottle: free failures, doubling lock-outs up to the cap, forgetting after a
quiet spell, a bounded table of addresses, and failures counted on other processes."""

from __future__ import annotations

import asyncio
import time

from pytest import approx

from areal_service.types import AuthFailures
from gateway.throttle import (
    AuthThrottle,
    AuthThrottleMiddleware,
    note_auth_failure,
    request_token,
    too_many_failures,
)


def test_backoff_doubles_to_the_cap_and_resets_after_quiet():
    throttle = AuthThrottle(free_failures=2, backoff_s=1, max_backoff_s=8)
    assert [throttle.failed("a", now=0) for _ in range(2)] == [0, 0]
    assert [throttle.failed("a", now=0) for _ in range(5)] == [1, 2, 4, 8, 8]
    assert throttle.retry_after("a", now=3) == 5
    assert throttle.retry_after("b", now=3) == 0
    # Quiet for longer than the cap after the lock-out ended: a fresh start.
    assert throttle.failed("a", now=8 + 8 + 1) == 0


def test_addresses_are_bounded():
    throttle = AuthThrottle(free_failures=0, backoff_s=1, max_backoff_s=10, max_addresses=100)
    for i in range(1000):
        throttle.failed(f"10.0.{i // 256}.{i % 256}", now=float(i))
    assert len(throttle._records) <= 100
    assert throttle.retry_after("10.0.3.231", now=999) > 0  # the newest is kept


def test_token_and_429_shape():
    assert request_token({"headers": [(b"authorization", b"Bearer sk-1 ")]}) == "sk-1"
    assert request_token({"headers": [(b"authorization", b"Basic x")]}) is None
    assert request_token({"headers": [(b"x-api-key", b"sk-2")]}) == "sk-2"
    error = too_many_failures(0.2)
    assert error.status == 429 and error.headers == {"retry-after": "1"}
    assert error.body()["error"]["code"] == "too_many_auth_failures"


def test_failures_on_other_processes_count_here():
    """Three failures on each of two processes (five free): once they have exchanged
    counts, both lock the address out on the sum, and the next failure doubles on it."""
    here = AuthThrottle(free_failures=5, backoff_s=10, max_backoff_s=100)
    there = AuthThrottle(free_failures=5, backoff_s=10, max_backoff_s=100)
    now, offset = time.monotonic(), 1_000_000.0
    for _ in range(3):
        assert here.failed("a", now=now) == 0 and there.failed("a", now=now) == 0
    assert here.retry_after("a", now=now) == 0
    sent = there.outgoing(offset)
    assert sent == {"a": AuthFailures(3, now + offset, 0.0)}
    assert there.outgoing(offset) == {}  # published once, until it changes again
    here.apply_peers(sent, offset)
    assert here.retry_after("a", now=now) == approx(10)  # six failures: one over
    assert here.failed("a", now=now) == 20  # the seventh, counting the other process's
    assert there.retry_after("a", now=now) == 0  # not told yet
    there.apply_peers(here.outgoing(offset), offset)
    assert there.retry_after("a", now=now) == approx(20)
    assert there.retry_after("b", now=now) == 0


def test_counts_that_could_not_be_published_go_with_the_next_exchange():
    throttle = AuthThrottle(free_failures=5)
    throttle.failed("a")
    sent = throttle.outgoing(offset=0.0)
    throttle.unpublished(sent)
    assert throttle.outgoing(offset=0.0) == sent


def _run(app, scope):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return send, sent


def test_self_reporting_paths_get_the_servers_send_and_count_their_own_401s():
    """A hot route's writes (one per streamed chunk) pass no wrapper; its 401s still
    count, reported through the scope. Other paths' 401s are seen in `send`."""
    throttle = AuthThrottle(free_failures=0, backoff_s=10, max_backoff_s=10)
    seen = []

    async def inner(scope, receive, send):
        seen.append(send)
        if scope["path"] == "/hot":
            note_auth_failure(scope)
        await send({"type": "http.response.start", "status": 401, "headers": []})

    app = AuthThrottleMiddleware(
        inner, throttle_of=lambda _: throttle, known_good_of=lambda _: None, self_reporting={"/hot"}
    )
    scope = {
        "type": "http",
        "path": "/hot",
        "method": "POST",
        "client": ("10.0.0.1", 1),
        "headers": [(b"authorization", b"Bearer sk-wrong")],
    }
    send, _ = _run(app, scope)
    assert seen[-1] is send
    assert throttle.retry_after("10.0.0.1") > 0
    send, _ = _run(app, {**scope, "path": "/v1/models", "client": ("10.0.0.2", 1)})
    assert seen[-1] is not send
    assert throttle.retry_after("10.0.0.2") > 0


def test_the_token_is_read_once_per_request():
    scope = {
        "headers": [
            (b"x-api-key", b"sk-2"),
            (b"authorization", b"Bearer sk-1"),
            (b"authorization", b"Bearer sk-3"),
        ]
    }
    assert request_token(scope) == "sk-1"
    scope["headers"] = []
    assert request_token(scope) == "sk-1"  # remembered in the scope
