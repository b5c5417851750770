"""A small stand-in for SGLang's router (`sglang-router`), the external part of router
mode, for the tests that run without the Rust wheel. It answers what the real router
0.3.2 answers to the calls the gateway makes (`areal_service/sglang_protocol.py`):
`GET /workers` and `POST /workers {"url"}` (or only the older `GET /list_workers` and
`POST /add_worker?url=` with `legacy=True`),
`GET /readiness`, `POST /generate` forwarded to one worker (streams passed through),
and 404 for everything it does not route (pause, continue, weight updates, abort).

Routing: a request with `X-SMG-Routing-Key` goes to the worker that key was first sent
to (the real router's `--policy manual`), others round-robin. It records each forwarded
generate as (worker url, routing key) and every path it refused."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from support.loopback import free_port


@dataclass
class StandInRouter:
    workers: list[str]
    legacy: bool = False
    ready: bool = True
    drop_adds: bool = False
    """Accept `POST /workers` and never list the worker (one that fails the router's
    own checks)."""
    routed: list[tuple[str, str | None]] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    url: str = ""
    _pins: dict[str, str] = field(default_factory=dict)
    _rr: itertools.count = field(default_factory=itertools.count)

    def pick(self, key: str | None) -> str:
        if key is not None and key in self._pins:
            return self._pins[key]
        worker = self.workers[next(self._rr) % len(self.workers)]
        if key is not None:
            self._pins[key] = worker
        return worker

    def app(self) -> web.Application:
        session: dict[str, aiohttp.ClientSession] = {}

        async def client() -> aiohttp.ClientSession:
            if "s" not in session:
                session["s"] = aiohttp.ClientSession()
            return session["s"]

        async def workers(_: web.Request) -> web.Response:
            if self.legacy:
                return web.Response(status=404)
            return web.json_response(
                {
                    "workers": [
                        {
                            "id": str(i),
                            "url": u,
                            "worker_type": "regular",
                            "is_healthy": True,
                            "metadata": {"tp_size": "1", "dp_size": "1"},
                        }
                        for i, u in enumerate(self.workers)
                    ],
                    "total": len(self.workers),
                }
            )

        async def list_workers(_: web.Request) -> web.Response:
            if not self.legacy:
                return web.Response(status=404)
            return web.json_response({"urls": list(self.workers)})

        async def add_worker(request: web.Request) -> web.Response:
            if self.legacy:
                return web.Response(status=404)
            url = str((await request.json())["url"])
            if url not in self.workers and not self.drop_adds:
                self.workers.append(url)
            return web.json_response({"status": "accepted", "url": url}, status=202)

        async def add_worker_legacy(request: web.Request) -> web.Response:
            if not self.legacy:
                return web.Response(status=404)
            url = request.query["url"]
            if url not in self.workers and not self.drop_adds:
                self.workers.append(url)
            return web.Response(text=f"Successfully added worker: {url}")

        async def readiness(_: web.Request) -> web.Response:
            if self.legacy:
                return web.Response(status=404)
            if self.ready and self.workers:
                return web.json_response(
                    {
                        "status": "ready",
                        "healthy_workers": len(self.workers),
                        "total_workers": len(self.workers),
                    }
                )
            return web.json_response({"status": "not ready"}, status=503)

        async def health(_: web.Request) -> web.Response:
            return web.Response(text="OK") if self.ready else web.Response(status=503)

        async def generate(request: web.Request) -> web.StreamResponse:
            key = request.headers.get("X-SMG-Routing-Key")
            worker = self.pick(key)
            self.routed.append((worker, key))
            body = await request.read()
            async with (await client()).post(
                worker + "/generate", data=body, headers={"Content-Type": "application/json"}
            ) as r:
                reply = web.StreamResponse(
                    status=r.status,
                    headers={"Content-Type": r.headers.get("Content-Type", "application/json")},
                )
                await reply.prepare(request)
                async for piece in r.content.iter_any():
                    await reply.write(piece)
                await reply.write_eof()
                return reply

        async def other(request: web.Request) -> web.Response:
            self.refused.append(request.path)
            return web.Response(status=404)

        async def close(_: web.Application) -> None:
            if "s" in session:
                await session["s"].close()

        app = web.Application()
        app.router.add_get("/workers", workers)
        app.router.add_post("/workers", add_worker)
        app.router.add_get("/list_workers", list_workers)
        app.router.add_post("/add_worker", add_worker_legacy)
        app.router.add_get("/readiness", readiness)
        app.router.add_get("/health", health)
        app.router.add_post("/generate", generate)
        app.router.add_route("*", "/{tail:.*}", other)
        app.on_cleanup.append(close)
        return app


@contextmanager
def run_standin_router(workers: list[str], *, legacy: bool = False) -> Iterator[StandInRouter]:
    """A stand-in router on a free loopback port, in a thread with its own loop."""
    router = StandInRouter(list(workers), legacy=legacy)
    port = free_port()
    router.url = f"http://127.0.0.1:{port}"
    loop = asyncio.new_event_loop()
    started = threading.Event()
    runner = web.AppRunner(router.app())

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=serve, name="standin-router", daemon=True)
    thread.start()
    if not started.wait(10):
        raise RuntimeError("stand-in router did not start")
    try:
        yield router
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
