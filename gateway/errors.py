"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure the gateway returns goes through here, so clients (openai-python, the
Agents SDK, Codex) map it to the right exception and never see HTML or a bare 500 for
bad input. Routes raise `OpenAIError`; `install_error_handlers` maps the rest.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from areal_service.store.write_probe import WRITE_REFUSED

log = logging.getLogger(__name__)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error the gateway returns, as `/openapi.json` documents it:
    `{"error": {message, type, param, code}}`."""

    error: ErrorDetail


class OpenAIError(Exception):
    """An error response in the OpenAI shape, raised anywhere under a route."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - the wire name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, dict[str, str | None]]:
        """The JSON body: also used for mid-stream `data: {"error": ...}` events."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        """The HTTP response for this error."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_api_key(given: str | None) -> OpenAIError:
    """401 as OpenAI words it; shows only the first characters of what was sent. No key
    at all is said as such (OpenAI's "You didn't provide an API key"), with where keys
    come from; the code stays `invalid_api_key` for clients that branch on it."""
    if not given:
        return OpenAIError(
            401,
            "You didn't provide an API key. Send it in an Authorization header "
            "(Authorization: Bearer YOUR_KEY; or x-api-key: YOUR_KEY): the admin key is in "
            "<data_dir>/admin_key, "
            "session keys come from POST /rl/sessions, others from `areal-service keys "
            "create`.",
            code="invalid_api_key",
        )
    return OpenAIError(
        401,
        f"Incorrect API key provided: {given[:6]}…. Check the key or create one with "
        "`areal-service keys create`.",
        code="invalid_api_key",
    )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """400 invalid_request_error naming the offending parameter."""
    return OpenAIError(400, message, param=param, code=code)


def backend_unavailable(message: str, retry_after_s: int = 2) -> OpenAIError:
    """503 with retry-after: openai-python retries these, riding out weight swaps."""
    return OpenAIError(
        503,
        message,
        type="server_error",
        code="backend_unavailable",
        headers={"retry-after": str(retry_after_s)},
    )


def validation_param(
    exc: ValidationError | RequestValidationError, body: Any = None
) -> tuple[str, str | None]:
    """(message, param) of the first validation error; param is the path in the request
    body, `messages[0].content`, as the Responses translation also names it."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if tuple(first.get("loc", ())) == ("body",) and isinstance(first.get("input"), bytes):
        return ("the request body must be a JSON object sent as application/json", None)
    if first.get("type") == "json_invalid":  # FastAPI's parse of a route's body
        return _json_error(first, body), None
    param = _body_path(first.get("loc", ()), body, missing=first.get("type") == "missing")
    # pydantic prefixes a validator's own message; the hot routes' messages carry none.
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{msg} (at {param or 'body'})", param


def _json_error(error: Any, doc: Any) -> str:
    """FastAPI's "JSON decode error" worded as the hot routes word it
    (`ingress.json_object`), with the line and column json's own error gives (FastAPI
    keeps the text and position)."""
    loc = tuple(error.get("loc", ()))
    reason = str((error.get("ctx") or {}).get("error", "invalid JSON"))
    if isinstance(doc, str) and len(loc) == 2 and isinstance(loc[1], int):
        reason = str(json.JSONDecodeError(reason, doc, loc[1]))
    return f"the request body is not valid JSON: {reason}"


_LOCATIONS = frozenset({"body", "query", "path", "header", "cookie"})
"""Where FastAPI found a parameter: the first part of its error `loc`, not a name."""


def _body_path(loc: Sequence[int | str], body: Any, *, missing: bool) -> str | None:
    """`loc` walked through `body`, dropping pydantic's union-member tags (`str`,
    `list[dict[str,any]]`, …): a part counts only where `body` has that key or index (or
    is the absent field of a `missing` error)."""
    parts = list(loc[1:] if loc and loc[0] in _LOCATIONS else loc)
    if body is None:
        return ".".join(str(p) for p in parts) or None
    path, node = "", body
    for i, part in enumerate(parts):
        if (
            isinstance(node, dict)
            and isinstance(part, str)
            and (part in node or (missing and i == len(parts) - 1))
        ):
            path, node = f"{path}.{part}" if path else part, node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path, node = f"{path}[{part}]", node[part]
    return path or None


def install_error_handlers(app: FastAPI) -> None:
    """Map framework errors to the OpenAI shape; unexpected ones to a logged 500."""

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_param(exc, exc.body)
        return bad_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = str(exc.detail)
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404 and message == "Not Found":  # the router's, not a route's
            message = (
                f"Invalid URL ({where}): this gateway has no such route; the OpenAI "
                "routes are under /v1 (all of them at /docs)"
            )
        elif exc.status_code == 405 and message == "Method Not Allowed":
            message = f"Invalid method ({where}): {request.url.path} does not take {request.method}"
        return OpenAIError(
            exc.status_code, message, type=kind, code=code, headers=dict(exc.headers or {})
        ).response()

    @app.exception_handler(RecursionError)
    async def _too_deep(_: Request, exc: RecursionError) -> JSONResponse:
        # A value nested too deeply for a converter or the store's encoder: the
        # request's fault (the hot routes map it the same way).
        return bad_request("the request body is nested too deeply").response()

    async def _store_unavailable(request: Request, exc: Exception) -> JSONResponse:
        # The database refused a write (disk or quota full, locked, read-only, gone):
        # the client can retry, as on the capture path, never a 500.
        log.warning("store error on %s %s: %s", request.method, request.url.path, exc)
        return OpenAIError(
            503,
            f"the store cannot take writes right now ({type(exc).__name__}); retry the request",
            type="server_error",
            code="store_unavailable",
            headers={"retry-after": "1"},
        ).response()

    for refused in WRITE_REFUSED:
        app.add_exception_handler(refused, _store_unavailable)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _internal_error(exc)

    app.add_middleware(_KeepAliveOn500)


def _internal_error(exc: Exception) -> JSONResponse:
    return OpenAIError(
        500, f"internal error: {type(exc).__name__}", type="server_error", code="internal_error"
    ).response()


class _KeepAliveOn500:
    """ASGI layer just inside Starlette's ServerErrorMiddleware: an unexpected error before
    the response started is answered here (a logged 500 in the OpenAI shape) and not
    re-raised. ServerErrorMiddleware answers it the same way but always re-raises, and the
    server then closes the client's keep-alive connection: one bug's 500 would cost every
    request the client had queued on it. An error after the response started still goes
    up (the reply is cut; the connection must close). Cost: one `send` wrapper per
    framework request (the hot routes never enter the framework)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            await _internal_error(exc)(scope, receive, send)
