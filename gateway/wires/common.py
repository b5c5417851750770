"""What the wire rooms share: the reasoning signer, the framing of named SSE events
(Responses and Anthropic Messages both send `event:` lines), and the pieces of their
`/openapi.json` declarations."""

from __future__ import annotations

from typing import Any

from gateway.errors import ErrorBody
from gateway.pipeline import dumps
from gateway.signing import Signer, signer_for
from gateway.state import GatewayState


def reasoning_signer(state: GatewayState) -> Signer:
    """Seals and signs reasoning the client carries back (Responses
    `include: ["reasoning.encrypted_content"]` for Codex, Anthropic thinking signatures),
    keyed by the admin key so only this deployment's gateways accept it back. Cached per
    secret by `signer_for`, so calling it per request costs a dict lookup."""
    return signer_for(state.config.gateway.auth.admin_key.get_secret_value())


def named_event(event: dict[str, Any]) -> str:
    """One SSE event named by its `type`: `event: <type>\\ndata: <json>\\n\\n`."""
    return f"event: {event['type']}\ndata: {dumps(event)}\n\n"


STREAM_CONTENT = {"text/event-stream": {"schema": {"type": "string"}}}
"""The `content` of a streamed 200 in `/openapi.json`."""

HOT_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in (
        (400, "invalid request (names the `param`)"),
        (401, "unknown or revoked key"),
        (404, "unknown model, session or previous response"),
        (409, "the session has ended"),
        (413, "body over gateway.limits.max_request_bytes"),
        (503, "no backend available (retry-after) or the record could not be stored"),
    )
}
"""The OpenAI-shaped errors of the OpenAI wires, as `/openapi.json` documents them."""


def hot_responses(description: str) -> dict[int | str, dict[str, Any]]:
    """The `responses` of an OpenAI wire's hot route in `/openapi.json`: its errors, and
    a 200 that is a JSON reply or, with `stream: true`, an event stream (`description`)."""
    return {**HOT_ERRORS, 200: {"content": STREAM_CONTENT, "description": description}}
