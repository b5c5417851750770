"""Interruptible generation: one completion across the weight swaps that abort it.
Engine-neutral: it drives any `Backend`'s `generate` / `generate_stream` (the
`generate_interruptible*` methods of `gateway/backends/base.py` delegate here).

Swap sequence (`Backend.swap_weights`): `pause_generation(mode="abort")` → in-flight
requests return `finish_reason.type == "abort"` with partial ids →
`update_weights_from_disk(path, weight_version=str(v))` (flushes the cache; safe, nothing
runs) → `continue_generation()` in a `finally`, so a failed load never leaves the backend
paused (AReaL#1160). `generate_interruptible*` resubmit the aborted requests (prompt +
partial ids, `max_new_tokens` reduced), so callers see one uninterrupted completion whose
tokens carry the weight version that produced them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence

from areal_service.sglang_protocol import (
    FinishReason,
    TopLogprobs,
    parse_version,
)
from gateway.backends.errors import BackendError, BackendUnavailable
from gateway.backends.records import EngineReply, Generation, GenerationDelta, TokenRequest
from gateway.backends.transport import EngineHttp

Generate = Callable[[TokenRequest], Awaitable[EngineReply]]
"""One round, not streamed: the client's `generate` with the routing key bound."""
Stream = Callable[[TokenRequest], AsyncGenerator[EngineReply, None]]
"""One round, streamed (coalesced, new tokens only): the client's `generate_stream`."""


async def generate_interruptible(
    generate: Generate, request: TokenRequest, http: EngineHttp
) -> Generation:
    """`generate`, resubmitting on pause-aborts until a stop/length finish.

    Each round sends prompt + ids so far with `max_new_tokens` (and `min_new_tokens`)
    reduced and rid `<rid>-<k>` (so `abort_request(rid)` still matches by prefix).
    All tokens of a round are tagged with the version that round reported. After
    `max_resubmissions` aborts: BackendUnavailable (the backend is stuck; 503)."""
    run = _Rounds(request, http)
    while True:
        result = await generate(run.next_request())
        run.add(
            result.output_ids,
            result.output_logprobs(),
            parse_version(result.weight_version),
            result.output_top_logprobs(),
        )
        if result.finish_reason is None:
            raise BackendError(502, "response without finish_reason", url=http.base_url)
        if (final := run.finish(result.finish_reason)) is not None:
            return run.generation(final)
        await run.before_resubmit()


async def generate_interruptible_stream(
    stream: Stream, request: TokenRequest, http: EngineHttp
) -> AsyncGenerator[GenerationDelta, None]:
    """Streaming `generate_interruptible`: yields only NEW tokens per chunk, across
    resubmissions, so the caller sees one uninterrupted stream; the last delta
    carries the finish reason. Each chunk's tokens get that chunk's version, except
    the final chunk of a pause-aborted round: SGLang reads `weight_version` when it
    emits an output, and that output can leave after the swap loaded the next
    version. A round never spans a swap (pause mode abort), so those tokens keep the
    version of the round's earlier chunks."""
    run = _Rounds(request, http)
    while True:
        final: FinishReason | None = None
        resubmit = False
        round_version: int | None = None
        async with contextlib.aclosing(stream(run.next_request())) as chunks:
            seen = 0
            async for chunk in chunks:  # reads through [DONE] so the connection is reused
                start = seen if chunk.cumulative else 0
                new_ids = tuple(chunk.output_ids[start:])
                new_lps = chunk.output_logprobs(start)
                new_tops = chunk.output_top_logprobs()[start:]
                seen += len(new_ids)
                version = parse_version(chunk.weight_version)
                if chunk.finish_reason is None:
                    round_version = version
                elif chunk.finish_reason.type == "abort" and round_version is not None:
                    version = round_version
                versions = run.add(new_ids, new_lps, version, new_tops)
                if chunk.finish_reason is not None:
                    final = run.finish(chunk.finish_reason)
                    resubmit = final is None
                if new_ids or final is not None:
                    yield GenerationDelta(
                        new_ids,
                        new_lps,
                        versions,
                        final,
                        run.prompt_tokens,
                        len(run.ids),
                        run.resubmissions,
                        new_tops,
                        http.base_url,
                    )
        if not resubmit:
            if final is None:
                raise BackendUnavailable("stream ended without a finish reason", url=http.base_url)
            return
        await run.before_resubmit()


class _Rounds:
    """Accumulated output across abort/resubmit rounds of one interruptible generation."""

    def __init__(self, request: TokenRequest, http: EngineHttp) -> None:
        self.http = http
        self.request = request
        self.prompt_tokens = len(request.prompt_ids)
        max_new = request.sampling_params.max_new_tokens
        self.max_new = 128 if max_new is None else max_new
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.tops: list[TopLogprobs] = []
        self.resubmissions = 0
        self.t0 = time.perf_counter()

    def next_request(self) -> TokenRequest:
        if not self.resubmissions:
            return self.request
        sp = self.request.sampling_params
        update: dict[str, int] = {"max_new_tokens": self.max_new - len(self.ids)}
        if "min_new_tokens" in sp.model_fields_set:
            update["min_new_tokens"] = max(0, sp.min_new_tokens - len(self.ids))
        # model_copy skips validation: the values derive from an already valid request.
        return dataclasses.replace(
            self.request,
            input_ids=[*self.request.prompt_ids, *self.ids],
            sampling_params=sp.model_copy(update=update),
            rid=f"{self.request.rid}-{self.resubmissions}",
        )

    def add(
        self,
        ids: Sequence[int],
        logprobs: Sequence[float],
        version: int,
        tops: Sequence[TopLogprobs] = (),
    ) -> tuple[int, ...]:
        self.ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.tops.extend(tops)
        versions = (version,) * len(ids)
        self.versions.extend(versions)
        return versions

    def finish(self, reason: FinishReason) -> FinishReason | None:
        """The final finish reason, or None when this round must be resubmitted."""
        if reason.type != "abort":
            return reason
        if reason.status_code is not None:  # a system abort (error), not a pause
            raise BackendError(
                int(reason.status_code), reason.message or "aborted", url=self.http.base_url
            )
        if len(self.ids) >= self.max_new:
            return FinishReason(type="length", length=len(self.ids))
        return None

    async def before_resubmit(self) -> None:
        self.resubmissions += 1
        if self.resubmissions > self.http.options.max_resubmissions:
            raise BackendUnavailable(
                f"request {self.request.rid} aborted {self.resubmissions} times",
                url=self.http.base_url,
            )
        # The paused backend holds new requests until continue, so a short wait suffices.
        await asyncio.sleep(self.http.options.resubmit_wait_s)

    def generation(self, final: FinishReason) -> Generation:
        return Generation(
            rid=self.request.rid,
            output_ids=tuple(self.ids),
            output_logprobs=tuple(self.logprobs),
            output_versions=tuple(self.versions),
            finish_reason=final,
            prompt_tokens=self.prompt_tokens,
            resubmissions=self.resubmissions,
            latency_s=time.perf_counter() - self.t0,
            output_top_logprobs=tuple(self.tops),
            backend=self.http.base_url,
        )
