"""The Anthropic Messages wire's routes: `POST /v1/messages` (Claude Code calls
`/v1/messages?beta=true`) and `/v1/messages/count_tokens`, also without `/v1`.

Served on the hot path (`gateway.hotpath.HotRoutes`) by the same pipeline as the OpenAI
wires (`gateway.pipeline`): the adapter here says only what is this wire's own. Errors
on these paths take Anthropic's shape (`encode.error_body`). `docs_router` declares them
for `/openapi.json` only.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Body

from gateway.auth import Principal
from gateway.backends import GenerationDelta
from gateway.errors import OpenAIError, bad_request
from gateway.hotpath import JsonReply, Reply, Route
from gateway.ingress import HotRequest, parse_hot
from gateway.large_prompts import refuse_overlong
from gateway.model_names import resolve_model
from gateway.pipeline import Conversation, StreamEncoder, StreamEnd, Turn, WireAdapter, dumps
from gateway.protocol import InvalidRequestError
from gateway.state import GatewayState
from gateway.translate import ParsedChoice, Usage, render_prompt_ids
from gateway.wires.anthropic.encode import MessageStreamAssembler, build_message, error_body
from gateway.wires.anthropic.protocol import CountTokensRequest, MessagesRequest
from gateway.wires.anthropic.translate import anthropic_to_chat
from gateway.wires.common import STREAM_CONTENT, named_event, reasoning_signer


def _conversation(
    state: GatewayState, request: MessagesRequest | CountTokensRequest
) -> Conversation:
    messages, tools, tool_choice, dropped = anthropic_to_chat(
        request, hosted_tools=state.config.gateway.hosted_tools, signer=reasoning_signer(state)
    )
    return Conversation(
        messages, tools, tool_choice, {"dropped_tools": dropped} if dropped else None
    )


class AnthropicAdapter(WireAdapter[MessagesRequest]):
    """Anthropic Messages (Claude Code, the `anthropic` SDKs), one chat turn."""

    label = "anthropic"
    request_model = MessagesRequest
    id_prefix = "msg_"
    prompt_param = "messages"

    async def conversation(
        self, state: GatewayState, principal: Principal, request: MessagesRequest
    ) -> Conversation:
        return _conversation(state, request)

    def reply(
        self, turn: Turn[MessagesRequest], choices: Sequence[ParsedChoice], usage: Usage
    ) -> dict[str, Any]:
        (choice,) = choices
        return build_message(
            message_id=turn.completion_id,
            model=turn.model,
            choice=choice,
            usage=usage,
            signer=reasoning_signer(turn.state),
        )

    def stream(self, turn: Turn[MessagesRequest]) -> StreamEncoder:
        return MessagesStream(turn)


class MessagesStream(StreamEncoder):
    """Anthropic SSE events; `message_stop` once the record is durable."""

    def __init__(self, turn: Turn[MessagesRequest]) -> None:
        self._asm = MessageStreamAssembler(
            turn.state.tokenizer,
            message_id=turn.completion_id,
            model=turn.model,
            sampling=turn.spec,
            prompt_tokens=len(turn.prompt_ids),
            parse_tools=turn.parse_tools,
            signer=reasoning_signer(turn.state),
            tools=turn.tools,
        )

    def start(self) -> str:
        return "".join(map(named_event, self._asm.start()))

    def push(self, index: int, delta: GenerationDelta) -> str:
        return "".join(map(named_event, self._asm.push(delta.output_ids, delta.finish_reason)))

    def end(self) -> StreamEnd:
        asm = self._asm
        assert asm.message is not None and asm.result is not None
        return StreamEnd([asm.result], asm.message, "", named_event(asm.stop()))

    def fail(self, error: OpenAIError) -> str:
        return named_event(error_body(error))


async def count_tokens(request: HotRequest, state: GatewayState) -> Reply:
    """`{"input_tokens": N}`: the prompt the same request would render (no session, so
    no continuity: the count of a fresh render)."""
    _, req = await parse_hot(
        request.body,
        CountTokensRequest,
        state.config.gateway.limits.max_messages,
        state.large_prompts.run,
    )
    resolve_model(state.config.gateway, req.model)
    try:
        conv = _conversation(state, req)
        args = (state.tokenizer, conv.messages, conv.tools, conv.tool_choice)
        if state.large_prompts.is_large(conv.messages, conv.tools):
            # As on the generation routes: surely over the context, refused from its
            # character count; else counted off the event loop.
            refuse_overlong(state.tokenizer, conv.messages, state.context_length, param="messages")
            ids = await state.large_prompts.run(render_prompt_ids, *args)
        else:
            ids = render_prompt_ids(*args)
    except InvalidRequestError as exc:
        raise bad_request(exc.message, exc.param, exc.code) from exc
    return JsonReply(dumps({"input_tokens": len(ids)}).encode(), f"req_{uuid.uuid4().hex}")


MESSAGES = AnthropicAdapter()

HOT_ROUTES: dict[str, Route] = {
    **{
        path: (MESSAGES.label, MESSAGES.handle, error_body)
        for path in ("/v1/messages", "/messages")
    },
    **{
        path: ("anthropic_count_tokens", count_tokens, error_body)
        for path in ("/v1/messages/count_tokens", "/messages/count_tokens")
    },
}
"""Served by `gateway.hotpath.HotRoutes`, outside FastAPI."""


# ------------------------------------------------------------------ schema of the hot routes

docs_router = APIRouter()
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"description": text + ' (`{"type": "error", "error": {"type", "message"}}`)'}
    for code, text in (
        (400, "invalid request"),
        (401, "unknown or revoked key"),
        (409, "the session has ended"),
        (503, "no backend available"),
    )
}


@docs_router.post(
    "/v1/messages",
    responses={
        **_ERRORS,
        200: {
            "content": {"application/json": {"schema": {"type": "object"}}, **STREAM_CONTENT},
            "description": "a `message`, or with `stream: true` Anthropic events ending in "
            "`message_stop`",
        },
    },
)
async def messages(body: MessagesRequest = Body()) -> dict[str, Any]:
    """Anthropic Messages (Claude Code: `x-api-key` or `Authorization: Bearer`), one turn
    recorded token for token like the OpenAI routes."""
    raise AssertionError("served by gateway.hotpath.HotRoutes")


@docs_router.post(
    "/v1/messages/count_tokens",
    responses={
        **_ERRORS,
        200: {
            "content": {"application/json": {"schema": {"type": "object"}}},
            "description": '`{"input_tokens": N}`',
        },
    },
)
async def messages_count_tokens(body: CountTokensRequest = Body()) -> dict[str, Any]:
    """Prompt tokens the same Messages request renders to."""
    raise AssertionError("served by gateway.hotpath.HotRoutes")
