"""`launch --scheduler ray` on a local Ray instance (CPU): the local engine, the gateway
and the trainer each run by an actor inside the launch's placement groups, the gateway
serving chat from the engine it was given, and everything gone after `stop()`."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from support.loopback import free_port, pid_alive

from areal_service.config import load_config

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install '.[ray]')")

pytestmark = pytest.mark.slow


def test_ray_places_engine_gateway_and_trainer(tmp_path, tiny_model_dir):
    from ray.util import placement_group_table

    from launcher.ray_cluster import RayDeployment

    cfg = load_config(
        None,
        [
            f"data_dir={tmp_path}",
            f"engine.model={tiny_model_dir}",
            f"engine.port={free_port()}",
            f"gateway.port={free_port()}",
            "gateway.auth.admin_key=sk-ray-admin",
            "engine.torch_threads=1",
            "trainer.torch_threads=1",
            "cluster.n_nodes=1",
            "cluster.n_gpus_per_node=0",
        ],
    )
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    deployment = RayDeployment(cfg, tmp_path / "launch")
    pids: list[int] = []
    try:
        deployment.start()
        # placement: every actor sits on the node its placement-group bundle reserved
        tables = [placement_group_table(pg) for pg in deployment.groups]
        assert [t["state"] for t in tables] == ["CREATED", "CREATED"]
        assert [len(t["bundles"]) for t in tables] == [2, 1]  # engine + gateway; trainer
        serve_nodes = tables[0]["bundles_to_node_id"]
        assert deployment.engines[0].node["node_id"] == serve_nodes[0]
        assert deployment.gateway.node["node_id"] == serve_nodes[1]
        assert deployment.trainers[0].node["node_id"] == tables[1]["bundles_to_node_id"][0]
        # the same code paths: the gateway routes to the engine Ray placed
        assert deployment.backends == [
            f"http://{deployment.engines[0].node['ip']}:{cfg.engine.port}"
        ]
        client = openai.OpenAI(
            base_url=f"{deployment.gateway_url}/v1", api_key="sk-ray-admin", max_retries=0
        )
        reply = client.chat.completions.create(
            model=cfg.gateway.model_name, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.choices[0].message.content is not None
        # the trainer runs (waiting for episodes) under its actor
        time.sleep(2)
        assert ray.get(deployment.trainers[0].actor.poll.remote()) is None
        children = [deployment.engines[0], deployment.gateway, deployment.trainers[0]]
        assert [ray.get(r.actor.poll.remote()) for r in children] == [None, None, None]
        pids = [r.pid for r in children]
        assert all(pid and pid_alive(pid) for pid in pids)
    finally:
        gateway_url = deployment.gateway.url if deployment.gateway else None
        deployment.stop()
        ray.shutdown()
    assert deployment.groups == [] and deployment.engines == []
    assert not any(pid_alive(pid) for pid in pids)
    if gateway_url:
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{gateway_url}/health/liveness", timeout=2)
    assert (tmp_path / "logs" / "engine-0.log").exists()
    assert (tmp_path / "logs" / "trainer-0.log").exists()
