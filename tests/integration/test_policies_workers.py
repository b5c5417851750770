"""A policy created at runtime on one gateway worker is served by every worker:
`areal-service serve --set gateway.scale.workers=2` in front of the local engine, the
policy created through `POST /admin/policies` (one worker answers), then chats on fresh
connections (both workers answer) that name the new policy's model name are served and
recorded under it by each worker. The serving path never reads the store for policies,
so this is each worker's refresher at work."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
from support.loopback import free_port

from areal_service.config import StoreConfig
from areal_service.store import TrajectoryStore
from launcher.processes import cli_argv

ADMIN = {"Authorization": "Bearer sk-test-admin"}


def _fresh(url: str) -> httpx.Client:
    """A new connection per request, so requests spread over both workers."""
    return httpx.Client(base_url=url, timeout=60, limits=httpx.Limits(max_keepalive_connections=0))


def test_a_policy_created_on_one_worker_is_served_by_every_worker(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    port = free_port()
    sets = [
        f"data_dir={tmp_path}",
        f"engine.model={tiny_model_dir}",
        f"gateway.port={port}",
        f"engine.port={free_port()}",
        "gateway.auth.admin_key=sk-test-admin",
        "gateway.scale.workers=2",
        "trainer.lora.rank=4",
        "engine.torch_threads=1",
    ]
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(
        cli_argv("serve", "--no-train", *(a for s in sets for a in ("--set", s))),
        stdout=subprocess.DEVNULL,
        stderr=open(log, "wb"),  # noqa: SIM115
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 150
        workers: set[str] = set()
        while len(workers) < 2:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "two workers did not come up\n" + log.read_text()
            try:
                with _fresh(url) as http:
                    for _ in range(12):
                        workers.add(http.get("/health/liveness").headers["x-areal-worker"])
            except httpx.HTTPError:
                time.sleep(0.3)
        made = httpx.post(
            f"{url}/admin/policies",
            json={"name": "critic", "model_names": ["critic-model"]},
            headers=ADMIN,
            timeout=30,
        )
        assert made.status_code == 201, made.text
        creator = made.headers["x-areal-worker"]
        time.sleep(2.5)  # POLICY_REFRESH_S (1 s), with a loaded machine's slack
        served: dict[str, str] = {}
        with _fresh(url) as http:
            for i in range(16):
                reply = http.post(
                    "/v1/chat/completions",
                    headers=ADMIN,
                    json={
                        "model": "critic-model",
                        "max_tokens": 3,
                        "messages": [{"role": "user", "content": f"hi {i}"}],
                    },
                )
                assert reply.status_code == 200, reply.text
                served[reply.json()["id"]] = reply.headers["x-areal-worker"]
        assert set(served.values()) == workers, "the chats did not reach both workers"
        assert any(w != creator for w in served.values())
        store = TrajectoryStore.open(
            f"sqlite:///{(tmp_path / 'areal.db').resolve()}", StoreConfig()
        )
        try:
            deadline = time.monotonic() + 30
            while any(store.get_completion(c) is None for c in served):
                assert time.monotonic() < deadline, "completions were not stored"
                time.sleep(0.2)
            models = {c: store.get_completion(c).model for c in served}  # type: ignore[union-attr]
        finally:
            store.close()
        assert set(models.values()) == {"critic"}, models
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode is not None
