"""`areal-service serve` on the embedded default runs the whole job: the gateway, its
local engine and the trainer. It says so at start-up (which policy trains, its log, how
to stop training), a rewarded group sent over HTTP on loopback is trained and the new
weights are swapped in, with no second command; `--no-train` serves only."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from support.loopback import free_port, wait_serving

from launcher.processes import cli_argv

pytestmark = pytest.mark.slow

ADMIN = {"Authorization": "Bearer sk-serve"}


def _serve(tmp_path: Path, model_dir: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    sets = [
        f"data_dir={tmp_path / 'data'}",
        f"engine.model={model_dir}",
        f"gateway.port={port}",
        f"engine.port={free_port()}",
        "gateway.auth.admin_key=sk-serve",
        "trainer.group_size=2",
        "trainer.batch_groups=1",
        "trainer.reward_wait_s=0",
    ]
    proc = subprocess.Popen(
        cli_argv("serve", *extra, *(a for s in sets for a in ("--set", s))),
        stdout=open(tmp_path / "serve.out", "wb"),  # noqa: SIM115
        stderr=open(tmp_path / "serve.log", "wb"),  # noqa: SIM115
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    wait_serving(proc, url, tmp_path / "serve.log")
    return proc, url


def _stop(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(90)


def _one_trained_group(url: str) -> None:
    group = httpx.post(
        f"{url}/rl/sessions", headers=ADMIN, json={"group_size": 2, "task_id": "t"}, timeout=60
    ).json()
    for i, s in enumerate(group["sessions"]):
        key = {"Authorization": f"Bearer {s['api_key']}"}
        chat = httpx.post(
            f"{url}/v1/chat/completions",
            headers=key,
            json={
                "model": "areal-policy",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
            },
            timeout=60,
        )
        assert chat.status_code == 200, chat.text
        reward = {"session_id": s["session_id"], "value": float(i), "end_session": True}
        assert (
            httpx.post(f"{url}/v1/rewards", headers=key, json=reward, timeout=60).status_code == 201
        )


def _live_version(url: str) -> int:
    return int(httpx.get(f"{url}/admin/status", headers=ADMIN, timeout=30).json()["live_version"])


def test_serve_trains_and_swaps_with_no_second_command(tmp_path, tiny_model_dir):
    proc, url = _serve(tmp_path, tiny_model_dir)
    try:
        out = (tmp_path / "serve.out").read_text()
        logs = tmp_path / "data" / "logs"
        assert f"training: policy 'default' on {tiny_model_dir}" in out, out
        assert str(logs / "trainer.log") in out
        assert "--no-train or trainer.enabled: false" in out
        _one_trained_group(url)
        deadline = time.monotonic() + 240
        while _live_version(url) < 1:
            assert time.monotonic() < deadline, (logs / "trainer.log").read_text()[-3000:]
            assert proc.poll() is None
            time.sleep(0.5)
        assert "step 1" in (logs / "trainer.log").read_text()
    finally:
        _stop(proc)
    log = (tmp_path / "serve.log").read_text()
    assert "stopped trainer" in log and "stopped engine" in log


def test_no_train_serves_only(tmp_path, tiny_model_dir):
    proc, url = _serve(tmp_path, tiny_model_dir, "--no-train")
    try:
        out = (tmp_path / "serve.out").read_text()
        assert "training: off (--no-train)" in out, out
        assert "started trainer" not in (tmp_path / "serve.log").read_text()
    finally:
        _stop(proc)
