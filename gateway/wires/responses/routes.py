"""The Responses wire's routes: `POST /v1/responses` (also without `/v1`), served by
`gateway.hotpath.HotRoutes` through the one pipeline in `gateway.pipeline`; the adapter
here says only what is the Responses wire's own. `docs_router` declares the path for
`/openapi.json` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Body

from gateway.auth import Principal
from gateway.backends import GenerationDelta
from gateway.errors import OpenAIError
from gateway.hotpath import Route
from gateway.pipeline import Conversation, StreamEncoder, StreamEnd, Turn, WireAdapter
from gateway.state import GatewayState
from gateway.translate import ParsedChoice, Usage
from gateway.wires.common import hot_responses, named_event, reasoning_signer
from gateway.wires.responses.encode import ResponseHead, ResponsesStreamAssembler
from gateway.wires.responses.protocol import Response, ResponsesRequest
from gateway.wires.responses.translate import translate_request, with_previous_responses


class ResponsesAdapter(WireAdapter[ResponsesRequest]):
    """OpenAI Responses (the Agents SDK's default and Codex), translated to one chat turn."""

    label = "responses"
    request_model = ResponsesRequest
    id_prefix = "resp_"
    prompt_param = "input"

    async def conversation(
        self, state: GatewayState, principal: Principal, request: ResponsesRequest
    ) -> Conversation:
        conv = translate_request(
            await with_previous_responses(state.store, principal, request),
            hosted_tools=state.config.gateway.hosted_tools,
            signer=reasoning_signer(state),
        )
        return Conversation(
            conv.messages,
            conv.tools,
            conv.tool_choice,
            {"dropped_tools": conv.dropped_tools} if conv.dropped_tools else None,
        )

    def reply(
        self, turn: Turn[ResponsesRequest], choices: Sequence[ParsedChoice], usage: Usage
    ) -> dict[str, Any]:
        (choice,) = choices
        head = ResponseHead(turn.request, turn.completion_id, turn.created, turn.model, turn.spec)
        return head.finished(choice, usage, reasoning_signer(turn.state))

    def stream(self, turn: Turn[ResponsesRequest]) -> StreamEncoder:
        return ResponsesStream(turn)


class ResponsesStream(StreamEncoder):
    """Responses SSE events; `response.completed` once the record is durable."""

    def __init__(self, turn: Turn[ResponsesRequest]) -> None:
        self._asm = ResponsesStreamAssembler(
            turn.request,
            turn.state.tokenizer,
            response_id=turn.completion_id,
            created_at=turn.created,
            model=turn.model,
            sampling=turn.spec,
            prompt_tokens=len(turn.prompt_ids),
            parse_tools=turn.parse_tools,
            logprobs=turn.logprobs,
            signer=reasoning_signer(turn.state),
            tools=turn.tools,
        )
        self._final: list[dict[str, Any]] = []

    def start(self) -> str:
        return "".join(named_event(e) for e in self._asm.start())

    def push(self, index: int, delta: GenerationDelta) -> str:
        out = []
        for e in self._asm.push(
            delta.output_ids,
            delta.output_logprobs,
            delta.finish_reason,
            new_top=delta.output_top_logprobs,
        ):
            if e["type"] == "response.completed":
                self._final.append(e)  # sent once the record is durable
            else:
                out.append(named_event(e))
        return "".join(out)

    def end(self) -> StreamEnd:
        asm = self._asm
        assert asm.response is not None and asm.result is not None
        return StreamEnd([asm.result], asm.response, "", "".join(map(named_event, self._final)))

    def fail(self, error: OpenAIError) -> str:
        return "".join(
            map(named_event, self._asm.fail(error.code or "server_error", error.message))
        )


RESPONSES = ResponsesAdapter()

HOT_ROUTES: dict[str, Route] = {
    path: (RESPONSES.label, RESPONSES.handle) for path in ("/v1/responses", "/responses")
}
"""Served by `gateway.hotpath.HotRoutes`, outside FastAPI."""


# ------------------------------------------------------------------ schema of the hot route

docs_router = APIRouter()
"""The hot route as `/openapi.json` documents it; never reached."""


@docs_router.post(
    "/v1/responses",
    response_model=Response,
    responses=hot_responses(
        "a response, or with `stream: true` Responses events ending in `response.completed`"
    ),
)
async def responses(body: ResponsesRequest = Body()) -> Response:
    """OpenAI Responses (the Agents SDK's default and Codex), one chat turn."""
    raise AssertionError("served by gateway.hotpath.HotRoutes")
