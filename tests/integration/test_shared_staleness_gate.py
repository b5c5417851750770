"""The staleness gate across gateway processes: two gateways on one store (workers or
replicas) take session starts concurrently; together they admit exactly the window,
and each refusal is a 429 with retry-after in the OpenAI error shape."""

from __future__ import annotations

import asyncio

import httpx
from support.harness import ADMIN_KEY

WINDOW = 8
"""(max_staleness 0 + version 0 + 1) x batch_groups 2 x group_size 4."""


def test_two_processes_admit_exactly_the_window(
    tmp_path, tiny_model_dir, engine_url, gateway_factory
):
    gate = [
        "gateway.sessions.staleness_gate=true",
        "gateway.sessions.admit_wait_s=0",
        "trainer.max_staleness=0",
        "trainer.batch_groups=2",
        "trainer.group_size=4",
    ]
    with (
        gateway_factory(tmp_path, tiny_model_dir, [engine_url], *gate) as one,
        gateway_factory(tmp_path, tiny_model_dir, [engine_url], *gate) as other,
    ):
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}

        async def starts() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60, headers=headers) as http:
                # One start through each process first, so both provably take from the
                # one shared window (a race alone may let one process fill it), then
                # the rest race each other across the two processes.
                first = [
                    await http.post(f"{gw.url}/rl/sessions", json={"group_size": 1})
                    for gw in (one, other)
                ]
                return first + list(
                    await asyncio.gather(
                        *(
                            http.post(f"{gw.url}/rl/sessions", json={"group_size": 1})
                            for _ in range(11)
                            for gw in (one, other)
                        )
                    )
                )

        replies = asyncio.run(starts())
        assert [r.status_code for r in replies[:2]] == [201, 201]
        admitted = [r for r in replies if r.status_code == 201]
        refused = [r for r in replies if r.status_code == 429]
        assert len(admitted) == WINDOW and len(refused) == 24 - WINDOW, [
            r.status_code for r in replies
        ]
        assert one.state.store.count_admitted_sessions() == WINDOW
        assert other.state.store.count_admitted_sessions() == WINDOW
        error = refused[0].json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "staleness window" in error["message"]
        assert refused[0].headers["retry-after"] == "1"
