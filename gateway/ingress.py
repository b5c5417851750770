"""The one ingress: where a request's body is read, bounded and checked, once.

Every request passes `HotRoutes` (`gateway/hotpath.py`), which hands its body to this
module before anything else sees it:

- a hot route (a generation or a token count) is bounded by
  `gateway.limits.max_request_bytes`: its declared length is refused before a byte is
  read (`refuse_declared`), its caller authenticated before the body is read, and the
  body read whole, counted as it arrives (`read_hot`). The route then gets one frozen
  `HotRequest` (path, headers, body bytes, principal), never a Starlette `Request`, and
  parses it with `parse_hot` (JSON object, list caps, `check_body`, the request model);
- any other route (FastAPI's) is bounded by `gateway.limits.control_body_bytes`, or for
  a request without a key by `gateway.limits.anonymous_body_bytes`; its body is read and
  checked here and replayed to FastAPI.

Requests without a key that send a body (what a client can make the gateway hold before
any credential is checked) have budgets of their own (`Ingress.admit_anonymous`). They
are counted in two pools: the console's (the sign-in form, and the signed-in console's
form posts, which carry a cookie, not a key) and the rest (API traffic without a key,
which no route serves past its 401). Each pool takes at most
`gateway.limits.max_anonymous_requests` at once, and one client address at most
`gateway.limits.max_anonymous_per_address` of them (the address the auth throttle
counts: the TCP peer, or `x-forwarded-for` from a configured proxy). So one address's
keyless connections cannot take the admin's sign-in away (the audit: 260 keyless
connections each holding a 1-byte body kept the console at 503 for 60 s), and API
traffic never uses the console's pool. Their bodies must arrive within
`gateway.limits.anonymous_body_timeout_s` (a sign-in form is a few hundred bytes; the
general 60 s is for large prompts), else 408 and the connection is closed. Cost: two
dict updates per keyless request with a body; nothing for a request with a key.

`check_body` is the single place a body's content is checked (NUL characters, lone
surrogates): both kinds of route call it, exactly once per body.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.types import Message, Receive, Scope

from areal_service.config import LimitsConfig
from gateway.auth import Principal
from gateway.errors import OpenAIError, bad_request, validation_param
from gateway.protocol import InvalidRequestError
from gateway.strings import check_json_body, json_needs_check, nul_refused
from gateway.throttle import client_address, request_token

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class HotRequest:
    """A hot route's request, read and bounded by the ingress: all a route reads of it."""

    path: str
    headers: Headers
    """Read-only, case-insensitive (a view of the ASGI scope's header list)."""
    body: bytes
    principal: Principal
    """The authenticated caller."""


# ------------------------------------------------------------------ bounds


def request_too_large(max_bytes: int) -> OpenAIError:
    """413 for a body over the gateway's `max_request_bytes`."""
    return OpenAIError(
        413,
        f"the request body exceeds this gateway's limit of {max_bytes} "
        "bytes (gateway.limits.max_request_bytes)",
        code="request_too_large",
    )


def too_deep() -> OpenAIError:
    """400 for a body nested deeper than the JSON parser follows."""
    return bad_request("the request body is nested too deeply")


def declared_length(scope: Scope) -> int:
    """The request's `content-length` (0 when absent or not a number)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0


def refuse_declared(scope: Scope, limit: int) -> OpenAIError | None:
    """413 when the request declares a body longer than `limit` (nothing read yet)."""
    return request_too_large(limit) if declared_length(scope) > limit else None


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


# ------------------------------------------------------------------ content


def check_body(
    raw: bytes, body: Any = None, *, form: bool = False, text_fields: Collection[str] = ()
) -> None:
    """The content checks of a request body, made once per body on every route: a NUL
    character (in a JSON body outside a conversation's `text_fields`, or `%00` in a form
    body) or a lone UTF-16 surrogate (anywhere in a JSON body) is 400
    `invalid_characters` (`gateway/strings.py`). `body`: `raw` parsed as JSON,
    or None to parse it here only when a check needs it (a body that is not JSON is left
    to its route). A new refusal of a body's content goes here."""
    if form:
        if b"%00" in raw:
            raise nul_refused("the request body")
        return
    if not json_needs_check(raw):  # the one scan every body pays
        return
    if body is None:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            return
    check_json_body(raw, body, text_fields=text_fields)


