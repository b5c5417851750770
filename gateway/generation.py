"""Fan-out of one OpenAI request to its backend generations (one per choice).

Maps backend failures to OpenAI errors: unavailable or paused past the deadline → 503
with retry-after; a backend 4xx (bad sampling values) → 400; anything else → 502.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field

from pydantic import ValidationError

from areal_service.sglang_protocol import FinishReason, SamplingParams
from gateway.backends import BackendError, BackendUnavailable, Generation, GenerationDelta
from gateway.backends.records import TokenRequest
from gateway.errors import OpenAIError, backend_unavailable
from gateway.routing import BackendPool
from gateway.state import GatewayState
from gateway.translate import SamplingSpec


def backend_error(exc: BackendError) -> OpenAIError:
    """The OpenAI error for a backend failure."""
    if isinstance(exc, BackendUnavailable):
        return backend_unavailable(f"the model backend is unavailable: {exc.message}")
    if 400 <= exc.status < 500:
        return OpenAIError(400, f"the backend rejected the request: {exc.message}")
    return OpenAIError(
        502, f"the model backend failed: {exc.message}", type="server_error", code="backend_error"
    )


def generate_requests(
    prompt_ids: Sequence[int],
    spec: SamplingSpec,
    completion_id: str,
    top_logprobs: int | None = None,
    adapter: str | None = None,
) -> list[TokenRequest]:
    """One `/generate` per choice. Rids have a fixed width (`-000`), because SGLang
    aborts by rid prefix and `x-1` would also match `x-10`. Top-k alternatives are
    asked for only when the client wants them (they cost the backend a top-k per token).
    Sampling values SGLang would reject with 400 are rejected here with its message.
    `adapter`: a named policy's LoRA adapter (`lora_path`)."""
    try:
        return [
            TokenRequest(
                input_ids=prompt_ids,  # shared, never mutated: a resubmission makes its own
                sampling_params=SamplingParams.model_validate(spec.to_sampling_params(i)),
                rid=f"{completion_id}-{i:03d}",
                top_logprobs_num=top_logprobs or 0,
                lora_path=adapter,  # a named policy's adapter (unset: the backend's default)
                lora_set=adapter is not None,
            )
            for i in range(spec.n)
        ]
    except ValidationError as exc:
        message = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
        raise OpenAIError(400, f"the backend rejected the request: {message}") from exc


def _choice_slots(state: GatewayState, choices: int) -> asyncio.Semaphore | None:
    """A request's choices run at most `gateway.limits.max_choices_in_flight` at once (None: it
    has no more than that, the usual case, at no cost)."""
    limit = state.config.gateway.limits.max_choices_in_flight
    return asyncio.Semaphore(limit) if choices > limit else None


async def generate_all(
    state: GatewayState,
    requests: Sequence[TokenRequest],
    session_id: str | None,
    pool: BackendPool | None = None,
) -> list[Generation]:
    """Every choice, generated concurrently (interruptible: swaps are ridden out).
    `pool`: a full-weight policy's own backends (None: the main pool)."""
    deadline = state.config.gateway.router.backend_unavailable_deadline_s
    backends = state.backends if pool is None else pool
    if len(requests) == 1:  # the common case: awaited here, no task and no gather (~5 µs)
        try:
            generation = await backends.generate_interruptible(
                requests[0], session_id=session_id, deadline_s=deadline
            )
        except BackendError as exc:
            raise backend_error(exc) from exc
        if generation.resubmissions:
            state.metrics.resubmissions.inc(generation.resubmissions)
        return [generation]
    slots = _choice_slots(state, len(requests))

    async def one(request: TokenRequest) -> Generation:
        async with slots or contextlib.nullcontext():
            return await backends.generate_interruptible(
                request, session_id=session_id, deadline_s=deadline
            )

    try:
        generations = list(await asyncio.gather(*(one(r) for r in requests)))
    except BackendError as exc:
        raise backend_error(exc) from exc
    state.metrics.resubmissions.inc(sum(g.resubmissions for g in generations))
    return generations


@dataclass
class StreamedChoice:
    """What one streamed choice produced so far (becomes a `Generation` at the end)."""

    rid: str
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    resubmissions: int = 0
    backend: str = ""

    def add(self, delta: GenerationDelta) -> None:
        """Append one delta's new tokens."""
        self.ids.extend(delta.output_ids)
        self.logprobs.extend(delta.output_logprobs)
        self.versions.extend(delta.output_versions)
        self.resubmissions = delta.resubmissions
        self.backend = delta.backend
        if delta.finish_reason is not None:
            self.finish = delta.finish_reason

    def generation(self, prompt_tokens: int, started: float) -> Generation:
        """The finished generation, as the non-streaming path returns it."""
        assert self.finish is not None, "stream ended without a finish reason"
        return Generation(
            self.rid,
            tuple(self.ids),
            tuple(self.logprobs),
            tuple(self.versions),
            self.finish,
            prompt_tokens,
            self.resubmissions,
            time.perf_counter() - started,
            backend=self.backend,
        )


async def stream_all(
    state: GatewayState,
    requests: Sequence[TokenRequest],
    session_id: str | None,
    pool: BackendPool | None = None,
) -> AsyncGenerator[tuple[int, GenerationDelta], None]:
    """(choice index, delta) from every choice's stream, interleaved as they arrive.
    Backend failures surface as `OpenAIError` (503/400/502). `pool`: as `generate_all`."""
    deadline = state.config.gateway.router.backend_unavailable_deadline_s
    backends = state.backends if pool is None else pool
    streams = [
        backends.generate_interruptible_stream(r, session_id=session_id, deadline_s=deadline)
        for r in requests
    ]
    try:
        if len(streams) == 1:
            async with contextlib.aclosing(streams[0]) as only:
                async for delta in only:
                    _count_resubmissions(state, delta)
                    yield 0, delta
            return
        async for item in _interleave(streams, _choice_slots(state, len(streams))):
            _count_resubmissions(state, item[1])
            yield item
    except BackendError as exc:
        raise backend_error(exc) from exc


def _count_resubmissions(state: GatewayState, delta: GenerationDelta) -> None:
    if delta.finish_reason is not None and delta.resubmissions:
        state.metrics.resubmissions.inc(delta.resubmissions)


async def _interleave(
    streams: Sequence[AsyncIterator[GenerationDelta]], slots: asyncio.Semaphore | None = None
) -> AsyncIterator[tuple[int, GenerationDelta]]:
    queue: asyncio.Queue[tuple[int, GenerationDelta | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[GenerationDelta]) -> None:
        try:
            async with slots or contextlib.nullcontext():  # the stream starts when iterated
                async for delta in stream:
                    await queue.put((index, delta, None))
            await queue.put((index, None, None))
        except Exception as exc:  # handed to the consumer, which re-raises it
            await queue.put((index, None, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(tasks)
        while open_streams:
            index, delta, error = await queue.get()
            if error is not None:
                raise error
            if delta is None:
                open_streams -= 1
            else:
                yield index, delta
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
