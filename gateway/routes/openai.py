"""OpenAI routes: `/v1/chat/completions`, `/v1/responses`, `/v1/models` (also without `/v1`).

The two completion routes are served by `gateway.hotpath.HotRoutes` (outside FastAPI,
see there why) through the one pipeline in `gateway.pipeline`; the adapters here say
only what differs between the two wire APIs. `docs_router` declares the same paths with
their request and reply models, for `/openapi.json` and `/docs` only: the hot path
answers these paths before FastAPI's router is reached, and parses with the same models.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Body

from gateway.auth import Principal
from gateway.backends import GenerationDelta
from gateway.chat_stream import ChatStreamAssembler, build_usage_chunk
from gateway.deps import PrincipalDep, StateDep
from gateway.errors import OpenAIError
from gateway.hotpath import Route
from gateway.model_names import model_card, model_cards, resolve_model
from gateway.pipeline import Conversation, StreamEncoder, StreamEnd, Turn, WireAdapter, dumps
from gateway.protocol import ChatCompletionRequest, ResponsesRequest
from gateway.replies import ChatCompletion, ErrorBody, Model, ModelList, Response
from gateway.response_chain import with_previous_responses
from gateway.responses import ResponsesStreamAssembler, build_response, translate_request
from gateway.routes import anthropic
from gateway.routes.wire import named_event, reasoning_signer
from gateway.state import GatewayState
from gateway.translate import ParsedChoice, Usage, build_chat_completion

router = APIRouter()


# ------------------------------------------------------------------ chat completions


class ChatAdapter(WireAdapter[ChatCompletionRequest]):
    """OpenAI Chat Completions, streaming or not, recorded token for token."""

    label = "chat"
    request_model = ChatCompletionRequest
    id_prefix = "chatcmpl-"
    prompt_param = "messages"
    refuse_over_budget = True  # `max_tokens` past the context: 400, as OpenAI answers
    # Messages and tools come from the body alone (legacy `functions` gain a few
    # characters of wrapping: the bound is off by that much, and a prompt just under the
    # offload threshold is then prepared on the loop, still checked exactly after).
    conversation_in_body = True

    async def conversation(
        self, state: GatewayState, principal: Principal, request: ChatCompletionRequest
    ) -> Conversation:
        return Conversation(
            request.message_dicts(), request.chat_tools(), request.chat_tool_choice()
        )

    def reply(
        self, turn: Turn[ChatCompletionRequest], choices: Sequence[ParsedChoice], usage: Usage
    ) -> dict[str, Any]:
        return build_chat_completion(
            completion_id=turn.completion_id,
            model=turn.model,
            created=int(turn.created),
            choices=choices,
            usage=usage,
        )

    def stream(self, turn: Turn[ChatCompletionRequest]) -> StreamEncoder:
        return ChatStream(self, turn)


class ChatStream(StreamEncoder):
    """`data: {chat.completion.chunk}` events; `data: [DONE]` once the record is durable
    (the `include_usage` chunk just before)."""

    def __init__(self, adapter: ChatAdapter, turn: Turn[ChatCompletionRequest]) -> None:
        self._adapter = adapter
        self._turn = turn
        self._assemblers = [
            ChatStreamAssembler(
                turn.state.tokenizer,
                completion_id=turn.completion_id,
                model=turn.model,
                created=int(turn.created),
                index=i,
                parse_tools=turn.parse_tools,
                stop=turn.spec.stop,
                logprobs=turn.logprobs,
                tools=turn.tools,
            )
            for i in range(turn.spec.n)
        ]

    def start(self) -> str:
        return "".join(f"data: {dumps(asm.start())}\n\n" for asm in self._assemblers)

    def push(self, index: int, delta: GenerationDelta) -> str:
        return self._assemblers[index].push_sse(
            delta.output_ids,
            delta.output_logprobs,
            delta.finish_reason,
            new_top=delta.output_top_logprobs,
        )

    def end(self) -> StreamEnd:
        turn = self._turn
        done = [asm.result for asm in self._assemblers if asm.result is not None]
        assert len(done) == len(self._assemblers), "a choice's stream did not finish"
        usage = Usage.of(len(turn.prompt_ids), done)
        before = ""
        options = turn.request.stream_options
        if options is not None and options.include_usage:
            chunk = build_usage_chunk(
                completion_id=turn.completion_id,
                model=turn.model,
                created=int(turn.created),
                usage=usage,
            )
            before = f"data: {dumps(chunk)}\n\n"
        return StreamEnd(done, self._adapter.reply(turn, done, usage), before, "data: [DONE]\n\n")

    def fail(self, error: OpenAIError) -> str:
        return f"data: {dumps(error.body())}\n\n"


# ------------------------------------------------------------------ responses


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
            await with_previous_responses(state, principal, request),
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
        return build_response(
            turn.request,
            response_id=turn.completion_id,
            created_at=turn.created,
            model=turn.model,
            choice=choice,
            usage=usage,
            sampling=turn.spec,
            signer=reasoning_signer(turn.state),
        )

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


CHAT = ChatAdapter()
RESPONSES = ResponsesAdapter()

HOT_ROUTES: dict[str, Route] = {
    **{
        path: (adapter.label, adapter.handle)
        for adapter, paths in (
            (CHAT, ("/v1/chat/completions", "/chat/completions")),
            (RESPONSES, ("/v1/responses", "/responses")),
        )
        for path in paths
    },
    **anthropic.HOT_ROUTES,
}
"""Served by `gateway.hotpath.HotRoutes`, outside FastAPI (see there why); the Anthropic
Messages routes (`routes/anthropic.py`) included."""


# ------------------------------------------------------------------ schema of the hot routes

docs_router = APIRouter()
"""The hot routes as `/openapi.json` documents them; never reached (see the module
docstring), so the endpoints below only declare bodies."""
_ERRORS: dict[int | str, dict[str, Any]] = {
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
_STREAM = {"text/event-stream": {"schema": {"type": "string"}}}
docs_router.include_router(anthropic.docs_router)


@docs_router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses={
        **_ERRORS,
        200: {
            "content": _STREAM,
            "description": "a chat.completion, or with "
            "`stream: true` `chat.completion.chunk` events ending in `[DONE]`",
        },
    },
)
async def chat_completions(body: ChatCompletionRequest = Body()) -> ChatCompletion:
    """OpenAI Chat Completions, streaming or not, recorded token for token."""
    raise AssertionError("served by gateway.hotpath.HotRoutes")


@docs_router.post(
    "/v1/responses",
    response_model=Response,
    responses={
        **_ERRORS,
        200: {
            "content": _STREAM,
            "description": "a response, or with "
            "`stream: true` Responses events ending in `response.completed`",
        },
    },
)
async def responses(body: ResponsesRequest = Body()) -> Response:
    """OpenAI Responses (the Agents SDK's default and Codex), one chat turn."""
    raise AssertionError("served by gateway.hotpath.HotRoutes")


# ------------------------------------------------------------------ models


@router.get("/v1/models")
@router.get("/models", include_in_schema=False)
async def list_models(state: StateDep, _: PrincipalDep) -> ModelList:
    """The served model and its configured aliases (OpenClaw and others discover it here)."""
    return ModelList(data=model_cards(state))


@router.get("/v1/models/{model_id:path}", responses={404: {"model": ErrorBody}})
@router.get("/models/{model_id:path}", include_in_schema=False)
async def get_model(model_id: str, state: StateDep, _: PrincipalDep) -> Model:
    """The card of any name the gateway serves (all are the policy), or 404
    `model_not_found` under strict `gateway.model_names`."""
    return model_card(state, resolve_model(state.config.gateway, model_id))