# ------------------------------------------------------------------ the hot routes


async def read_hot(
    scope: Scope,
    receive: Receive,
    resolve: Callable[[str | None], Awaitable[Principal]],
    max_bytes: int,
) -> HotRequest | None:
    """A hot route's request: its caller authenticated first (`resolve`: 401 before a
    byte of the body is read), then its body read whole within `max_bytes` (413). None
    when the client left while sending it."""
    principal = await resolve(request_token(scope))
    body = await read_body(receive, max_bytes)
    if body is None:
        return None
    return HotRequest(scope["path"], Headers(scope=scope), body, principal)


OFFLOAD_BODY_BYTES = 1 << 20
"""A hot route's body larger than this is parsed and validated on the large-prompt worker
thread, not the event loop (parsing 30 MB of JSON into 600k messages and validating them
took seconds); a smaller one stays on the loop, where a thread hop costs more."""
_LISTS = (("messages", "messages"), ("input", "input"), ("tools", "tools"))
CONVERSATION_FIELDS = frozenset(
    {"messages", "input", "tools", "system", "instructions", "functions", "prompt"}
)
"""A generation request's conversation text: may hold a NUL (`gateway/strings.py`)."""

Offload = Callable[..., Awaitable[Any]]
"""Runs a function off the event loop (`LargePrompts.run`)."""


async def parse_hot(
    body: bytes, model: type[M], max_messages: int, offload: Offload
) -> tuple[dict[str, Any], M]:
    """The JSON object `body` holds, and it validated as `model`: 400 (never 422 or 500)
    when it is missing, malformed or nested too deeply, when a conversation list has more
    than `max_messages` items (`too_many_messages`, before any validation), or when
    `check_body` refuses it. A large body is parsed off the event loop
    (`OFFLOAD_BODY_BYTES`)."""
    if len(body) <= OFFLOAD_BODY_BYTES:
        return _parse_hot(body, model, max_messages)
    parsed: tuple[dict[str, Any], M] = await offload(_parse_hot, body, model, max_messages, True)
    return parsed


def _parse_hot(
    raw: bytes, model: type[M], max_items: int, yielding: bool = False
) -> tuple[dict[str, Any], M]:
    body = json_object(raw, yielding=yielding)
    for field, param in _LISTS:
        items = body.get(field)
        if isinstance(items, list) and len(items) > max_items:
            raise bad_request(
                f"{field} has {len(items):,} items; this gateway takes at most "
                f"{max_items:,} (gateway.limits.max_messages)",
                param,
                "too_many_messages",
            )
    check_body(raw, body, text_fields=CONVERSATION_FIELDS)
    return body, parse_model(model, body)


def _same(value: Any) -> Any:
    return value


def _int(text: str) -> int:
    return int(text)


def _float(text: str) -> float:
    return float(text)


_YIELDING_HOOKS: dict[str, Any] = {"object_hook": _same, "parse_int": _int, "parse_float": _float}
"""json's C parser holds the GIL for a whole document: 0.2-0.4 s for a 21 MB body of 600k
messages here, over 1 s on a loaded machine, and the event loop waits that long even though
the parse runs on a worker thread. A hook written in Python enters the interpreter once per
object and number, and there the parsing thread gives the GIL up at the switch interval (5
ms). Measured: the loop's worst wait went from 0.34 s to 0.04 s, the parse no slower."""


