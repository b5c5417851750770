"""OpenAI routes: `/v1/chat/completions`, `/v1/responses`, `/v1/models` (also without `/v1`).

Each handler reads top to bottom as the hop table says: authenticate → parse → render
the chat template to ids → generate on a backend (token in, token out) → build the
OpenAI reply from the returned ids → make the record durable → reply. Streaming sends
tokens as the backend produces them; the record is durable before `[DONE]` (chat) or
`response.completed` (Responses).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request

from gateway.auth import Principal
from gateway.capture import build_records, persist
from gateway.chat_stream import ChatStreamAssembler, build_usage_chunk
from gateway.deps import PrincipalDep, StateDep, parse_model, read_json
from gateway.errors import OpenAIError, bad_request
from gateway.generation import StreamedChoice, generate_all, generate_requests, stream_all
from gateway.hotpath import EventStream, Handler, JsonReply, Reply
from gateway.protocol import ChatCompletionRequest, InvalidRequestError, ResponsesRequest
from gateway.response_chain import with_previous_responses
from gateway.responses import ResponsesStreamAssembler, build_response, responses_to_chat
from gateway.sessions import session_for_request
from gateway.sglang_types import GenerationDelta
from gateway.state import GatewayState
from gateway.translate import (
    GeneratedChoice,
    SamplingSpec,
    Usage,
    build_chat_completion,
    parse_choice,
    render_prompt_ids,
    resolve_sampling,
    tools_enabled,
)

router = APIRouter()


_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
"""Compact JSON of a reply or stream chunk. Built once: `json.dumps` with arguments makes
a new encoder per call (~2 of its ~5 µs for a stream chunk)."""


def _json(body: dict[str, Any], request_id: str) -> JsonReply:
    return JsonReply(_dumps(body).encode(), request_id)


def check_model(state: GatewayState, model: str | None) -> None:
    """404 `model_not_found` unless `model` is the served model's id."""
    if model != state.config.gateway.model_name:
        raise OpenAIError(404, f"The model `{model}` does not exist or you do not have access "
                          f"to it. This gateway serves `{state.config.gateway.model_name}`.",
                          param="model", code="model_not_found")


def prepare(state: GatewayState, messages: list[dict[str, Any]], tools: Any, tool_choice: Any,
            sampling: Any, param: str) -> tuple[list[int], SamplingSpec]:
    """Prompt ids (the served model's chat template) and the sampling actually used."""
    gw = state.config.gateway
    try:
        prompt_ids = render_prompt_ids(state.tokenizer, messages, tools, tool_choice)
        spec = resolve_sampling(sampling, prompt_tokens=len(prompt_ids),
                                context_length=state.context_length,
                                default_max_tokens=gw.default_max_tokens, mode=gw.sampling,
                                training_temperature=gw.training_temperature, param=param)
    except InvalidRequestError as exc:
        raise bad_request(exc.message, exc.param, exc.code) from exc
    return prompt_ids, spec


async def _first_or_error(deltas: AsyncIterator[tuple[int, GenerationDelta]]
                          ) -> tuple[int, GenerationDelta] | None:
    """The first delta, pulled before the response starts so a failure is still a plain
    HTTP error (503/400) rather than an error event inside a 200 stream."""
    try:
        return await deltas.__anext__()
    except StopAsyncIteration:
        return None


# ------------------------------------------------------------------ chat completions


