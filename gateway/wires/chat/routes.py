"""The chat wire's routes: `POST /v1/chat/completions` (also without `/v1`), served by
`gateway.hotpath.HotRoutes` (outside FastAPI, see there why) through the one pipeline in
`gateway.pipeline`; the adapter here says only what is the chat wire's own.
`docs_router` declares the path with its request and reply models, for `/openapi.json`
and `/docs` only: the hot path answers it before FastAPI's router is reached, and
parses with the same models.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Body

from gateway.auth import Principal
from gateway.backends import GenerationDelta
from gateway.errors import OpenAIError
from gateway.hotpath import Route
from gateway.pipeline import Conversation, StreamEncoder, StreamEnd, Turn, WireAdapter, dumps
from gateway.state import GatewayState
from gateway.translate import ParsedChoice, Usage
from gateway.wires.chat.encode import ChatStreamAssembler, build_chat_completion, build_usage_chunk
from gateway.wires.chat.protocol import ChatCompletion, ChatCompletionRequest
from gateway.wires.chat.translate import conversation
from gateway.wires.common import hot_responses

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
        return conversation(request)

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


CHAT = ChatAdapter()

HOT_ROUTES: dict[str, Route] = {
    path: (CHAT.label, CHAT.handle) for path in ("/v1/chat/completions", "/chat/completions")
}
"""Served by `gateway.hotpath.HotRoutes`, outside FastAPI."""


# ------------------------------------------------------------------ schema of the hot route

docs_router = APIRouter()
"""The hot route as `/openapi.json` documents it; never reached (see the module
docstring), so the endpoint below only declares bodies."""


@docs_router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses=hot_responses(
        "a chat.completion, or with "
        "`stream: true` `chat.completion.chunk` events ending in `[DONE]`"
    ),
)
async def chat_completions(body: ChatCompletionRequest = Body()) -> ChatCompletion:
    """OpenAI Chat Completions, streaming or not, recorded token for token."""
    raise AssertionError("served by gateway.hotpath.HotRoutes")