def json_object(raw: bytes, *, yielding: bool = False) -> dict[str, Any]:
    """The JSON object `raw` holds; 400 when it is empty, malformed, nested too deeply or
    not an object. `yielding`: parse so that other threads run meanwhile (for a large body
    parsed off the event loop; `_YIELDING_HOOKS`)."""
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        body = json.loads(raw, **_YIELDING_HOOKS) if yielding else json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # the C parser's guard: ~1000 levels of [ or {
        raise too_deep() from exc
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def parse_model(model: type[M], body: dict[str, Any]) -> M:
    """Validate `body` as `model`; 400 invalid_request_error naming the bad `param`."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, param = validation_param(exc, body)
        raise bad_request(message, param) from exc
    except InvalidRequestError as exc:
        raise bad_request(exc.message, exc.param, exc.code) from exc


# ------------------------------------------------------------------ the other routes

BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
CONSOLE_PREFIX = "/console"

Ticket = tuple[str, str]
"""(pool, client address) of an admitted keyless request: what `release` gives back."""


class Ingress:
    """The other routes' admission: their body bound (by whether the request carries a
    key) and the budgets of requests without a key that send a body (module docstring).
    One per app; its counts are this process's."""

    def __init__(self) -> None:
        self.in_flight: dict[str, int] = {}
        """pool -> keyless requests being served."""
        self.by_address: dict[Ticket, int] = {}
        """(pool, address) -> keyless requests being served; absent at zero, so it holds
        only the addresses with a request in progress."""

    def other_limit(self, scope: Scope, limits: LimitsConfig) -> int:
        """The body bound of a request to a route FastAPI serves."""
        anonymous = request_token(scope) is None
        return min(
            limits.anonymous_body_bytes if anonymous else limits.control_body_bytes,
            limits.max_request_bytes,
        )  # the latter bounds every route

    def admit_anonymous(self, scope: Scope, limits: LimitsConfig) -> Ticket | bool:
        """This request's ticket when it is counted (give it back with `release` when the
        request ends); True when it is not counted (it carries a key, or sends no body:
        health checks and page loads); False when it is refused (503: its pool, or its
        address's share of the pool, is full)."""
        if request_token(scope) is not None or scope["method"] not in BODY_METHODS:
            return True
        pool = "console" if scope["path"].startswith(CONSOLE_PREFIX) else "api"
        ticket = (pool, client_address(scope))
        if (
            self.in_flight.get(pool, 0) >= limits.max_anonymous_requests
            or self.by_address.get(ticket, 0) >= limits.max_anonymous_per_address
        ):
            return False
        self.in_flight[pool] = self.in_flight.get(pool, 0) + 1
        self.by_address[ticket] = self.by_address.get(ticket, 0) + 1
        return ticket

    def release(self, ticket: Ticket) -> None:
        """An admitted keyless request ended."""
        self.in_flight[ticket[0]] -= 1
        left = self.by_address[ticket] - 1
        if left:
            self.by_address[ticket] = left
        else:
            del self.by_address[ticket]

    @staticmethod
    async def read_other(
        scope: Scope, receive: Receive, limit: int, deadline_s: float | None = None
    ) -> Receive | None:
        """Refuse a NUL in the URL, then (for a method with a body) read the body whole
        within `limit` and `deadline_s` (a keyless body's: 408 and close past it), check it
        (`check_body`), and hand it on as a replay so no route sees it unchecked; raises
        `OpenAIError`; None when the client left."""
        if b"%00" in scope["query_string"] or b"%00" in scope.get("raw_path", b""):
            raise nul_refused("the URL")
        if scope["method"] not in BODY_METHODS:
            return receive
        try:
            async with asyncio.timeout(deadline_s):
                body = await read_body(receive, limit)  # small: `limit`
        except TimeoutError:
            raise keyless_body_late(deadline_s or 0.0) from None
        if body is None:
            return None
        form = any(k == b"content-type" and b"form-urlencoded" in v for k, v in scope["headers"])
        check_body(body, form=form)
        return _replay(body, receive)


def _replay(body: bytes, then: Receive) -> Receive:
    """A `receive` that hands the route the body already read, once; after that `then`
    (the connection's own `receive`: a disconnect is still seen)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return await then()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


def anonymous_busy() -> OpenAIError:
    """503 when the keyless request's pool, or its address's share of it, is full."""
    return OpenAIError(
        503,
        "too many requests without an API key in progress (from this address, or for "
        "this part of the gateway); retry later",
        type="server_error",
        code="server_busy",
        headers={"retry-after": "1"},
    )


def keyless_body_late(timeout_s: float) -> OpenAIError:
    """408 for a keyless body not complete within its deadline; the connection closes."""
    late = f"the request body was not received within {timeout_s:g} s"
    why = "(gateway.limits.anonymous_body_timeout_s: requests without an API key)"
    return OpenAIError(408, f"{late} {why}", code="request_timeout", headers=_CLOSE)


_CLOSE = {"connection": "close"}
"""uvicorn closes the connection after a reply carrying this header."""
