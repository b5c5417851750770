"""One pipeline for both OpenAI wire APIs: parse → model → session → prompt → generate →
record → reply. `WireAdapter` subclasses (one per wire: `gateway/wires/<wire>/routes.py`)
fill in only what differs: the request model, the conversation a body asks for, the
reply body and the stream encoding. The steps here are shared, so both APIs count,
record and fail the same way. Nothing here knows a wire format.

Streaming sends tokens as the backend produces them; the record is durable before the
stream's last event (`[DONE]`, `response.completed`), so an acknowledged completion is
never lost. Cost: this is the hot path; a turn is one slotted object and the adapters
are stateless singletons (no per-request closures).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar, cast

from areal_service.types import CompletionRecord
from gateway.auth import Principal
from gateway.backends import Generation, GenerationDelta
from gateway.backends.records import TokenRequest
from gateway.capture import build_records, persist
from gateway.continuity import Lineage
from gateway.errors import OpenAIError, bad_request
from gateway.generation import StreamedChoice, generate_all, generate_requests, stream_all
from gateway.hotpath import EventStream, JsonReply, LastEvent, Reply
from gateway.ingress import HotRequest, parse_hot
from gateway.large_prompts import refuse_overlong
from gateway.model_names import resolve_model
from gateway.policies import serving_policy
from gateway.protocol import ClientSampling, InvalidRequestError, ToolChoice
from gateway.routing import BackendPool
from gateway.sessions import session_for_request
from gateway.state import GatewayState
from gateway.translate import (
    GeneratedChoice,
    ParsedChoice,
    SamplingSpec,
    Usage,
    parse_choice,
    resolve_sampling,
    tools_enabled,
)

log = logging.getLogger(__name__)

dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
"""Compact JSON of a reply or stream chunk. Built once: `json.dumps` with arguments makes
a new encoder per call (~2 of its ~5 µs for a stream chunk)."""


class WireRequest(Protocol):
    """What the pipeline reads from a parsed request body (both request models have it)."""

    model: str
    stream: bool | None

    def wants_logprobs(self) -> int | None: ...

    def client_sampling(self) -> ClientSampling: ...


RequestT = TypeVar("RequestT", bound=WireRequest)


@dataclass(frozen=True, slots=True)
class Conversation:
    """What a request asks the model to continue, in chat form."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: ToolChoice | None
    notes: dict[str, Any] | None = None
    """What the gateway changed about the request (e.g. `dropped_tools`: hosted tools left
    out of the prompt); recorded under `gateway` in the completion's response JSON."""


@dataclass(slots=True)
class Turn(Generic[RequestT]):
    """One request on its way through the pipeline (everything later steps need)."""

    state: GatewayState
    principal: Principal
    body: dict[str, Any]
    """The request JSON as sent (recorded with the completion)."""
    request: RequestT
    model: str
    """The model name the client asked for: echoed in the reply, recorded."""
    session_id: str | None
    prompt_ids: list[int]
    spec: SamplingSpec
    completion_id: str
    created: float
    parse_tools: bool
    tools: list[dict[str, Any]] | None
    """The tool definitions rendered (argument types, for parsers that read them)."""
    logprobs: int | None
    """None unless the client asked for logprobs, else how many top alternatives."""
    generate: list[TokenRequest]
    """One backend request per choice."""
    started: float
    lineage: Lineage | None = None
    """What the prompt was made from (token continuity remembers it with the outputs)."""
    adapter: str | None = None
    """The policy adapter the generations run under (`gateway/policies.py`); None: the
    default policy."""
    pool: BackendPool | None = None
    """A full-weight policy's own backends (`gateway/policy_pools.py`); None: the main
    pool."""
    notes: dict[str, Any] | None = None
    """`Conversation.notes`."""


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """How a stream ends: `before` is sent, the record made durable, then `after`."""

    choices: list[ParsedChoice]
    response: dict[str, Any]
    """The complete reply body, as the non-streaming path would send it (recorded)."""
    before: str
    after: str


