"""Router mode against the REAL SGLang router (`sglang-router`, the Rust wheel of the
`[sglang]` extra) in front of two local engines on loopback: generation goes through the
router (a session stays on one worker under `--policy manual`; the engines join it by
`POST /workers`, as the launcher adds the servers it starts), and the gateway's
weight syncer swaps each worker the router lists, once, from disk and by broadcast
over gloo, after which both serve the new version bit-exactly. Slow (a child process
and two engines); the router runs from the first interpreter that has it
(`support/sglang_router.py`: the `[sglang]` extra here, or SGLang's CPU venv); tests/unit/test_router_mode.py covers the same split with a stand-in router."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from support.sglang_router import router_python_or_skip, run_router
from support.weight_checks import PROMPT, variant_state

from areal_service.config import load_config
from areal_service.policy_registry import PolicyRegistry
from areal_service.store import TrajectoryStore
from areal_service.types import WeightVersionRecord
from engine.testing import make_weight_variant, start_engine_in_thread
from gateway.backends import TokenRequest
from gateway.metrics import GatewayMetrics
from gateway.routing import BackendPool
from gateway.weight_sync import SyncGroup, sync_weights_once
from launcher.sglang_servers import register_with_router
from trainer.weight_broadcast import WeightBroadcaster

pytestmark = pytest.mark.slow


def _generated(engine: str) -> int:
    info = httpx.get(f"{engine}/server_info", timeout=10).json()
    return int(info["internal_states"][0]["generated_tokens"])


def greedy(max_new: int = 8) -> TokenRequest:
    return TokenRequest.for_tokens(
        PROMPT,
        {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
        rid=uuid.uuid4().hex,
    )


async def test_real_router_routes_generation_and_each_worker_swaps_once(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    variants = [
        make_weight_variant(tiny_model_dir, tmp_path / f"w{i}", seed=500 + i) for i in range(2)
    ]
    cfg = load_config(overrides=[f"data_dir={tmp_path / 'data'}", f"engine.model={tiny_model_dir}"])
    with (
        start_engine_in_thread(tiny_model_dir) as a,
        start_engine_in_thread(tiny_model_dir) as b,
        run_router(router_python_or_skip(), [], tmp_path / "router.log") as router,
    ):
        register_with_router(router, [a, b])  # what the launcher does (POST /workers)
        pool = BackendPool([], router_url=router)
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        store = TrajectoryStore.open(cfg.database_url(), cfg.store)
        state = SimpleNamespace(
            backends=pool,
            store=store,
            live_version=0,
            config=cfg,
            policy_registry=PolicyRegistry(cfg),
            metrics=GatewayMetrics(),
        )
        try:
            await pool.check_health()
            assert sorted(w.url for w in pool.backends) == sorted([a, b])
            assert all(w.healthy for w in pool.backends)

            # a session stays on one worker (X-SMG-Routing-Key, --policy manual)
            for session in ("s1", "s2"):
                before = {e: _generated(e) for e in (a, b)}
                for _ in range(3):
                    gen = await pool.generate_interruptible(greedy(), session_id=session)
                    assert gen.completion_tokens == 8 and gen.backend == router
                grown = sorted(_generated(e) - before[e] for e in (a, b))
                # one worker made the session's 24 tokens; the router's health checks
                # (`/health_generate`, every second) add a token now and then to both
                assert grown[0] < 8 and 24 <= grown[1] < 32, (session, grown)

            # disk: one pause/update/continue per worker, both on v1 after
            store.add_weight_version(WeightVersionRecord(version=1, path=str(variants[0])))
            assert await sync_weights_once(state) == 1
            state.live_version = 1
            row = store.get_weight_version(1)
            assert row.metadata["swap_mode"] == "disk"
            assert sorted(row.metadata["swap"]) == sorted([a, b])
            for e in (a, b):
                assert httpx.get(f"{e}/model_info").json()["weight_version"] == "1"
            from_disk = await pool.generate_interruptible(greedy(), session_id="s3")
            assert set(from_disk.output_versions) == {1}

            # distributed over gloo: the trainer (rank 0) broadcasts to both workers
            sender = WeightBroadcaster(
                store, backend="gloo", bucket_bytes=2**30, timeout_s=60, address="127.0.0.1"
            )
            try:
                weights = variant_state(variants[1])
                offer, buckets = sender.offer(2, weights)
                store.add_weight_version(
                    WeightVersionRecord(version=2, path=str(variants[1]), metadata={"sync": offer})
                )
                sent, synced = await asyncio.gather(
                    asyncio.to_thread(sender.send, 2, weights, offer, buckets),
                    sync_weights_once(state, SyncGroup()),
                )
            finally:
                sender.close()
            assert synced == 2 and sent["sync_sent"]["world_size"] == 3, sent
            state.live_version = 2
            assert store.get_weight_version(2).metadata["swap_mode"] == "distributed"
            by_broadcast = [
                await pool.generate_interruptible(greedy(), session_id=s) for s in ("s1", "s2")
            ]  # one per worker

            store.add_weight_version(WeightVersionRecord(version=3, path=str(variants[1])))
            assert await sync_weights_once(state) == 3
            again = [
                await pool.generate_interruptible(greedy(), session_id=s) for s in ("s1", "s2")
            ]
            for dist, disk in zip(by_broadcast, again, strict=True):
                assert set(dist.output_versions) == {2} and set(disk.output_versions) == {3}
                assert dist.output_ids == disk.output_ids  # bit-exact: same weights
                assert dist.output_logprobs == disk.output_logprobs
            assert by_broadcast[0].output_logprobs != from_disk.output_logprobs  # new weights
            swap_s = {v: store.get_weight_version(v).metadata["swap_s"] for v in (1, 2, 3)}
            print(
                f"\nswap of both workers behind the router: disk {swap_s[1] * 1e3:.1f} / "
                f"{swap_s[3] * 1e3:.1f} ms, gloo broadcast {swap_s[2] * 1e3:.1f} ms "
                "(first, forms the group)"
            )
        finally:
            await pool.aclose()
            store.close()
