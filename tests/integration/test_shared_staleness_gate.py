"""The staleness gate across gateway processes: two gateways on one store (workers or
replicas) take session starts concurrently; together they admit exactly the window,
and each refusal is a 429 with retry-after in the OpenAI error shape."""

from __future__ import annotations

import asyncio

import httpx
from harness import ADMIN_KEY  # tests/integration/harness.py

WINDOW = 8
"""(max_staleness 0 + version 0 + 1) x batch_groups 2 x group_size 4."""


def test_two_processes_admit_exactly_the_window(tmp_path, tiny_model_dir, engine_url,
                                                gateway_factory):
    gate = ["gateway.staleness_gate=true", "gateway.admit_wait_s=0", "trainer.max_staleness=0",
            "trainer.batch_groups=2", "trainer.group_size=4"]
    with gateway_factory(tmp_path, tiny_model_dir, [engine_url], *gate) as one, \
            gateway_factory(tmp_path, tiny_model_dir, [engine_url], *gate) as other:

        async def starts() -> list[httpx.Response]:
            headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
            async with httpx.AsyncClient(timeout=60, headers=headers) as http:
                return await asyncio.gather(*(
                    http.post(f"{gw.url}/rl/sessions", json={"group_size": 1})
                    for _ in range(12) for gw in (one, other)))

        replies = asyncio.run(starts())
        admitted = [r for r in replies if r.status_code == 201]
        refused = [r for r in replies if r.status_code == 429]
        assert len(admitted) == WINDOW and len(refused) == 24 - WINDOW, \
            [r.status_code for r in replies]
        assert one.state.store.count_admitted_sessions() == WINDOW
        error = refused[0].json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "staleness window" in error["message"]
        assert refused[0].headers["retry-after"] == "1"
        # Both processes served some of the admitted starts (the window is one, shared).
        served = {str(r.request.url).rsplit("/rl/", 1)[0] for r in admitted}
        assert served == {one.url, other.url}
