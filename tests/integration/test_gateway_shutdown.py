"""SIGTERM to a gateway with session starts waiting on the staleness gate: they are
answered at once (503, "shutting down", retry-after) instead of being cancelled by the
server's graceful-shutdown timeout, which logged one `Exception in ASGI application ...
CancelledError` traceback per waiting request and an ERROR line."""

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


def test_sigterm_answers_sessions_waiting_for_admission(tmp_path, tiny_model_dir):
    echo = start_echo_backend(tokens=4)
    port = free_port()
    log = tmp_path / "gateway.log"
    proc = subprocess.Popen(
        cli_argv(
            "serve",
            "--set",
            f"data_dir={tmp_path}",
            "--set",
            f"engine.model={tiny_model_dir}",
            "--set",
            f"gateway.port={port}",
            "--set",
            f"gateway.router.backends=[{echo.url}]",
            "--set",
            "gateway.auth.admin_key=sk-test-admin",
            "--set",
            "gateway.scale.workers=1",
            "--set",
            "gateway.sessions.staleness_gate=true",
            "--set",
            "gateway.sessions.admit_wait_s=60",
            "--set",
            "trainer.max_staleness=0",
            "--set",
            "trainer.batch_groups=1",
            "--set",
            "trainer.group_size=1",
            "--set",
            "trainer.advantage=batch",
        ),
        stdout=subprocess.DEVNULL,
        stderr=open(log, "wb"),  # noqa: SIM115
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    replies: list[httpx.Response] = []

    def start_session() -> None:
        replies.append(httpx.post(f"{url}/rl/sessions", headers=ADMIN, json={}, timeout=60))

    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"{url}/health/liveness", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
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
