"""`EngineHttp`: the HTTP plumbing every engine client holds (composition, not a base
class): one aiohttp session for the control calls, the lean keep-alive pool for the
generate call, the error mapping (`BackendError` / `BackendUnavailable`), the SSE read
loop of a streamed generation, and fire-and-forget aborts. It knows no engine's wire
format: the client hands it a path, a body and a parser (`StreamParser`).

HTTP client, chosen by measurement (`python -m benchmarks.http_client_choice`): 2-core
box shared with other jobs, uvloop, 64 concurrent `/generate` (64 ids in, 32 ids +
logprobs out) against the echo backend in a child process; client-process CPU ms per
request (req/s is noisy on a shared box; CPU/request is the number that matters):

    client                          req/s  no-stream  stream(33 chunks)  backend +100ms
    httpx default AsyncClient         291       2.19       2.29               1.61
    httpx tuned limits (64 conns)      72      11.07      10.23              14.68
    httpx 8 sharded pools             554       1.80       1.90               1.67
    httpx2 tuned limits               740       1.04       1.87               1.21
    aiohttp TCPConnector             2199       0.20       0.82               0.23
    raw asyncio keep-alive           3742       0.07       0.52               0.11
    SGLangClient on aiohttp (before) 1703       0.25       1.04               0.31

httpcore's pool bookkeeping grows with open connections (the tuned 64-connection pool
is the worst); aiohttp stays flat (0.24 ms at 256 concurrent). So: aiohttp, one
`ClientSession` + `TCPConnector` per client, for the control calls. The one hot call,
generate, goes through `gateway/http1.py` (httptools' parser on an asyncio protocol):
0.10 ms per non-streamed request including the typed parse, against 0.23 ms on aiohttp,
because the gateway's event loop is its bottleneck.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict

import aiohttp
from pydantic import BaseModel, ValidationError

from areal_service.sglang_protocol import ROUTING_KEY_HEADER, Endpoint, ErrorResponse
from gateway.backends.errors import BackendError, BackendUnavailable
from gateway.backends.records import EngineReply
from gateway.http1 import ConnectFailed, Http1Pool
from gateway.stream_parse import ErrorEvent

log = logging.getLogger(__name__)
_JSON = {"Content-Type": "application/json"}
_KEEPALIVE_S = 4.0  # below uvicorn's 5 s keep-alive (SGLang's server), so a pooled
# connection is never reused just as the server closes it.


class ChunkParser(Protocol):
    """Turns the SSE payloads of one network read into replies, error events and None
    for `[DONE]` (ValidationError when one is malformed). One parser per stream: it may
    keep state between reads (`gateway/stream_parse.py` has SGLang's)."""

    def chunks(
        self, batch: list[bytes], coalesce: bool
    ) -> Sequence[EngineReply | ErrorEvent | None]: ...


class ClientOptions(TypedDict, total=False):
    """The keyword settings every engine client takes (`HttpOptions`' fields)."""

    timeout_s: float
    connect_timeout_s: float
    control_timeout_s: float
    max_connections: int
    api_key: str | None
    max_resubmissions: int
    resubmit_wait_s: float


@dataclass(frozen=True, slots=True)
class HttpOptions:
    """One engine client's HTTP settings, and how often interruptible generation
    resubmits (`gateway/backends/interruptible.py`)."""

    timeout_s: float = 600.0
    """A generate call's (and a weight load's) whole timeout."""
    connect_timeout_s: float = 5.0
    control_timeout_s: float = 60.0
    """Pause, continue, aborts, info."""
    max_connections: int = 1024
    api_key: str | None = None
    max_resubmissions: int = 50
    resubmit_wait_s: float = 0.05


class EngineHttp:
    """HTTP to one engine server (`base_url`); the aiohttp session and the generate pool
    are created lazily on the running loop. `abort`: the client's own abort call, used
    for requests their caller gave up on."""

    def __init__(
        self, base_url: str, abort: Callable[[str], Awaitable[None]], options: HttpOptions
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._abort = abort
        self.options = options
        self.timeout_s = options.timeout_s  # read per generate call
        self.control_timeout_s = options.control_timeout_s
        api_key = options.api_key
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None
        self._pool: Http1Pool | None = None
        self.background: set[asyncio.Task[None]] = set()
        """Fire-and-forget tasks (aborts, and the client's own), awaited by `aclose`."""

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self.options.max_connections, limit_per_host=0, keepalive_timeout=_KEEPALIVE_S
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(
                    total=self.timeout_s, sock_connect=self.options.connect_timeout_s
                ),
            )
        return self._session

    def _generate_pool(self) -> Http1Pool:
        """The lean keep-alive pool for generate calls (see `gateway/http1.py` for why)."""
        if self._pool is None:
            self._pool = Http1Pool(
                self.base_url,
                max_connections=self.options.max_connections,
                connect_timeout_s=self.options.connect_timeout_s,
                keepalive_s=_KEEPALIVE_S,
                headers=self._headers,
            )
        return self._pool

    async def aclose(self) -> None:
        """Wait for pending fire-and-forget tasks, then close the HTTP connections."""
        if self.background:
            await asyncio.gather(*self.background, return_exceptions=True)
        if self._pool is not None:
            self._pool.close()
        if self._session is not None:
            await self._session.close()

    def spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run `work` in the background, held until it ends (awaited by `aclose`)."""
        task = asyncio.get_running_loop().create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    # -- errors ------------------------------------------------------------------------
    def unavailable(self, exc: BaseException) -> BackendUnavailable:
        refused = isinstance(
            exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError | ConnectFailed
        )
        return BackendUnavailable(
            f"{type(exc).__name__}: {exc}", url=self.base_url, sent=not refused
        )

    def error(self, status: int, raw: bytes) -> BackendError:
        """The error of a non-2xx reply: `{"error": {"message"}}` (SGLang's and vLLM's
        shape), else the text."""
        try:
            message = ErrorResponse.model_validate_json(raw).error.message
        except ValidationError:
            message = raw.decode("utf-8", "replace")[:2000]
        if status == 503:
            return BackendUnavailable(message, url=self.base_url)
        return BackendError(status, message, url=self.base_url)

    def malformed(self, path: str, exc: ValueError) -> BackendError:
        """A 2xx reply that does not have the shape the protocol module expects: 502."""
        return BackendError(502, f"malformed {path} reply: {exc}", url=self.base_url)

    def failed(self, message: str, status: int = 400) -> BackendError:
        """An error this client raises about its own backend."""
        return BackendError(status, message, url=self.base_url)

    # -- control calls -----------------------------------------------------------------
    async def call(
        self,
        endpoint: Endpoint,
        body: BaseModel | None = None,
        *,
        path: str | None = None,
        timeout_s: float | None = None,
    ) -> bytes:
        """One control request/response (`path` overrides the endpoint's, for legacy
        names or a query); raises BackendError / BackendUnavailable, else the body."""
        timeout = aiohttp.ClientTimeout(
            total=timeout_s or self.timeout_s, sock_connect=self.options.connect_timeout_s
        )
        data = None if body is None else body.model_dump_json(exclude_unset=True).encode()
        headers = None if data is None else _JSON
        try:
            async with self._http().request(
                endpoint.method,
                self.base_url + (path or endpoint.path),
                data=data,
                headers=headers,
                timeout=timeout,
            ) as r:
                raw = await r.read()
                status = r.status
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as e:
            raise self.unavailable(e) from e
        if status >= 400:
            raise self.error(status, raw)
        return raw

    async def control(self, endpoint: Endpoint, body: BaseModel | None = None) -> bytes:
        """`call` with the short control timeout (pause, continue, aborts, info)."""
        return await self.call(endpoint, body, timeout_s=self.control_timeout_s)

    async def get_with_fallback(self, endpoint: Endpoint, timeout_s: float | None = None) -> bytes:
        """`endpoint`, or its older path when the server answers 404 (older versions)."""
        timeout_s = self.control_timeout_s if timeout_s is None else timeout_s
        try:
            return await self.call(endpoint, timeout_s=timeout_s)
        except BackendError as e:
            if e.status != 404 or endpoint.legacy_path is None:
                raise
            return await self.call(endpoint, path=endpoint.legacy_path, timeout_s=timeout_s)

    async def healthy(self, endpoint: Endpoint, timeout_s: float) -> bool:
        """True when `endpoint` (or its older path) answers 2xx; False on errors."""
        try:
            await self.get_with_fallback(endpoint, timeout_s)
        except BackendError:
            return False
        return True

    def abort_soon(self, rid: str) -> None:
        """Fire-and-forget abort of a request its caller gave up on."""

        async def abort() -> None:
            try:
                await self._abort(rid)
            except BackendError as e:
                log.warning("abort of %s failed: %s", rid, e)

        self.spawn(abort())

    # -- the generate call -------------------------------------------------------------
    async def generate(self, path: str, body: bytes, rid: str, routing_key: str | None) -> bytes:
        """One non-streamed generate call: the reply body. Cancelling the caller (or a
        timeout after sending) aborts request `rid`."""
        try:
            async with self._generate_pool().post(
                path, body, timeout_s=self.timeout_s, headers=_routing_header(routing_key)
            ) as r:
                raw = await r.read()
                status = r.status
        except asyncio.CancelledError:
            self.abort_soon(rid)
            raise
        except (OSError, TimeoutError) as e:
            unavailable = self.unavailable(e)
            if unavailable.sent:  # e.g. a timeout: the backend may still be generating
                self.abort_soon(rid)
            raise unavailable from e
        if status >= 400:
            raise self.error(status, raw)
        return raw

    async def stream(
        self,
        path: str,
        body: bytes,
        rid: str,
        parser: ChunkParser,
        coalesce: bool,
        routing_key: str | None,
    ) -> AsyncGenerator[EngineReply, None]:
        """One streamed generate call: the parser's chunks of each network read's SSE
        `data:` payloads, through `[DONE]`. A `data: {"error":…}` event raises
        BackendError. Closing the iterator early (client gone) or cancelling aborts
        request `rid`."""
        done = False
        try:
            async with self._generate_pool().post(
                path, body, timeout_s=self.timeout_s, headers=_routing_header(routing_key)
            ) as r:
                if r.status >= 400:
                    done = True  # rejected before it started
                    raise self.error(r.status, await r.read())
                buf = b""
                while True:  # SSE `data:` payloads, a list per network read
                    piece = await r.next_piece()
                    if piece is None:
                        batch = [buf[5:].strip()] if buf.startswith(b"data:") else []
                        buf = b""
                        if not batch:
                            break
                    else:
                        buf += piece
                        *lines, buf = buf.split(b"\n")
                        batch = [line[5:].strip() for line in lines if line.startswith(b"data:")]
                        if not batch:
                            continue
                    try:
                        chunks = parser.chunks(batch, coalesce)
                    except ValidationError as e:
                        raise self.malformed(path, e) from e
                    for chunk in chunks:
                        if chunk is None:
                            done = True
                            return
                        if isinstance(chunk, ErrorEvent):  # the request ended with an error
                            done = True
                            raise BackendError(chunk.status, chunk.message, url=self.base_url)
                        yield chunk
            raise BackendUnavailable("stream ended without [DONE]", url=self.base_url)
        except (OSError, TimeoutError) as e:
            unavailable = self.unavailable(e)
            done = not unavailable.sent  # never reached the backend: nothing to abort
            raise unavailable from e
        finally:
            if not done:
                self.abort_soon(rid)


def _routing_header(key: str | None) -> bytes:
    """The `X-SMG-Routing-Key` line for a session (none without one). A key is an id the
    gateway made; CR/LF are dropped anyway so it can never end the header block."""
    if key is None:
        return b""
    clean = key.replace("\r", "").replace("\n", "")
    return f"{ROUTING_KEY_HEADER}: {clean}\r\n".encode("utf-8", "replace")
