"""One large request never stalls the others: a multi-MB prompt is rendered and tokenized
on the large-prompt worker thread (`gateway/large_prompts.py`) while `/health/liveness`
and small chats are answered as usual; past the bound, a large request gets 503
`server_busy`, never a queue without end."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
from support.harness import ADMIN_KEY

AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _big_text(chars: int, seed: int) -> str:
    """Text the tokenizer has never seen (its segment cache cannot shortcut it)."""
    rng = random.Random(seed)
    words = [
        "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(5000)
    ]
    out, size = [], 0
    while size < chars:
        word = rng.choice(words)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


async def _chat(client: httpx.AsyncClient, content: str, max_tokens: int = 2) -> httpx.Response:
    return await client.post(
        "/v1/chat/completions",
        headers=AUTH,
        json={
            "model": "m",
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content}],
        },
    )


async def _while_big_is_in_flight(gateway, big_chars: int) -> tuple[httpx.Response, list[float]]:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as client:
        await _chat(client, "warm up")
        big = asyncio.create_task(_chat(client, _big_text(big_chars, seed=big_chars)))
        await asyncio.sleep(0.3)  # the body is uploaded and its prompt being prepared
        waits = []
        while not big.done():
            start = time.perf_counter()
            live = await client.get("/health/liveness")
            waits.append(time.perf_counter() - start)
            small = await _chat(client, "hi")  # timed by the engine too: not in `waits`
            assert live.status_code == 200 and small.status_code == 200, small.text
            await asyncio.sleep(0.05)
        return await big, waits


def test_a_large_prompt_does_not_stall_health_or_small_chats(gateway, monkeypatch):
    # A context the prompt's character count cannot rule out (3M chars need at least
    # ~62k tokens by that bound), so it is prepared on the worker, then over it (~2M).
    monkeypatch.setattr(gateway.state, "context_length", 300_000)
    started = time.perf_counter()
    reply, waits = asyncio.run(_while_big_is_in_flight(gateway, 3_000_000))
    took = time.perf_counter() - started
    # Far over the tiny model's context: refused, but only after the full tokenization.
    assert reply.status_code == 400 and "context" in reply.json()["error"]["message"]
    # On the event loop the large prompt would hold every other request for its whole
    # preparation (seconds); off it, every liveness check stays quick (and small chats
    # are served meanwhile: their time also counts the shared engine, which a previous
    # test may still keep busy, so it is not what is timed).
    assert max(waits) < took / 2, (max(waits), took)
    assert len(waits) >= 3, f"the large prompt took only {took:.2f} s: too small to tell"


def test_large_prompts_over_the_bound_are_503_server_busy(
    gateway_factory, tmp_path, tiny_model_dir, engine_url
):
    async def run(gw) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gw.url, timeout=120) as client:
            return await asyncio.gather(
                *(_chat(client, _big_text(400_000, seed=i)) for i in range(3))
            )

    # engine.context_length: past the character pre-check (400k chars need at least ~8k
    # tokens), under the prompts' real length (~250k tokens).
    with gateway_factory(
        tmp_path,
        tiny_model_dir,
        [engine_url],
        "gateway.limits.offload_prompt_chars=100000",
        "engine.context_length=40000",
        "gateway.limits.offload_max_prompts=1",
    ) as gw:
        replies = asyncio.run(run(gw))
    busy = [r for r in replies if r.status_code == 503]
    assert busy and all(r.json()["error"]["code"] == "server_busy" for r in busy)
    assert all(r.headers["retry-after"] for r in busy)
    assert {r.status_code for r in replies} <= {400, 503}  # the admitted one: over context
