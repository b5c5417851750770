"""Policies with their own full weights (`policies[].weights: full`, issue 29): the
config's combinations, where each policy's engines are, the gateway's pools for them, and
the local engine `serve` starts for such a policy (a real child process)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from support.loopback import free_port

from areal_service.config import DEFAULT_POLICY, ServiceConfig, load_config, save_config
from areal_service.serving_plan import ServingPlan
from gateway.policy_pools import build_policy_pools, close_policy_pools
from launcher.policy_engines import (
    local_policy_engines,
    policy_engine_config,
    start_policy_engines,
    stop_policy_engines,
)

LORA = {"rank": 4, "alpha": 8.0}


def _config(**tree: object) -> ServiceConfig:
    return ServiceConfig.model_validate(tree)


def test_full_weight_policies_need_no_trainer_lora_and_train_every_weight() -> None:
    config = _config(policies=[{"name": "critic", "weights": "full"}])
    plan = ServingPlan(config)
    assert config.default_policy.lora is None
    assert [p.name for p in plan.full_weight()] == ["critic"]
    assert plan.lora("critic") is None and plan["critic"].own_pool
    # Beside LoRA policies: the default's adapter shape is theirs, not the critic's.
    mixed = _config(
        trainer={"lora": LORA},
        policies=[{"name": "solver"}, {"name": "critic", "weights": "full"}],
    )
    mixed_plan = ServingPlan(mixed)
    assert [p.name for p in mixed_plan.full_weight()] == ["critic"]
    solver = mixed_plan.lora("solver")
    assert solver is not None and solver.rank == 4
    assert mixed_plan.lora("critic") is None
    assert mixed_plan.lora(DEFAULT_POLICY) is not None


def test_each_full_weight_policy_gets_its_own_backends() -> None:
    config = _config(
        engine={"host": "127.0.0.1", "port": 31000},
        policies=[
            {"name": "a", "weights": "full"},
            {"name": "b", "weights": "full", "port": 32000},
            {"name": "c", "weights": "full", "backends": ["http://gpu-7:30000/"]},
            {"name": "d", "weights": "full"},
        ],
    )
    assert config.backend_urls() == ["http://127.0.0.1:31000"]
    urls = {p.name: list(p.backend_urls) for p in ServingPlan(config).full_weight()}
    assert urls == {
        "a": ["http://127.0.0.1:31001"],
        "b": ["http://127.0.0.1:32000"],
        "c": ["http://gpu-7:30000"],
        "d": ["http://127.0.0.1:31004"],  # engine.port + its place among the full ones
    }
    assert local_policy_engines(config) == {"a": 31001, "b": 32000, "d": 31004}
    with pytest.raises(KeyError):
        ServingPlan(config)["nobody"]


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        (
            {"policies": [{"name": "a", "weights": "full", "lora": LORA}]},
            "drop its lora section",
        ),
        (
            {"trainer": {"lora": LORA}, "policies": [{"name": "a", "backends": ["http://x:1"]}]},
            "backends and port are for weights: full",
        ),
        ({"trainer": {"lora": LORA}, "policies": [{"name": "a", "port": 9}]}, "weights: full"),
        (
            {"policies": [{"name": "a", "weights": "full", "backends": ["http://x:1"], "port": 9}]},
            "not both",
        ),
        ({"policies": [{"name": "a", "weights": "fat"}]}, "'lora' or 'full'"),
        (
            {"policies": [{"name": "a", "weights": "full"}, {"name": "b"}]},
            "set default_policy.lora",
        ),
        (
            {"gateway": {"port": 30001}, "policies": [{"name": "a", "weights": "full"}]},
            "also gateway.port",
        ),
        (
            {"policies": [{"name": "a", "weights": "full", "port": 30000}]},
            "also serves the main pool",
        ),
        (
            {
                "gateway": {"router": {"backends": ["http://e:1"]}},
                "policies": [{"name": "a", "weights": "full", "port": 30000}],
            },
            "also engine.port",
        ),
        (
            {
                "policies": [
                    {"name": "a", "weights": "full", "port": 30005},
                    {"name": "b", "weights": "full", "port": 30005},
                ]
            },
            "also policy 'a'",
        ),
        (
            {
                "gateway": {"router": {"backends": ["http://e:1"]}},
                "policies": [{"name": "a", "weights": "full", "backends": ["http://e:1/"]}],
            },
            "also serves the main pool",
        ),
        (
            {"engine": {"port": 0}, "policies": [{"name": "a", "weights": "full"}]},
            "engine.port 0",
        ),
        (
            {
                "trainer": {"policy": "a", "weight_sync": "distributed"},
                "policies": [{"name": "a", "weights": "full"}],
            },
            "set trainer.weight_sync=disk",
        ),
    ],
)
def test_bad_full_weight_policies_are_refused(tree: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ServiceConfig.model_validate(tree)


async def test_the_gateway_builds_a_pool_per_full_weight_policy() -> None:
    config = _config(
        trainer={"lora": LORA},
        policies=[
            {"name": "solver"},
            {"name": "critic", "weights": "full", "backends": ["http://127.0.0.1:1", "http://h:2"]},
        ],
    )
    pools = build_policy_pools(config, lambda: False)
    try:
        assert set(pools) == {"critic"}  # LoRA policies stay on the main pool
        assert [b.url for b in pools["critic"].backends] == ["http://127.0.0.1:1", "http://h:2"]
        assert pools["critic"].may_swap() is False  # a follower waits for the leader's re-sync
    finally:
        await close_policy_pools(pools)
    assert build_policy_pools(_config(trainer={"lora": LORA}, policies=[{"name": "s"}])) == {}


def test_a_policy_engine_config_reloads_with_its_port(tmp_path: Path) -> None:
    config = _config(
        data_dir=str(tmp_path),
        trainer={"policy": "critic"},
        policies=[{"name": "critic", "weights": "full", "port": 30000 + 7}],
    )
    saved = save_config(policy_engine_config(config, 30007), tmp_path / "engine-critic.yaml")
    # Moving engine.port onto the policy's own port must not trip the ports check.
    reloaded = load_config(saved)
    assert reloaded.engine.port == 30007 and reloaded.policies == []
    assert reloaded.trainer.policy == DEFAULT_POLICY


@pytest.mark.processes
def test_serve_starts_and_stops_a_local_engine_per_full_weight_policy(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    port = free_port()
    config = load_config(
        overrides=[
            f"data_dir={tmp_path}",
            f"engine.model={tiny_model_dir}",
            f"engine.port={free_port()}",
            "engine.torch_threads=1",
            f"policies=[{{name: critic, weights: full, port: {port}}}, "
            "{name: judge, weights: full, backends: ['http://127.0.0.1:9']}]",
        ]
    )
    engines = start_policy_engines(config)  # only the critic's: the judge's is given
    try:
        assert [e.name for e in engines] == ["engine-critic"]
        info = httpx.get(f"http://127.0.0.1:{port}/model_info", timeout=10).json()
        assert info["weight_version"] == "default"  # the base checkpoint, the critic's v0
    finally:
        stop_policy_engines(engines)
    assert all(e.proc.poll() is not None for e in engines)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


async def test_a_follower_adopts_each_full_weight_policys_live_version(store) -> None:
    """A gateway process that does not lead the swaps takes each full-weight policy's
    version once the leader made it live, and aims its pool's re-syncs at it."""
    from types import SimpleNamespace

    from areal_service.types import WeightVersionRecord
    from gateway.policy_pools import follow_full_policies

    config = _config(
        policies=[
            {"name": "critic", "weights": "full", "backends": ["http://127.0.0.1:1"]},
            {"name": "judge", "weights": "full", "backends": ["http://127.0.0.1:2"]},
        ]
    )
    pools = build_policy_pools(config, lambda: False)
    state: Any = SimpleNamespace(policy_pools=pools, store=store, policy_versions={})
    try:
        store.add_weight_version(WeightVersionRecord(version=1, path="/c1", policy="critic"))
        await follow_full_policies(state)  # published, not live yet: nothing to adopt
        assert state.policy_versions == {} and pools["critic"].target is None
        store.update_weight_version_metadata(1, {"live_at": 5.0}, "critic")
        store.add_weight_version(WeightVersionRecord(version=2, path="/c2", policy="critic"))
        store.add_weight_version(WeightVersionRecord(version=1, path="/d1", metadata={}))
        store.update_weight_version_metadata(1, {"live_at": 6.0})  # the default policy's v1
        await follow_full_policies(state)
        assert state.policy_versions == {"critic": 1}
        assert pools["critic"].target == ("/c1", 1) and pools["judge"].target is None
    finally:
        await close_policy_pools(pools)
