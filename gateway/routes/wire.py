"""What the OpenAI and Anthropic completion routes share: the reasoning signer and the
framing of named SSE events (Responses and Anthropic Messages both send `event:` lines)."""

from __future__ import annotations

from typing import Any

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
