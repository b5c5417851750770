"""`areal-service serve` never orphans the local engine it started: SIGTERM (what systemd,
Docker and Kubernetes send) stops it like Ctrl-C does, and a serve process killed outright
takes its engine along (the child asks the kernel for SIGTERM when its parent dies)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support.loopback import free_port, pid_alive, wait_gone

from launcher.processes import cli_argv


def _start_serve(tmp_path: Path, model_dir: Path) -> tuple[subprocess.Popen, int]:
    """`areal-service serve` on free ports; returns it and its engine child's pid."""
    gw_port, engine_port = free_port(), free_port()
    log_path = tmp_path / "serve.log"
    proc = subprocess.Popen(
        cli_argv(
            "serve",
            "--set",
            f"data_dir={tmp_path}",
            "--set",
            f"engine.model={model_dir}",
            "--set",
            f"gateway.port={gw_port}",
            "--set",
            f"engine.port={engine_port}",
            "--set",
            "gateway.auth.admin_key=sk-test-admin",
        ),
        stdout=subprocess.DEVNULL,
        stderr=open(log_path, "wb"),  # noqa: SIM115
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, log_path.read_text()
        try:
            if (
                httpx.get(f"http://127.0.0.1:{gw_port}/health/liveness", timeout=1).status_code
                == 200
            ):
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("serve did not come up:\n" + log_path.read_text())
    found = re.search(r"started engine \(pid (\d+)\)", log_path.read_text())
    assert found, log_path.read_text()
    return proc, int(found.group(1))


@pytest.mark.parametrize(
    "how", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["sigterm", "sigint", "sigkill"]
)
def test_serve_stops_its_engine_however_it_is_stopped(tmp_path, tiny_model_dir, how):
    proc, engine_pid = _start_serve(tmp_path, tiny_model_dir)
    try:
        assert pid_alive(engine_pid)
        os.kill(proc.pid, how)
        proc.wait(timeout=30)
        assert wait_gone(engine_pid, 20), f"engine {engine_pid} outlived serve ({how.name})"
    finally:
        for pid in (proc.pid, engine_pid):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    if how != signal.SIGKILL:
        assert "stopped engine" in (tmp_path / "serve.log").read_text()


def test_cli_argv_runs_this_interpreter():
    assert cli_argv("serve")[:3] == [sys.executable, "-m", "launcher"]