class StreamEncoder(ABC):
    """One streamed reply's wire encoding (SSE text), fed backend deltas."""

    @abstractmethod
    def start(self) -> str:
        """Events sent before the first token."""

    @abstractmethod
    def push(self, index: int, delta: GenerationDelta) -> str:
        """Events for choice `index`'s new tokens ("" when nothing is to be sent yet)."""

    @abstractmethod
    def end(self) -> StreamEnd:
        """Once every choice finished."""

    @abstractmethod
    def fail(self, error: OpenAIError) -> str:
        """The error event for a failure after the stream started."""


class WireAdapter(ABC, Generic[RequestT]):
    """One OpenAI wire API on the shared pipeline: the hooks say how its body parses
    into a conversation and how its reply and stream look. Instances are stateless."""

    label: ClassVar[str]
    """Metrics label of the route."""
    request_model: type[RequestT]
    id_prefix: ClassVar[str]
    prompt_param: ClassVar[str]
    """The body field a too-long prompt is blamed on."""
    conversation_in_body: ClassVar[bool] = False
    """Whether `conversation` takes all its text from the request body (then the body's
    size bounds the text's length: `LargePrompts.is_large` skips its count when small).
    Not so where stored earlier turns join in (the Responses API's
    `previous_response_id`)."""
    refuse_over_budget: ClassVar[bool] = False
    """Refuse (400) an output budget that does not fit beside the prompt, as OpenAI's
    chat API does; otherwise cut it to what fits (`resolve_sampling`)."""

    @abstractmethod
    async def conversation(
        self, state: GatewayState, principal: Principal, request: RequestT
    ) -> Conversation:
        """The chat messages and tools to render; raises `InvalidRequestError`."""

    @abstractmethod
    def reply(
        self, turn: Turn[RequestT], choices: Sequence[ParsedChoice], usage: Usage
    ) -> dict[str, Any]:
        """The complete (non-streamed) reply body."""

    @abstractmethod
    def stream(self, turn: Turn[RequestT]) -> StreamEncoder:
        """The encoder of this turn's streamed reply."""

    async def handle(self, request: HotRequest, state: GatewayState) -> Reply:
        """The route (`hotpath.Handler`): the whole pipeline for one request."""
        async with state.keys.limits.holding(request.principal.key) as keep:  # per-key 429s
            turn = await begin(self, request, state)
            if turn.request.stream:
                reply = await reply_stream(self, turn)
                return EventStream(keep(reply.events), reply.request_id)
            return await reply_complete(self, turn)


async def begin(
    adapter: WireAdapter[RequestT], request: HotRequest, state: GatewayState
) -> Turn[RequestT]:
    """Parse, check the model, find the session, render the prompt, pick the sampling."""
    started = time.perf_counter()
    gw = state.config.gateway
    principal = request.principal
    # cast: parse_hot takes a pydantic model class, which every request_model is; mypy
    # has no intersection type to bound RequestT by both BaseModel and WireRequest.
    req: RequestT  # (an annotation only)
    body, req = await parse_hot(
        request.body,
        cast("type[Any]", adapter.request_model),
        gw.limits.max_messages,
        state.large_prompts.run,
    )
    size = len(request.body)
    model = resolve_model(gw, req.model)
    session_id = await session_for_request(state, principal, request.headers, body)
    # Without declared policies, no call at all (the request path's common case). A
    # role's completions are recorded in the episode's role sub-session (`roles.py`).
    lora = None
    if state.policy_registry.declared:
        lora, session_id = await serving_policy(state, principal, session_id, model)
    conv, prompt_ids, lineage, spec = await prepare_prompt(
        adapter, state, principal, req, session_id, size
    )
    # 128 random bits as 32 hex digits, like `uuid4().hex` (which costs ~5 µs to build
    # the UUID object; this ~1 µs).
    completion_id = f"{adapter.id_prefix}{os.urandom(16).hex()}"
    logprobs = req.wants_logprobs()
    # A full-weight policy is served by its own pool, under its engines' own weights (no
    # adapter); one dict lookup, and none without a named policy.
    pool = state.policy_pools.get(lora) if lora is not None else None
    return Turn(
        state=state,
        principal=principal,
        body=body,
        request=req,
        model=model,
        session_id=session_id,
        prompt_ids=prompt_ids,
        spec=spec,
        completion_id=completion_id,
        created=time.time(),
        parse_tools=tools_enabled(conv.tools, conv.tool_choice),
        tools=conv.tools,
        logprobs=logprobs,
        generate=generate_requests(
            prompt_ids, spec, completion_id, logprobs, lora if pool is None else None
        ),
        started=started,
        lineage=lineage,
        notes=conv.notes,
        adapter=lora,
        pool=pool,
    )


