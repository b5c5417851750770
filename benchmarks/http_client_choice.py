"""Which HTTP client should the gateway forward with? Measured, not guessed.

Against the echo backend (a child process, so its CPU is not counted), C concurrent
workers send N `POST /generate` requests through each candidate client; we report
req/s and client-process CPU milliseconds per request (`time.process_time`). CPU per
request is the number that matters on a 2-core gateway host: wall req/s moves with
whatever else the machine runs. Run: `python -m benchmarks.http_client_choice
[--requests 4000] [--concurrency 64] [--delay-ms 0] [--stream] [--no-uvloop]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import httpx

from engine.echo_backend import start_echo_backend

Post = Callable[[dict[str, Any]], Awaitable[int]]
"""Send one /generate request; return the number of output ids received."""


def _payload(i: int, stream: bool) -> dict[str, Any]:
    return {
        "input_ids": list(range(1 + i % 7, 65 + i % 7)),
        "rid": f"bench-{i:08d}",
        "sampling_params": {"max_new_tokens": 32, "temperature": 1.0},
        "return_logprob": True,
        "stream": stream,
    }


def _last_sse(lines: list[bytes]) -> int:
    """Output id count in the last `data:` chunk before [DONE]."""
    last = b""
    for line in lines:
        if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
            last = line[6:]
    return len(json.loads(last)["output_ids"])


# -- candidates: each returns (post, close) ----------------------------------------------
async def httpx_default(url: str, n_conn: int, stream: bool) -> tuple[Post, Callable]:
    client = httpx.AsyncClient(base_url=url, timeout=60)
    return _httpx_post(client, stream), client.aclose


async def httpx_tuned(url: str, n_conn: int, stream: bool) -> tuple[Post, Callable]:
    limits = httpx.Limits(
        max_connections=n_conn, max_keepalive_connections=n_conn, keepalive_expiry=60
    )
    client = httpx.AsyncClient(
        base_url=url, timeout=60, limits=limits, http1=True, http2=False, trust_env=False
    )
    return _httpx_post(client, stream), client.aclose


async def httpx_sharded(url: str, n_conn: int, stream: bool) -> tuple[Post, Callable]:
    """8 independent httpx pools of n_conn/8 connections each (round-robin)."""
    shards = 8
    limits = httpx.Limits(
        max_connections=max(1, n_conn // shards), max_keepalive_connections=max(1, n_conn // shards)
    )
    clients = [
        httpx.AsyncClient(base_url=url, timeout=60, limits=limits, trust_env=False)
        for _ in range(shards)
    ]
    posts = [_httpx_post(c, stream) for c in clients]
    counter = iter(range(1 << 62))

    async def post(p: dict[str, Any]) -> int:
        return await posts[next(counter) % shards](p)

    async def close() -> None:
        for c in clients:
            await c.aclose()

    return post, close


async def httpx2_tuned(url: str, n_conn: int, stream: bool) -> tuple[Post, Callable]:
    """httpx2 (openai-python's transport) with the same tuned limits."""
    import httpx2

    limits = httpx2.Limits(max_connections=n_conn, max_keepalive_connections=n_conn)
    client = httpx2.AsyncClient(base_url=url, timeout=60, limits=limits, trust_env=False)
    return _httpx_post(client, stream), client.aclose


def _httpx_post(client: Any, stream: bool) -> Post:
    async def post(p: dict[str, Any]) -> int:
        if not stream:
            r = await client.post("/generate", json=p)
            r.raise_for_status()
            return len(r.json()["output_ids"])
        async with client.stream("POST", "/generate", json=p) as r:
            r.raise_for_status()
            return _last_sse([line.encode() async for line in r.aiter_lines()])

    return post


async def aiohttp_connector(url: str, n_conn: int, stream: bool) -> tuple[Post, Callable]:
    connector = aiohttp.TCPConnector(
        limit=n_conn, limit_per_host=0, keepalive_timeout=60, enable_cleanup_closed=False
    )
    session = aiohttp.ClientSession(
        url, connector=connector, timeout=aiohttp.ClientTimeout(total=60)
    )

    async def post(p: dict[str, Any]) -> int:
        async with session.post("/generate", json=p) as r:
            r.raise_for_status()
            if not stream:
                return len((await r.json())["output_ids"])
            return _last_sse([line async for line in r.content])

    return post, session.close


async def raw_keepalive(url: str, n_conn: int, stream: bool) -> tuple[Post, Callable]:
    """Hand-written HTTP/1.1 keep-alive pool on asyncio streams (the floor)."""
    host, port = url.removeprefix("http://").split(":")
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    slots = asyncio.Semaphore(n_conn)

    async def post(p: dict[str, Any]) -> int:
        async with slots:
            conn = idle.pop() if idle else await asyncio.open_connection(host, int(port))
            reader, writer = conn
            body = json.dumps(p).encode()
            writer.write(
                b"POST /generate HTTP/1.1\r\nHost: %s\r\nContent-Type: "
                b"application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (host.encode(), len(body), body)
            )
            head = (await reader.readuntil(b"\r\n\r\n")).lower()
            if b"transfer-encoding: chunked" in head:
                data = await _read_chunked(reader)
                n = _last_sse(data.split(b"\n"))
            else:
                length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
                n = len(json.loads(await reader.readexactly(length))["output_ids"])
            idle.append(conn)
            return n

    async def close() -> None:
        for _, w in idle:
            w.close()

    return post, close


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while size := int(await reader.readuntil(b"\r\n"), 16):
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)
    await reader.readexactly(2)
    return b"".join(parts)


