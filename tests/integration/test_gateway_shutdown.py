"""SIGTERM to a gateway with requests in flight: session starts waiting on the staleness
gate are answered at once (503, "shutting down", retry-after) instead of being cancelled
by the server's graceful-shutdown timeout, which logged one `Exception in ASGI
application ... CancelledError` traceback per waiting request and an ERROR line; a
completion still running when that timeout ends gets 503 `shutting_down` too."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx
from support.loopback import free_port

from engine.echo_backend import start_echo_backend
from launcher.processes import cli_argv

ADMIN = {"authorization": "Bearer sk-test-admin"}


def _serve(tmp_path, tiny_model_dir, port: int, echo_url: str, *settings: str):
    """`areal-service serve` in its own process group, its log in tmp_path/gateway.log."""
    return subprocess.Popen(
        cli_argv(
            "serve",
            "--set",
            f"data_dir={tmp_path}",
            "--set",
            f"engine.model={tiny_model_dir}",
            "--set",
            f"gateway.port={port}",
            "--set",
            f"gateway.router.backends=[{echo_url}]",
            "--set",
            "gateway.auth.admin_key=sk-test-admin",
            "--set",
            "gateway.scale.workers=1",
            *[arg for setting in settings for arg in ("--set", setting)],
        ),
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "gateway.log", "wb"),  # noqa: SIM115
        start_new_session=True,
    )


def _wait_serving(proc: subprocess.Popen, url: str, log) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        try:
            if httpx.get(f"{url}/health/liveness", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)


def test_request_cut_by_shutdown_gets_503_with_retry_after(tmp_path, tiny_model_dir):
    """A completion still generating when the grace period (3 s) ends is answered 503
    `shutting_down` with `retry-after`, and logged in one line, not a bare 500 and a
    CancelledError traceback."""
    echo = start_echo_backend(tokens=4, delay_ms=30_000)
    port = free_port()
    log = tmp_path / "gateway.log"
    proc = _serve(tmp_path, tiny_model_dir, port, echo.url)
    url = f"http://127.0.0.1:{port}"
    replies: list[httpx.Response] = []

    def chat() -> None:
        body = {"model": "areal-policy", "messages": [{"role": "user", "content": "hi"}]}
        replies.append(
            httpx.post(f"{url}/v1/chat/completions", headers=ADMIN, json=body, timeout=60)
        )

    try:
        _wait_serving(proc, url, log)
        waiting = threading.Thread(target=chat)
        waiting.start()
        time.sleep(1.0)  # it waits on the backend
        assert not replies
        os.kill(proc.pid, signal.SIGTERM)
        waiting.join(30)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        echo.stop()
    assert [r.status_code for r in replies] == [503], [r.text for r in replies]
    error = replies[0].json()["error"]
    assert error["code"] == "shutting_down" and replies[0].headers["retry-after"] == "5"
    text = log.read_text()
    assert "Exception in ASGI application" not in text and "CancelledError" not in text, text
    assert "POST /v1/chat/completions cut by the gateway's shutdown: answered 503" in text


def test_sigterm_answers_sessions_waiting_for_admission(tmp_path, tiny_model_dir):
    echo = start_echo_backend(tokens=4)
    port = free_port()
    log = tmp_path / "gateway.log"
    proc = _serve(
        tmp_path,
        tiny_model_dir,
        port,
        echo.url,
        "gateway.sessions.staleness_gate=true",
        "gateway.sessions.admit_wait_s=60",
        "trainer.max_staleness=0",
        "trainer.batch_groups=1",
        "trainer.group_size=1",
        "trainer.advantage=batch",
    )
    url = f"http://127.0.0.1:{port}"
    replies: list[httpx.Response] = []

    def start_session() -> None:
        replies.append(httpx.post(f"{url}/rl/sessions", headers=ADMIN, json={}, timeout=60))

    try:
        _wait_serving(proc, url, log)
        first = httpx.post(f"{url}/rl/sessions", headers=ADMIN, json={}, timeout=10)
        assert first.status_code == 201, first.text  # the window (one session) is full
        waiting = [threading.Thread(target=start_session) for _ in range(3)]
        for thread in waiting:
            thread.start()
        time.sleep(1.0)  # they wait on the gate
        assert not replies
        stopped_at = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        for thread in waiting:
            thread.join(30)
        proc.wait(30)
        took = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
        echo.stop()
    assert [r.status_code for r in replies] == [503] * 3
    error = replies[0].json()["error"]
    assert error["code"] == "shutting_down" and replies[0].headers["retry-after"]
    assert error["message"] == (
        "the gateway is shutting down; the session was not started "
        "(retry once a gateway is serving again)"
    )
    text = log.read_text()
    assert "Exception in ASGI application" not in text and "CancelledError" not in text, text
    assert " ERROR " not in text, text
    assert took < 3.0  # not the graceful-shutdown timeout