async def prepare_prompt(
    adapter: WireAdapter[RequestT],
    state: GatewayState,
    principal: Principal,
    req: RequestT,
    session_id: str | None,
    size: int,
) -> tuple[Conversation, list[int], Lineage | None, SamplingSpec]:
    """The request's conversation, its prompt ids (and what they were made from), and
    the sampling to run it with; `size`: the body's bytes. 400 for what cannot be
    rendered or sampled."""
    gw = state.config.gateway
    try:
        conv = await adapter.conversation(state, principal, req)
        prompt_args = (session_id, conv.messages, conv.tools, conv.tool_choice)
        if state.continuity.wants_recall(session_id, conv.messages):
            await recall_previous_turn(state, *prompt_args)
        if state.large_prompts.is_large(
            conv.messages, conv.tools, size if adapter.conversation_in_body else None
        ):
            # Surely too long: refused from its character count, before render/tokenize
            # (a small prompt's exact check below is cheaper than this walk).
            refuse_overlong(
                state.tokenizer, conv.messages, state.context_length, param=adapter.prompt_param
            )
            prompt_ids, lineage = await state.large_prompts.run(
                state.continuity.prompt, *prompt_args
            )
        else:
            prompt_ids, lineage = state.continuity.prompt(*prompt_args)
        # Training sampling keeps behaviour logprobs what the trainer recomputes; a turn
        # outside any session is never trained on (an evaluation through a training
        # gateway, the admin's own calls), so it samples as its client asks.
        mode = gw.sampling.mode if session_id is not None else "client"
        spec = resolve_sampling(
            req.client_sampling(),
            prompt_tokens=len(prompt_ids),
            context_length=state.context_length,
            default_max_tokens=gw.sampling.default_max_tokens,
            mode=mode,
            training_temperature=gw.sampling.training_temperature,
            param=adapter.prompt_param,
            refuse_over_budget=adapter.refuse_over_budget,
            max_n_tokens=gw.limits.max_n_tokens,
        )
    except InvalidRequestError as exc:
        raise bad_request(exc.message, exc.param, exc.code) from exc
    return conv, prompt_ids, lineage, spec


async def recall_previous_turn(
    state: GatewayState,
    session_id: str | None,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    tool_choice: ToolChoice | None,
) -> None:
    """Token continuity from the store, off the event loop (`Continuity.recall`). A
    failure (the database down) only loses the optimisation: logged, not raised."""
    assert session_id is not None
    try:
        await asyncio.to_thread(state.continuity.recall, session_id, messages, tools, tool_choice)
    except Exception:  # noqa: BLE001 - the turn is served with a full render
        log.warning(
            "session %s: token continuity could not read the store", session_id, exc_info=True
        )


async def reply_complete(adapter: WireAdapter[RequestT], turn: Turn[RequestT]) -> JsonReply:
    """Generate every choice, build the reply, make the record durable, reply."""
    generations = await generate_all(turn.state, turn.generate, turn.session_id, turn.pool)
    choices = [
        parse_choice(
            turn.state.tokenizer,
            GeneratedChoice(
                g.output_ids, g.output_logprobs, g.finish_reason, g.output_top_logprobs
            ),
            completion_id=turn.completion_id,
            index=i,
            parse_tools=turn.parse_tools,
            logprobs=turn.logprobs,
            tools=turn.tools,
        )
        for i, g in enumerate(generations)
    ]
    usage = count_usage(turn, choices)
    response = adapter.reply(turn, choices, usage)
    await persist(turn.state, records(turn, generations, choices, response))
    turn.state.continuity.remember(turn.lineage, generations, choices)
    return JsonReply(dumps(response).encode(), turn.completion_id)