async def sglang_client(url: str, n_conn: int, stream: bool) -> tuple[Post, Callable]:
    """The gateway's own client (`gateway/http1.py` + typed parsing into GenerateResponse)."""
    from gateway.backends import SGLangClient, TokenRequest

    client = SGLangClient(url, timeout_s=60)

    async def post(p: dict[str, Any]) -> int:
        r = TokenRequest.for_tokens(p["input_ids"], p["sampling_params"], rid=p["rid"])
        if not stream:
            return len((await client.generate(r)).output_ids)
        chunks = [c async for c in client.generate_stream(r)]
        return len(chunks[-1].output_ids)

    return post, client.aclose


CANDIDATES = {
    "httpx default AsyncClient": httpx_default,
    "httpx tuned limits (http1)": httpx_tuned,
    "httpx 8 sharded pools": httpx_sharded,
    "httpx2 tuned limits": httpx2_tuned,
    "aiohttp TCPConnector": aiohttp_connector,
    "raw asyncio keep-alive": raw_keepalive,
    "gateway SGLangClient (httptools client)": sglang_client,
}


async def measure(
    make: Callable, url: str, n_req: int, conc: int, stream: bool
) -> tuple[float, float]:
    """(req/s, client CPU ms per request) for n_req requests from conc workers."""
    post, close = await make(url, conc, stream)
    queue = iter(range(n_req))

    async def worker() -> None:
        for i in queue:
            assert await post(_payload(i, stream)) == 32

    await asyncio.gather(*(post(_payload(10_000_000 + i, stream)) for i in range(conc)))
    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    await close()
    return n_req / wall, 1000 * cpu / n_req


async def _run(args: argparse.Namespace) -> None:
    backend = start_echo_backend(subprocess_mode=True, tokens=32, delay_ms=args.delay_ms)
    try:
        print(
            f"{args.requests} requests, {args.concurrency} concurrent, backend delay "
            f"{args.delay_ms} ms, stream={args.stream}, loop={type(asyncio.get_running_loop()).__module__}"
        )
        print(f"{'client':30} {'req/s':>8} {'CPU ms/req':>11}")
        for name, make in CANDIDATES.items():
            if args.only and args.only not in name:
                continue
            rps, cpu_ms = await measure(
                make, backend.url, args.requests, args.concurrency, args.stream
            )
            print(f"{name:30} {rps:8.0f} {cpu_ms:11.3f}", flush=True)
    finally:
        backend.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--no-uvloop", action="store_true")
    p.add_argument("--only", default="", help="run only candidates whose name contains this")
    args = p.parse_args()
    run: Callable[[Awaitable[None]], None] = asyncio.run  # type: ignore[assignment]
    if not args.no_uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            run = uvloop.run
    run(_run(args))


if __name__ == "__main__":
    main()
