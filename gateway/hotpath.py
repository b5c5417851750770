"""The hot routes served straight from ASGI: `POST /v1/chat/completions` and
`POST /v1/responses` (and the same without `/v1`).

Nearly all traffic is these two routes. Under 64 concurrent clients, FastAPI's middleware
stack (telemetry, body limit, exception and exit-stack layers), the router's scan and
dependency injection were ~16% of the gateway's GIL time per completion (py-spy, GIL
samples). `HotRoutes` is the outermost ASGI middleware: for these paths it authenticates,
calls the handler, and sends the reply itself; every other request goes to the FastAPI
app unchanged. Replies keep the same contract: errors in the OpenAI shape (never a
framework 500), `x-request-id` on every response. A client that goes away before its
reply is complete (streamed or not) cancels its request: the backend generation is
aborted at once (an agent framework that times out and retries would otherwise leave
the abandoned generation running on the GPU).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.auth import Principal
from gateway.deps import request_too_large, too_deep
from gateway.errors import OpenAIError
from gateway.limits import Events
from gateway.state import GatewayState
from gateway.strings import check_json_body, json_needs_check, nul_refused
from gateway.throttle import note_auth_failure, request_token

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class JsonReply:
    """A complete JSON response."""

    body: bytes
    request_id: str
    status: int = 200
    headers: Mapping[str, str] | None = None


@dataclass(frozen=True, slots=True)
class EventStream:
    """A `text/event-stream` response; `events` yields ready-to-send SSE text and turns
    its own mid-stream failures into error events."""

    events: Events
    request_id: str


class LastEvent(str):
    """An `EventStream` event known to be the stream's last: sent together with the end
    of the body (one socket write, not two)."""

    __slots__ = ()


Reply = JsonReply | EventStream
Handler = Callable[[Request, GatewayState, Principal], Awaitable[Reply]]
"""A hot route: (request, state, authenticated caller) → reply; raises `OpenAIError`."""
ErrorBody = Callable[[OpenAIError], dict[str, Any]]
"""A route's error body (`OpenAIError.body`, the OpenAI shape, unless the route gives
its own: the Anthropic Messages route answers in Anthropic's)."""
Route = tuple[str, Handler] | tuple[str, Handler, ErrorBody]
"""(metrics label, handler[, error body])."""

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def error_reply(exc: OpenAIError, shape: ErrorBody | None = None) -> JsonReply:
    """The error response for `exc`: OpenAI-shaped, or `shape`d."""
    body = exc.body() if shape is None else shape(exc)
    return JsonReply(json.dumps(body).encode(), f"req_{uuid.uuid4().hex}", exc.status, exc.headers)


