"""M4: a conversation of very many small messages neither stalls the event loop nor is
accepted without bound: past `gateway.limits.max_messages` it is 400 before validation, and a
large body is parsed, validated and rendered off the loop. Liveness is polled meanwhile."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import httpx

ADMIN = {"authorization": "Bearer sk-test-admin", "content-type": "application/json"}


def _worst_liveness_while(
    gw: Any, send: Callable[[], httpx.Response]
) -> tuple[httpx.Response, float]:
    """(the response of `send()`, the slowest liveness answer while it ran)."""
    worst = 0.0
    done = threading.Event()

    def poll() -> None:
        nonlocal worst
        with httpx.Client(timeout=30) as client:
            while not done.is_set():
                started = time.monotonic()
                assert client.get(gw.url + "/health/liveness").status_code == 200
                worst = max(worst, time.monotonic() - started)
                time.sleep(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        response = send()
    finally:
        done.set()
        poller.join(30)
    return response, worst


def _body(count: int) -> bytes:
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": ""} for i in range(count)
    ]
    messages[-1] = {"role": "user", "content": "hi"}
    return json.dumps({"model": "areal-policy", "max_tokens": 2, "messages": messages}).encode()


def test_600k_empty_messages_are_refused_and_liveness_answered(
    serve: Callable[..., AbstractContextManager[Any]],
) -> None:
    with serve() as gw:
        body = _body(600_000)
        response, worst = _worst_liveness_while(
            gw,
            lambda: httpx.post(
                gw.url + "/v1/chat/completions", content=body, headers=ADMIN, timeout=120
            ),
        )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "too_many_messages"
    assert worst < 1.0, f"liveness took {worst:.2f} s"


def test_many_messages_under_the_cap_are_served_off_the_loop(
    serve: Callable[..., AbstractContextManager[Any]],
) -> None:
    with serve("engine.context_length=1000000") as gw:
        body = _body(19_999)
        response, worst = _worst_liveness_while(
            gw,
            lambda: httpx.post(
                gw.url + "/v1/messages/count_tokens", content=body, headers=ADMIN, timeout=120
            ),
        )
    assert response.status_code == 200, response.text
    assert worst < 1.0, f"liveness took {worst:.2f} s"
