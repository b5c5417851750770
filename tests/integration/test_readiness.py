"""Readiness that tells the truth and requests that fail fast, through a real gateway:
a locked database (writes fail, reads work) is `db: error` until it is released; a dead
backend is reported down within one health interval; once no backend has been healthy
for `gateway.router.no_backend_fail_fast_s`, chats get 503 with retry-after at once, and
recover when the backend is back."""

from __future__ import annotations

import logging
import sqlite3
import time

import httpx
from support.harness import ADMIN_KEY
from support.loopback import free_port

from areal_service.store import connect
from engine.echo_backend import start_echo_backend

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
CHAT = {"model": "areal-policy", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}


def _poll(fn, timeout_s: float, step_s: float = 0.02):
    """Call `fn` until it returns a truthy value; that value (AssertionError on timeout)."""
    end = time.monotonic() + timeout_s
    while not (value := fn()):
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(step_s)
    return value


def test_locked_database_is_not_ready_until_released(
    tmp_path, tiny_model_dir, engine_url, gateway_factory, monkeypatch
):
    monkeypatch.setattr(connect, "SQLITE_BUSY_TIMEOUT_MS", 300)  # fail in 0.3 s, not 30
    with gateway_factory(tmp_path, tiny_model_dir, [engine_url]) as gw:
        http = httpx.Client(base_url=gw.url, timeout=60, headers=ADMIN)
        assert http.get("/health/readiness").json()["db"] == "ok"
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
        lock = sqlite3.connect(tmp_path / "areal.db", isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        try:
            failed = http.post("/v1/chat/completions", json=CHAT)
            assert failed.status_code == 503, failed.text
            ready = http.get("/health/readiness")
            assert ready.status_code == 503, ready.text
            assert ready.json()["status"] == "unavailable"
            assert ready.json()["db"].startswith("error: writes failing"), ready.json()
            assert ready.json()["backends"][0]["healthy"]  # the backend is fine
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        ready = http.get("/health/readiness")
        assert ready.status_code == 200 and ready.json()["db"] == "ok", ready.text
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_dead_backend_reported_then_fail_fast_then_recovery(
    tmp_path, tiny_model_dir, gateway_factory
):
    port = free_port()
    echo = start_echo_backend(port, tokens=3)
    with gateway_factory(
        tmp_path,
        tiny_model_dir,
        [echo.url],
        "gateway.router.health_interval_s=0.3",
        "gateway.router.no_backend_fail_fast_s=1",
        "gateway.router.backend_unavailable_deadline_s=30",
    ) as gw:
        http = httpx.Client(base_url=gw.url, timeout=60, headers=ADMIN)
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert http.get("/health/readiness").status_code == 200
        echo.stop()
        stopped = time.monotonic()

        def reported_down() -> bool:
            body = http.get("/health/readiness").json()
            return body["status"] == "unavailable" and not body["backends"][0]["healthy"]

        _poll(reported_down, timeout_s=5)
        # within one health interval (+ the check itself), with slack for a loaded machine
        assert time.monotonic() - stopped < 2.0
        # Past the fail-fast window every new request is refused at once, not after 30 s.
        time.sleep(max(0.0, stopped + 1.2 - time.monotonic()))
        for _ in range(3):
            started = time.monotonic()
            refused = http.post("/v1/chat/completions", json=CHAT)
            elapsed = time.monotonic() - started
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"]
            assert refused.json()["error"]["code"] == "backend_unavailable"
            assert elapsed < 5.0, elapsed  # not the 30 s deadline
        # The backend comes back on the same address: requests succeed again.
        echo = start_echo_backend(port, tokens=3)
        try:
            _poll(
                lambda: http.post("/v1/chat/completions", json=CHAT).status_code == 200,
                timeout_s=15,
                step_s=0.2,
            )
            assert http.get("/health/readiness").status_code == 200
        finally:
            echo.stop()


def test_background_task_that_raises_is_logged_restarted_and_shown(
    tmp_path, tiny_model_dir, gateway_factory, monkeypatch, caplog
):
    """A raise in the weight syncer outside its own `try` (`export_live_versions`) used
    to end weight sync silently until shutdown: the supervisor logs it with its
    traceback, readiness is 503 naming the task while it waits to be started again, and
    then weight sync runs again."""
    from gateway import weight_sync

    real = weight_sync.export_live_versions
    calls: list[int] = []

    def flaky(state) -> None:
        calls.append(1)
        if len(calls) <= 2:  # the first two rounds die (backoff 1 s, then 2 s)
            raise RuntimeError("metrics export broke")
        real(state)

    monkeypatch.setattr(weight_sync, "export_live_versions", flaky)
    echo = start_echo_backend(tokens=2)
    try:
        with (
            caplog.at_level(logging.ERROR, logger="gateway.supervisor"),
            gateway_factory(tmp_path, tiny_model_dir, [echo.url]) as gw,
        ):
            http = httpx.Client(base_url=gw.url, timeout=30, headers=ADMIN)
            red = _poll(lambda: (r := http.get("/health/readiness")).status_code == 503 and r, 10)
            assert red.json()["tasks"] == {
                "weight_sync": "restarting after RuntimeError: metrics export broke"
            }, red.text
            green = _poll(lambda: (r := http.get("/health/readiness")).status_code == 200 and r, 10)
            assert "tasks" not in green.json()
            seen = len(calls)
            _poll(lambda: len(calls) > seen + 3, 5)  # weight sync runs again
            assert gw.app.state.life.supervisor.tasks["weight_sync"].restarts == 2
    finally:
        echo.stop()
    failures = [r for r in caplog.records if r.name == "gateway.supervisor"]
    assert len(failures) == 2 and all(r.exc_info for r in failures), failures
    assert "background task weight_sync failed" in failures[0].getMessage()
