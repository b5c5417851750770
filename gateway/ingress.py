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
  a request without a key by `gateway.limits.anonymous_body_bytes`, and at most
  `gateway.limits.max_anonymous_requests` of those that send a body are served at once
  (`Ingress.admit_other`); its body is read and checked here and replayed to FastAPI.

`check_body` is the single place a body's content is checked (NUL characters, lone
surrogates): both kinds of route call it, exactly once per body.
"""

from __future__ import annotations

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
from gateway.throttle import request_token

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
    parsed: tuple[dict[str, Any], M] = await offload(_parse_hot, body, model, max_messages)
    return parsed


def _parse_hot(raw: bytes, model: type[M], max_items: int) -> tuple[dict[str, Any], M]:
    body = json_object(raw)
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


def json_object(raw: bytes) -> dict[str, Any]:
    """The JSON object `raw` holds; 400 when it is empty, malformed, nested too deeply or
    not an object."""
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
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


class Ingress:
    """The other routes' admission: their body bound (by whether the request carries a
    key) and the count of requests without a key that send a body (what holds memory
    before any key is checked). One per app."""

    def __init__(self) -> None:
        self.anonymous_in_flight = 0

    def other_limit(self, scope: Scope, limits: LimitsConfig) -> int:
        """The body bound of a request to a route FastAPI serves."""
        anonymous = request_token(scope) is None
        return min(
            limits.anonymous_body_bytes if anonymous else limits.control_body_bytes,
            limits.max_request_bytes,
        )  # the latter bounds every route

    def admit_anonymous(self, scope: Scope, limits: LimitsConfig) -> bool | None:
        """Whether this request is counted (call `release` when it ends); None when it is
        refused (503: too many without a key in progress). Health checks and page loads
        (no body) are never counted nor refused."""
        if request_token(scope) is not None or scope["method"] not in BODY_METHODS:
            return False
        if self.anonymous_in_flight >= limits.max_anonymous_requests:
            return None
        self.anonymous_in_flight += 1
        return True

    def release(self) -> None:
        self.anonymous_in_flight -= 1

    @staticmethod
    async def read_other(scope: Scope, receive: Receive, limit: int) -> Receive | None:
        """Refuse a NUL in the URL, then (for a method with a body) read the body whole
        within `limit`, check it (`check_body`), and hand it on as a replay so no route
        sees it unchecked; raises `OpenAIError`; None when the client left."""
        if b"%00" in scope["query_string"] or b"%00" in scope.get("raw_path", b""):
            raise nul_refused("the URL")
        if scope["method"] not in BODY_METHODS:
            return receive
        body = await read_body(receive, limit)  # small: `limit`
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
    """503 when too many requests without a key are in progress."""
    return OpenAIError(
        503,
        "too many requests without an API key in progress; retry later",
        type="server_error",
        code="server_busy",
        headers={"retry-after": "1"},
    )
