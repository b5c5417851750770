"""`areal-service launch --scheduler local`: the gateway (with its local engine) and the
trainer as children of the launch command; chat works through the gateway, the trainer
runs, and SIGTERM to the launcher stops every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import openai
import pytest
from support.loopback import free_port, pid_alive, wait_serving

from launcher.processes import cli_argv

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (from /proc), nearest first."""
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        kids.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in kids.get(todo.pop(0), []):
            out.append(child)
            todo.append(child)
    return out


def test_launch_local_runs_gateway_engine_and_trainer(tmp_path, tiny_model_dir):
    gw_port = free_port()
    log = tmp_path / "launch.log"
    proc = subprocess.Popen(
        cli_argv(
            "launch",
            "--scheduler",
            "local",
            "--set",
            f"data_dir={tmp_path}",
            "--set",
            f"engine.model={tiny_model_dir}",
            "--set",
            f"engine.port={free_port()}",
            "--set",
            f"gateway.port={gw_port}",
            "--set",
            "gateway.auth.admin_key=sk-launch",
            "--set",
            "engine.torch_threads=1",
            "--set",
            "trainer.torch_threads=1",
        ),
        stdout=subprocess.DEVNULL,
        stderr=open(log, "wb"),  # noqa: SIM115
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{gw_port}"
        wait_serving(proc, url, log)
        reply = openai.OpenAI(
            base_url=f"{url}/v1", api_key="sk-launch", max_retries=0
        ).chat.completions.create(
            model="areal-policy", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.choices[0].message is not None
        deadline = time.monotonic() + 30
        while "trainer" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "started trainer" in log.read_text()
        # launch starts the trainer itself: its gateway child (`serve --no-train`) did not.
        assert "started trainer" not in (tmp_path / "logs" / "gateway.log").read_text()
        descendants = _children(proc.pid)
        assert len(descendants) >= 3  # gateway (serve), its engine, the trainer
        assert (tmp_path / "launch" / "config.yaml").exists()
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(60)
    assert code == 128 + signal.SIGTERM, log.read_text()[-2000:]  # stopped, not finished
    deadline = time.monotonic() + 30
    while any(pid_alive(p) for p in descendants) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(pid_alive(p) for p in descendants), "a child outlived the launcher"
