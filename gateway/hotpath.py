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

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import OpenAIError
from gateway.ingress import HotRequest, Ingress, anonymous_busy, read_hot, refuse_declared, too_deep
from gateway.limits import Events
from gateway.state import GatewayState
from gateway.throttle import note_auth_failure

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
Handler = Callable[[HotRequest, GatewayState], Awaitable[Reply]]
"""A hot route: (request as the ingress read it, state) → reply; raises `OpenAIError`."""
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
    middleware runs). Every request's body is read, bounded and checked by
    `gateway/ingress.py` before anything else reads it (413 `request_too_large` for a
    declared length beyond its bound, before a byte is read); a hot route's caller is
    authenticated before its body is read (a wrong or missing key never has its body
    buffered)."""

    def __init__(self, app: ASGIApp, routes: Mapping[str, Route]) -> None:
        self.app = app
        self.routes = dict(routes)
        self.ingress = Ingress()

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
        refused = refuse_declared(scope, state.config.gateway.limits.max_request_bytes)
        if refused is not None:  # refused before a byte is read
            await send_json(send, error_reply(refused, shape))
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
        """A route FastAPI serves, once the ingress admitted it and read its body."""
        limits = state.config.gateway.limits
        limit = self.ingress.other_limit(scope, limits)
        refused = refuse_declared(scope, limit)
        if refused is not None:
            await send_json(send, error_reply(refused))
            return
        ticket = self.ingress.admit_anonymous(scope, limits)
        if ticket is False:
            await send_json(send, error_reply(anonymous_busy()))
            return
        deadline = None if ticket is True else limits.anonymous_body_timeout_s
        try:
            try:
                replay = await self.ingress.read_other(scope, receive, limit, deadline)
            except OpenAIError as exc:
                await send_json(send, error_reply(exc))
                return
            if replay is not None:  # None: the client left
                await self.app(scope, replay, send)
        finally:
            if not isinstance(ticket, bool):
                self.ingress.release(ticket)

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
            request = await read_hot(
                scope, receive, state.keys.resolve, state.config.gateway.limits.max_request_bytes
            )
        except OpenAIError as exc:
            state.metrics.count_request(label, exc.status)
            if exc.status == 401:
                note_auth_failure(scope)
            await send_json(send, error_reply(exc, shape))
            return
        if request is None:
            return  # the client left while sending its request
        watch = ClientWatch(receive)
        answering = False  # True once the reply's first bytes may have gone out
        try:
            reply = await _reply(handler, request, state, shape)
            status = reply.status if isinstance(reply, JsonReply) else 200
            state.metrics.count_request(label, status)
            if status == 401:  # a session key that ended, a revoked key
                note_auth_failure(scope)
            answering = True
            if isinstance(reply, JsonReply):
                watch.finish()
                await send_json(send, reply)
            else:
                await send_stream(send, reply, watch)
        except asyncio.CancelledError:
            # Only two things cancel this task: its client leaving (`watch`), and the
            # server at the end of its graceful-shutdown period (`server.py`).
            asyncio.current_task().uncancel()  # type: ignore[union-attr]  # ended here
            if watch.gone:
                state.metrics.count_request(label, 499)  # nginx's "client closed"
                return
            state.metrics.count_request(label, 503)
            await _cut_by_shutdown(send, scope, answering, shape)
        finally:
            watch.close()


async def _reply(
    handler: Handler, request: HotRequest, state: GatewayState, shape: ErrorBody | None
) -> Reply:
    """The handler's reply, or its failure as an error reply in the route's shape."""
    try:
        return await handler(request, state)
    except OpenAIError as exc:
        return error_reply(exc, shape)
    except RecursionError:  # a structure (a tool's JSON schema) nested too deeply for a
        # renderer or converter: the request's fault, found at no cost to the requests
        # that are not nested so (no depth walk up front)
        return error_reply(too_deep(), shape)
    except Exception as exc:  # the route's shape even for a bug, and a log line
        log.exception("unhandled error on POST %s", request.path)
        return error_reply(
            OpenAIError(
                500,
                f"internal error: {type(exc).__name__}",
                type="server_error",
                code="internal_error",
            ),
            shape,
        )


SHUTDOWN_RETRY_AFTER_S = 5
"""`retry-after` of a request cut by shutdown: about a restart's time."""


async def _cut_by_shutdown(
    send: Send, scope: Scope, answering: bool, shape: ErrorBody | None
) -> None:
    """The server stopped while this request was still being served, past its grace
    period: 503 `shutting_down` with `retry-after` when nothing was sent yet (a stream
    already under way is ended where it stands), and one log line, not a traceback."""
    log.warning("POST %s cut by the gateway's shutdown: answered 503", scope["path"])
    with contextlib.suppress(Exception):  # the connection may be closing already
        if not answering:
            await send_json(send, error_reply(shutting_down(), shape))
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def shutting_down() -> OpenAIError:
    """503 for a request the gateway's shutdown cut short."""
    return OpenAIError(
        503,
        "the gateway shut down before this request was answered (retry once a gateway is "
        "serving again)",
        type="server_error",
        code="shutting_down",
        headers={"retry-after": str(SHUTDOWN_RETRY_AFTER_S)},
    )


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
