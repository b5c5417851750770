"""Fault: the gateway process killed outright (SIGKILL) under load loses no completion it
acknowledged. 16 clients chat through `areal-service serve` (its own process, in front of
an echo backend) until the gateway is killed mid-load; every completion id a client got
a 200 for must then be in the store, with its tokens, and the store must pass SQLite's
integrity check."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import threading
import time

import httpx
from support.loopback import free_port

from engine.echo_backend import start_echo_backend
from launcher.processes import cli_argv

ADMIN_KEY = "sk-test-admin"


def _client_loop(url: str, stop: threading.Event, acked: list[str], stream: bool) -> None:
    body = {
        "model": "m",
        "max_tokens": 8,
        "stream": stream,
        "messages": [{"role": "user", "content": "count"}],
    }
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=url, timeout=10) as client:
        while not stop.is_set():
            try:
                if stream:
                    ids, done = set(), False
                    with client.stream(
                        "POST", "/v1/chat/completions", json=body, headers=headers
                    ) as resp:
                        for line in resp.iter_lines():
                            if line == "data: [DONE]":
                                done = True
                            elif line.startswith("data: {") and '"id"' in line:
                                ids.add(line.split('"id":"', 1)[1].split('"', 1)[0])
                    if resp.status_code == 200 and done:  # [DONE]: the reply was complete
                        acked.extend(ids)
                else:
                    resp = client.post("/v1/chat/completions", json=body, headers=headers)
                    if resp.status_code == 200:
                        acked.append(resp.json()["id"])
            except httpx.HTTPError:
                time.sleep(0.01)


def test_kill_9_under_load_loses_no_acknowledged_completion(tmp_path, tiny_model_dir):
    echo = start_echo_backend(tokens=8)
    port = free_port()
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
            f"gateway.auth.admin_key={ADMIN_KEY}",
            # one process: the one killed is the one that acknowledges and writes
            "--set",
            "gateway.scale.workers=1",
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    stop, acked = threading.Event(), []
    clients = []
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "gateway did not start"
            try:
                if httpx.get(f"{url}/health/liveness", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        clients = [
            threading.Thread(target=_client_loop, args=(url, stop, acked, i % 2 == 1))
            for i in range(16)
        ]
        for thread in clients:
            thread.start()
        while len(acked) < 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        stop.set()
        for thread in clients:
            thread.join(20)
        if proc.poll() is None:
            proc.kill()
        echo.stop()
    assert len(acked) >= 200
    db = sqlite3.connect(tmp_path / "areal.db")
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    stored = {
        row[0]: row[1] for row in db.execute("SELECT id, length(output_ids) FROM completions")
    }
    missing = [cid for cid in acked if cid not in stored]
    assert not missing, f"{len(missing)} of {len(acked)} acknowledged completions lost"
    assert all(stored[cid] > 0 for cid in acked)