async def reply_stream(adapter: WireAdapter[RequestT], turn: Turn[RequestT]) -> EventStream:
    """Start the backend streams and wait for the first delta before answering, so a
    failure until then is still a plain HTTP error (503/400) rather than an error event
    inside a 200 stream."""
    deltas = stream_all(turn.state, turn.generate, turn.session_id, turn.pool)
    try:
        first = await anext(deltas, None)
    except BaseException:
        await deltas.aclose()
        raise
    turn.state.metrics.ttft.observe(time.perf_counter() - turn.started)
    return EventStream(stream_events(turn, adapter.stream(turn), first, deltas), turn.completion_id)


async def stream_events(
    turn: Turn[Any],
    encoder: StreamEncoder,
    first: tuple[int, GenerationDelta] | None,
    deltas: AsyncGenerator[tuple[int, GenerationDelta], None],
) -> AsyncGenerator[str, None]:
    """The streamed reply: one write per backend delta (a socket send per chunk was the
    largest streaming cost under load); the opening events go out with the first delta
    (already here: nothing waits for them) and the last event with the end of the body.
    A failure after the first byte becomes one error event; the backend streams are
    closed in every case (client gone included). A client that reads slower than the
    backend writes gets fewer, larger writes: while a write waits on the socket nothing
    pulls from the backend, so its chunks pile up and are read, parsed and sent as one."""
    try:
        # cast: generate_requests gives each request one rid (the wire field also takes lists).
        acc = [StreamedChoice(r.rid) for r in turn.generate]
        head = encoder.start()
        item = first
        while item is not None:
            index, delta = item
            acc[index].add(delta)
            out = encoder.push(index, delta)
            if head:
                out, head = head + out, ""
            if out:
                yield out
            item = await anext(deltas, None)
        if head:
            yield head
        end = encoder.end()
        count_usage(turn, end.choices)
        if end.before:
            yield end.before
        generations = [a.generation(len(turn.prompt_ids), turn.started) for a in acc]
        await persist(turn.state, records(turn, generations, end.choices, end.response))
        turn.state.continuity.remember(turn.lineage, generations, end.choices)
        yield LastEvent(end.after)
    except OpenAIError as exc:
        yield encoder.fail(exc)
    finally:
        await deltas.aclose()


def count_usage(turn: Turn[Any], choices: Sequence[ParsedChoice]) -> Usage:
    """The request's usage, counted in the token metrics."""
    usage = Usage.of(len(turn.prompt_ids), choices)
    metrics = turn.state.metrics
    metrics.prompt_tokens.inc(usage.prompt_tokens)
    metrics.completion_tokens.inc(usage.completion_tokens)
    turn.state.keys.limits.spent(turn.principal.key, usage.total_tokens)
    return usage


def records(
    turn: Turn[Any],
    generations: Sequence[Generation],
    choices: Sequence[ParsedChoice],
    response: dict[str, Any],
) -> list[CompletionRecord]:
    """One record per choice, as `capture.build_records` makes them (the gateway's
    `notes` beside the reply in the recorded response JSON)."""
    if turn.notes:
        response = {**response, "gateway": turn.notes}
    return build_records(
        completion_id=turn.completion_id,
        model=turn.adapter or turn.state.config.gateway.model_name,
        requested_model=turn.model,
        prompt_ids=turn.prompt_ids,
        generations=generations,
        choices=choices,
        spec=turn.spec,
        request_json=turn.body,
        response_json=response,
        session_id=turn.session_id,
        api_key_id=turn.principal.key_id,
        started=turn.started,
        continuity_keys=turn.state.continuity.keys(turn.lineage, choices),
    )
