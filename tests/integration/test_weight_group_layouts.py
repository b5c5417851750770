"""Distributed weight sync with servers of several ranks and with dp > 1, over gloo on
CPU: the local engine stands in for SGLang servers of other shapes
(`engine.emulate_tp_size`, `emulate_dp_size`, `emulate_dp_attention`), joining a
weight-update group with as many ranks as it reports. The gateway lays the group out by
SGLang's rule (`sglang_protocol.weight_group_layout`: `tp_size` ranks per server, also
with dp attention); a wrong offset or world size would hang or fail the rendezvous. A dp
> 1 server without dp attention cannot join (SGLang refuses it): the version goes out
from disk, and the trainer gives up its broadcast at once instead of timing out."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
from support.harness import run_gateway
from support.weight_checks import greedy, variant_state, wait_live

from areal_service.store import TrajectoryStore
from areal_service.types import WeightVersionRecord
from engine.testing import make_weight_variant, start_engine_in_thread
from trainer.weight_broadcast import WeightBroadcaster


def _broadcast(store: TrajectoryStore, version: int, variant: Path, timeout_s: float = 60) -> dict:
    """Trainer rank 0: offer the version, then broadcast (or give up) and report."""
    sender = WeightBroadcaster(
        store, backend="gloo", bucket_bytes=256 * 1024, timeout_s=timeout_s, address="127.0.0.1"
    )
    try:
        state = variant_state(variant)
        offer, buckets = sender.offer(version, state)
        store.add_weight_version(
            WeightVersionRecord(version=version, path=str(variant), metadata={"sync": offer})
        )
        return sender.send(version, state, offer, buckets)
    finally:
        sender.close()


def test_multi_rank_servers_join_at_their_offsets(tmp_path, tiny_model_dir):
    """A server of 2 ranks (tp 2, dp 2 with dp attention) and one of 1: world 1 + 2 + 1."""
    variant = make_weight_variant(tiny_model_dir, tmp_path / "w", seed=21)
    with (
        start_engine_in_thread(
            tiny_model_dir, emulate_tp_size=2, emulate_dp_size=2, emulate_dp_attention=True
        ) as a,
        start_engine_in_thread(tiny_model_dir) as b,
        run_gateway(
            tmp_path / "gw", tiny_model_dir, [a, b], "gateway.router.weight_poll_interval_s=0.01"
        ) as gw,
    ):
        info = httpx.get(f"{a}/server_info").json()
        assert (info["tp_size"], info["dp_size"], info["enable_dp_attention"]) == (2, 2, True)
        store = TrajectoryStore.open(gw.config.database_url(), gw.config.store)
        try:
            sent = _broadcast(store, 1, variant)
            assert sent.get("sync_sent", {}).get("world_size") == 4, sent
            assert wait_live(store, 1).metadata["swap_mode"] == "distributed"
            served_a, served_b = greedy(a, 8), greedy(b, 8)
            assert served_a == served_b and served_a[2] == "1"
            store.add_weight_version(WeightVersionRecord(version=2, path=str(variant)))
            assert wait_live(store, 2).metadata["swap_mode"] == "disk"
            assert greedy(a, 8)[:2] == served_a[:2]  # bit-exact with a disk load
        finally:
            store.close()


def test_a_dp_server_without_dp_attention_is_swapped_from_disk(tmp_path, tiny_model_dir):
    variant = make_weight_variant(tiny_model_dir, tmp_path / "w", seed=22)
    with (
        start_engine_in_thread(tiny_model_dir, emulate_dp_size=2) as engine,
        run_gateway(
            tmp_path / "gw", tiny_model_dir, [engine], "gateway.router.weight_poll_interval_s=0.01"
        ) as gw,
    ):
        refused = httpx.post(
            f"{engine}/init_weights_update_group",
            json={
                "master_address": "127.0.0.1",
                "master_port": 1,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": "g",
                "backend": "gloo",
            },
        )
        assert refused.status_code == 400 and "dp_size must be 1" in refused.text  # as SGLang
        store = TrajectoryStore.open(gw.config.database_url(), gw.config.store)
        try:
            sent: dict = {}
            t0 = time.monotonic()
            trainer = threading.Thread(
                target=lambda: sent.update(_broadcast(store, 1, variant, timeout_s=60))
            )
            trainer.start()
            row = wait_live(store, 1)
            trainer.join(30)
            assert not trainer.is_alive()
            assert time.monotonic() - t0 < 30  # gave up at once, not after its 60 s
            assert row.metadata["swap_mode"] == "disk"
            assert "dp_size=2" in row.metadata["sync_failed"]
            assert "sync_error" in sent, sent
            assert greedy(engine, 8)[2] == "1"
        finally:
            store.close()
