"""M1/M2: the address the auth throttle counts, and what a lock-out refuses.

- `X-Forwarded-For` moves the counted address only when the peer is a configured proxy
  (`gateway.auth.forwarded_allow_ips`, empty by default): 200 wrong keys each "from" another
  address were all answered 401 before (uvicorn trusts loopback by default).
- A lock-out refuses wrong keys, never a right one: the admin signing in to the console,
  or a valid key this process has not seen yet."""

from __future__ import annotations

import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import httpx

from areal_service.keys import new_api_key

ADMIN_KEY = "sk-test-admin"
THROTTLE = ("gateway.auth.free_failures=3", "gateway.auth.backoff_s=30")


def _guesses(gw: Any, n: int) -> list[int]:
    return [
        httpx.get(
            gw.url + "/v1/models",
            timeout=10,
            headers={
                "authorization": f"Bearer sk-guess-{i}",
                "x-forwarded-for": f"10.1.{i // 250}.{i % 250}",
            },
        ).status_code
        for i in range(n)
    ]


def test_forwarded_for_is_not_trusted_by_default(
    serve: Callable[..., AbstractContextManager[Any]],
) -> None:
    with serve(*THROTTLE) as gw:
        codes = _guesses(gw, 20)
    assert codes[:3] == [401] * 3 and codes[4:] == [429] * 16, codes


def test_forwarded_for_is_trusted_from_a_configured_proxy(
    serve: Callable[..., AbstractContextManager[Any]],
) -> None:
    with serve(*THROTTLE, 'gateway.auth.forwarded_allow_ips=["127.0.0.1"]') as gw:
        assert _guesses(gw, 20) == [401] * 20  # each from its own (proxied) address


def _csrf(page: str) -> str:
    found = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert found, page
    return found.group(1)


def test_a_lock_out_never_refuses_a_right_key(
    serve: Callable[..., AbstractContextManager[Any]],
) -> None:
    with serve(*THROTTLE) as gw:
        # A valid key created elsewhere (another replica, the CLI): never seen here.
        plaintext, record = new_api_key(name="elsewhere")
        gw.state.store.keys.add_api_key(record)
        http = httpx.Client(base_url=gw.url, timeout=10)
        wrong = {"authorization": "Bearer sk-guess"}
        assert [http.get("/v1/models", headers=wrong).status_code for _ in range(5)] == [
            401
        ] * 4 + [429]
        assert gw.app.state.auth_throttle.retry_after("127.0.0.1") > 20
        # The unseen valid key is served; a wrong one still refused.
        assert (
            http.get("/v1/models", headers={"authorization": f"Bearer {plaintext}"}).status_code
            == 200
        )
        assert http.get("/v1/models", headers=wrong).status_code == 429
        # The console: a wrong admin key refused, the right one signs in.
        page = http.get("/console/login")
        bad = http.post(
            "/console/login", data={"csrf_token": _csrf(page.text), "admin_key": "sk-wrong"}
        )
        assert bad.status_code == 429 and bad.headers["retry-after"], bad.text
        good = http.post(
            "/console/login", data={"csrf_token": _csrf(page.text), "admin_key": ADMIN_KEY}
        )
        assert good.status_code == 303, good.text
        assert http.get("/console").status_code == 200
