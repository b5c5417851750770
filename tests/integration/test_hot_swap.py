"""Hot swaps while agents run: 5 weight versions published while 16 agents hold
multi-turn sessions (half streaming). Zero failed requests, and the per-token versions
stored with the completions show the swaps inside them."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
from support.harness import ADMIN_KEY, run_gateway

from areal_service.types import WeightVersionRecord
from engine.testing import make_weight_variant, start_engine_in_thread

AGENTS = 16
TURNS = 3
SWAPS = 5


async def _agent(gw, session: dict, stream: bool, failures: list[str]) -> list[str]:
    client = openai.AsyncOpenAI(
        base_url=gw.v1, api_key=session["api_key"], max_retries=0, timeout=120
    )
    messages = [{"role": "user", "content": "tell me a long story"}]
    ids = []
    try:
        for turn in range(TURNS):
            try:
                if stream:
                    text, cid = "", None
                    chunks = await client.chat.completions.create(
                        model="areal-policy", messages=messages, max_tokens=48, stream=True
                    )
                    async for chunk in chunks:
                        cid = chunk.id
                        if chunk.choices and chunk.choices[0].delta.content:
                            text += chunk.choices[0].delta.content
                else:
                    reply = await client.chat.completions.create(
                        model="areal-policy", messages=messages, max_tokens=48
                    )
                    text, cid = reply.choices[0].message.content or "", reply.id
            except openai.APIError as exc:
                failures.append(f"turn {turn}: {exc!r}")
                return ids
            ids.append(cid)
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"go on ({turn})"},
            ]
    finally:
        await client.close()
    return ids


async def _publish(gw, variants, stop: asyncio.Event) -> None:
    from sqlalchemy import func, select

    from areal_service.store.schema import CompletionRow

    def completions() -> int:
        with gw.state.store.engine.connect() as c:
            return c.execute(select(func.count()).select_from(CompletionRow)).scalar_one()

    while completions() == 0:  # some tokens of version 0 first
        await asyncio.sleep(0.05)
    for version, path in enumerate(variants, start=1):
        await asyncio.sleep(0.4)
        gw.state.store.add_weight_version(WeightVersionRecord(version=version, path=str(path)))
        while gw.state.live_version < version:  # the gateway's syncer swaps the engine
            await asyncio.sleep(0.02)
    stop.set()


def test_five_swaps_under_load(tmp_path, tiny_model_dir):
    variants = [
        make_weight_variant(tiny_model_dir, tmp_path / f"v{i}", seed=100 + i)
        for i in range(1, SWAPS + 1)
    ]
    with (
        start_engine_in_thread(tiny_model_dir) as engine,
        run_gateway(
            tmp_path / "gw", tiny_model_dir, [engine], "gateway.router.weight_poll_interval_s=0.02"
        ) as gw,
    ):

        async def drive():
            failures: list[str] = []
            async with httpx.AsyncClient(base_url=gw.url, timeout=60) as http:
                started = await http.post(
                    "/rl/sessions",
                    json={"group_size": AGENTS},
                    headers={"authorization": f"Bearer {ADMIN_KEY}"},
                )
                sessions = started.json()["sessions"]
            stop = asyncio.Event()
            publisher = asyncio.create_task(_publish(gw, variants, stop))
            rounds = []
            while not stop.is_set():  # keep agents busy until every swap happened
                rounds.append(
                    await asyncio.gather(
                        *(_agent(gw, s, i % 2 == 0, failures) for i, s in enumerate(sessions))
                    )
                )
            await publisher
            return failures, [cid for r in rounds for ids in r for cid in ids]

        t0 = time.monotonic()
        failures, completion_ids = asyncio.run(drive())
        assert not failures, failures
        assert gw.state.live_version == SWAPS
        info = httpx.get(f"{engine}/model_info").json()
        assert info["weight_version"] == str(SWAPS)

        records = [gw.state.store.get_completion(c) for c in completion_ids]
        assert all(r is not None for r in records), "an acknowledged completion is missing"
        seen_versions = set()
        mixed = 0
        for r in records:
            assert len(r.output_versions) == len(r.output_ids) == len(r.output_logprobs)
            assert r.backend == engine  # streamed and not
            assert list(r.output_versions) == sorted(r.output_versions)  # never goes back
            seen_versions |= set(r.output_versions)
            mixed += len(set(r.output_versions)) > 1
        assert seen_versions == set(range(SWAPS + 1)), [
            sorted(set(r.output_versions)) for r in records
        ][:20]
        assert mixed >= 1, "no completion spans a swap"
        rows = gw.state.store.list_weight_versions()
        assert all("swap" in row.metadata for row in rows)
        assert time.monotonic() - t0 < 120
