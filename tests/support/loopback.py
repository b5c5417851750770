"""Helpers for tests that start servers and processes on this machine."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie counts as dead: only its reaping is left)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ", 1)[1].startswith("Z"))


def wait_gone(pid: int, timeout_s: float) -> bool:
    """True once `pid` is gone, False if it still runs after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    return False


def wait_serving(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 180) -> None:
    """Block until `url/health/liveness` answers 200 while `proc` (an `areal-service`
    command this test started) runs; fails with the tail of its `log` otherwise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health/liveness", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise AssertionError(f"{url} did not come up:\n{log.read_text()[-3000:]}")
