"""Per-key limits through a real gateway (uvicorn on loopback, SQLite, the echo backend
at the network edge): requests/min, tokens/min, requests in flight and a total token
budget, each answered with 429 + retry-after in the OpenAI shape; set through the admin
REST API and the console; the budget's running total survives a restart."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from support.harness import ADMIN_KEY, run_gateway

from engine.echo_backend import start_echo_backend
from gateway.errors import OpenAIError

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def _chat(
    http: httpx.Client, key: str, max_tokens: int = 2, stream: bool = False
) -> httpx.Response:
    return http.post(
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={
            "model": "m",
            "max_tokens": max_tokens,
            "stream": stream,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )


def _key(http: httpx.Client, **limits) -> tuple[str, str]:
    made = http.post("/admin/keys", json={"name": "limited", **limits}, headers=ADMIN)
    assert made.status_code == 201, made.text
    return made.json()["id"], made.json()["api_key"]


def _assert_429(response: httpx.Response, code: str, max_wait: int = 60) -> None:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == code, error
    assert 1 <= int(response.headers["retry-after"]) <= max_wait


def test_limits_are_set_and_validated_through_the_admin_api(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    with (
        start_echo_backend(tokens=4) as echo,
        run_gateway(tmp_path, tiny_model_dir, [echo.url]) as gw,
    ):
        http = httpx.Client(base_url=gw.url, timeout=30)
        key_id, _ = _key(http, rpm_limit=60, token_budget=1000)
        patched = http.patch(
            f"/admin/keys/{key_id}", headers=ADMIN, json={"tpm_limit": 500, "token_budget": None}
        )
        assert patched.status_code == 200, patched.text
        view = patched.json()
        assert (
            view["rpm_limit"],
            view["tpm_limit"],
            view["max_concurrent"],
            view["token_budget"],
            view["tokens_used"],
        ) == (60, 500, None, None, 0)
        for bad in ({"rpm_limit": 0}, {"rpm_limit": "10"}, {"rpm_limit": 1.5}, {"burst": 3}):
            refused = http.patch(f"/admin/keys/{key_id}", headers=ADMIN, json=bad)
            assert refused.status_code == 400, (bad, refused.text)
        assert (
            http.patch("/admin/keys/key_nope", headers=ADMIN, json={"rpm_limit": 1}).status_code
            == 404
        )
        listed = {k["id"]: k for k in http.get("/admin/keys", headers=ADMIN).json()["data"]}
        assert listed[key_id]["tpm_limit"] == 500


def test_requests_per_minute_and_tokens_per_minute(tmp_path: Path, tiny_model_dir: Path) -> None:
    with (
        start_echo_backend(tokens=4) as echo,
        run_gateway(tmp_path, tiny_model_dir, [echo.url]) as gw,
    ):
        http = httpx.Client(base_url=gw.url, timeout=30)
        _, rpm_key = _key(http, rpm_limit=2)
        assert [_chat(http, rpm_key).status_code for _ in range(2)] == [200, 200]
        _assert_429(_chat(http, rpm_key), "rate_limit_exceeded")
        _, tpm_key = _key(http, tpm_limit=5)
        first = _chat(http, tpm_key)
        assert first.status_code == 200 and first.json()["usage"]["total_tokens"] > 5
        _assert_429(_chat(http, tpm_key), "rate_limit_exceeded")
        # Other keys and the admin are not affected.
        _, free_key = _key(http)
        assert _chat(http, free_key).status_code == 200
        assert _chat(http, ADMIN_KEY).status_code == 200


def test_concurrent_requests_streams_included(tmp_path: Path, tiny_model_dir: Path) -> None:
    # 4 tokens x 500 ms: the first request holds its slot for 2 s, time enough for the
    # second to arrive even on a loaded machine.
    with (
        start_echo_backend(tokens=4, token_delay_ms=500) as echo,
        run_gateway(tmp_path, tiny_model_dir, [echo.url]) as gw,
    ):
        http = httpx.Client(base_url=gw.url, timeout=30)
        _, key = _key(http, max_concurrent=1)
        results: list[int] = []
        slow = threading.Thread(
            target=lambda: results.append(_chat(http, key, max_tokens=4).status_code)
        )
        slow.start()
        # Admitted before it reaches the backend: once the echo backend runs it, it holds
        # the key's one slot (waited on, not slept for).
        deadline = time.monotonic() + 30
        while not echo.backend.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert echo.backend.running, "the first request never reached the backend"
        _assert_429(_chat(http, key), "concurrency_limit_exceeded", max_wait=1)
        slow.join()
        assert results == [200]
        # A stream holds its slot until its last event, then frees it.
        with (
            httpx.Client(base_url=gw.url, timeout=30) as other,
            other.stream(
                "POST",
                "/v1/chat/completions",
                headers={"authorization": f"Bearer {key}"},
                json={
                    "model": "m",
                    "max_tokens": 4,
                    "stream": True,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            ) as streamed,
        ):
            assert streamed.status_code == 200
            lines = streamed.iter_lines()
            next(lines)
            _assert_429(_chat(http, key), "concurrency_limit_exceeded", max_wait=1)
            assert "[DONE]" in "".join(lines)
        deadline = time.monotonic() + 5
        while (status := _chat(http, key).status_code) == 429 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status == 200


def test_token_budget_survives_a_restart(tmp_path: Path, tiny_model_dir: Path) -> None:
    with start_echo_backend(tokens=4) as echo:
        with run_gateway(
            tmp_path, tiny_model_dir, [echo.url], "gateway.auth.key_usage_interval_s=0.2"
        ) as gw:
            http = httpx.Client(base_url=gw.url, timeout=30)
            key_id, key = _key(http, token_budget=20)
            used = 0
            while used < 20:
                reply = _chat(http, key)
                assert reply.status_code == 200, reply.text
                used += reply.json()["usage"]["total_tokens"]
            _assert_429(_chat(http, key), "token_budget_exhausted")
        # Stopped: the last flush wrote tokens_used; a new process refuses at once.
        with run_gateway(tmp_path, tiny_model_dir, [echo.url]) as gw:
            http = httpx.Client(base_url=gw.url, timeout=30)
            view = {k["id"]: k for k in http.get("/admin/keys", headers=ADMIN).json()["data"]}
            assert view[key_id]["tokens_used"] == used
            _assert_429(_chat(http, key), "token_budget_exhausted")
            raised = http.patch(
                f"/admin/keys/{key_id}", headers=ADMIN, json={"token_budget": used + 100}
            )
            assert raised.status_code == 200
            assert _chat(http, key).status_code == 200


def test_console_shows_and_edits_limits(tmp_path: Path, tiny_model_dir: Path) -> None:
    with (
        start_echo_backend(tokens=4) as echo,
        run_gateway(tmp_path, tiny_model_dir, [echo.url]) as gw,
    ):
        http = httpx.Client(base_url=gw.url, timeout=30)
        key_id, _ = _key(http, rpm_limit=7)
        page = http.get("/console/login")
        token = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
        http.post("/console/login", data={"csrf_token": token, "admin_key": ADMIN_KEY})
        keys = http.get("/console/keys").text
        row = re.search(rf'<tr id="key-{key_id}".*?</tr>', keys, re.S).group(0)
        assert "7 req/min" in row and "∞ tok/min" in row and "0 tokens used" in row
        token = re.search(r'name="csrf_token" value="([^"]+)"', keys).group(1)
        saved = http.post(
            f"/console/keys/{key_id}/limits",
            data={
                "csrf_token": token,
                "rpm_limit": "",
                "tpm_limit": "1,000",
                "max_concurrent": "2",
                "token_budget": "50000",
            },
        )
        assert saved.status_code == 303, saved.text
        key = gw.state.store.keys.get_api_key(key_id)
        assert (key.rpm_limit, key.tpm_limit, key.max_concurrent, key.token_budget) == (
            None,
            1000,
            2,
            50000,
        )
        row = re.search(
            rf'<tr id="key-{key_id}".*?</tr>', http.get(saved.headers["location"]).text, re.S
        ).group(0)
        assert "∞ req/min" in row and "1,000 tok/min" in row and "of 50,000" in row
        bad = http.post(
            f"/console/keys/{key_id}/limits", data={"csrf_token": token, "rpm_limit": "-3"}
        )
        assert bad.status_code == 400
        assert (
            http.post(f"/console/keys/{key_id}/limits", data={"rpm_limit": "5"}).status_code == 403
        )  # CSRF as on every form


async def test_a_stream_never_iterated_still_frees_its_slot() -> None:
    from areal_service.types import ApiKeyRecord
    from gateway.limits import KeyLimits

    limits = KeyLimits()
    key = ApiKeyRecord(id="k", key_hash="h", display="d", max_concurrent=1)

    async def events():
        yield "data: 1\n\n"

    for finish in ("iterate", "aclose", "drop"):
        async with limits.holding(key) as keep:
            stream = keep(events())
        if finish == "iterate":
            assert [e async for e in stream] == ["data: 1\n\n"]
        elif finish == "aclose":
            await stream.aclose()
        else:
            del stream  # the client left before the first byte: never iterated
        assert limits.admit(key)  # the slot is free again
        limits.release(key)


async def test_a_request_count_is_released_once_however_it_is_handed_on() -> None:
    """`holding`: a block's count is released exactly once: by the block's exit, or by
    the one stream `keep` wrapped (a second `keep` hands on nothing), also on an error."""
    from areal_service.types import ApiKeyRecord
    from gateway.limits import KeyLimits

    limits = KeyLimits()
    key = ApiKeyRecord(id="k", key_hash="h", display="d", max_concurrent=2)

    async def events():
        yield "data: 1\n\n"

    async with limits.holding(key):  # another request of the key, in flight throughout
        async with limits.holding(key) as keep:
            streams = [keep(events()), keep(events())]
        for stream in streams:
            assert [e async for e in stream] == ["data: 1\n\n"]
        assert limits.admit(key)  # one slot free: the other request still holds its own
        with pytest.raises(OpenAIError) as full:
            limits.admit(key)
        assert full.value.status == 429
        limits.release(key)
        with pytest.raises(RuntimeError):
            async with limits.holding(key):
                raise RuntimeError("the request failed")
        assert limits.admit(key)  # released on the error
        limits.release(key)