class HotRoutes:
    """ASGI middleware: `routes` (path → (metrics label, handler[, error body])) for
    POST, else `app`.

    The gateway state comes from `scope["app"]` (Starlette sets it before any
    middleware runs). Request bodies are bounded before anything reads them, by route
    (413 `request_too_large` for a declared length beyond, bodies without a length
    counted as they arrive): the hot routes by `gateway.limits.max_request_bytes`, and their
    caller is authenticated before a byte of the body is read (a wrong or missing key
    never has its body buffered); other routes by `gateway.limits.control_body_bytes`, or, for a
    request without a key, `gateway.limits.anonymous_body_bytes`, and at most
    `gateway.limits.max_anonymous_requests` of those that send a body are served at once (503
    beyond; health checks and page loads are never refused)."""

    def __init__(self, app: ASGIApp, routes: Mapping[str, Route]) -> None:
        self.app = app
        self.routes = dict(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state: GatewayState = scope["app"].state.gateway
        route = self.routes.get(scope["path"])
        if route is None:
            await self._other(scope, receive, send, state)
            return
        label, handler, *shaped = route
        shape = shaped[0] if shaped else None
        limit = state.config.gateway.limits.max_request_bytes
        if _declared_length(scope) > limit:  # refused before a byte is read
            await send_json(send, error_reply(request_too_large(limit), shape))
            return
        if scope["method"] != "POST":
            await send_json(
                send,
                error_reply(
                    OpenAIError(
                        405,
                        f"{scope['method']} is not allowed on {scope['path']}; use POST",
                        headers={"allow": "POST"},
                    ),
                    shape,
                ),
            )
            return
        metrics = state.metrics
        started = time.perf_counter()
        metrics.in_flight.inc()
        try:
            await self._serve(scope, receive, send, state, label, handler, shape)
        finally:
            metrics.in_flight.dec()
            metrics.observe_latency(label, time.perf_counter() - started)

    async def _other(self, scope: Scope, receive: Receive, send: Send, state: GatewayState) -> None:
        """A route FastAPI serves: its body bounded (by whether it carries a key), and
        requests without a key counted."""
        gw = state.config.gateway
        anonymous = request_token(scope) is None
        limit = min(
            gw.limits.anonymous_body_bytes if anonymous else gw.limits.control_body_bytes,
            gw.limits.max_request_bytes,
        )  # the latter bounds every route
        if _declared_length(scope) > limit:
            await send_json(send, error_reply(request_too_large(limit)))
            return
        counted = anonymous and scope["method"] in _BODY_METHODS  # what holds memory
        if counted:
            if state.anonymous_in_flight >= gw.limits.max_anonymous_requests:
                await send_json(
                    send,
                    error_reply(
                        OpenAIError(
                            503,
                            "too many requests without an API key in progress; retry later",
                            type="server_error",
                            code="server_busy",
                            headers={"retry-after": "1"},
                        )
                    ),
                )
                return
            state.anonymous_in_flight += 1
        try:
            if b"%00" in scope["query_string"] or b"%00" in scope.get("raw_path", b""):
                await send_json(send, error_reply(nul_refused("the URL")))
                return
            if scope["method"] in _BODY_METHODS:
                # Read here (bounded, counted as it arrives) so a NUL is refused before
                # any route sees it; these bodies are small (`limit`).
                form = any(
                    k == b"content-type" and b"form-urlencoded" in v for k, v in scope["headers"]
                )
                bounded = await _bounded(
                    receive, send, limit, _refuse_nul_form if form else _refuse_nul_json
                )
                if bounded is None:
                    return
                receive = bounded
            await self.app(scope, receive, send)
        finally:
            if counted:
                state.anonymous_in_flight -= 1

    async def _serve(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        state: GatewayState,
        label: str,
        handler: Handler,
        shape: ErrorBody | None,
    ) -> None:
        try:
            # Authenticated first: an unknown key is answered without its body read.
            principal = await state.keys.resolve(request_token(scope))
            body = await read_body(receive, state.config.gateway.limits.max_request_bytes)
        except OpenAIError as exc:
            state.metrics.count_request(label, exc.status)
            if exc.status == 401:
                note_auth_failure(scope)
            await send_json(send, error_reply(exc, shape))
            return
        if body is None:
            return  # the client left while sending its request
        request = Request(scope, _replay(body))
        watch = ClientWatch(receive)
        try:
            try:
                reply = await handler(request, state, principal)
            except OpenAIError as exc:
                reply = error_reply(exc, shape)
            except RecursionError:  # a structure (a tool's JSON schema) nested too deeply
                # for a renderer or converter: the request's fault, found at no cost to
                # the requests that are not nested so (no depth walk up front)
                reply = error_reply(too_deep(), shape)
            except Exception as exc:  # the route's shape even for a bug, and a log line
                log.exception("unhandled error on POST %s", scope["path"])
                reply = error_reply(
                    OpenAIError(
                        500,
                        f"internal error: {type(exc).__name__}",
                        type="server_error",
                        code="internal_error",
                    ),
                    shape,
                )
            status = reply.status if isinstance(reply, JsonReply) else 200
            state.metrics.count_request(label, status)
            if status == 401:  # a session key that ended, a revoked key
                note_auth_failure(scope)
            if isinstance(reply, JsonReply):
                watch.finish()
                await send_json(send, reply)
            else:
                await send_stream(send, reply, watch)
        except asyncio.CancelledError:
            if not watch.gone:
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]  # ended here
            state.metrics.count_request(label, 499)  # nginx's "client closed"
        finally:
            watch.close()


