"""A lean HTTP/1.1 keep-alive client for the gateway's one hot backend call, `POST
/generate` (streamed or not). Control calls (pause, weight updates, health) stay on
aiohttp: they are rare.

Why: measured with `python -m benchmarks.http_client_choice` (64 concurrent, uvloop,
echo backend), aiohttp costs ~0.20-0.25 ms of the event loop per non-streamed request;
an asyncio protocol driving httptools' C parser (the one uvicorn uses) ~0.07 ms. The
gateway makes one such call per completion, and its event loop is what limits it.

Scope, on purpose small: `http://` (backends usually sit on loopback or a private
network) or `https://` with the default TLS context, a JSON request body, responses framed by Content-Length or chunked encoding,
keep-alive as RFC 9112 says (`Connection: close` honoured). A connection goes back to
the pool only after its response was read to the end; a cancelled, failed or
abandoned exchange closes its connection. Idle connections are dropped after
`keepalive_s`, which must stay below the server's own keep-alive (uvicorn: 5 s) so a
request is never written to a socket the server is closing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

import httptools


class ConnectFailed(OSError):
    """The connection could not be made: the request certainly never reached the server."""


class ExchangeFailed(OSError):
    """The connection broke, or the response was malformed, after the request was sent."""


class _Connection(asyncio.Protocol):
    """One TCP connection: writes requests, parses responses as bytes arrive.

    State per exchange: `status` (once headers are in), body pieces not yet taken,
    `complete` when the response ended, `error` when it cannot end. One waiter at a
    time (the exchange's reader) is woken by any of them."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.pieces: collections.deque[bytes] = collections.deque()
        self.complete = False
        self.keep_alive = False
        self.error: BaseException | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ExchangeFailed(f"malformed HTTP response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            self._fail(ExchangeFailed(f"connection closed before the response ended: {exc}"))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # exchange side
    def start(self, head: bytes, body: bytes, deadline: float) -> None:
        assert self.transport is not None
        self._reset()
        self._timer = self._loop.call_at(
            deadline, self._fail, TimeoutError("backend request timed out")
        )
        self.transport.write(head + body)

    def finish(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        """Until something new happened (headers, body, end, error)."""
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        self.finish()
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Exchange:
    """One request's response: `status`, then the body whole (`read`) or as it arrives
    (`pieces`). Raises `TimeoutError` / `ExchangeFailed` from either."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn

    @property
    def status(self) -> int:
        return self._conn.status

    async def _headers(self) -> None:
        conn = self._conn
        while not conn.status and not conn.complete:
            if conn.error is not None:
                raise conn.error
            await conn.wait()

    async def read(self) -> bytes:
        """The whole body."""
        conn = self._conn
        while not conn.complete:
            if conn.error is not None:
                raise conn.error
            await conn.wait()
        body = b"".join(conn.pieces)
        conn.pieces.clear()
        return body

    async def next_piece(self) -> bytes | None:
        """The body bytes that arrived since the last call (all of them, joined), waiting
        for some if none did; None once the body ended. A plain coroutine: cheaper per
        streamed chunk than an async iterator."""
        conn = self._conn
        while True:
            if conn.pieces:
                data = conn.pieces.popleft() if len(conn.pieces) == 1 else b"".join(conn.pieces)
                conn.pieces.clear()
                return data
            if conn.complete:
                return None
            if conn.error is not None:
                raise conn.error
            await conn.wait()


class Http1Pool:
    """Keep-alive connections to one `http(s)://host[:port]` base URL (LIFO reuse)."""

    def __init__(
        self,
        base_url: str,
        *,
        max_connections: int = 1024,
        connect_timeout_s: float = 5.0,
        keepalive_s: float = 4.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"Http1Pool needs an http(s)://host[:port] URL, got {base_url!r}")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self._tls = ssl.create_default_context() if url.scheme == "https" else None
        self.base_path = url.path.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        host = f"{self.host}:{self.port}" if url.port else self.host
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = f"Host: {host}\r\nContent-Type: application/json\r\n{extra}".encode()
        self._idle: list[tuple[float, _Connection]] = []
        self._slots = asyncio.Semaphore(max_connections)

    @contextlib.asynccontextmanager
    async def post(
        self, path: str, body: bytes, *, timeout_s: float, headers: bytes = b""
    ) -> AsyncIterator[Exchange]:
        """`POST path` with a JSON `body`; yields once the response headers are in.
        `headers`: extra `Name: value\r\n` lines for this request only.
        The connection is reused only if the caller read the response to its end."""
        loop = asyncio.get_running_loop()
        async with self._slots:
            conn = await self._connect(loop)
            reusable = False
            try:
                head = b"POST %s%s HTTP/1.1\r\n%s%sContent-Length: %d\r\n\r\n" % (
                    self.base_path.encode(),
                    path.encode(),
                    self._head,
                    headers,
                    len(body),
                )
                conn.start(head, body, loop.time() + timeout_s)
                exchange = Exchange(conn)
                await exchange._headers()
                yield exchange
                reusable = conn.complete and conn.keep_alive and conn.error is None
            finally:
                conn.finish()
                if reusable and not conn.closed:
                    self._idle.append((loop.time(), conn))
                else:
                    conn.close()

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        now = loop.time()
        while self._idle:
            since, conn = self._idle.pop()
            if not conn.closed and now - since < self.keepalive_s:
                return conn
            conn.close()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    _Connection, self.host, self.port, ssl=self._tls
                )
        except (OSError, TimeoutError) as exc:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc!r}") from exc
        return conn

    def close(self) -> None:
        """Close the idle connections (those in use close when their exchange ends)."""
        while self._idle:
            self._idle.pop()[1].close()
