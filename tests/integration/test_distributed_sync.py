"""Distributed weight sync over gloo, end to end on CPU: the trainer's broadcaster (rank 0
of a weight-update group) offers a version through the store, the real gateway's syncer
pauses the real local engine, has it join the group and receive the buckets, then
continues. The engine then serves the new version bit-exactly: the same greedy tokens
and logprobs as after a disk update of the same weights. Prints sync time of both paths
measured in the same run."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
from support.harness import ADMIN_KEY, run_gateway
from support.trainer_run import train_in_thread
from support.weight_checks import greedy, variant_state, wait_live

from areal_service.store import TrajectoryStore
from areal_service.types import WeightVersionRecord
from engine.testing import make_weight_variant, start_engine_in_thread
from trainer.weight_broadcast import WeightBroadcaster, plan_buckets

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
ROUNDS = 4
DEFAULT_BUCKET = 1024 * 2**20  # trainer.weight_sync_bucket_mb's default


def _publish_distributed(
    sender: WeightBroadcaster,
    store: TrajectoryStore,
    version: int,
    variant: Path,
    bucket_bytes: int,
) -> dict:
    """What trainer rank 0 does: insert the row with the offer, then broadcast."""
    sender.bucket_bytes = bucket_bytes
    state = variant_state(variant)
    offer, buckets = sender.offer(version, state)
    store.add_weight_version(
        WeightVersionRecord(version=version, path=str(variant), metadata={"sync": offer})
    )
    return sender.send(version, state, offer, buckets)


def test_plan_buckets_splits_by_bytes(tiny_model_dir):
    state = variant_state(Path(tiny_model_dir))
    sizes = {n: t.numel() * t.element_size() for n, t in state.items()}
    buckets = plan_buckets(state, bucket_bytes=max(sizes.values()))
    assert [n for b in buckets for n in b.names] == list(state)  # every tensor, in order
    assert len(buckets) > 1
    assert all(b.nbytes <= max(sizes.values()) for b in buckets)
    assert all(d == "float32" for b in buckets for d in b.dtypes)
    assert len(plan_buckets(state, bucket_bytes=2**40)) == 1


def test_distributed_update_serves_new_version_bit_exactly(tmp_path, tiny_model_dir):
    """Round 0 in 64 KB buckets (many calls), the others in the default 1 GB (one call,
    what a real run of the tiny model does); only those are timed against disk."""
    variants = [
        make_weight_variant(tiny_model_dir, tmp_path / f"w{i}", seed=300 + i) for i in range(ROUNDS)
    ]
    with (
        start_engine_in_thread(tiny_model_dir) as engine,
        run_gateway(
            tmp_path / "gw", tiny_model_dir, [engine], "gateway.router.weight_poll_interval_s=0.01"
        ) as gw,
    ):
        store = TrajectoryStore.open(gw.config.database_url(), gw.config.store)  # the trainer's own
        sender = WeightBroadcaster(
            store, backend="gloo", bucket_bytes=DEFAULT_BUCKET, timeout_s=60, address="127.0.0.1"
        )
        try:
            before = greedy(engine)
            dist_s, disk_s, version = [], [], 0
            for k, variant in enumerate(variants):
                # distributed: v = 2k+1, then the same weights from disk: v = 2k+2
                version += 1
                bucket_bytes = 64 * 1024 if k == 0 else DEFAULT_BUCKET
                sent = _publish_distributed(sender, store, version, variant, bucket_bytes)
                assert "sync_sent" in sent, sent
                assert (sent["sync_sent"]["buckets"] > 1) == (k == 0)
                # the first swap forms the group; later ones reuse it (same backends)
                assert sent["sync_sent"]["reused_group"] == (k > 0)
                row = wait_live(gw.state.store, version)
                assert row.metadata["swap_mode"] == "distributed"
                by_broadcast = greedy(engine)
                dist_row_s = row.metadata["swap_s"]

                version += 1
                store.add_weight_version(WeightVersionRecord(version=version, path=str(variant)))
                row = wait_live(gw.state.store, version)
                assert row.metadata["swap_mode"] == "disk"
                from_disk = greedy(engine)
                if k:
                    dist_s.append(dist_row_s)
                    disk_s.append(row.metadata["swap_s"])

                assert by_broadcast[2] == str(version - 1) and from_disk[2] == str(version)
                assert by_broadcast[:2] == from_disk[:2]  # ids and logprobs, bit-exact
                assert by_broadcast[:2] != before[:2]  # the weights did change
            n = len(dist_s)
            print(
                f"\ngateway swap time of the tiny model ({n} rounds each, one bucket, "
                f"gloo): distributed min {min(dist_s) * 1e3:.1f} ms median "
                f"{sorted(dist_s)[n // 2] * 1e3:.1f} ms; disk min {min(disk_s) * 1e3:.1f} ms "
                f"median {sorted(disk_s)[n // 2] * 1e3:.1f} ms"
            )
        finally:
            sender.close()
            store.close()


def test_expired_offer_falls_back_to_disk(tmp_path, tiny_model_dir):
    """Nobody broadcasts (the trainer gave up): the gateway swaps from the disk copy."""
    variant = make_weight_variant(tiny_model_dir, tmp_path / "w", seed=7)
    with (
        start_engine_in_thread(tiny_model_dir) as engine,
        run_gateway(
            tmp_path / "gw", tiny_model_dir, [engine], "gateway.router.weight_poll_interval_s=0.01"
        ) as gw,
    ):
        store = gw.state.store
        store.add_weight_version(
            WeightVersionRecord(
                version=1,
                path=str(variant),
                metadata={
                    "sync": {
                        "mode": "distributed",
                        "master_address": "127.0.0.1",
                        "master_port": 1,
                        "group_name": "g",
                        "backend": "gloo",
                        "buckets": [],
                        "expires_at": time.time() - 1,
                    }
                },
            )
        )
        row = wait_live(gw.state.store, 1)
        assert row.metadata["swap_mode"] == "disk"
        assert greedy(engine)[2] == "1"


def test_trainer_gives_up_when_no_gateway_takes_the_offer(tmp_path, tiny_model_dir):
    """No gateway: the offer expires, the trainer records sync_error and moves on."""
    from areal_service.config import load_config

    cfg = load_config(overrides=[f"data_dir={tmp_path}", f"engine.model={tiny_model_dir}"])
    store = TrajectoryStore.open(cfg.database_url(), cfg.store)
    try:
        sender = WeightBroadcaster(
            store, backend="gloo", bucket_bytes=2**20, timeout_s=0.3, address="127.0.0.1"
        )
        state = variant_state(Path(tiny_model_dir))
        offer, buckets = sender.offer(1, state)
        store.add_weight_version(WeightVersionRecord(version=1, path="x", metadata={"sync": offer}))
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(sender.send(1, state, offer, buckets)))
        t.start()
        t.join(10)
        assert "sync_error" in result
        assert "sync_error" in store.get_weight_version(1).metadata
    finally:
        store.close()


def _episodes(gw, n_groups: int) -> None:
    http = httpx.Client(base_url=gw.url, timeout=60)
    for g in range(n_groups):
        started = http.post("/rl/sessions", json={"group_size": 2}, headers=ADMIN)
        assert started.status_code == 201, started.text
        for j, s in enumerate(started.json()["sessions"]):
            auth = {"authorization": f"Bearer {s['api_key']}"}
            reply = http.post(
                "/v1/chat/completions",
                headers=auth,
                json={
                    "model": "areal-policy",
                    "max_tokens": 8,
                    "messages": [{"role": "user", "content": f"count to {g}"}],
                },
            )
            assert reply.status_code == 200, reply.text
            reward = http.post(
                "/v1/rewards",
                headers=auth,
                json={"session_id": s["session_id"], "value": float(j), "end_session": True},
            )
            assert reward.status_code == 201, reward.text


def test_trainer_publishes_by_broadcast_end_to_end(tmp_path, tiny_model_dir):
    """The real trainer loop (FSDP2, world size 1) with `trainer.weight_sync=distributed`:
    both versions reach the engine by broadcast (the second in the reused group), and
    what it serves equals a disk load of the copy the trainer wrote."""
    overrides = (
        "trainer.group_size=2",
        "trainer.batch_groups=2",
        "trainer.lr=1e-3",
        "trainer.total_steps=2",
        "gateway.sessions.staleness_gate=false",
        "trainer.weight_sync=distributed",
        "trainer.weight_sync_address=127.0.0.1",
        "gateway.router.weight_poll_interval_s=0.01",
    )
    with (
        start_engine_in_thread(tiny_model_dir) as engine,
        run_gateway(tmp_path, tiny_model_dir, [engine], *overrides) as gw,
    ):
        _episodes(gw, n_groups=4)
        train_in_thread(gw.config, timeout_s=180)
        rows = [wait_live(gw.state.store, v) for v in (1, 2)]
        for row in rows:
            assert row.metadata["swap_mode"] == "distributed", row.metadata
        assert [r.metadata["sync_sent"]["reused_group"] for r in rows] == [False, True]
        by_broadcast = greedy(engine)
        assert by_broadcast[2] == "2"
        store = gw.state.store
        store.add_weight_version(
            WeightVersionRecord(version=3, path=str(tmp_path / "weights" / "v2"))
        )
        assert wait_live(gw.state.store, 3).metadata["swap_mode"] == "disk"
        from_disk = greedy(engine)
        assert by_broadcast[:2] == from_disk[:2]


def test_two_backends_join_as_ranks_1_and_2(tmp_path, tiny_model_dir):
    """Two engines: one group of world size 3 (trainer + 2), both serve the broadcast."""
    variant = make_weight_variant(tiny_model_dir, tmp_path / "w", seed=11)
    with (
        start_engine_in_thread(tiny_model_dir) as a,
        start_engine_in_thread(tiny_model_dir) as b,
        run_gateway(
            tmp_path / "gw", tiny_model_dir, [a, b], "gateway.router.weight_poll_interval_s=0.01"
        ) as gw,
    ):
        store = TrajectoryStore.open(gw.config.database_url(), gw.config.store)
        sender = WeightBroadcaster(
            store, backend="gloo", bucket_bytes=256 * 1024, timeout_s=60, address="127.0.0.1"
        )
        try:
            sent = _publish_distributed(sender, store, 1, variant, 256 * 1024)
            assert sent["sync_sent"]["world_size"] == 3, sent
            assert wait_live(gw.state.store, 1).metadata["swap_mode"] == "distributed"
            served_a, served_b = greedy(a), greedy(b)
            assert served_a == served_b and served_a[2] == "1"
        finally:
            sender.close()
            store.close()


def test_the_weight_update_session_is_sglangs(tiny_model_dir):
    """The local engine keeps SGLang 0.5.23's rule: a distributed update outside
    `/begin_weight_update` ... `/end_weight_update` is refused, and so is a second begin;
    the gateway's client closes a session left open (a gateway that died mid-swap) and
    opens a new one."""
    import asyncio

    from gateway.backends.sglang import SGLangClient

    bucket = {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "none"}
    with start_engine_in_thread(tiny_model_dir) as engine:
        refused = httpx.post(f"{engine}/update_weights_from_distributed", json=bucket)
        assert refused.status_code == 400
        assert "between begin_weight_update() and end_weight_update()" in refused.text
        assert httpx.post(f"{engine}/begin_weight_update", json={}).status_code == 200
        again = httpx.post(f"{engine}/begin_weight_update", json={})
        assert again.status_code == 400 and "already open" in again.text

        async def reopen_and_close() -> None:
            async with SGLangClient(engine) as client:
                await client.begin_weight_update()  # left open above: closed, reopened
                await client.end_weight_update()

        asyncio.run(reopen_and_close())
        closed = httpx.post(f"{engine}/end_weight_update", json={})
        assert closed.status_code == 400 and "no weight-update session" in closed.text
