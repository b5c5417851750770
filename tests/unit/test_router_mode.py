"""Router mode (`gateway.router.url`): generation goes through SGLang's router, every
weight-control call goes to each worker the router lists, once. Against a stand-in
router (`tests/support/router_standin.py`; the real one runs in
tests/integration/test_sglang_router.py when the `sglang-router` wheel is installed)
and echo backends as workers. Also SGLang's weight-group rank rule for tp/dp/pp."""

from __future__ import annotations

import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.router_standin import run_standin_router

from areal_service.config import load_config
from areal_service.sglang_protocol import (
    UpdateWeightsResponse,
    router_worker_urls,
    weight_group_layout,
    weight_group_ranks,
)
from areal_service.types import WeightVersionRecord
from engine.echo_backend import echo_token, start_echo_backend
from gateway.backends import BackendUnavailable, TokenRequest
from gateway.routing import BackendPool
from gateway.weight_sync import swap_distributed
from launcher.sglang_servers import register_with_router, sglang_specs

PROMPT = (11, 12, 13)
SWAP = ["pause_generation", "update_weights_from_disk", "continue_generation"]


def req(max_new: int = 4) -> TokenRequest:
    return TokenRequest.for_tokens(PROMPT, {"max_new_tokens": max_new}, rid=uuid.uuid4().hex)


async def test_generation_through_the_router_swaps_to_each_worker_once(tmp_path: Path) -> None:
    with (
        start_echo_backend() as a,
        start_echo_backend() as b,
        run_standin_router([a.url, b.url]) as router,
    ):
        pool = BackendPool([], router_url=router.url)
        try:
            await pool.check_health()  # lists the workers and admits them
            assert [w.url for w in pool.backends] == [a.url, b.url]
            assert all(w.healthy for w in pool.backends)
            for session in ("s1", "s2", "s1", "s2", None):
                gen = await pool.generate_interruptible(req(), session_id=session)
                assert list(gen.output_ids) == [
                    echo_token(PROMPT[0], len(PROMPT) + i) for i in range(4)
                ]
                assert gen.backend == router.url
            # every generation went through the router, the session as its routing key,
            # and a session stayed on one worker
            assert [key for _, key in router.routed] == ["s1", "s2", "s1", "s2", None]
            assert router.routed[0][0] == router.routed[2][0]
            assert router.routed[1][0] == router.routed[3][0]
            assert {w for w, _ in router.routed} == {a.url, b.url}

            timings = await pool.swap_weights(str(tmp_path), 3)
            assert set(timings) == {a.url, b.url}
            assert a.backend.calls == SWAP and b.backend.calls == SWAP  # one swap each
            assert router.refused == []  # no control call went to the router
            gen = await pool.generate_interruptible(req(), session_id="s1")
            assert set(gen.output_versions) == {3}
        finally:
            await pool.aclose()


async def test_a_newly_listed_worker_is_synced_and_a_dropped_one_forgotten(tmp_path: Path) -> None:
    with (
        start_echo_backend() as a,
        start_echo_backend() as b,
        run_standin_router([a.url]) as router,
    ):
        pool = BackendPool([], router_url=router.url)
        try:
            await pool.check_health()
            await pool.swap_weights(str(tmp_path), 5)
            router.workers[:] = [a.url, b.url]  # the router got a new worker
            await pool.check_health()
            new = pool.backends[1]
            assert new.url == b.url and new.healthy
            assert b.backend.calls == SWAP  # re-synced to v5 before it counted as healthy
            assert (await new.client.model_info()).weight_version == "5"
            router.workers[:] = [b.url]
            await pool.check_health()
            assert [w.url for w in pool.backends] == [b.url]
        finally:
            await pool.aclose()


async def test_router_down_means_not_ready_and_no_generation() -> None:
    with start_echo_backend() as a, run_standin_router([a.url]) as router:
        pool = BackendPool([], router_url=router.url, unhealthy_after=1, probe_interval_s=0.05)
        try:
            await pool.check_health()
            assert [s.healthy for s in pool.status()] == [True, True]
            router.ready = False
            await pool.check_health()
            router_status, worker_status = pool.status()
            assert (router_status.url, router_status.healthy) == (router.url, False)
            # the worker is up but serves this gateway only through the router
            assert not worker_status.healthy and worker_status.last_error == "router down"
            with pytest.raises(BackendUnavailable):
                await pool.generate_interruptible(req(), deadline_s=0.2)
            router.ready = True
            gen = await pool.generate_interruptible(req(), deadline_s=5)
            assert gen.completion_tokens == 4
        finally:
            await pool.aclose()


async def test_aborts_fan_out_to_every_worker_and_old_routers_list_urls() -> None:
    with (
        start_echo_backend() as a,
        start_echo_backend() as b,
        run_standin_router([f"{a.url}@0", f"{a.url}@1", b.url], legacy=True) as router,
    ):
        pool = BackendPool([], router_url=router.url)
        try:
            await pool.check_health()  # /list_workers and /health of an older router
            assert [w.url for w in pool.backends] == [a.url, b.url]  # dp-aware urls: one server
            assert pool.router is not None and pool.router.healthy
            await pool.router.client.abort_request("rid-1")
            assert router.refused == []  # the abort never went to the router
        finally:
            await pool.aclose()


