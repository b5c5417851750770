"""Time and count bounds on the gateway's HTTP connections, under uvicorn.

uvicorn times out only idle keep-alive connections: a client that trickles its request
line, headers or body a byte at a time holds its connection (and the task reading it)
forever, and nothing caps how many connections are open. These protocol classes are
uvicorn's own two HTTP/1.1 implementations (httptools and h11) with three bounds added:

- a request's line and headers must be complete `header_timeout_s` after its first byte
  (or, for a connection's first request, after the connection opened; else `408` and
  the connection is closed);
- its body must be complete `body_timeout_s` after its headers (else the connection is
  closed: the handler, waiting on the body, sees a disconnect);
- at most `max_connections` connections are open in this process (a new one beyond
  gets `503` and is closed at once).

Cost per request: one `call_at` timer, armed at the request's first byte and cancelled
when its body is complete (re-armed once when the headers are in and the body deadline
lies later). A reply being generated or streamed is never timed: only bytes the client
still owes are.

`protocol_factory(http, limits)` is what `gateway/server.py` passes uvicorn as `http`: a
`functools.partial` of a module-level class, so it pickles into uvicorn's spawned workers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

HttpImpl = Literal["httptools", "h11"]


def _raw_json(status: bytes, extra: bytes, body: bytes) -> bytes:
    """A complete `connection: close` response written straight to the transport (no
    ASGI cycle exists yet, or it is being abandoned)."""
    return (
        b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n%sconnection: close\r\n"
        b"content-length: %d\r\n\r\n%s" % (status, extra, len(body), body)
    )


_TIMEOUT_408 = _raw_json(
    b"408 Request Timeout",
    b"",
    b'{"error":{"message":"the request '
    b'was not received in time","type":"invalid_request_error",'
    b'"param":null,"code":"request_timeout"}}',
)
_BUSY_503 = _raw_json(
    b"503 Service Unavailable",
    b"retry-after: 1\r\n",
    b'{"error":{'
    b'"message":"too many open connections; retry later","type":'
    b'"server_error","param":null,"code":"too_many_connections"}}',
)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """The bounds (from `GatewayConfig`); see the module docstring."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 4096


class _Guard:
    """The bounds, mixed into one of uvicorn's protocol classes (which must come after it
    in the bases). The subclass calls `_request_began`, `_headers_done` and
    `_body_done` from its parser's events."""

    connections: set[Any]
    transport: asyncio.Transport
    cycle: Any
    loop: asyncio.AbstractEventLoop

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = limits
        self._timer: asyncio.TimerHandle | None = None
        self._headers_at: float | None = None
        """When the current request's headers were complete (None: still arriving)."""

    def connection_made(self, transport: asyncio.Transport) -> None:
        # ignore: a mixin; uvicorn's protocol class after it in the MRO defines this.
        super().connection_made(transport)  # type: ignore[misc]
        if len(self.connections) > self._limits.max_connections:
            log.warning(
                "refused a connection: %d open (gateway.limits.max_connections)",
                len(self.connections) - 1,
            )
            transport.write(_BUSY_503)
            transport.close()
            return
        self._request_began()  # a connection that never sends a byte is timed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        super().connection_lost(exc)  # type: ignore[misc]

    def _request_began(self) -> None:
        if self._timer is None:
            self._headers_at = None
            self._timer = self.loop.call_at(
                self.loop.time() + self._limits.header_timeout_s, self._expired
            )

    def _headers_done(self) -> None:
        self._headers_at = self.loop.time()
        if self._timer is None:  # (h11 may report headers and body in one go)
            self._timer = self.loop.call_at(
                self._headers_at + self._limits.body_timeout_s, self._expired
            )

    def _body_done(self) -> None:
        self._cancel()
        self._headers_at = None

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        now = self.loop.time()
        if self._headers_at is not None:
            deadline = self._headers_at + self._limits.body_timeout_s
            if now < deadline:  # headers in time; the body has until its own deadline
                self._timer = self.loop.call_at(deadline, self._expired)
                return
            log.info(
                "closed a connection whose request body was not complete %.0f s after its headers",
                self._limits.body_timeout_s,
            )
            cycle = self.cycle
            if cycle is not None and not cycle.response_started:
                self.transport.write(_TIMEOUT_408)
        else:
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                # A pipelined request's first bytes while the previous reply is still
                # being sent (a long stream): the client is not slow; wait on.
                self._timer = self.loop.call_at(now + self._limits.header_timeout_s, self._expired)
                return
            log.info(
                "closed a connection whose request headers were not complete %.0f s "
                "after its first byte",
                self._limits.header_timeout_s,
            )
            self.transport.write(_TIMEOUT_408)
        self.transport.close()


class HeldHead:
    """The transport as one response's cycle sees it: the status line and headers, which
    uvicorn writes on their own at `http.response.start`, are held until the reply's
    first body write and go out with it in one `write` (one socket send and one wake-up
    of the client fewer per reply; a JSON reply is then a single send). Held at most
    until the loop's next iteration (`call_soon`), so nothing waits on a body that
    does not follow at once. Everything else is the connection's transport."""

    __slots__ = ("_transport", "_loop", "_held", "_flush")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._flush: asyncio.Handle | None = None
        """Set at the first write: only that one is held."""

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._flush.cancel()  # type: ignore[union-attr]
            self._transport.write(held + data)
        elif self._flush is None:
            self._held = data
            self._flush = self._loop.call_soon(self._release)
        else:
            self._transport.write(data)

    def _release(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self._transport.write(held)

    def close(self) -> None:
        self._release()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


# ignore[misc] (both classes): uvicorn narrows connection_made's transport to
# asyncio.Transport against asyncio's BaseProtocol (its own ignore[override]); the guard's
# connection_made takes what uvicorn's does, so mypy sees the same conflict here.
class GuardedHttpToolsProtocol(_Guard, HttpToolsProtocol):  # type: ignore[misc]
    """uvicorn's httptools protocol with the bounds (events from httptools' parser), and
    each response's head sent with its first body bytes (`HeldHead`)."""

    def on_message_begin(self) -> None:
        self._request_began()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._headers_done()
        cycle = self.cycle
        super().on_headers_complete()
        if self.cycle is not cycle:  # this request's cycle (not started yet)
            self.cycle.transport = HeldHead(self.transport, self.loop)

    def on_message_complete(self) -> None:
        self._body_done()
        super().on_message_complete()


class GuardedH11Protocol(_Guard, H11Protocol):  # type: ignore[misc]
    """uvicorn's h11 protocol with the bounds. h11 reports no per-event hook to
    subclasses, so the peer's state is read after each batch of received bytes."""

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.IDLE:  # bytes of a request line / headers, not complete yet
            self._request_began()
        elif state is h11.SEND_BODY:
            if self._headers_at is None:
                self._headers_done()
        else:  # DONE (the request is complete), or closed / errored
            self._body_done()


_CLASSES: dict[str, type[_Guard]] = {
    "httptools": GuardedHttpToolsProtocol,
    "h11": GuardedH11Protocol,
}


def protocol_factory(http: HttpImpl, limits: ConnectionLimits) -> Callable[..., Any]:
    """What uvicorn's `http` option takes: builds one guarded protocol per connection."""
    return functools.partial(_CLASSES[http], limits=limits)