async def chat_completions(request: Request, state: GatewayState, principal: Principal
                           ) -> Reply:
    """OpenAI Chat Completions, streaming or not, recorded token for token."""
    started = time.perf_counter()
    body = await read_json(request)
    req = parse_model(ChatCompletionRequest, body)
    check_model(state, req.model)
    session_id = await session_for_request(state, principal, request, body)
    tools, tool_choice = req.chat_tools(), req.chat_tool_choice()
    prompt_ids, spec = prepare(state, req.message_dicts(), tools, tool_choice,
                               req.client_sampling(), "messages")
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    parse_tools = tools_enabled(tools, tool_choice)
    requests = generate_requests(prompt_ids, spec, completion_id, req.wants_logprobs())

    def finish(choices: list[Any], generations: list[Any]) -> dict[str, Any]:
        usage = Usage.of(len(prompt_ids), choices)
        state.metrics.prompt_tokens.inc(len(prompt_ids))
        state.metrics.completion_tokens.inc(usage.completion_tokens)
        return build_chat_completion(completion_id=completion_id, model=req.model,
                                     created=created, choices=choices, usage=usage)

    def records(generations: list[Any], choices: list[Any], response: dict[str, Any]
                ) -> list[Any]:
        return build_records(
            completion_id=completion_id, model=req.model, prompt_ids=prompt_ids,
            generations=generations, choices=choices, spec=spec, request_json=body,
            response_json=response, session_id=session_id, api_key_id=principal.key_id,
            started=started)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        assemblers = [ChatStreamAssembler(
            state.tokenizer, completion_id=completion_id, model=req.model, created=created,
            index=i, parse_tools=parse_tools, stop=spec.stop, logprobs=req.wants_logprobs())
            for i in range(spec.n)]
        deltas = stream_all(state, requests, session_id)
        first = await _first_or_error(deltas)
        state.metrics.ttft.observe(time.perf_counter() - started)

        async def chat_events() -> AsyncIterator[str]:
            acc = [StreamedChoice(r.rid) for r in requests]
            for asm in assemblers:
                yield f"data: {_dumps(asm.start())}\n\n"
            item = first
            while item is not None:
                index, delta = item
                acc[index].add(delta)
                # One write per backend delta: a socket send per chunk was the largest
                # streaming cost under load.
                out = "".join(f"data: {_dumps(chunk)}\n\n" for chunk in assemblers[index].push(
                    delta.output_ids, delta.output_logprobs, delta.finish_reason,
                    new_top=delta.output_top_logprobs))
                if out:
                    yield out
                item = await anext(deltas, None)
            choices = [asm.result for asm in assemblers]
            generations = [a.generation(len(prompt_ids), started) for a in acc]
            response = finish(choices, generations)
            if include_usage:
                usage_chunk = build_usage_chunk(completion_id=completion_id, model=req.model,
                                                created=created, usage=Usage.of(
                                                    len(prompt_ids), choices))
                yield f"data: {_dumps(usage_chunk)}\n\n"
            await persist(state, records(generations, choices, response))
            yield "data: [DONE]\n\n"

        return _sse(state, chat_events(), deltas, completion_id,
                    on_error=lambda e: f"data: {_dumps(e.body())}\n\n")

    generations = await generate_all(state, requests, session_id)
    choices = [parse_choice(state.tokenizer, GeneratedChoice(g.output_ids, g.output_logprobs,
                                                             g.finish_reason,
                                                             g.output_top_logprobs),
                            completion_id=completion_id, index=i, parse_tools=parse_tools,
                            logprobs=req.wants_logprobs())
               for i, g in enumerate(generations)]
    response = finish(choices, generations)
    await persist(state, records(generations, choices, response))
    return _json(response, completion_id)


