"""FastAPI dependencies: the app's state and the authenticated caller, as Annotated aliases."""

from __future__ import annotations

import json
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Query, Request
from pydantic import BaseModel, ValidationError

from gateway.auth import Principal, bearer_token, require_admin
from gateway.errors import OpenAIError, bad_request, validation_param
from gateway.protocol import InvalidRequestError
from gateway.state import GatewayState
from gateway.strings import check_json_body

M = TypeVar("M", bound=BaseModel)

MAX_OFFSET = 1_000_000_000
"""Largest paging offset a list route takes (400 beyond): the databases' integers are
64-bit, and no list holds a billion rows to skip."""
PageOffset = Annotated[int, Query(ge=0, le=MAX_OFFSET)]
PageLimit = Annotated[int, Query(ge=0, le=MAX_OFFSET)]
"""A page size (the routes then serve at most 1000)."""


async def get_state(request: Request) -> GatewayState:
    """The `GatewayState` built by `create_app`'s lifespan. Async on purpose: FastAPI
    runs a sync dependency in its thread pool (a thread hop per request, ~0.3 ms)."""
    state: GatewayState = request.app.state.gateway
    return state


StateDep = Annotated[GatewayState, Depends(get_state)]


async def get_principal(request: Request, state: StateDep) -> Principal:
    """The caller (401 `invalid_api_key` unless the bearer token is known)."""
    return await state.keys.resolve(bearer_token(request))


PrincipalDep = Annotated[Principal, Depends(get_principal)]


async def get_admin(principal: PrincipalDep) -> Principal:
    """The caller, who must hold the admin key (403 otherwise)."""
    require_admin(principal)
    return principal


AdminDep = Annotated[Principal, Depends(get_admin)]


async def read_json(request: Request) -> dict[str, Any]:
    """The JSON object body of a hot route (`gateway.pipeline`; FastAPI routes declare
    theirs); 400 (never 422 or 500) when it is missing, malformed or nested too deeply,
    413 `request_too_large` past `gateway.limits.max_request_bytes` (counted as it arrives)."""
    state: GatewayState = request.app.state.gateway
    return _json_object(await _read_bounded(request, state.config.gateway.limits.max_request_bytes))


def _json_object(raw: bytes) -> dict[str, Any]:
    """The JSON object `raw` holds; 400 otherwise (see `read_json`)."""
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


OFFLOAD_BODY_BYTES = 1 << 20
"""A hot route's body larger than this is parsed and validated on the large-prompt worker
thread, not the event loop (parsing 30 MB of JSON into 600k messages and validating them
took seconds); a smaller one stays on the loop, where a thread hop costs more."""
_LISTS = (("messages", "messages"), ("input", "input"), ("tools", "tools"))
CONVERSATION_FIELDS = frozenset(
    {"messages", "input", "tools", "system", "instructions", "functions", "prompt"}
)
"""A generation request's conversation text: may hold a NUL (`gateway/strings.py`)."""


async def read_request(request: Request, model: type[M]) -> tuple[dict[str, Any], M, int]:
    """`read_json` then `parse_model`, with the conversation's lists capped at
    `gateway.limits.max_messages` items (400 `too_many_messages`, before any validation) and a
    large body handled off the event loop (`OFFLOAD_BODY_BYTES`). Also returns the body's
    size in bytes (a bound on the characters of any text in it)."""
    state: GatewayState = request.app.state.gateway
    gw = state.config.gateway
    raw = await _read_bounded(request, gw.limits.max_request_bytes)
    if len(raw) <= OFFLOAD_BODY_BYTES:
        return (*_parse_request(raw, model, gw.limits.max_messages), len(raw))
    parsed = await state.large_prompts.run(_parse_request, raw, model, gw.limits.max_messages)
    return (*parsed, len(raw))


def _parse_request(raw: bytes, model: type[M], max_items: int) -> tuple[dict[str, Any], M]:
    body = _json_object(raw)
    for field, param in _LISTS:
        items = body.get(field)
        if isinstance(items, list) and len(items) > max_items:
            raise bad_request(
                f"{field} has {len(items):,} items; this gateway takes at most "
                f"{max_items:,} (gateway.limits.max_messages)",
                param,
                "too_many_messages",
            )
    check_json_body(raw, body, text_fields=CONVERSATION_FIELDS)
    return body, parse_model(model, body)


def parse_model(model: type[M], body: dict[str, Any]) -> M:
    """Validate `body` as `model`; 400 invalid_request_error naming the bad `param`."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, param = validation_param(exc, body)
        raise bad_request(message, param) from exc
    except InvalidRequestError as exc:
        raise bad_request(exc.message, exc.param, exc.code) from exc


def too_deep() -> OpenAIError:
    """400 for a body nested deeper than the JSON parser follows."""
    return bad_request("the request body is nested too deeply")


def request_too_large(max_bytes: int) -> OpenAIError:
    """413 for a body over the gateway's `max_request_bytes`."""
    return OpenAIError(
        413,
        f"the request body exceeds this gateway's limit of {max_bytes} "
        "bytes (gateway.limits.max_request_bytes)",
        code="request_too_large",
    )


async def _read_bounded(request: Request, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise request_too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)