class ClientWatch:
    """Cancels the task serving a request when its client disconnects before `finish()`:
    whatever the task awaits then (a backend generation, a stream) is cancelled, and
    the backend request aborted at once, not after SGLang's own ~2 s timer. Start it
    after the request body was read (it consumes `receive`)."""

    def __init__(self, receive: Receive) -> None:
        self.gone = False
        """True once the client left and the task was cancelled for it."""
        self._finished = False
        self._task = asyncio.current_task()
        self._watcher = asyncio.create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        try:
            message: Message = await receive()
            while message["type"] != "http.disconnect":
                message = await receive()
        except asyncio.CancelledError:
            # `close` at the end of every request: ended here, the task keeps no
            # CancelledError, whose traceback's frames (this one holds `self`, which holds
            # the task) made a cycle per request that only the GC freed, keeping the
            # request's objects alive until a collection (~20 objects and their referents
            # a request, the largest source of young-generation collections).
            return
        if not self._finished and self._task is not None:
            self.gone = True
            self._task.cancel()

    def finish(self) -> None:
        """The reply is complete: a disconnect from now on changes nothing."""
        self._finished = True

    def close(self) -> None:
        self._watcher.cancel()


async def read_body(receive: Receive, max_bytes: int) -> bytes | None:
    """The whole request body (None if the client disconnected first); 413
    `request_too_large` as soon as more than `max_bytes` arrived."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise request_too_large(max_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, then: Receive | None = None) -> Receive:
    """A `receive` that hands the handler the body already read, once; after that
    `then` (the connection's own `receive`: a disconnect is still seen), or a
    disconnect at once."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return await then() if then is not None else {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def _has_length(scope: Scope) -> bool:
    return any(name == b"content-length" for name, _ in scope["headers"])


async def _bounded(
    receive: Receive, send: Send, limit: int, check: Callable[[bytes], None] | None = None
) -> Receive | None:
    """Read a body whole (413 past `limit`; `check` may refuse it: answered here) and
    hand it on as a replay; None when the request was answered or the client left."""
    try:
        body = await read_body(receive, limit)
        if body is not None and check is not None:
            check(body)
    except OpenAIError as exc:
        await send_json(send, error_reply(exc))
        return None
    return None if body is None else _replay(body, receive)


def _refuse_nul_form(body: bytes) -> None:
    """400 for a NUL in a form body (`%00`)."""
    if b"%00" in body:
        raise nul_refused("the request body")


def _refuse_nul_json(body: bytes) -> None:
    """400 for a NUL in a JSON body (`\u0000` that decodes to one) or a lone surrogate
    (`gateway/strings.py`)."""
    if json_needs_check(body):
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError):
            return  # not JSON: the route answers it
        check_json_body(body, parsed)


def _declared_length(scope: Scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0


async def send_json(send: Send, reply: JsonReply) -> None:
    """Status line, headers and the whole body: two ASGI sends."""
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(reply.body)).encode()),
        (b"x-request-id", reply.request_id.encode()),
    ]
    if reply.headers:
        headers += [(k.encode(), v.encode()) for k, v in reply.headers.items()]
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body})


async def send_stream(send: Send, reply: EventStream, watch: ClientWatch) -> None:
    """Send each event as it comes. If the client leaves first, `watch` cancels this
    task, which closes `events` (and with it the backend stream: the generation is
    aborted, nothing is acknowledged)."""
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [*_SSE_HEADERS, (b"x-request-id", reply.request_id.encode())],
        }
    )
    async with contextlib.aclosing(reply.events) as events:
        async for text in events:
            if isinstance(text, LastEvent):
                watch.finish()
                await send(
                    {"type": "http.response.body", "body": text.encode(), "more_body": False}
                )
                return
            await send({"type": "http.response.body", "body": text.encode(), "more_body": True})
    watch.finish()
    await send({"type": "http.response.body", "body": b"", "more_body": False})
