"""gateway/http1.py: the keep-alive client for `/generate`, against raw loopback servers
that send exactly the bytes each case needs (framing, keep-alive, failures)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gateway.http1 import ConnectFailed, ExchangeFailed, Http1Pool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[bool]]
"""Answer one request (its head+body given); return False to close the connection."""


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


class RawServer:
    """A loopback server; counts connections and keeps the requests it got."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while (request := await read_request(reader)) is not None:
                self.requests.append(request)
                if not await self.handler(reader, writer, request):
                    break
        except asyncio.CancelledError:
            pass  # the test ended while this connection was open
        finally:
            writer.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


@pytest.fixture
async def raw_server() -> AsyncIterator[Callable[[Handler], Awaitable[RawServer]]]:
    servers: list[RawServer] = []

    async def start(handler: Handler) -> RawServer:
        srv = RawServer(handler)
        srv.server = await asyncio.start_server(srv.serve, "127.0.0.1", 0)
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        assert srv.server is not None
        srv.server.close()


def reply(body: bytes, *, status: int = 200, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        status,
        len(body),
        extra,
        body,
    )


async def echo_length(_: asyncio.StreamReader, w: asyncio.StreamWriter, req: bytes) -> bool:
    w.write(reply(req.split(b"\r\n\r\n", 1)[1]))
    return True


async def test_content_length_bodies_reuse_one_connection(raw_server) -> None:  # noqa: ANN001
    srv = await raw_server(echo_length)
    pool = Http1Pool(srv.url, headers={"Authorization": "Bearer k"})
    for i in range(5):
        async with pool.post("/generate", b'{"i": %d}' % i, timeout_s=5) as r:
            assert r.status == 200
            assert await r.read() == b'{"i": %d}' % i
    assert srv.connections == 1
    head = srv.requests[0].split(b"\r\n\r\n")[0].split(b"\r\n")
    assert head[0] == b"POST /generate HTTP/1.1"
    assert b"Authorization: Bearer k" in head and b"Content-Length: 8" in head
    pool.close()


async def test_chunked_stream_pieces_arrive_before_the_end(raw_server) -> None:  # noqa: ANN001
    release = asyncio.Event()

    async def chunked(_: asyncio.StreamReader, w: asyncio.StreamWriter, __: bytes) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        w.write(b"6\r\ndata:1\r\n")
        await w.drain()
        await release.wait()
        w.write(b"6\r\ndata:2\r\n0\r\n\r\n")
        return True

    srv = await raw_server(chunked)
    pool = Http1Pool(srv.url)
    async with pool.post("/generate", b"{}", timeout_s=5) as r:
        assert await r.next_piece() == b"data:1"  # while the server still holds the rest
        release.set()
        assert await r.next_piece() == b"data:2"
        assert await r.next_piece() is None
    async with pool.post("/generate", b"{}", timeout_s=5) as r:  # reused after the end
        assert await r.read() == b"data:1data:2"
    assert srv.connections == 1


async def test_connection_close_and_early_exit_are_not_reused(raw_server) -> None:  # noqa: ANN001
    async def closing(_: asyncio.StreamReader, w: asyncio.StreamWriter, __: bytes) -> bool:
        w.write(reply(b"{}", extra=b"Connection: close\r\n"))
        return False

    srv = await raw_server(closing)
    pool = Http1Pool(srv.url)
    for _ in range(2):
        async with pool.post("/generate", b"{}", timeout_s=5) as r:
            assert await r.read() == b"{}"
    assert srv.connections == 2

    async def unfinished(_: asyncio.StreamReader, w: asyncio.StreamWriter, req: bytes) -> bool:
        if len(srv2.requests) == 1:  # the first response never ends
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n")
            return True
        return await echo_length(_, w, req)

    srv2 = await raw_server(unfinished)
    pool2 = Http1Pool(srv2.url)
    async with pool2.post("/generate", b"{}", timeout_s=5) as r:
        assert await r.next_piece() == b"a"  # the caller leaves before the end
    async with pool2.post("/generate", b"{}", timeout_s=5) as r:
        assert await r.read() == b"{}"
    assert srv2.connections == 2


async def test_error_status_and_body_are_returned(raw_server) -> None:  # noqa: ANN001
    async def bad(_: asyncio.StreamReader, w: asyncio.StreamWriter, __: bytes) -> bool:
        w.write(reply(b'{"error": "no"}', status=400))
        return True

    srv = await raw_server(bad)
    async with Http1Pool(srv.url).post("/generate", b"{}", timeout_s=5) as r:
        assert (r.status, await r.read()) == (400, b'{"error": "no"}')


async def test_failures_are_typed(raw_server) -> None:  # noqa: ANN001
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    with pytest.raises(ConnectFailed):
        async with Http1Pool(f"http://127.0.0.1:{port}").post("/generate", b"{}", timeout_s=5):
            pass

    async def hang_up(_: asyncio.StreamReader, w: asyncio.StreamWriter, __: bytes) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        return False  # closes mid-body

    srv = await raw_server(hang_up)
    with pytest.raises(ExchangeFailed, match="before the response ended"):
        async with Http1Pool(srv.url).post("/generate", b"{}", timeout_s=5) as r:
            await r.read()

    async def garbage(_: asyncio.StreamReader, w: asyncio.StreamWriter, __: bytes) -> bool:
        w.write(b"NOT HTTP AT ALL\r\n\r\n")
        return True

    srv = await raw_server(garbage)
    with pytest.raises(ExchangeFailed, match="malformed"):
        async with Http1Pool(srv.url).post("/generate", b"{}", timeout_s=5) as r:
            await r.read()

    async def silent(_: asyncio.StreamReader, __: asyncio.StreamWriter, ___: bytes) -> bool:
        await asyncio.sleep(5)
        return True

    srv = await raw_server(silent)
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(TimeoutError):
        async with Http1Pool(srv.url).post("/generate", b"{}", timeout_s=0.2) as r:
            await r.read()
    assert asyncio.get_running_loop().time() - t0 < 2


async def test_idle_connections_expire_and_server_side_closes_are_noticed(raw_server) -> None:  # noqa: ANN001
    srv = await raw_server(echo_length)
    pool = Http1Pool(srv.url, keepalive_s=0.05)
    async with pool.post("/generate", b"{}", timeout_s=5) as r:
        await r.read()
    await asyncio.sleep(0.1)  # past keepalive_s: a new connection
    async with pool.post("/generate", b"{}", timeout_s=5) as r:
        await r.read()
    assert srv.connections == 2

    async def once(_: asyncio.StreamReader, w: asyncio.StreamWriter, __: bytes) -> bool:
        w.write(reply(b"{}"))  # keep-alive promised, then the server closes anyway
        return False

    srv2 = await raw_server(once)
    pool2 = Http1Pool(srv2.url)
    async with pool2.post("/generate", b"{}", timeout_s=5) as r:
        await r.read()
    await asyncio.sleep(0.05)  # the close reaches the client
    async with pool2.post("/generate", b"{}", timeout_s=5) as r:
        assert await r.read() == b"{}"
    assert srv2.connections == 2


def test_only_http_urls() -> None:
    with pytest.raises(ValueError, match="http"):
        Http1Pool("unix:///tmp/sock")