def _sse(state: GatewayState, events: AsyncIterator[str],
         deltas: AsyncIterator[tuple[int, GenerationDelta]], request_id: str, *,
         on_error: Callable[[OpenAIError], str]) -> EventStream:
    """A streaming reply that turns a failure after the first byte into one error
    event and closes the backend stream in every case (client gone included)."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except OpenAIError as exc:
            yield on_error(exc)
        finally:
            await deltas.aclose()

    return EventStream(guarded(), request_id)


# ------------------------------------------------------------------ responses


async def responses(request: Request, state: GatewayState, principal: Principal) -> Reply:
    """OpenAI Responses (the Agents SDK's default and Codex), translated to one chat turn."""
    started = time.perf_counter()
    body = await read_json(request)
    req = parse_model(ResponsesRequest, body)
    check_model(state, req.model)
    session_id = await session_for_request(state, principal, request, body)
    try:
        messages, tools, tool_choice = responses_to_chat(
            await with_previous_responses(state, principal, req))
    except InvalidRequestError as exc:
        raise bad_request(exc.message, exc.param, exc.code) from exc
    prompt_ids, spec = prepare(state, messages, tools, tool_choice, req.client_sampling(),
                               "input")
    response_id = f"resp_{uuid.uuid4().hex}"
    created_at = time.time()
    parse_tools = tools_enabled(tools, tool_choice)
    requests = generate_requests(prompt_ids, spec, response_id, req.wants_logprobs())

    def records(generation: Any, choice: Any, response: dict[str, Any]) -> list[Any]:
        return build_records(
            completion_id=response_id, model=req.model, prompt_ids=prompt_ids,
            generations=[generation], choices=[choice], spec=spec, request_json=body,
            response_json=response, session_id=session_id, api_key_id=principal.key_id,
            started=started)

    if req.stream:
        asm = ResponsesStreamAssembler(
            req, state.tokenizer, response_id=response_id, created_at=created_at,
            model=req.model, sampling=spec, prompt_tokens=len(prompt_ids),
            parse_tools=parse_tools, logprobs=req.wants_logprobs())
        deltas = stream_all(state, requests, session_id)
        first = await _first_or_error(deltas)
        state.metrics.ttft.observe(time.perf_counter() - started)

        def event(e: dict[str, Any]) -> str:
            return f"event: {e['type']}\ndata: {_dumps(e)}\n\n"

        async def response_events() -> AsyncIterator[str]:
            acc = StreamedChoice(requests[0].rid)
            for e in asm.start():
                yield event(e)
            item = first
            final: list[dict[str, Any]] = []
            while item is not None:
                _, delta = item
                acc.add(delta)
                for e in asm.push(delta.output_ids, delta.output_logprobs, delta.finish_reason):
                    if e["type"] == "response.completed":
                        final.append(e)  # sent once the record is durable
                    else:
                        yield event(e)
                item = await anext(deltas, None)
            assert asm.response is not None and asm.result is not None
            await persist(state, records(acc.generation(len(prompt_ids), started), asm.result,
                                         asm.response))
            for e in final:
                yield event(e)

        return _sse(state, response_events(), deltas, response_id,
                    on_error=lambda e: "".join(event(x) for x in asm.fail(
                        e.code or "server_error", e.message)))

    (generation,) = await generate_all(state, requests, session_id)
    choice = parse_choice(state.tokenizer, GeneratedChoice(
        generation.output_ids, generation.output_logprobs, generation.finish_reason),
        completion_id=response_id, parse_tools=parse_tools, logprobs=req.wants_logprobs())
    usage = Usage.of(len(prompt_ids), [choice])
    response = build_response(req, response_id=response_id, created_at=created_at,
                              model=req.model, choice=choice, usage=usage, sampling=spec)
    await persist(state, records(generation, choice, response))
    return _json(response, response_id)


HOT_ROUTES: dict[str, tuple[str, Handler]] = {
    path: (label, handler)
    for label, handler, paths in (
        ("chat", chat_completions, ("/v1/chat/completions", "/chat/completions")),
        ("responses", responses, ("/v1/responses", "/responses")))
    for path in paths}
"""Served by `gateway.hotpath.HotRoutes`, outside FastAPI (see there why)."""


# ------------------------------------------------------------------ models


def model_card(state: GatewayState) -> dict[str, Any]:
    """The served model as `/v1/models` lists it."""
    return {"id": state.config.gateway.model_name, "object": "model",
            "created": int(state.started_at), "owned_by": "areal-service",
            "max_model_len": state.context_length}


@router.get("/v1/models")
@router.get("/models", include_in_schema=False)
async def list_models(state: StateDep, _: PrincipalDep) -> dict[str, Any]:
    """The one served model (OpenClaw and others discover it here)."""
    return {"object": "list", "data": [model_card(state)]}


@router.get("/v1/models/{model_id:path}")
@router.get("/models/{model_id:path}", include_in_schema=False)
async def get_model(model_id: str, state: StateDep, _: PrincipalDep) -> dict[str, Any]:
    """The model card, or 404 `model_not_found`."""
    check_model(state, model_id)
    return model_card(state)