def test_from_config_builds_router_mode() -> None:
    cfg = load_config(overrides=["gateway.router.url=http://127.0.0.1:39999/"])
    pool = BackendPool.from_config(cfg)
    assert pool.router is not None and pool.router.url == "http://127.0.0.1:39999"
    assert pool.backends == []
    direct = BackendPool.from_config(
        load_config(overrides=["gateway.router.backends=[http://127.0.0.1:1, http://127.0.0.1:2]"])
    )
    assert direct.router is None and len(direct.backends) == 2


def test_router_worker_urls_shapes() -> None:
    assert router_worker_urls({"workers": [{"url": "http://h:1/"}, {"url": "http://h:2"}]}) == [
        "http://h:1",
        "http://h:2",
    ]
    assert router_worker_urls({"urls": ["http://h:1@0", "http://h:1@1", "http://h:3"]}) == [
        "http://h:1",
        "http://h:3",
    ]
    assert router_worker_urls({"workers": []}) == []


# -- weight-update group ranks (SGLang's rule) -------------------------------------------
def test_weight_group_ranks_follow_sglang() -> None:
    # model_runner.init_weights_update_group: rank = rank_offset + tp_rank
    assert weight_group_ranks({"tp_size": 4}) == 4
    assert weight_group_ranks({}) == 1
    # dp attention: the dp replicas live inside the tp ranks
    assert weight_group_ranks({"tp_size": 8, "dp_size": 4, "enable_dp_attention": True}) == 8
    # the tokenizer manager refuses dp > 1 without dp attention
    with pytest.raises(ValueError, match="dp_size=2"):
        weight_group_ranks({"tp_size": 1, "dp_size": 2})
    with pytest.raises(ValueError, match="pp_size=2"):
        weight_group_ranks({"tp_size": 2, "pp_size": 2})
    world, offsets = weight_group_layout(
        [{"tp_size": 1}, {"tp_size": 2}, {"tp_size": 4, "dp_size": 2, "enable_dp_attention": True}]
    )
    # trainer = rank 0; servers take 1, 2-3, 4-7
    assert (world, offsets) == (8, [1, 2, 4])


def test_dp_replica_lists_in_a_disk_reply_are_folded() -> None:
    ok = UpdateWeightsResponse.model_validate(
        {"success": [True, True], "message": ["a", "b"], "num_paused_requests": [0, 1]}
    )
    assert (ok.success, ok.message, ok.num_paused_requests) == (True, "a | b", 1)
    assert not UpdateWeightsResponse.model_validate(
        {"success": [True, False], "message": "x"}
    ).success


async def test_a_dp_server_is_refused_before_anything_is_paused() -> None:
    """A dp=2 server cannot join: the distributed swap fails before any pause and before
    the row names a world size (so the trainer gives up at once and the syncer swaps
    from disk)."""
    with start_echo_backend() as a:
        pool = BackendPool([a.url])
        backend = pool.backends[0]

        async def dp_server_info() -> dict:
            return {"tp_size": 1, "dp_size": 2}

        backend.client.server_info = dp_server_info  # type: ignore[method-assign]
        state = SimpleNamespace(backends=pool, store=None)
        offer = {"group_name": "g", "master_address": "127.0.0.1", "master_port": 1, "buckets": []}
        try:
            with pytest.raises(ValueError, match="dp_size=2"):
                await swap_distributed(
                    state,
                    WeightVersionRecord(version=1, path="x"),  # type: ignore[arg-type]
                    offer,
                )
            assert a.backend.calls == []
        finally:
            await pool.aclose()


# -- launcher: servers join the router -----------------------------------------------------
@pytest.mark.parametrize("legacy", [False, True])
def test_launched_servers_are_added_to_the_router(legacy: bool) -> None:
    with run_standin_router(["http://10.0.0.1:30000"], legacy=legacy) as router:
        register_with_router(router.url, ["http://10.0.0.2:30000/", "http://10.0.0.1:30000"])
        assert router.workers == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]
        router.drop_adds = True  # accepted, never listed: the launcher does not hang
        with pytest.raises(TimeoutError, match="10.0.0.3"):
            register_with_router(router.url, ["http://10.0.0.3:30000"], timeout_s=0.3)


def test_dp_attention_servers_take_tp_gpus() -> None:
    base = [
        "engine.sglang.gpus=[0,1,2,3,4,5,6,7]",
        "engine.sglang.tp_size=2",
        "engine.sglang.dp_size=2",
        "engine.model=/m",
    ]
    assert len(sglang_specs(load_config(overrides=base))) == 2  # 4 GPUs per server
    dpa = load_config(overrides=[*base, "engine.sglang.extra_args=[--enable-dp-attention]"])
    specs = sglang_specs(dpa)
    assert len(specs) == 4 and specs[1].env["CUDA_VISIBLE_DEVICES"] == "2,3"
