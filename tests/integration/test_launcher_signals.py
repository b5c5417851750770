"""`areal-service serve` never orphans the local engine and the trainer it started:
SIGTERM (what systemd, Docker and Kubernetes send) stops them like Ctrl-C does, and a
serve process killed outright takes them along (each child asks the kernel for SIGTERM
when its parent dies)."""

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


def _start_serve(tmp_path: Path, model_dir: Path) -> tuple[subprocess.Popen, int, int]:
    """`areal-service serve` on free ports; returns it and its engine's and trainer's pids."""
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
    pids = [
        re.search(rf"started {name} \(pid (\d+)\)", log_path.read_text())
        for name in ("engine", "trainer")
    ]
    assert all(pids), log_path.read_text()
    return proc, *(int(found.group(1)) for found in pids if found)  # type: ignore[return-value]


@pytest.mark.parametrize(
    "how", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["sigterm", "sigint", "sigkill"]
)
def test_serve_stops_its_engine_and_trainer_however_it_is_stopped(tmp_path, tiny_model_dir, how):
    proc, engine_pid, trainer_pid = _start_serve(tmp_path, tiny_model_dir)
    try:
        assert pid_alive(engine_pid) and pid_alive(trainer_pid)
        os.kill(proc.pid, how)
        proc.wait(timeout=90)
        assert wait_gone(engine_pid, 20), f"engine {engine_pid} outlived serve ({how.name})"
        assert wait_gone(trainer_pid, 60), f"trainer {trainer_pid} outlived serve ({how.name})"
    finally:
        for pid in (proc.pid, engine_pid, trainer_pid):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    if how != signal.SIGKILL:
        log = (tmp_path / "serve.log").read_text()
        assert "stopped trainer" in log and "stopped engine" in log
        assert log.index("stopped trainer") < log.index("stopped engine")  # trainer first


def test_cli_argv_runs_this_interpreter():
    assert cli_argv("serve")[:3] == [sys.executable, "-m", "launcher"]
