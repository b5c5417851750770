"""Hot swaps under load, as the real-engine tests (vLLM, SGLang) drive them: agents chat
through the gateway (half streamed) while versions are published; what each request saw."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

import openai

from areal_service.types import WeightVersionRecord
from support.harness import ADMIN_KEY

QUESTION = [{"role": "user", "content": "What is 3 + 4? Answer with the number only."}]


async def chat_loop(
    gw,
    stream: bool,
    stop: asyncio.Event,
    failures: list[str],
    done: list[tuple[int, str]],
    max_tokens: int,
) -> None:
    """Chats until `stop`; `done` gets (live version when it started, completion id)."""
    client = openai.AsyncOpenAI(base_url=gw.v1, api_key=ADMIN_KEY, max_retries=0, timeout=300)
    try:
        while not stop.is_set():
            live = gw.state.live_version
            try:
                if stream:
                    cid = None
                    async for chunk in await client.chat.completions.create(
                        model="m", messages=QUESTION, max_tokens=max_tokens, stream=True
                    ):
                        cid = chunk.id
                else:
                    reply = await client.chat.completions.create(
                        model="m", messages=QUESTION, max_tokens=max_tokens
                    )
                    cid = reply.id
                done.append((live, cid))
            except openai.APIError as exc:
                failures.append(repr(exc))
    finally:
        await client.close()


Publish = Callable[[int, Path], None]
"""Publishes checkpoint folder `path` as version `n` (blocking: run on a thread)."""


def swaps_under_load(
    gw,
    versions: Sequence[Path],
    *,
    per_version: int,
    after_last: int,
    max_tokens: int,
    publish: Publish | None = None,
) -> tuple[list[str], list[tuple[int, str]]]:
    """Six agents chat while `versions` are published as 1, 2, ... (each after
    `per_version` more completions, waiting until it is live); they stop once
    `after_last` requests begun on the last version finished. (failures, done).
    `publish`: how a version is published (default: its row, a swap from disk)."""
    store = gw.state.store

    def on_disk(version: int, path: Path) -> None:
        store.add_weight_version(WeightVersionRecord(version=version, path=str(path)))

    publish = publish or on_disk

    async def drive() -> tuple[list[str], list[tuple[int, str]]]:
        stop = asyncio.Event()
        failures: list[str] = []
        done: list[tuple[int, str]] = []
        agents = [
            asyncio.create_task(chat_loop(gw, i % 2 == 0, stop, failures, done, max_tokens))
            for i in range(6)
        ]
        for version, path in enumerate(versions, start=1):
            while len(done) < per_version * version:
                await asyncio.sleep(0.05)
            await asyncio.to_thread(publish, version, path)
            while gw.state.live_version < version:
                await asyncio.sleep(0.05)
        while sum(live == len(versions) for live, _ in done) < after_last:
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.gather(*agents)
        return failures, done

    return asyncio.run(drive())
