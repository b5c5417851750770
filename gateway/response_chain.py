"""`previous_response_id`: a Responses turn that continues a stored one.

Every response is a stored completion (its request and response JSON), so a chain is
rebuilt from the store: for each earlier response, oldest first, its input items then
its output items, then the new request's input. As on OpenAI, `instructions` and
`tools` are not carried over (each request sends its own). The rebuilt conversation
renders to a prompt that extends the previous prompt + output token for token (the same
property replayed items have), so the turns still merge into one training sequence.
A response is visible only to the key that created it (and to the admin key): another
key's id is answered like an unknown one, and so is one whose request said `store:
false` (Codex sends it; its completion is still captured for training, but not kept
for `previous_response_id`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from areal_service.store import TrajectoryStore
from gateway.auth import Principal
from gateway.errors import OpenAIError
from gateway.protocol import ResponsesRequest
from gateway.state import GatewayState

MAX_CHAIN = 1000
"""Longest chain followed (each link is one indexed store read)."""


async def with_previous_responses(
    state: GatewayState, principal: Principal, request: ResponsesRequest
) -> ResponsesRequest:
    """`request` with the stored conversation before it prepended to `input` (and
    `previous_response_id` resolved away); `request` itself when it names none."""
    if not request.previous_response_id:
        return request
    owner = None if principal.is_admin else principal.key_id
    earlier = await asyncio.to_thread(
        conversation_items, state.store, request.previous_response_id, owner
    )
    return request.model_copy(
        update={"input": earlier + input_items(request.input), "previous_response_id": None}
    )


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's `input` as a list of items (a string is one user message)."""
    return [{"role": "user", "content": value}] if isinstance(value, str) else list(value)


def conversation_items(
    store: TrajectoryStore, response_id: str, owner: str | None
) -> list[dict[str, Any]]:
    """Input and output items of `response_id` and every response it continues, oldest
    first. 404 `previous_response_not_found` for an id that is unknown, not a Responses
    completion, or (with `owner`) created by another key."""
    chain = []
    current: str | None = response_id
    while current:
        record = store.get_completion(current)
        if (
            record is None
            or "input" not in record.request_json
            or (owner is not None and record.api_key_id != owner)
            or record.request_json.get("store") is False
        ):
            raise OpenAIError(
                404,
                f"Previous response with id '{current}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        chain.append(record)
        if len(chain) > MAX_CHAIN:
            raise OpenAIError(
                400,
                f"the response chain behind '{response_id}' is longer "
                f"than {MAX_CHAIN}; resend the conversation in `input`",
                param="previous_response_id",
            )
        current = record.request_json.get("previous_response_id")
    items: list[dict[str, Any]] = []
    for record in reversed(chain):
        items += input_items(record.request_json["input"])
        items += list(record.response_json.get("output") or ())
    return items
